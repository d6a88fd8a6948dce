"""The conformance checks: what every strategy and client of the pack must do.

Each check takes a *factory*, ``make(num_nodes) -> strategy`` (node ids are
``1001, 1002, ...``), builds what it needs and raises ``AssertionError`` saying
what broke. They run in process, in milliseconds, on hand-built replies
(:mod:`.replies`) and a model of two arrays.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import MessageType

from ..core.client.client import TorchClient
from ..core.client.rule import ClientRule, ProtocolError
from ..core.transport.flower import set_task_identity
from ..core.transport.inprocess import InProcessGrid
from ..core.transport.keys import (
    ACCEPTED_KEYS_KEY,
    ACCEPTED_ROUND_KEY,
    ACCEPTED_ROUNDS_KEY,
)
from ..core.transport.records import record_to_dict
from .replies import (
    BAD_REPLIES,
    error_reply,
    model_arrays,
    record,
    servers_of,
    valid_reply,
)

#: How many nodes the checks' grid has.
NUM_NODES = 5

#: A factory of the strategy checked: number of nodes -> a fresh strategy.
Factory = Callable[[int], Any]


def _unused_app(message: Message, context: Context) -> Message:  # pragma: no cover
    raise AssertionError("this grid only samples; replies are built by hand")


def sampling_grid(num_nodes: int = NUM_NODES) -> InProcessGrid:
    """Return a grid that lists ``num_nodes`` nodes and runs nothing.

    Parameters
    ----------
    num_nodes : int (default: NUM_NODES)
        Nodes ``1001 .. 1000 + num_nodes``.

    Returns
    -------
    InProcessGrid
        For ``configure_train``; replies are built by hand.
    """
    return InProcessGrid(_unused_app, num_nodes=num_nodes)


def first_round(make: Factory) -> tuple[Any, list[Message], list[Message]]:
    """Return a fresh strategy, its round-1 train messages and a valid reply to each.

    Parameters
    ----------
    make : Callable[[int], Any]
        The strategy's factory.

    Returns
    -------
    tuple
        ``(strategy, messages, replies)``; node ``i``'s reply has
        ``num-examples`` ``10 + i``.
    """
    strategy = make(NUM_NODES)
    messages = list(
        strategy.configure_train(
            1, record(model_arrays()), ConfigRecord(), sampling_grid()
        )
    )
    assert len(messages) == NUM_NODES, (
        f"round 1 sampled {len(messages)} of {NUM_NODES} nodes: the checks need "
        "a configuration that samples every node"
    )
    replies = [
        valid_reply(strategy, m, seed=i, num_examples=10 + i)
        for i, m in enumerate(messages)
    ]
    return strategy, messages, replies


def to_arrays(rec: ArrayRecord | None) -> dict[str, np.ndarray]:
    """Return an ``ArrayRecord`` as numpy arrays (asserting there is one)."""
    assert rec is not None, "no model where one was expected"
    return record_to_dict(rec)


def assert_same_value(a: Any, b: Any, where: str = "") -> None:
    """Assert that two values (dicts of arrays, arrays, scalars) are bit-identical.

    Parameters
    ----------
    a, b : Any
        The values; mappings are compared key by key (``run-tag`` skipped).
    where : str (default: "")
        Where they come from, for the message.

    Raises
    ------
    AssertionError
        Naming the first place they differ.
    """
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        assert isinstance(a, Mapping) and isinstance(b, Mapping), where
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            if key != "run-tag":  # each strategy instance names its own run
                assert_same_value(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), (
            f"{where}: the arrays differ"
        )
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check_bad_reply(make: Factory, kind: str) -> None:
    """Check that a bad reply leaves the round as if it had not been sent.

    The model, the round's metrics (but the failure counts) and every piece of
    strategy state (``state_dict``) must equal those of the same round in
    which that node sent nothing; the reply is counted once.

    Parameters
    ----------
    make : Callable[[int], Any]
        The strategy's factory.
    kind : str
        A key of :data:`~flwr_prox_strategies.testing.BAD_REPLIES`.
    """
    with_bad, messages, good = first_round(make)
    without_bad, _, good_b = first_round(make)
    bad = BAD_REPLIES[kind](with_bad, messages[0])
    if kind == "duplicate":
        replies_a, replies_b = [good[0], bad, *good[1:]], list(good_b)
    else:  # the bad reply replaces node 0's; the reference has none from it
        replies_a, replies_b = [bad, *good[1:]], list(good_b[1:])
    arrays_a, metrics_a = with_bad.aggregate_train(1, iter(replies_a))
    arrays_b, metrics_b = without_bad.aggregate_train(1, replies_b)
    assert_same_value(to_arrays(arrays_a), to_arrays(arrays_b), f"{kind}: model")
    assert_same_value(with_bad.state_dict(), without_bad.state_dict(), "state")
    counts = {"replies-failed", "replies-rejected"}
    assert {k: v for k, v in metrics_a.items() if k not in counts} == {
        k: v for k, v in metrics_b.items() if k not in counts
    }, f"{kind}: the round's metrics differ"
    # Counted once; a sampled node that sent nothing (the bad reply came from
    # another node) is counted once more, as no-reply.
    rejections: Counter[str] = Counter(with_bad.rejections)
    silent = sum(n for k, n in rejections.items() if k.endswith(":no-reply"))
    assert sum(rejections.values()) - silent == 1, f"{kind}: counted {dict(rejections)}"
    assert metrics_a["replies-failed"] + metrics_a["replies-rejected"] == 1 + silent


def check_only_bad_replies_keep_the_model(make: Factory) -> None:
    """Check that a round of bad replies only keeps the model and the state."""
    strategy, messages, _ = first_round(make)
    reference, _, _ = first_round(make)
    reference.aggregate_train(1, [])
    kinds = ["nan", "error-reply", "wrong-shape", "num-examples-zero", "no-arrays"]
    bad = [BAD_REPLIES[k](strategy, m) for k, m in zip(kinds, messages, strict=True)]
    arrays, metrics = strategy.aggregate_train(1, iter(bad))
    assert arrays is None, "a round of bad replies returned a model"
    assert metrics is not None and metrics["replies-valid"] == 0
    assert_same_value(reference.state_dict(), strategy.state_dict(), "state")


def check_empty_round_keeps_the_model(make: Factory) -> None:
    """Check that a round without replies returns no model (``start`` keeps it)."""
    strategy, _, _ = first_round(make)
    arrays, _ = strategy.aggregate_train(1, [])
    assert arrays is None, "a round without replies returned a model"


def check_fresh_payload_per_node(make: Factory) -> None:
    """Check that each node's message has content of its own."""
    _, messages, _ = first_round(make)
    configs = [m.content.config_records["config"] for m in messages]
    assert len({id(c) for c in configs}) == len(configs), "a shared ConfigRecord"
    assert len({id(m.content) for m in messages}) == len(messages), "shared content"
    configs[0]["poison"] = 1
    assert "poison" not in configs[1]


def check_accept_failures_false_keeps_the_model(make: Factory) -> None:
    """Check that with ``accept_failures=False`` one failure keeps the model."""
    strategy, messages, good = first_round(make)
    strategy.accept_failures = False
    arrays, _ = strategy.aggregate_train(1, [error_reply(messages[0]), *good[1:]])
    assert arrays is None, "accept_failures=False aggregated a round with a failure"


def check_state_dict_round_trip(make: Factory) -> None:
    """Check that ``load_state_dict(state_dict())`` gives the same state."""
    strategy, _, good = first_round(make)
    strategy.aggregate_train(1, good)
    other = make(NUM_NODES)
    other.load_state_dict(strategy.state_dict())
    assert_same_value(other.state_dict(), strategy.state_dict(), "state")


# How the server confirms client state differs after a restore (per client key
# instead of per node): the same facts in another form, left out of the comparison.
_COMMIT_KEYS = {ACCEPTED_ROUND_KEY, ACCEPTED_KEYS_KEY, ACCEPTED_ROUNDS_KEY}


def _sent(message: Message) -> dict[str, Any]:
    content = message.content
    return {
        "dst": message.metadata.dst_node_id,
        "arrays": {n: to_arrays(r) for n, r in content.array_records.items()},
        "config": {
            n: {k: v for k, v in r.items() if k not in _COMMIT_KEYS}
            for n, r in content.config_records.items()
        },
    }


def check_restore_continues(make: Factory) -> None:
    r"""Check that a strategy restored from ``state_dict`` continues bit for bit.

    After round 1, the original and a fresh strategy loaded with its
    ``state_dict`` must send the same round-2 messages and produce the same
    model and state from the same replies: ``state_dict`` holds everything the
    next round reads. A strategy may send records again after a restore that
    it names in ``records_resent_after_restore`` (FedDyn's :math:`\theta^0`).
    """
    original, _, good = first_round(make)
    arrays, _ = original.aggregate_train(1, good)
    assert arrays is not None, "round 1 of valid replies was not aggregated"
    restored = make(NUM_NODES)
    restored.load_state_dict(original.state_dict())
    runs = []
    for strategy in (original, restored):
        # A restored strategy numbers Flower's rounds from 1 again (as start()
        # does after a resume); its round_offset makes that round 2.
        offset = servers_of(strategy)[0].round_offset
        rnd = 2 - offset if strategy is restored else 2
        messages = list(
            strategy.configure_train(rnd, arrays, ConfigRecord(), sampling_grid())
        )
        replies = [
            valid_reply(strategy, m, seed=i + 3, num_examples=12 + i)
            for i, m in enumerate(messages)
        ]
        new, _ = strategy.aggregate_train(rnd, replies)
        runs.append(([_sent(m) for m in messages], new, strategy.state_dict()))
    (sent, model, state), (sent_again, model_again, state_again) = runs
    resent = set(getattr(servers_of(original)[0], "records_resent_after_restore", ()))
    assert len(sent) == len(sent_again), "another number of nodes sampled"
    for first, second in zip(sent, sent_again, strict=True):
        assert first["dst"] == second["dst"], "other nodes sampled after a restore"
        assert first["config"] == second["config"], "another config after a restore"
        assert first["arrays"].keys() <= second["arrays"].keys()
        extra = second["arrays"].keys() - first["arrays"].keys()
        assert extra <= resent, f"records {sorted(extra)} sent only after a restore"
        for name in first["arrays"]:
            assert_same_value(first["arrays"][name], second["arrays"][name], name)
    assert_same_value(to_arrays(model), to_arrays(model_again), "round-2 model")
    assert_same_value(state, state_again, "round-2 state")


def _plain_attributes(strategy: Any) -> dict[str, Any]:
    """Deep copy of the attributes that hold plain data (a rule's possible stash)."""
    plain = (type(None), bool, int, float, str, np.ndarray)

    def is_plain(value: Any) -> bool:
        if isinstance(value, dict):
            return all(is_plain(v) for v in value.values())
        return isinstance(value, plain)

    return {k: copy.deepcopy(v) for k, v in vars(strategy).items() if is_plain(v)}


def check_server_rule_is_pure(make: Factory) -> None:
    """Check that ``server_update`` depends on its arguments only, changing nothing.

    The base may run a rule twice in a round and commits its state only if the
    round is aggregated: in round 2 (every state field set) the rule must give
    the same update twice, store nothing on the strategy and return only
    declared fields. (Writing into the state it is given raises in every run.)
    """
    strategy, _, good = first_round(make)
    arrays, _ = strategy.aggregate_train(1, good)
    assert arrays is not None, "round 1 of valid replies was not aggregated"
    calls = []
    for server in servers_of(strategy):
        rule = server.server_update

        def spy(rnd, state, replies, rule=rule, server=server):  # type: ignore[no-untyped-def]
            attributes = _plain_attributes(server)
            update = rule(rnd, state, replies)
            assert_same_value(_plain_attributes(server), attributes, "attributes")
            again = rule(rnd, state, replies)
            assert_same_value(
                to_arrays(update.arrays), to_arrays(again.arrays), "model"
            )
            assert_same_value(update.state, again.state, "state")
            assert set(update.state) <= set(server.state_fields), (
                f"state {sorted(set(update.state) - set(server.state_fields))} "
                "is not declared in state_fields"
            )
            calls.append(rnd)
            return update

        server.server_update = spy
    messages = list(
        strategy.configure_train(2, arrays, ConfigRecord(), sampling_grid())
    )
    replies = [
        valid_reply(strategy, m, seed=i + 3, num_examples=12 + i)
        for i, m in enumerate(messages)
    ]
    assert strategy.aggregate_train(2, replies)[0] is not None
    assert calls, "server_update was not called"


@contextmanager
def _flower_log() -> Iterator[list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def check_reply_without_rule_metric(make: Factory) -> None:
    """Check that a reply lacking the rule metric is warned of once, or rejected.

    For a strategy whose clients must apply a rule (``rule_metric``): such a
    reply comes from a client that does not run the algorithm. Nothing to
    check for a strategy without one.
    """
    rule = getattr(servers_of(make(NUM_NODES))[0], "rule_metric", None)
    if rule is None:
        return

    def round_without_rule(strict: bool) -> tuple[Any, Any, Any]:
        strategy, _, replies = first_round(make)
        for server in servers_of(strategy):
            server.strict = strict
        del replies[0].content["metrics"][rule]
        return (strategy, *strategy.aggregate_train(1, replies))

    with _flower_log() as lines:
        _, arrays, metrics = round_without_rule(False)
    assert arrays is not None and metrics["replies-valid"] == NUM_NODES
    warned = [line for line in lines if f"'{rule}'" in line]
    assert len(warned) == 1 and "[1001]" in warned[0], (
        f"expected one warning naming node 1001 and '{rule}', got {warned}"
    )
    strategy, _, metrics = round_without_rule(True)
    assert metrics["replies-valid"] == NUM_NODES - 1
    assert metrics["replies-rejected"] == 1
    rejected = sum(
        v
        for s in servers_of(strategy)
        for k, v in s.rejections.items()
        if "rule-not-applied" in k
    )
    assert rejected == 1, "strict=True did not reject the reply as rule-not-applied"


def check_cases_set_every_state_field(cases: Mapping[str, Factory]) -> None:
    """Check that the configurations together set every declared state field.

    Otherwise a field no check exercises could be mutated, lost on restore or
    left out of ``state_dict`` unnoticed.

    Parameters
    ----------
    cases : Mapping[str, Callable[[int], Any]]
        The algorithm's configurations, name -> factory.
    """
    declared: set[str] = set()
    set_: set[str] = set()
    for make in cases.values():
        strategy, _, good = first_round(make)
        assert strategy.aggregate_train(1, good)[0] is not None
        for server in servers_of(strategy):
            fields = getattr(server, "state_fields", ())
            declared.update(fields)
            set_.update(f for f in fields if _holds_something(getattr(server, f)))
    missing = declared - set_
    assert not missing, (
        f"no configuration sets state fields {sorted(missing)} in round 1: add one "
        "to the algorithm's cases that does"
    )


def _holds_something(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, (Mapping, list, tuple, set)):
        return len(value) > 0
    return True


def fedavg_message(dim: int = 3) -> Message:
    """Return what Flower's (or the pack's) FedAvg sends a node: model and lr only.

    Parameters
    ----------
    dim : int (default: 3)
        The model is one ``(1, dim)`` array (a ``Linear(dim, 1, bias=False)``).

    Returns
    -------
    Message
        A train message to node 1001.
    """
    set_task_identity(1)  # a hand-built message needs a run and task identity
    content = RecordDict(
        {
            "arrays": ArrayRecord([np.zeros((1, dim), np.float32)]),
            "config": ConfigRecord({"lr": 0.1, "server-round": 1}),
        }
    )
    return Message(content=content, message_type=MessageType.TRAIN, dst_node_id=1001)


def _context() -> Context:
    return Context(
        run_id=1,
        node_id=1001,
        node_config={"partition-id": 0},
        state=RecordDict(),
        run_config={},
    )


def check_rule_refuses_another_strategys_message(
    rule_cls: type[ClientRule], **rule_kwargs: Any
) -> None:
    """Check that a rule sent FedAvg's message names the strategy it needs.

    Parameters
    ----------
    rule_cls : type
        The rule (a ``ClientRule`` subclass); its ``protocol`` must appear in
        the error.
    **rule_kwargs
        More keyword arguments of ``rule_cls.from_message``.
    """
    model = torch.nn.Linear(3, 1, bias=False)
    try:
        rule_cls.from_message(fedavg_message(), _context(), model, **rule_kwargs)
    except ProtocolError as err:
        assert f"running {rule_cls.protocol}" in str(err), str(err)
    else:
        raise AssertionError(
            f"{rule_cls.__name__} accepted FedAvg's message: it must raise "
            f"ProtocolError naming {rule_cls.protocol}"
        )


def check_client_refuses_another_strategys_message(
    client_cls: type[TorchClient],
) -> None:
    """Check that a client sent FedAvg's config names the strategy it needs.

    Parameters
    ----------
    client_cls : type
        The client (a ``TorchClient`` subclass); its ``protocol`` must appear
        in the error.
    """
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    client = client_cls(
        torch.nn.Linear(3, 1, bias=False),
        torch.utils.data.DataLoader(data, batch_size=4),
        loss_fn=torch.nn.MSELoss(),
    )
    try:
        client.fit(
            [np.zeros((1, 3), np.float32)],
            {"server-round": 1, "local-epochs": 1, "lr": 0.1},
        )
    except ProtocolError as err:
        assert client_cls.protocol in str(err), str(err)
    else:
        raise AssertionError(
            f"{client_cls.__name__} trained on FedAvg's message: it must raise "
            f"ProtocolError naming {client_cls.protocol}"
        )


#: The checks of one configuration, name -> check(make).
STRATEGY_CHECKS: dict[str, Callable[[Factory], None]] = {
    "only-bad-replies-keep-the-model": check_only_bad_replies_keep_the_model,
    "empty-round-keeps-the-model": check_empty_round_keeps_the_model,
    "fresh-payload-per-node": check_fresh_payload_per_node,
    "accept-failures-false": check_accept_failures_false_keeps_the_model,
    "state-dict-round-trip": check_state_dict_round_trip,
    "restore-continues": check_restore_continues,
    "server-rule-is-pure": check_server_rule_is_pure,
    "reply-without-rule-metric": check_reply_without_rule_metric,
}

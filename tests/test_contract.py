"""One contract suite, run over every strategy the pack exports.

Each kind of bad reply must leave the aggregated model, the round's metrics and
every piece of strategy state bit-identical to the same round without that
reply. Later algorithms join by adding one line to STRATEGIES.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flwr_prox_strategies import (
    APFL,
    FedAvg,
    FedDC,
    FedDyn,
    FedEPM,
    FedProx,
    PFedAvg,
    Scaffold,
    SFedAvg,
    SFedProx,
)
from flwr_prox_strategies.algorithms.feddyn import INITIAL_MODEL_RECORD
from flwr_prox_strategies.core.inprocess import node_unavailable_reply
from flwr_prox_strategies.core.keys import (
    ACCEPTED_KEYS_KEY,
    ACCEPTED_ROUND_KEY,
    ACCEPTED_ROUNDS_KEY,
)
from flwr_prox_strategies.core.strategy import ValidatedFedAvg

from .helpers import error_reply, model_arrays, record, reply, sampling_grid

NUM_NODES = 5

STRATEGIES: dict[str, Callable[[], ValidatedFedAvg]] = {
    "fedavg": lambda: FedAvg(min_available_nodes=NUM_NODES),
    "fedavg-uniform": lambda: FedAvg(
        min_available_nodes=NUM_NODES, weighting="uniform"
    ),
    "fedprox": lambda: FedProx(mu=0.1, min_available_nodes=NUM_NODES),
    "fedprox-monitor": lambda: FedProx(
        mu=0.1, min_available_nodes=NUM_NODES, monitor_dissimilarity=True
    ),
    "feddyn": lambda: FedDyn(alpha=0.1, num_clients=NUM_NODES),
    "feddyn-track": lambda: FedDyn(
        alpha=0.1, num_clients=NUM_NODES, track_all_clients=True
    ),
    "scaffold": lambda: Scaffold(num_clients=NUM_NODES, server_learning_rate=0.5),
    "feddc": lambda: FedDC(alpha=0.1, num_clients=NUM_NODES),
    "feddc-paper": lambda: FedDC(alpha=0.1, num_clients=NUM_NODES, correction="paper"),
    "apfl": lambda: APFL(alpha=0.5, min_available_nodes=NUM_NODES),
    "fedepm": lambda: FedEPM(num_clients=NUM_NODES, rho=1.0),
    "fedepm-l1-heavy": lambda: FedEPM(num_clients=NUM_NODES, rho=1.0, lam=10.0),
    "sfedavg": lambda: SFedAvg(num_clients=NUM_NODES, rho=1.0),
    "pfedavg-ring": lambda: PFedAvg(
        servers=4,
        topology="ring",
        inner=lambda: FedAvg(min_available_nodes=1, min_train_nodes=1),
        assignment={1001 + i: i % 4 for i in range(NUM_NODES)},
    ),
    "pfedavg-fedprox-sdp": lambda: PFedAvg(
        servers=4,
        topology="star",
        mixing="sdp",
        inner=lambda: FedProx(mu=0.1, min_available_nodes=1, min_train_nodes=1),
        assignment={1001 + i: i % 4 for i in range(NUM_NODES)},
    ),
    "sfedprox": lambda: SFedProx(num_clients=NUM_NODES, rho=1.0),
    "apfl-last-iterate": lambda: APFL(
        alpha=0.5,
        adaptive_alpha=True,
        weighted_average=False,
        min_available_nodes=NUM_NODES,
    ),
}


def good_content(strategy: ValidatedFedAvg, i: int) -> dict[str, dict[str, np.ndarray]]:
    """Arrays for every record the strategy expects, distinct per node."""
    return {
        name: {
            key: np.full(spec.shape, i + 1 + 10 * k, dtype=spec.dtype)
            + np.arange(int(np.prod(spec.shape)), dtype=spec.dtype).reshape(spec.shape)
            for k, (key, spec) in enumerate(specs.items())
        }
        for name, specs in strategy.expected_train_arrays(1).items()
    }


def rule_metric_of(strategy) -> str | None:
    """The metric the strategy's clients must report (P-FedAvg: its servers')."""
    if isinstance(strategy, PFedAvg):
        strategy = strategy.inner[0]
    return getattr(strategy, "rule_metric", None)


def build_reply(
    to: Message,
    content: dict[str, dict[str, np.ndarray]],
    n=10,
    metrics=None,
    *,
    strategy=None,
):
    assert metrics is not None or strategy is not None, "say whose reply it is"
    if metrics is None:  # stateful strategies need the client's key
        metrics = {"train-loss": 1.0, "client-key": to.metadata.dst_node_id - 1000}
        if (rule := rule_metric_of(strategy)) is not None:
            metrics[rule] = 1  # what the pack's clients report
    records = dict(content)
    arrays = records.pop("arrays", None)
    return reply(
        to,
        arrays,
        n,
        extra_records={name: record(a) for name, a in records.items()},
        metrics=metrics,
    )


def setup_round(name: str):
    strategy = STRATEGIES[name]()
    grid = sampling_grid(NUM_NODES)
    arrays = model_arrays()
    messages = list(strategy.configure_train(1, record(arrays), ConfigRecord(), grid))
    assert len(messages) == NUM_NODES
    good = [
        build_reply(m, good_content(strategy, i), strategy=strategy, n=10 + i)
        for i, m in enumerate(messages)
    ]
    return strategy, messages, good


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def with_arrays(strategy, to, mutate, n=10):
    content = good_content(strategy, 7)
    mutate(content["arrays"])
    return build_reply(to, content, n=n, strategy=strategy)


BAD_REPLIES: dict[str, Callable] = {
    "error-reply": lambda s, m, good: error_reply(m),
    "no-arrays": lambda s, m, good: reply(m, None, 10),
    "extra-record": lambda s, m, good: build_reply(
        m,
        {**good_content(s, 7), "junk": {"x": np.zeros(2, np.float32)}},
        strategy=s,
    ),
    "two-metric-records": lambda s, m, good: _two_metric_records(s, m),
    "config-record": lambda s, m, good: _with_config(s, m),
    "missing-key": lambda s, m, good: with_arrays(s, m, lambda a: a.pop("b")),
    "extra-key": lambda s, m, good: with_arrays(
        s, m, lambda a: a.update(c=np.zeros(2, np.float32))
    ),
    "wrong-shape": lambda s, m, good: with_arrays(
        s, m, lambda a: a.update(w=np.zeros((3, 4), np.float32))
    ),
    "wrong-dtype": lambda s, m, good: with_arrays(
        s, m, lambda a: a.update(w=a["w"].astype(np.float64))
    ),
    "broadcastable-shape": lambda s, m, good: with_arrays(
        s, m, lambda a: a.update(b=np.zeros((1,), np.float32))
    ),
    "nan": lambda s, m, good: with_arrays(
        s, m, lambda a: a["w"].__setitem__((0, 0), np.nan)
    ),
    "inf": lambda s, m, good: with_arrays(
        s, m, lambda a: a["b"].__setitem__(1, -np.inf)
    ),
    # +inf: an elastic-net centre (FedEPM) turns it into the others' minimum.
    "plus-inf": lambda s, m, good: with_arrays(
        s, m, lambda a: a["w"].__setitem__((1, 2), np.inf)
    ),
    # Above the default size limit; the payload would not even decode.
    "too-large": lambda s, m, good: _too_large(s, m),
    # The SuperLink's reply for a node that died, from node 1 (Flower's code).
    "dead-node": lambda s, m, good: node_unavailable_reply(m),
    "num-examples-missing": lambda s, m, good: build_reply(
        m, good_content(s, 7), strategy=s, n=None
    ),
    "num-examples-zero": lambda s, m, good: build_reply(
        m, good_content(s, 7), strategy=s, n=0
    ),
    "num-examples-negative": lambda s, m, good: build_reply(
        m, good_content(s, 7), strategy=s, n=-5
    ),
    "num-examples-nan": lambda s, m, good: build_reply(
        m, good_content(s, 7), strategy=s, n=float("nan")
    ),
    "num-examples-inf": lambda s, m, good: build_reply(
        m, good_content(s, 7), strategy=s, n=float("inf")
    ),
    "num-examples-list": lambda s, m, good: build_reply(
        m, good_content(s, 7), strategy=s, n=[1, 2]
    ),
    "payload-lies": lambda s, m, good: _lying_payload(s, m),
    "payload-truncated": lambda s, m, good: _truncated_payload(s, m),
    "duplicate": lambda s, m, good: build_reply(
        m, good_content(s, 9), strategy=s, n=50
    ),
    "unsampled-node": lambda s, m, good: build_reply(
        _foreign(m), good_content(s, 7), strategy=s
    ),
}


def _two_metric_records(s, m):
    msg = build_reply(m, good_content(s, 7), strategy=s)
    msg.content["more"] = MetricRecord({"num-examples": 3})
    return msg


def _with_config(s, m):
    msg = build_reply(m, good_content(s, 7), strategy=s)
    msg.content["cfg"] = ConfigRecord({"a": 1})
    return msg


def _lying_payload(s, m):
    msg = build_reply(m, good_content(s, 7), strategy=s)
    wrong = np.zeros((3, 4), np.float32)  # same size, other shape than declared
    msg.content["arrays"]["w"] = Array(
        "float32", (4, 3), "numpy.ndarray", npy_bytes(wrong)
    )
    return msg


def _truncated_payload(s, m):
    msg = build_reply(m, good_content(s, 7), strategy=s)
    data = npy_bytes(np.zeros((4, 3), np.float32))[:-8]
    msg.content["arrays"]["w"] = Array("float32", (4, 3), "numpy.ndarray", data)
    return msg


def _too_large(s, m):
    msg = build_reply(m, good_content(s, 7), strategy=s)
    size = 2**20 + 4096
    msg.content["arrays"]["junk"] = Array(
        "float32", (size // 4,), "numpy.ndarray", b"\0" * size
    )
    return msg


def _foreign(m: Message) -> Message:
    """A message as if it had been sent to a node that was not sampled."""
    return Message(
        RecordDict(), dst_node_id=424242, message_type=m.metadata.message_type
    )


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "run-tag":  # each strategy instance names its own run
            continue
        if isinstance(a[key], np.ndarray) or isinstance(b[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key])
        elif isinstance(a[key], dict):
            assert_same_state(a[key], b[key])
        else:
            assert a[key] == b[key], key


def to_np(rec: ArrayRecord | None) -> dict[str, np.ndarray]:
    assert rec is not None
    return {k: v.numpy() for k, v in rec.items()}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("kind", sorted(BAD_REPLIES))
def test_bad_reply_is_as_if_absent(name: str, kind: str) -> None:
    with_bad, messages, good = setup_round(name)
    without_bad, _, good_b = setup_round(name)
    bad = BAD_REPLIES[kind](with_bad, messages[0], good)
    if kind == "duplicate":
        # A second, different reply from node 0, after its first one.
        replies_a = [good[0], bad, *good[1:]]
    else:
        # The bad reply replaces node 0's reply; the reference has none from node 0.
        replies_a = [bad, *good[1:]]
    replies_b = list(good_b if kind == "duplicate" else good_b[1:])

    arrays_a, metrics_a = with_bad.aggregate_train(1, (r for r in replies_a))
    arrays_b, metrics_b = without_bad.aggregate_train(1, replies_b)

    a, b = to_np(arrays_a), to_np(arrays_b)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype
        assert a[key].tobytes() == b[key].tobytes(), key
    assert_same_state(with_bad.state_dict(), without_bad.state_dict())
    ignore = {"replies-failed", "replies-rejected"}
    assert {k: v for k, v in metrics_a.items() if k not in ignore} == {
        k: v for k, v in metrics_b.items() if k not in ignore
    }
    # The bad reply is counted once; a sampled node that sent nothing (the bad
    # reply came from another node) is counted once more, as no-reply.
    silent = sum(n for k, n in with_bad.rejections.items() if k.endswith(":no-reply"))
    assert sum(with_bad.rejections.values()) - silent == 1
    assert metrics_a["replies-failed"] + metrics_a["replies-rejected"] == 1 + silent


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_round_of_only_bad_replies_keeps_the_model(name: str) -> None:
    strategy, messages, good = setup_round(name)
    reference, _, _ = setup_round(name)
    reference.aggregate_train(1, [])  # the same round with no reply at all
    bad = [
        BAD_REPLIES[kind](strategy, m, good)
        for kind, m in zip(
            ["nan", "error-reply", "wrong-shape", "num-examples-zero", "no-arrays"],
            messages,
            strict=True,
        )
    ]
    arrays, metrics = strategy.aggregate_train(1, iter(bad))
    assert arrays is None  # Strategy.start keeps the previous model
    assert metrics is not None and metrics["replies-valid"] == 0
    assert_same_state(reference.state_dict(), strategy.state_dict())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_empty_round_keeps_the_model(name: str) -> None:
    strategy, _, _ = setup_round(name)
    arrays, _ = strategy.aggregate_train(1, [])
    assert arrays is None


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_fresh_payload_per_node(name: str) -> None:
    _, messages, _ = setup_round(name)
    configs = [m.content["config"] for m in messages]
    assert len({id(c) for c in configs}) == len(configs)
    assert len({id(m.content) for m in messages}) == len(messages)
    configs[0]["poison"] = 1
    assert "poison" not in configs[1]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_accept_failures_false_keeps_the_model(name: str) -> None:
    strategy = STRATEGIES[name]()
    strategy.accept_failures = False
    grid = sampling_grid(NUM_NODES)
    messages = list(
        strategy.configure_train(1, record(model_arrays()), ConfigRecord(), grid)
    )
    replies = [error_reply(messages[0])] + [
        build_reply(m, good_content(strategy, i), strategy=strategy)
        for i, m in enumerate(messages[1:])
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is None


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_state_dict_round_trip(name: str) -> None:
    strategy, _, good = setup_round(name)
    strategy.aggregate_train(1, good)
    other = STRATEGIES[name]()
    other.load_state_dict(strategy.state_dict())
    assert_same_state(other.state_dict(), strategy.state_dict())


def test_zero_total_weight_is_logged_not_raised() -> None:
    class ZeroWeight(FedAvg):
        def reply_weight(self, reply):
            return 0.0

    strategy = ZeroWeight(min_available_nodes=NUM_NODES)
    grid = sampling_grid(NUM_NODES)
    messages = list(
        strategy.configure_train(1, record(model_arrays()), ConfigRecord(), grid)
    )
    replies = [
        build_reply(m, good_content(strategy, i), strategy=strategy)
        for i, m in enumerate(messages)
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is None and metrics is not None


def test_not_enough_nodes_fails_fast_with_the_fix() -> None:
    strategy = FedAvg(min_available_nodes=20, node_wait_timeout=0.0)
    with pytest.raises(RuntimeError, match="num-supernodes"):
        strategy.configure_train(
            1, record(model_arrays()), ConfigRecord(), sampling_grid(3)
        )


@pytest.mark.parametrize(
    "name", sorted(n for n in STRATEGIES if rule_metric_of(STRATEGIES[n]()))
)
def test_reply_without_the_rule_metric_is_warned_once_or_rejected_if_strict(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    rule = rule_metric_of(STRATEGIES[name]())

    def round_without_rule(strategy):
        messages = list(
            strategy.configure_train(
                1, record(model_arrays()), ConfigRecord(), sampling_grid(NUM_NODES)
            )
        )
        replies = [
            build_reply(m, good_content(strategy, i), strategy=strategy)
            for i, m in enumerate(messages)
        ]
        del replies[0].content["metrics"][rule]
        return strategy.aggregate_train(1, replies)

    lenient = STRATEGIES[name]()
    with caplog.at_level("WARNING"):
        arrays, metrics = round_without_rule(lenient)
    assert arrays is not None and metrics["replies-valid"] == NUM_NODES
    warned = [r.getMessage() for r in caplog.records if f"'{rule}'" in r.getMessage()]
    assert len(warned) == 1 and "[1001]" in warned[0], warned

    strict = STRATEGIES[name]()
    for strategy in getattr(strict, "inner", [strict]):
        strategy.strict = True
    _, metrics = round_without_rule(strict)
    assert metrics["replies-valid"] == NUM_NODES - 1
    assert metrics["replies-rejected"] == 1
    assert sum(v for k, v in strict.rejections.items() if "rule-not-applied" in k) == 1


# How the server confirms client state: per node in a running strategy, per client
# key after a restore (nodes may have changed); test_resume checks both end to end.
COMMIT_KEYS = {ACCEPTED_ROUND_KEY, ACCEPTED_KEYS_KEY, ACCEPTED_ROUNDS_KEY}


def message_content(message: Message) -> dict:
    content = message.content
    return {
        "dst": message.metadata.dst_node_id,
        "arrays": {n: to_np(r) for n, r in content.array_records.items()},
        "config": {
            n: {k: v for k, v in r.items() if k not in COMMIT_KEYS}
            for n, r in content.config_records.items()
        },
    }


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_restored_strategy_continues_exactly_as_the_original(name: str) -> None:
    """The resume contract: state_dict holds everything the next round reads.

    A field missing from both state_dict and load_state_dict passes the round
    trip above; here the restored strategy must send the same messages and
    produce the same model and state as the original in the round after.
    """
    original, _, good = setup_round(name)
    arrays, _ = original.aggregate_train(1, good)
    assert arrays is not None
    restored = STRATEGIES[name]()
    restored.load_state_dict(original.state_dict())
    runs = []
    for strategy in (original, restored):
        # A restored strategy numbers Flower's rounds from 1 again (as start()
        # does after a resume); its round_offset makes that round 2.
        servers = getattr(strategy, "inner", [strategy])  # P-FedAvg's count
        rnd = 2 - servers[0].round_offset if strategy is restored else 2
        messages = list(
            strategy.configure_train(
                rnd, arrays, ConfigRecord(), sampling_grid(NUM_NODES)
            )
        )
        replies = [
            build_reply(m, good_content(strategy, i + 3), strategy=strategy, n=12 + i)
            for i, m in enumerate(messages)
        ]
        new, _ = strategy.aggregate_train(rnd, replies)
        runs.append(
            ([message_content(m) for m in messages], to_np(new), strategy.state_dict())
        )
    (sent, model, state), (sent_again, model_again, state_again) = runs
    assert len(sent) == len(sent_again)
    for first, second in zip(sent, sent_again, strict=True):
        assert first["dst"] == second["dst"] and first["config"] == second["config"]
        # FedDyn's tracking sends theta^0 to every node it has not identified in
        # this process: after a restore, each node once more (its client ignores
        # it when it holds its own latest model).
        extra = second["arrays"].keys() - first["arrays"].keys()
        assert first["arrays"].keys() <= second["arrays"].keys()
        assert extra <= {INITIAL_MODEL_RECORD}
        for record_name in first["arrays"]:
            assert_same_state(
                first["arrays"][record_name], second["arrays"][record_name]
            )
    assert_same_state(model, model_again)
    assert_same_state(state, state_again)


def _assert_same_value(a, b) -> None:
    if isinstance(a, dict) or isinstance(b, dict):
        assert isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_same_value(a[key], b[key])
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        np.testing.assert_array_equal(a, b)
        assert np.asarray(a).dtype == np.asarray(b).dtype
    else:
        assert a == b


def _plain_attributes(strategy) -> dict:
    """Deep copy of a strategy's attributes that hold plain data (no objects)."""
    plain = (type(None), bool, int, float, str, np.ndarray)

    def is_plain(value) -> bool:
        if isinstance(value, dict):
            return all(is_plain(v) for v in value.values())
        return isinstance(value, plain)

    return {k: copy.deepcopy(v) for k, v in vars(strategy).items() if is_plain(v)}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_server_rules_are_pure(name: str) -> None:
    """The rule contract: server_update reads its arguments and changes nothing.

    The base may run a rule twice in a round (a non-finite reply is dropped and
    the rule re-run) and commits its state only if the round is aggregated, so
    a rule must leave the state it is given untouched and give the same update
    for the same arguments. Checked in round 2, when every state field is set.
    """
    strategy, _, good = setup_round(name)
    arrays, _ = strategy.aggregate_train(1, good)
    assert arrays is not None
    calls = []
    for server in getattr(strategy, "inner", [strategy]):
        rule = server.server_update

        def spy(rnd, state, replies, rule=rule, server=server):
            before = copy.deepcopy(state)
            attributes = _plain_attributes(server)
            update = rule(rnd, state, replies)
            _assert_same_value(state, before)  # not mutated
            _assert_same_value(_plain_attributes(server), attributes)  # no stash
            again = rule(rnd, state, replies)  # the same again
            _assert_same_value(to_np(update.arrays), to_np(again.arrays))
            _assert_same_value(update.state, again.state)
            assert set(update.state) <= set(server.state_fields)
            calls.append(rnd)
            return update

        server.server_update = spy
    messages = list(
        strategy.configure_train(2, arrays, ConfigRecord(), sampling_grid(NUM_NODES))
    )
    replies = [
        build_reply(m, good_content(strategy, i + 3), strategy=strategy, n=12 + i)
        for i, m in enumerate(messages)
    ]
    assert strategy.aggregate_train(2, replies)[0] is not None
    assert calls, "server_update was not called"

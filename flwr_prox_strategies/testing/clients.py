r"""The conformance kit's client half: an algorithm's own client against its strategy.

The strategy checks (:mod:`.checks`) build every reply by hand; these run the
algorithm's *own* client (its ``TorchClient``, else its rule in a plain loop)
for three rounds (:func:`run_clients`) on a small federation made to expose what
hand-built replies hide: a model with buffers, a first model :math:`\theta^0 \ne
0`, a node not sampled in round 2 (1005) and a reply made invalid on its way to
the server (1002's). :data:`CLIENT_CHECKS` then checks the replies, the
two-phase commit and the rule's term; the full list: the documentation's guide
"Add an algorithm", section "What the conformance kit checks, and what it
cannot".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ..core.client.adapter import to_client_app
from ..core.client.rule import ClientRule
from ..core.transport.inprocess import InProcessGrid
from ..core.transport.keys import NUM_EXAMPLES_KEY
from .checks import _flower_log
from .replies import servers_of

#: Nodes of the client federation (ids ``1001 .. 1005``).
CLIENT_NODES = 5
#: Rounds of its run.
CLIENT_ROUNDS = 3
#: The node not listed (so not sampled) in round 2, back in round 3.
ABSENT_NODE = 1005
#: The node whose round-2 reply is made invalid on its way to the server.
REJECTED_NODE = 1002
_ABSENT_ROUND = _REJECTED_ROUND = 2
_LR = 0.05


def buffered_model() -> nn.Sequential:
    """Return the kit's model: Linear(3, 4), BatchNorm1d(4), ReLU, Linear(4, 1).

    Returns
    -------
    torch.nn.Module
        A fresh model; its ``state_dict`` has 9 entries, 3 of them buffers
        (BatchNorm's running mean and variance and its int64 batch counter).
    """
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))


def initial_model() -> ArrayRecord:
    r"""Return :math:`\theta^0` for :func:`buffered_model`: no entry is zero.

    Returns
    -------
    ArrayRecord
        Parameters drawn with a fixed seed (all >= 0.5); BatchNorm's running
        mean 0.5, running variance 2.0, and 3 batches counted.
    """
    generator = torch.Generator().manual_seed(7)
    arrays = []
    for key, value in buffered_model().state_dict().items():
        if key.endswith("running_mean"):
            arrays.append(np.full(tuple(value.shape), 0.5, np.float32))
        elif key.endswith("running_var"):
            arrays.append(np.full(tuple(value.shape), 2.0, np.float32))
        elif key.endswith("num_batches_tracked"):
            arrays.append(np.asarray(3, dtype=np.int64))
        else:
            drawn = torch.randn(tuple(value.shape), generator=generator)
            arrays.append((0.5 + 0.5 * drawn.abs()).numpy().astype(np.float32))
    return ArrayRecord(arrays)


def node_loader(partition: int) -> DataLoader:
    """Return a node's regression data: 16 rows, batches of 8 (two steps an epoch)."""
    generator = torch.Generator().manual_seed(100 + partition)
    x = torch.randn(16, 3, generator=generator)
    target = torch.tensor([1.0, -2.0, 0.5]) + 0.5 * partition
    y = (x @ target).unsqueeze(-1) + 0.1 * torch.randn(16, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Scaled so the gradient's Lipschitz constant is small: the step rules of
    # FedEPM and SFedAvg (steps of 1/r0 = 20 at their defaults) stay stable.
    return 1e-6 * ((out - y) ** 2).mean()


def client_app_of(
    algorithm: Any, make_model: Callable[[], nn.Module] = buffered_model
) -> Callable[[Message, Context], Message]:
    """Return the ``ClientApp`` that runs an algorithm's own client on the kit's data.

    Parameters
    ----------
    algorithm : Algorithm
        Its ``client`` (a ``TorchClient``), built as ``client(model,
        train_loader, loss_fn=..., learning_rate=0.05, local_epochs=1)``; when
        None, its ``rule``, in the loop of a Message-API ``ClientApp``
        (``from_message``, plain SGD ``attach``-ed, ``reply``).
    make_model : Callable[[], torch.nn.Module] (default: buffered_model)
        Builds each node's model every round (or the part of it the client
        or rule gets).

    Returns
    -------
    Callable[[Message, Context], Message]
        What :class:`~flwr_prox_strategies.testing.InProcessGrid` runs on
        every node (node ``1001 + k`` holds partition ``k``).
    """
    client_cls = algorithm.client
    if client_cls is not None:

        def client_fn(context: Context) -> Any:
            partition = int(context.node_config["partition-id"])
            return client_cls(
                make_model(),
                node_loader(partition),
                loss_fn=_mse,
                learning_rate=_LR,
                local_epochs=1,
            )

        return to_client_app(client_fn)
    rule_cls = algorithm.rule
    options = (
        {"num_examples": 16}
        if "num_examples" in inspect.signature(rule_cls.__init__).parameters
        else {}
    )

    def app(message: Message, context: Context) -> Message:
        model = make_model()
        rule = rule_cls.from_message(message, context, model, **options)
        optimizer = rule.attach(torch.optim.SGD(model.parameters(), lr=_LR))
        loader = node_loader(int(context.node_config["partition-id"]))
        for x, y in loader:
            optimizer.zero_grad()
            _mse(model(x), y).backward()
            optimizer.step()
        return rule.reply(num_examples=len(loader.dataset))  # type: ignore[arg-type]

    return app


class _Grid(InProcessGrid):
    """The kit's grid: a node may be left out of the listing (not sampled)."""

    def __init__(self, app: Callable[[Message, Context], Message]) -> None:
        super().__init__(app, num_nodes=CLIENT_NODES)
        self.unlisted: set[int] = set()

    def get_node_ids(self) -> list[int]:
        return [n for n in self.contexts if n not in self.unlisted]


def _committed(context: Context) -> dict[str, list[np.ndarray]]:
    """Return a node's state records as the next round reads them."""
    records = context.state.array_records
    resolved: dict[str, list[np.ndarray]] = {}
    for name, record in records.items():
        if name.startswith("scalar:") or name == "run-tag":
            continue
        base = name.removeprefix("pending:")
        if name.startswith("pending:") or base not in resolved:
            resolved[base] = [a.numpy().copy() for a in record.values()]
    return resolved


def _held(context: Context) -> dict[str, list[np.ndarray]]:
    """Return a node's committed state records (pending ones left out)."""
    return {
        name: [a.numpy().copy() for a in record.values()]
        for name, record in context.state.array_records.items()
        if not name.startswith(("pending:", "scalar:")) and name != "run-tag"
    }


@dataclass
class ClientRun:
    """What :func:`run_clients` saw: the inputs of the client checks.

    Parameters
    ----------
    strategy : Strategy
        The strategy that ran.
    rule : type | None (default: None)
        The client rule that ran (its class), when known.
    metrics, record_problems, errors, rejected : dict | list
        What the replies gave (each field's comment says what).
    state_before, state_after : dict[str, list[numpy.ndarray]]
        Node 1002's committed state around its rejected round.
    k_before, k_after : int | None
        N after round 1 and after the run.
    log : list[str]
        Flower's log lines at WARNING and above.
    sampled : dict[int, list[int]]
        The nodes sampled in each round.
    """

    strategy: Any
    rule: type | None = None
    #: Round -> the round's metrics (None when nothing was returned).
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: Problems with the replies' records, found before the server saw them.
    record_problems: list[str] = field(default_factory=list)
    #: Error replies: node -> reason (the client raised).
    errors: dict[tuple[int, int], str] = field(default_factory=dict)
    #: Replies the server rejected, besides the one made invalid on purpose.
    rejected: list[str] = field(default_factory=list)
    #: The rejected node's state before and after its rejected round.
    state_before: dict[str, list[np.ndarray]] = field(default_factory=dict)
    state_after: dict[str, list[np.ndarray]] = field(default_factory=dict)
    #: N after round 1 and after the run (None: the rule does not use N).
    k_before: int | None = None
    k_after: int | None = None
    #: Flower log lines at WARNING and above.
    log: list[str] = field(default_factory=list)
    #: Nodes sampled per round.
    sampled: dict[int, list[int]] = field(default_factory=dict)


def _where(cls: Any, method: str) -> str:
    """``Class.method (file)``, to name the place to fix."""
    try:
        path = inspect.getsourcefile(cls) or "?"
    except TypeError:
        path = "?"
    return f"{cls.__name__}.{method} ({path})"


def _record_problems(
    strategy: Any, rule_cls: type | None, reply: Message, server_round: int
) -> list[str]:
    """Compare a reply's ArrayRecords with what the strategy expects, naming sides."""
    if reply.has_error():
        return []
    server = servers_of(strategy)[0]
    expected = server.expected_train_arrays(server_round)
    sent = dict(reply.content.array_records)
    node = reply.metadata.src_node_id
    strategy_side = _where(type(server), "expected_train_arrays")
    client_side = _where(rule_cls, "finish") if rule_cls is not None else "the client"
    entries = len(buffered_model().state_dict())
    problems = []
    for name in expected.keys() - sent.keys():
        problems.append(
            f"round {server_round}, node {node}: the client does not send the "
            f"ArrayRecord '{name}' that {strategy_side} expects: return it from "
            f"{client_side}, or stop expecting it"
        )
    for name in sent.keys() - expected.keys():
        problems.append(
            f"round {server_round}, node {node}: the client sends the ArrayRecord "
            f"'{name}' that {strategy_side} does not declare (the server rejects "
            f"the reply): declare it there, or stop sending it from {client_side}"
        )
    for name in expected.keys() & sent.keys():
        if len(sent[name]) != entries and name != server.arrayrecord_key:
            problems.append(
                f"round {server_round}, node {node}: the ArrayRecord '{name}' holds "
                f"{len(sent[name])} arrays, the model's state_dict {entries} entries "
                "(buffers such as BatchNorm's running statistics included): lay it "
                f"out with rule.to_reply_layout(tensors) in {client_side}"
            )
    return problems


def run_clients(algorithm: Any, make: Callable[[int], Any]) -> ClientRun:
    """Run an algorithm's own client against one configuration of its strategy.

    Three rounds on 5 nodes with :func:`buffered_model` from
    :func:`initial_model`; node 1005 is not listed in round 2; node 1002's
    round-2 reply gets ``num-examples`` 0 on its way to the server (which
    rejects it).

    Parameters
    ----------
    algorithm : Algorithm
        Names the client (or the rule) to run.
    make : Callable[[int], Any]
        The strategy's factory (one of the algorithm's ``cases``).

    Returns
    -------
    ClientRun
        What the checks assert on.
    """
    strategy = make(CLIENT_NODES)
    servers = servers_of(strategy)
    for server in servers:  # later rounds go on with the nodes listed
        server.min_round_nodes = 2
        server.node_wait_timeout = 0.0
        server.max_rounds_without_aggregation = None  # the checks say why
    rule_cls = algorithm.rule
    if algorithm.client is not None:
        rule_cls = getattr(algorithm.client, "rule_class", rule_cls)
    grid = _Grid(client_app_of(algorithm))
    run = ClientRun(strategy, rule_cls)
    arrays = initial_model()
    with _flower_log() as lines:
        for rnd in range(1, CLIENT_ROUNDS + 1):
            grid.unlisted = {ABSENT_NODE} if rnd == _ABSENT_ROUND else set()
            minimums = [server.min_train_nodes for server in servers]
            listed = len(grid.get_node_ids())
            for server in servers:  # a sample of all (FedEPM's rho = 1) goes on
                server.min_train_nodes = min(server.min_train_nodes, listed)
            messages = list(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
            for server, minimum in zip(servers, minimums, strict=True):
                server.min_train_nodes = minimum
            run.sampled[rnd] = [m.metadata.dst_node_id for m in messages]
            context = grid.contexts[REJECTED_NODE]
            if rnd == _REJECTED_ROUND:
                run.state_before = _committed(context)
            replies = list(grid.send_and_receive(messages))
            for reply in replies:
                node = reply.metadata.src_node_id
                if reply.has_error():
                    run.errors[(rnd, node)] = str(reply.error.reason)
                    continue
                run.record_problems += _record_problems(strategy, rule_cls, reply, rnd)
                if rnd == _REJECTED_ROUND and node == REJECTED_NODE:
                    reply.content.metric_records["metrics"][NUM_EXAMPLES_KEY] = 0
            if rnd == _REJECTED_ROUND:
                run.state_after = _held(context)
            before = sum(strategy.rejections.values())
            new, metrics = strategy.aggregate_train(rnd, replies)
            run.metrics[rnd] = dict(metrics or {})
            injected = int(rnd == _REJECTED_ROUND and REJECTED_NODE in run.sampled[rnd])
            if sum(strategy.rejections.values()) - before > injected:
                run.rejected.append(f"round {rnd}: {dict(strategy.rejections)}")
            if new is not None:
                arrays = new
            if rnd == 1:  # N as the first round set it (learned, when not given)
                run.k_before = getattr(servers[0], "num_clients", None)
    run.log = lines
    run.k_after = getattr(servers[0], "num_clients", None)
    return run


def check_clients_run(run: ClientRun) -> None:
    """Check that every client trained and replied (no client raised)."""
    assert not run.errors, "the client raised: " + "; ".join(
        f"round {r}, node {n}: {why}" for (r, n), why in sorted(run.errors.items())
    )
    assert REJECTED_NODE in run.sampled[_REJECTED_ROUND], (
        f"the configuration did not sample node {REJECTED_NODE} in round 2: the "
        "client checks need one that samples every listed node"
    )
    assert ABSENT_NODE in run.sampled[CLIENT_ROUNDS], (
        f"node {ABSENT_NODE} was not sampled again in round 3"
    )


def check_replies_pass_screening(run: ClientRun) -> None:
    """Check that the client's replies carry what the strategy expects, and pass."""
    assert not run.record_problems, "\n".join(run.record_problems)
    lines = [line for line in run.log if "reject" in line.lower()]
    assert not run.rejected, (
        "the server rejected replies of the algorithm's own client: "
        + "; ".join(run.rejected)
        + (f". Its log: {lines}" if lines else "")
    )


def check_rejected_reply_keeps_state(run: ClientRun) -> None:
    """Check that a reply the server rejected left its client's state as it was.

    The two-phase commit: state saved during a round is pending until the
    server confirms the round's reply was aggregated.
    """
    before, after = run.state_before, run.state_after
    personal = set(getattr(run.rule, "personal_state", ()))

    def differs(name: str) -> bool:
        if name not in before or name not in after:
            return True
        old, new = before[name], after[name]
        return len(old) != len(new) or any(
            a.shape != b.shape or a.tobytes() != b.tobytes()
            for a, b in zip(old, new, strict=True)
        )

    changed = sorted(n for n in (before.keys() | after.keys()) - personal if differs(n))
    server = servers_of(run.strategy)[0]
    assert not changed, (
        f"node {REJECTED_NODE}'s committed state {changed} changed in round 2 "
        "although the server rejected its reply: the rule saves state with "
        "state.set (which commits at once) or does not declare it; save it with "
        "self.state.set_pending(name, arrays, self.server_round), list it in the "
        "rule's state_names with stateful = True (or, for state the client keeps "
        "whatever the server does, such as a personal model, in personal_state)"
        + (
            ""
            if getattr(server, "stateful_clients", False)
            else f", and declare stateful_clients = True on {type(server).__name__}"
        )
    )


def check_state_recognised(run: ClientRun) -> None:
    """Check that every client's committed state is recognised next round.

    No state retired, N unchanged, no state saved outside the commit.
    """
    outside = sum(
        int(m.get("replies-state-outside-commit", 0)) for m in run.metrics.values()
    )
    assert not outside, (
        f"{outside} replies came from a rule that saves state outside the two-phase "
        "commit (state.set): save it with self.state.set_pending(name, arrays, "
        "self.server_round)"
    )
    retired = [line for line in run.log if "holds no state" in line]
    stale = [line for line in run.log if "a stale copy of its state" in line]
    assert not retired and not stale, (
        "the server did not recognise client states it had committed: "
        f"{(retired + stale)[:2]}. A stateful rule reports the round of its "
        "committed state (stateful = True, state saved with set_pending)"
    )
    assert run.k_before == run.k_after, (
        f"N grew {run.k_before} -> {run.k_after} over a run of the same clients"
    )


def check_rule_applied_every_step(run: ClientRun) -> None:
    """Check that every reply reports the rule's term in every update."""
    for rnd, metrics in run.metrics.items():
        missing = int(metrics.get("replies-rule-missing", 0))
        short = int(metrics.get("replies-term-incomplete", 0))
        assert not missing and not short, (
            f"round {rnd}: {missing} replies lack the strategy's rule metric and "
            f"{short} applied the term in fewer steps than they took: the client "
            "must run the algorithm's rule and reply with rule.reply (or "
            "rule.reply_records)"
        )


#: The client checks of one configuration, name -> check(run).
CLIENT_CHECKS: dict[str, Callable[[ClientRun], None]] = {
    "client/trains": check_clients_run,
    "client/replies-pass-screening": check_replies_pass_screening,
    "client/rejected-reply-keeps-state": check_rejected_reply_keeps_state,
    "client/state-recognised": check_state_recognised,
    "client/rule-applied-every-step": check_rule_applied_every_step,
}


def runs_client(algorithm: Any) -> bool:
    """Return whether the algorithm names a client the kit can run.

    Parameters
    ----------
    algorithm : Algorithm
        The algorithm.

    Returns
    -------
    bool
        True when it names a ``client``, or a ``rule`` other than FedAvg's.
    """
    return algorithm.client is not None or (
        algorithm.rule is not None and algorithm.rule is not ClientRule
    )


def frozen_model() -> nn.Sequential:
    """Return :func:`buffered_model` with its first layer frozen (a backbone).

    Returns
    -------
    torch.nn.Module
        Its trainable part: BatchNorm's weight and bias and the last layer.
    """
    model = buffered_model()
    with torch.no_grad():  # the same frozen layer on every node
        generator = torch.Generator().manual_seed(11)
        for p in model[0].parameters():
            p.copy_(torch.randn(tuple(p.shape), generator=generator))
    model[0].requires_grad_(False)
    return model


def check_frozen_part(algorithm: Any, make: Callable[[int], Any]) -> None:
    """Check that the algorithm federates a model's part and leaves the rest alone.

    Two rounds on 5 nodes whose client (or rule, in a plain loop) gets
    ``federated_part(frozen_model())``: every reply must pass screening, the
    server's model must have the part's layout, and no node's frozen layer
    may change.
    """
    from ..core.client.training import federated_part

    built: list[tuple[nn.Sequential, list[torch.Tensor]]] = []

    def frozen_part() -> nn.Module:
        model = frozen_model()
        built.append((model, [p.detach().clone() for p in model[0].parameters()]))
        return federated_part(model)

    strategy = make(CLIENT_NODES)
    initial = ArrayRecord(federated_part(frozen_model()).state_dict())
    try:
        result = strategy.start(
            grid=InProcessGrid(
                client_app_of(algorithm, frozen_part), num_nodes=CLIENT_NODES
            ),
            initial_arrays=initial,
            num_rounds=2,
        )
    except Exception as err:  # the kit reports what broke as an assertion
        raise AssertionError(
            f"a federation of the federated part failed: {type(err).__name__}: {err}"
        ) from err
    shapes = [a.shape for a in result.arrays.to_numpy_ndarrays()]
    expected = [a.shape for a in initial.to_numpy_ndarrays()]
    assert shapes == expected, (
        f"the server's model has {shapes}, the federated part {expected}"
    )
    for server_round, metrics in result.train_metrics_clientapp.items():
        valid = metrics.get("replies-valid")
        assert valid == CLIENT_NODES, (
            f"round {server_round}: {valid} of {CLIENT_NODES} replies of the "
            "federated part were valid"
        )
    moved = sum(
        not all(
            torch.equal(p, q)
            for p, q in zip(model[0].parameters(), before, strict=True)
        )
        for model, before in built
    )
    assert built and not moved, (
        f"the frozen layer changed in {moved} of {len(built)} clients' rounds"
    )

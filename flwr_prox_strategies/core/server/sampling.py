"""Which nodes train and evaluate each round: seeded, quorum-checked, bounded waits.

The generator of a draw is seeded by ``(seed, round, stream)`` and nothing else
(no global ``random`` state), so two strategies built with the same seed sample
the same nodes, and a resumed run samples exactly as an uninterrupted one.
Streams: 0 training, 1 stragglers, 2 evaluation.
"""

from __future__ import annotations

import time
from logging import INFO
from typing import TYPE_CHECKING

import numpy as np
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from .outcome import EveryClientRetiredError

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

    from .strategy import ValidatedFedAvg

PARTICIPATION = ("fixed", "bernoulli")
# Redraws of a Bernoulli sample below min_train_nodes before giving up (the official
# loop redraws until one node joins; a tiny p with a large minimum would never end).
BERNOULLI_DRAWS = 10_000


def connected_nodes(grid: Grid, needed: int, timeout: float, owner: str) -> list[int]:
    """Return the connected node ids (sorted) once ``needed`` are connected.

    Waits ``timeout`` seconds at most, then fails with the fix in the message
    (Flower's own ``FedAvg`` waits forever).
    """
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < needed:
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"{owner}: only {len(nodes)} node(s) connected after "
                f"{timeout:.0f} s, but {needed} are required "
                "(min_available_nodes / min_*_nodes). Start more SuperNodes, run "
                "the simulation with --federation-config 'num-supernodes=N', or "
                "lower the minimum."
            )
        log(INFO, "Waiting for nodes: %d connected, %d required", len(nodes), needed)
        time.sleep(1.0)
    return nodes


def sample_nodes(
    grid: Grid,
    server_round: int,
    *,
    seed: int,
    stream: int,
    fraction: float,
    minimum: int,
    quorum: int,
    timeout: float,
    owner: str,
    exclude: set[int] | frozenset[int] = frozenset(),
    bernoulli: bool = False,
) -> tuple[list[int], int]:
    """Sample nodes reproducibly for ``server_round``, once ``quorum`` are connected.

    ``fixed`` (default): ``max(int(fraction * n), minimum)`` of the ``n``
    connected nodes, uniformly without replacement. ``bernoulli``: each node
    independently with probability ``fraction``, redrawn while fewer than
    ``max(minimum, 1)`` are drawn. Nodes in ``exclude`` (retired) are never drawn.

    Returns
    -------
    tuple[list[int], int]
        The sampled node ids (sorted) and the number of connected nodes.
    """
    # One listing a round when enough nodes are there: at 10,000 nodes a listing
    # from the SuperLink's state costs tens of milliseconds.
    nodes = sorted(grid.get_node_ids())
    size = max(int(len(nodes) * fraction), minimum)
    if len(nodes) < max(quorum, size):
        nodes = connected_nodes(grid, max(quorum, size), timeout, owner)
    connected = len(nodes)
    if exclude:
        nodes = [n for n in nodes if n not in exclude]
    rng = np.random.default_rng([seed, server_round, stream])
    if bernoulli:
        least = min(max(minimum, 1), len(nodes)) if fraction > 0 else 0
        for _ in range(BERNOULLI_DRAWS):
            joins = np.flatnonzero(rng.random(len(nodes)) < fraction)
            if len(joins) >= least:
                return sorted(nodes[i] for i in joins), connected
        raise ValueError(
            f"participation='bernoulli': {BERNOULLI_DRAWS} draws at probability "
            f"{fraction} gave fewer than the {least} nodes min_train_nodes asks "
            f"of {len(nodes)}; raise fraction_train or lower min_train_nodes"
        )
    size = min(max(int(len(nodes) * fraction), minimum), len(nodes))
    chosen = rng.choice(len(nodes), size=size, replace=False)
    return sorted(nodes[i] for i in chosen), connected


def draw_stragglers(
    node_ids: list[int],
    server_round: int,
    *,
    seed: int,
    drop_percent: float,
    local_epochs: int | None,
) -> dict[int, int]:
    """Return ``{node: epochs}`` for this round's stragglers.

    ``drop_percent`` of the nodes, each running a random number of epochs in
    ``1 .. local_epochs - 1`` (``np.random.randint(1, E)`` in the official
    FedProx code).
    """
    if drop_percent == 0.0 or not node_ids:
        return {}
    assert local_epochs is not None  # checked by the strategy
    rng = np.random.default_rng([seed, server_round, 1])
    num_active = round(len(node_ids) * (1.0 - drop_percent))
    order = rng.permutation(len(node_ids))
    stragglers = sorted(node_ids[i] for i in order[num_active:])
    epochs = rng.integers(1, local_epochs, size=len(stragglers))
    return {node: int(e) for node, e in zip(stragglers, epochs, strict=True)}


def training_sample(
    strategy: ValidatedFedAvg,
    grid: Grid,
    server_round: int,
    arrays: ArrayRecord,
) -> tuple[list[int], dict[int, int]]:
    """Return the nodes that train this round and the stragglers' epochs.

    Retired nodes (privacy budget spent) are never drawn; when every connected
    node is retired, training stops (:class:`.outcome.EveryClientRetiredError`,
    with ``arrays``, the last aggregated model). Stragglers are dropped or kept
    with partial work, as the strategy's ``straggler_policy`` says.
    """
    name = type(strategy).__name__
    node_ids, num_connected = strategy.sample_nodes(
        grid,
        server_round,
        fraction=strategy.fraction_train,
        minimum=strategy.min_train_nodes,
        stream=0,
        exclude=strategy.retired_nodes,
        bernoulli=strategy.participation == "bernoulli",
    )
    if (
        strategy.requires_num_clients
        and strategy.num_clients is not None
        and num_connected != strategy.num_clients
    ):
        log(
            INFO,
            "configure_train: %d node(s) connected, K=%d clients (%s): absent "
            "clients keep their state in the sums; new ones join K when they "
            "first reply",
            num_connected,
            strategy.num_clients,
            strategy.num_clients_source,
        )
    if not node_ids and num_connected and strategy.retired_nodes:
        raise EveryClientRetiredError(
            f"{name}: round {server_round}: every one of the "
            f"{num_connected} connected node(s) has spent its privacy budget "
            f"(retired: {len(strategy.retired_nodes)}); training stops here instead "
            f"of idling through the remaining rounds. The model is the one "
            f"aggregated last (round {server_round - 1}). To train longer, "
            "raise the budget (privacy.dp.target_epsilon) or spend it more "
            "slowly (more noise, fewer local steps, fewer rounds).",
            Result(arrays=arrays),
            server_round,
        )
    stragglers = draw_stragglers(
        node_ids,
        server_round,
        seed=strategy.seed,
        drop_percent=strategy.drop_percent,
        local_epochs=strategy.local_epochs,
    )
    keep_partial = strategy.straggler_policy == "keep-partial"
    if stragglers and not keep_partial:
        node_ids = [n for n in node_ids if n not in stragglers]
        log(INFO, "configure_train: dropping %d straggler(s)", len(stragglers))
    if strategy.retired_nodes:
        log(
            INFO,
            "configure_train: %d node(s) retired (privacy budget spent)",
            len(strategy.retired_nodes),
        )
    log(
        INFO,
        "configure_train: sampled %d nodes (out of %d)%s",
        len(node_ids),
        num_connected,
        f", {len(stragglers)} straggler(s) keep partial work"
        if stragglers and keep_partial
        else "",
    )
    return node_ids, stragglers

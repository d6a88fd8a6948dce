"""Which nodes train and evaluate each round: seeded, quorum-checked, bounded waits.

The generator of a draw is seeded by ``(seed, round, stream)`` and nothing else
(no global ``random`` state), so two strategies built with the same seed sample
the same nodes, and a resumed run samples exactly as an uninterrupted one.
Streams: 0 training, 1 stragglers, 2 evaluation.
"""

from __future__ import annotations

import time
from logging import INFO

import numpy as np
from flwr.common.logger import log
from flwr.serverapp import Grid

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
    size = max(int(len(list(grid.get_node_ids())) * fraction), minimum)
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

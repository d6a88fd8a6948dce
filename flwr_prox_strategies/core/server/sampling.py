"""Which nodes train and evaluate each round: seeded, quorum-checked, bounded waits.

The generator of a draw is seeded by ``(seed, round, stream)`` and nothing else
(no global ``random`` state), so two strategies built with the same seed sample
the same nodes, and a resumed run samples exactly as an uninterrupted one.
Streams: 0 training, 1 stragglers, 2 evaluation.

:class:`TrainSampling` gives the base strategy ``sample_nodes`` and
``sample_train``; :class:`Sampler` is the part it holds (its seed,
participation, the quorum of later rounds); :class:`Stragglers` is the
FedProx paper's systems heterogeneity, a piece the sampler composes (none by
default).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from ...ops.checks import check_int
from .outcome import EveryClientRetiredError
from .population import Population

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


@dataclass(frozen=True)
class Stragglers:
    """The FedProx paper's stragglers: a share of each round's nodes do less work.

    ``drop_percent`` of the sampled nodes run a random number of epochs in
    ``1 .. local_epochs - 1``; ``keep_partial`` says whether the strategy uses
    their partial work (FedProx) or drops them before sending (its FedAvg).

    Parameters
    ----------
    drop_percent : float (default: 0.0)
        The share of each round's sampled nodes made stragglers, in ``[0, 1]``.
    keep_partial : bool (default: False)
        Keep their partial work (the strategy's ``straggler_policy`` is
        ``"keep-partial"``) instead of dropping them.
    """

    drop_percent: float = 0.0
    keep_partial: bool = False

    def draw(
        self,
        node_ids: list[int],
        server_round: int,
        seed: int,
        local_epochs: int | None,
    ) -> dict[int, int]:
        """Return ``{node: epochs}`` for this round's stragglers (seeded, stream 1)."""
        return draw_stragglers(
            node_ids,
            server_round,
            seed=seed,
            drop_percent=self.drop_percent,
            local_epochs=local_epochs,
        )


@dataclass
class Sampler:
    """The nodes of each round, for one strategy: its seed and participation.

    The first sampling waits for the first quorum (``min_available_nodes``),
    later ones for the second when set (``min_round_nodes``: a federation that
    loses nodes goes on). ``stragglers`` is a piece it composes.
    """

    seed: int
    participation: str
    stragglers: Stragglers = field(default_factory=Stragglers)
    sampled_once: bool = False

    def sample(
        self,
        grid: Grid,
        server_round: int,
        *,
        quorum: tuple[int, int | None],
        timeout: float,
        owner: str,
        **draw: Any,
    ) -> tuple[list[int], int]:
        """Sample with this seed once the round's quorum is connected."""
        first, later = quorum
        needed = later if self.sampled_once and later is not None else first
        self.sampled_once = True
        return sample_nodes(
            grid,
            server_round,
            seed=self.seed,
            quorum=needed,
            timeout=timeout,
            owner=owner,
            **draw,
        )


class TrainSampling:
    """Who trains this round: the base strategy's sampling, quorum and stragglers.

    The base of :class:`~flwr_prox_strategies.extend.ValidatedFedAvg` for
    drawing nodes; the draws are its :class:`Sampler`'s, seeded per round.
    """

    # Set by ValidatedFedAvg.__init__ (its parts and settings).
    sampler: Sampler
    population: Population
    retired_nodes: set[int]
    num_clients: int | None
    fraction_train: float
    min_train_nodes: int
    min_available_nodes: int
    min_round_nodes: int | None
    node_wait_timeout: float
    local_epochs: int | None
    participation: str
    seed: int

    def sample_nodes(
        self, grid: Grid, server_round: int, **draw: Any
    ) -> tuple[list[int], int]:
        """Sample nodes with this strategy's seed, waiting for a quorum.

        The quorum is ``min_available_nodes`` at the first sampling, then
        ``min_round_nodes`` when set.
        """
        return self.sampler.sample(
            grid,
            server_round,
            quorum=(self.min_available_nodes, self.min_round_nodes),
            timeout=self.node_wait_timeout,
            owner=type(self).__name__,
            **draw,
        )

    def learn_num_clients(self, num_clients: int) -> None:
        """Adopt N learned from the grid, grown, or from a checkpoint.

        Subclasses that derive settings from it (FedEPM's sampling) extend this.

        Raises
        ------
        ValueError
            If ``num_clients`` is not an integer >= 1.
        """
        check_int("num_clients", num_clients, 1)
        self.num_clients = num_clients

    def sample_train(
        self, grid: Grid, server_round: int, arrays: ArrayRecord
    ) -> tuple[list[int], dict[int, int]]:
        """Return the nodes that train this round and the stragglers' epochs.

        N is learned from the grid when not given. Retired nodes (privacy
        budget spent) are never drawn; when every connected node is retired,
        training stops (:class:`.outcome.EveryClientRetiredError`, with
        ``arrays``, the last aggregated model). Stragglers are dropped or kept
        with partial work, as the strategy's ``straggler_policy`` says.
        """
        owner = type(self).__name__
        self.population.learn_from_grid(
            lambda: len(
                connected_nodes(
                    grid, self.min_available_nodes, self.node_wait_timeout, owner
                )
            ),
            server_round,
        )
        retired, stragglers = self.retired_nodes, self.sampler.stragglers
        node_ids, num_connected = self.sample_nodes(
            grid,
            server_round,
            fraction=self.fraction_train,
            minimum=self.min_train_nodes,
            stream=0,
            exclude=retired,
            bernoulli=self.participation == "bernoulli",
        )
        if note := self.population.note(num_connected):
            log(INFO, "configure_train: %s", note)
        if not node_ids and num_connected and retired:
            raise EveryClientRetiredError(
                f"{owner}: round {server_round}: every one of the "
                f"{num_connected} connected node(s) has spent its privacy budget "
                f"(retired: {len(retired)}); training stops here instead "
                f"of idling through the remaining rounds. The model is the one "
                f"aggregated last (round {server_round - 1}). To train longer, "
                "raise the budget (privacy.dp.target_epsilon) or spend it more "
                "slowly (more noise, fewer local steps, fewer rounds).",
                Result(arrays=arrays),
                server_round,
            )
        drawn = stragglers.draw(node_ids, server_round, self.seed, self.local_epochs)
        if drawn and not stragglers.keep_partial:
            node_ids = [n for n in node_ids if n not in drawn]
            log(INFO, "configure_train: dropping %d straggler(s)", len(drawn))
        if retired:
            log(
                INFO,
                "configure_train: %d node(s) retired (privacy budget spent)",
                len(retired),
            )
        log(
            INFO,
            "configure_train: sampled %d nodes (out of %d)%s",
            len(node_ids),
            num_connected,
            f", {len(drawn)} straggler(s) keep partial work"
            if drawn and stragglers.keep_partial
            else "",
        )
        return node_ids, drawn

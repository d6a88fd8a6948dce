"""A strategy's checkpoint: what resumes a run exactly, and what a restore refuses.

Sampling is seeded per round, so no RNG state is saved, only the rounds done:
after a restore, ``start()``'s round 1 continues as round ``rounds-completed + 1``.
Besides the algorithm's declared fields (:mod:`..contract.fields`), a checkpoint
holds the base's own parts: N and its source (:class:`.population.Population`),
the epsilon ledger and the retired nodes, the two-phase commit
(:class:`.commit.ClientBook`). A checkpoint of another strategy, seed, N or
resume setting is refused, naming the difference: the run would not resume
identically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .commit import ClientBook
from .population import Population


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gives back besides the parts it restores in place."""

    rounds_completed: int
    epsilon_totals: dict[int, float]
    retired_nodes: set[int]


def checkpoint(
    *,
    strategy: str,
    seed: int,
    rounds_completed: int,
    population: Population,
    epsilon_totals: Mapping[int, float],
    retired_nodes: set[int],
    book: ClientBook,
    fields: Mapping[str, Any],
) -> dict[str, Any]:
    """Return what :func:`restore` needs to resume the run (``fields``: declared)."""
    return {
        "strategy": strategy,
        "seed": seed,
        "rounds-completed": rounds_completed,
        "num-clients": population.size,
        "epsilon-totals": dict(epsilon_totals),
        "retired-nodes": sorted(retired_nodes),
        "num-clients-source": population.source,
        **book.state_dict(),
        **fields,
    }


def restore(
    state: Mapping[str, Any],
    *,
    strategy: str,
    seed: int,
    population: Population,
    book: ClientBook,
    check_settings: Callable[[Mapping[str, Any]], None],
) -> Restored:
    """Restore ``population`` and ``book`` from :func:`checkpoint`'s, or refuse it.

    ``check_settings(state)`` refuses a checkpoint made under other resume
    settings (after the strategy's name, before N and the seed).
    """
    if state.get("strategy") != strategy:
        raise ValueError(f"checkpoint is for {state.get('strategy')!r}, not {strategy}")
    check_settings(state)
    saved_k = population.restore(state)
    for key, mine, saved in (
        ("seed", seed, state.get("seed")),
        ("num-clients", population.size, saved_k),
    ):
        if saved != mine:
            raise ValueError(
                f"checkpoint was made with {key}={saved!r}, the strategy "
                f"has {mine!r}: the run would not resume identically"
            )
    book.load_state_dict(state)
    return Restored(
        rounds_completed=int(state["rounds-completed"]),
        epsilon_totals={
            int(k): float(v) for k, v in state.get("epsilon-totals", {}).items()
        },
        retired_nodes={int(n) for n in state.get("retired-nodes", [])},
    )

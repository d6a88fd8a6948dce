"""A strategy's checkpoint: what resumes a run exactly, and what a restore refuses.

Sampling is seeded per round, so no RNG state is saved, only the rounds done:
after a restore, ``start()``'s round 1 continues as round ``rounds-completed + 1``.
Besides the algorithm's declared fields (:mod:`.fields`), a checkpoint holds
the base's own state: K and its source (:mod:`.population`), the epsilon
ledger and the retired nodes, the two-phase commit (:mod:`.commit`). A
checkpoint of another strategy, seed, K or resume setting is refused, naming
the difference: the run would not resume identically.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..contract.fields import check_settings, load_fields, save_fields
from . import population

if TYPE_CHECKING:
    from .strategy import ValidatedFedAvg


def strategy_state(strategy: ValidatedFedAvg) -> dict[str, Any]:
    """Return what :func:`restore_strategy` needs to resume ``strategy``'s run."""
    return {
        "strategy": type(strategy).__name__,
        "seed": strategy.seed,
        "rounds-completed": strategy.rounds_completed,
        "num-clients": strategy.num_clients,
        "epsilon-totals": dict(strategy.epsilon_totals),
        "retired-nodes": sorted(strategy.retired_nodes),
        "num-clients-source": strategy.num_clients_source,
        **strategy.book.state_dict(),
        **save_fields(strategy, strategy.resume_settings),
        **save_fields(strategy, strategy.state_fields),
    }


def restore_strategy(strategy: ValidatedFedAvg, state: Mapping[str, Any]) -> None:
    """Restore what :func:`strategy_state` returned, or refuse it naming why."""
    name = type(strategy).__name__
    if state.get("strategy") != name:
        raise ValueError(f"checkpoint is for {state.get('strategy')!r}, not {name}")
    check_settings(strategy, strategy.resume_settings, state)
    saved_k = population.restore(strategy, state)
    for key, mine, saved in (
        ("seed", strategy.seed, state.get("seed")),
        ("num-clients", strategy.num_clients, saved_k),
    ):
        if saved != mine:
            raise ValueError(
                f"checkpoint was made with {key}={saved!r}, the strategy "
                f"has {mine!r}: the run would not resume identically"
            )
    strategy.rounds_completed = int(state["rounds-completed"])
    strategy.epsilon_totals = {
        int(k): float(v) for k, v in state.get("epsilon-totals", {}).items()
    }
    strategy.retired_nodes = {int(n) for n in state.get("retired-nodes", [])}
    strategy.book.load_state_dict(state)
    strategy.round_offset = strategy.rounds_completed
    load_fields(strategy, strategy.state_fields, state)

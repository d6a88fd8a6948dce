"""K, the number of all clients: given, learned from the grid, grown, restored.

Rules that divide by K (``requires_num_clients``: FedDyn, FedDC, SCAFFOLD,
FedEPM, SFedAvg) take ``num_clients=None`` as "the nodes connected at the first
round" (logged). K then only grows: a client the server has never seen joins K
in the round its first reply is used; it holds zero state, so sums over all
clients are unchanged and a mean over K is rescaled by the strategy's
``grown_state``. A round whose model is kept leaves K as it was. A checkpoint
carries K and where it came from (``num-clients-source``).

The functions read and set the strategy's ``num_clients`` and
``num_clients_source`` and call its ``learn_num_clients`` (which FedEPM
extends: its sample size and step sizes follow from K).
"""

from __future__ import annotations

from collections.abc import Mapping
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from flwr.common.logger import log
from flwr.serverapp import Grid

from ..contract.frozen import FrozenState
from ..contract.validation import ValidReply
from .sampling import connected_nodes

if TYPE_CHECKING:
    from .strategy import ValidatedFedAvg


def learn_from_grid(strategy: ValidatedFedAvg, grid: Grid, server_round: int) -> None:
    """Set K to the connected nodes when the rule needs K and none was given."""
    if strategy.num_clients is not None or not strategy.requires_num_clients:
        return
    name = type(strategy).__name__
    known = len(
        connected_nodes(
            grid, strategy.min_available_nodes, strategy.node_wait_timeout, name
        )
    )
    strategy.learn_num_clients(known)
    strategy.num_clients_source = f"learned from the grid at round {server_round}"
    log(
        INFO,
        "%s: num_clients not given: using the %d nodes connected at round %d",
        name,
        known,
        server_round,
    )


def state_for_round(
    strategy: ValidatedFedAvg, k_base: int | None, replies: list[ValidReply]
) -> dict[str, Any]:
    """Return the declared state the round's rule starts from, K set for it.

    K counts every client seen, these repliers included; when that grows it,
    the state is the strategy's ``grown_state`` (not yet committed).
    """
    state = {name: getattr(strategy, name) for name in strategy.state_fields}
    if strategy.stateful_clients and strategy.requires_num_clients and k_base:
        strategy.num_clients = max(k_base, strategy.book.clients_needed(replies))
        if strategy.num_clients != k_base:
            given = FrozenState(state, type(strategy).__name__, strategy.state_fields)
            grown = strategy.grown_state(given, k_base, strategy.num_clients)
            state = {name: given.thaw(value) for name, value in grown.items()}
    return state


def commit_growth(strategy: ValidatedFedAvg, old: int | None) -> None:
    """Commit K's growth from ``old`` once the round's replies are used."""
    new = strategy.num_clients
    if old is None or new is None or new == old:
        return
    strategy.num_clients = old
    strategy.learn_num_clients(new)
    strategy.num_clients_source = (
        f"grown: {len(strategy.book.client_keys_seen)} client keys seen, "
        f"{strategy.book.retired_states} retired state(s)"
    )
    log(
        WARNING,
        "%s: K grows %d -> %d (%s)",
        type(strategy).__name__,
        old,
        new,
        strategy.num_clients_source,
    )


def restore(strategy: ValidatedFedAvg, state: Mapping[str, Any]) -> Any:
    """Adopt a checkpoint's K where it grew or was learned; return the K to match.

    A K that grew during the run (new clients, retired states) is adopted; a
    K learned from the grid is adopted by a strategy built without one, and a
    strategy built with K resumes a checkpoint made before K was learned.
    """
    saved_k = state.get("num-clients")
    grown = str(state.get("num-clients-source", "")).startswith("grown")
    if grown and strategy.num_clients is not None and saved_k is not None:
        if int(saved_k) < strategy.num_clients:
            raise ValueError(
                f"checkpoint has K={saved_k} after growth, below the "
                f"strategy's num_clients={strategy.num_clients}"
            )
        strategy.learn_num_clients(int(saved_k))
        strategy.num_clients_source = str(state["num-clients-source"])
    if strategy.requires_num_clients and None in (saved_k, strategy.num_clients):
        if saved_k is not None and strategy.num_clients is None:
            strategy.learn_num_clients(int(saved_k))
            strategy.num_clients_source = "from the checkpoint"
        saved_k = strategy.num_clients
    return saved_k

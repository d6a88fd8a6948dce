"""N, the number of all clients: given, learned from the grid, grown, restored.

Rules that divide by N (``requires_num_clients``: FedDyn, FedDC, SCAFFOLD,
FedEPM, SFedAvg) take ``num_clients=None`` as "the nodes connected at the first
round" (logged). N then only grows: a client the server has never seen joins N
in the round its first reply is used; it holds zero state, so sums over all
clients are unchanged and a mean over N is rescaled by the strategy's
``grown_state``. A round whose model is kept leaves N as it was. A checkpoint
carries N and where it came from (``num-clients-source``).

:class:`Population` is the part the strategy holds. An N it adopts goes through
the strategy's ``learn_num_clients`` hook (``adopt``), which FedEPM extends: its
sample size and step sizes follow from N.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.common.logger import log


class Population:
    """N and where it came from, for one strategy.

    Parameters
    ----------
    num_clients : int | None
        N as given (None: not given).
    requires : bool
        Whether the strategy's rule divides by N (then a missing N is learned).
    owner : str
        The strategy's name, in the log.
    adopt : callable
        ``adopt(k)``: the strategy's ``learn_num_clients``, which sets
        :attr:`size` (and what the strategy derives from N).
    """

    def __init__(
        self,
        num_clients: int | None,
        *,
        requires: bool,
        owner: str,
        adopt: Callable[[int], None],
    ) -> None:
        self.size = num_clients
        self.source = "given" if num_clients is not None else "not set"
        self.requires = requires
        self.owner = owner
        self.adopt = adopt

    def learn_from_grid(self, connected: Callable[[], int], server_round: int) -> None:
        """Set N to the connected nodes when the rule needs N and none was given."""
        if self.size is not None or not self.requires:
            return
        known = connected()
        self.adopt(known)
        self.source = f"learned from the grid at round {server_round}"
        log(
            INFO,
            "%s: num_clients not given: using the %d nodes connected at round %d",
            self.owner,
            known,
            server_round,
        )

    def note(self, num_connected: int) -> str | None:
        """Say how the connected nodes relate to N, when they differ."""
        if not self.requires or self.size is None or num_connected == self.size:
            return None
        return (
            f"{num_connected} node(s) connected, N={self.size} clients "
            f"({self.source}): absent clients keep their state in the sums; new "
            "ones join N when they first reply"
        )

    def grow_to(self, base: int, needed: int) -> int:
        """Let N (``base`` before the round) cover ``needed`` clients, uncommitted."""
        self.size = max(base, needed)
        return self.size

    def commit_growth(self, old: int | None, why: str) -> None:
        """Commit N's growth from ``old`` once the round's replies are used."""
        new = self.size
        if old is None or new is None or new == old:
            return
        self.size = old
        self.adopt(new)
        self.source = f"grown: {why}"
        log(WARNING, "%s: N grows %d -> %d (%s)", self.owner, old, new, self.source)

    def restore(self, state: Mapping[str, Any]) -> Any:
        """Adopt a checkpoint's N where it grew or was learned; return the N to match.

        An N that grew during the run (new clients, retired states) is adopted; a
        N learned from the grid is adopted by a strategy built without one, and a
        strategy built with N resumes a checkpoint made before N was learned.
        """
        saved_k = state.get("num-clients")
        grown = str(state.get("num-clients-source", "")).startswith("grown")
        if grown and self.size is not None and saved_k is not None:
            if int(saved_k) < self.size:
                raise ValueError(
                    f"checkpoint has N={saved_k} after growth, below the "
                    f"strategy's num_clients={self.size}"
                )
            self.adopt(int(saved_k))
            self.source = str(state["num-clients-source"])
        if self.requires and None in (saved_k, self.size):
            if saved_k is not None and self.size is None:
                self.adopt(int(saved_k))
                # Where the checkpoint's N came from stays true of it.
                saved = state.get("num-clients-source", "from the checkpoint")
                self.source = str(saved)
            saved_k = self.size
        return saved_k

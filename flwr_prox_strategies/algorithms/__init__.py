"""One module per algorithm: its Strategy, its client, its wire keys.

:data:`ALGORITHMS` is the one list of them. The conf tree (``conf/strategy/<name>
.yaml``), the package's exports, the contract suite and the README are checked
against it (``tests/test_algorithms.py``), so an algorithm added half-way fails a
test instead of being skipped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.client import TorchClient
from ..core.rule import ClientRule
from .apfl import APFL, APFLClient, APFLRule
from .fedavg import FedAvg, FedAvgClient
from .feddc import FedDC, FedDCClient, FedDCRule
from .feddyn import FedDyn, FedDynClient, FedDynRule
from .fedepm import FedEPM, FedEPMClient, FedEPMRule
from .fedprox import FedProx, FedProxClient, FedProxRule
from .pfedavg import PFedAvg
from .pfedavg_server import PFedAvgServer
from .scaffold import Scaffold, ScaffoldClient, ScaffoldRule
from .sfed import SFedAvg, SFedAvgClient, SFedProx, SFedProxClient, SFedRule


@dataclass(frozen=True)
class Algorithm:
    """An algorithm's pieces: its strategy, and the client and rule that match it.

    Parameters
    ----------
    strategy : type
        The strategy class (a :class:`~flwr_prox_strategies.extend.ValidatedFedAvg`
        subclass, or a composite such as P-FedAvg).
    client : type[TorchClient] | None
        The matching ``NumPyClient`` class; None for a strategy that composes
        others (P-FedAvg: its clients are those of its inner strategy).
    rule : type[ClientRule] | None
        The matching client rule class; None as ``client``.
    deployed : type | None (default: None)
        The strategy that runs one of its servers as a deployment of its own,
        when the algorithm has one (P-FedAvg's
        :class:`~flwr_prox_strategies.PFedAvgServer`).
    """

    strategy: type
    client: type[TorchClient] | None
    rule: type[ClientRule] | None
    deployed: type | None = None


#: Every algorithm of the pack, by its conf name (``strategy=<name>``).
ALGORITHMS: dict[str, Algorithm] = {
    "fedavg": Algorithm(FedAvg, FedAvgClient, ClientRule),
    "fedprox": Algorithm(FedProx, FedProxClient, FedProxRule),
    "feddyn": Algorithm(FedDyn, FedDynClient, FedDynRule),
    "feddc": Algorithm(FedDC, FedDCClient, FedDCRule),
    "scaffold": Algorithm(Scaffold, ScaffoldClient, ScaffoldRule),
    "apfl": Algorithm(APFL, APFLClient, APFLRule),
    "fedepm": Algorithm(FedEPM, FedEPMClient, FedEPMRule),
    "sfedavg": Algorithm(SFedAvg, SFedAvgClient, SFedRule),
    "sfedprox": Algorithm(SFedProx, SFedProxClient, SFedRule),
    "pfedavg": Algorithm(PFedAvg, None, None, deployed=PFedAvgServer),
}

__all__ = ["ALGORITHMS", "Algorithm"]

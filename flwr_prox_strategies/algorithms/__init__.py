"""One module per algorithm (APFL and P-FedAvg: two): its Strategy, client, keys.

:data:`ALGORITHMS` is the one list of them. The conf tree (``conf/strategy/<name>
.yaml``), the package's exports, the contract suite and the README are checked
against it (``tests/test_algorithms.py``), so an algorithm added half-way fails a
test instead of being skipped silently.

Installed packages add algorithms of their own through the entry-point group
:data:`ENTRY_POINT_GROUP`; :func:`registered_algorithms` is the pack's table
plus theirs (:mod:`.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.client.client import TorchClient
from ..core.client.rule import ClientRule
from . import apfl, fedavg, feddc, feddyn, fedepm, fedprox, pfedavg, scaffold, sfed
from .apfl import APFL, APFLClient, APFLRule
from .fedavg import FedAvg, FedAvgClient
from .feddc import FedDC, FedDCClient, FedDCRule
from .feddyn import FedDyn, FedDynClient, FedDynRule
from .fedepm import FedEPM, FedEPMClient, FedEPMRule
from .fedprox import FedProx, FedProxClient, FedProxRule
from .pfedavg import PFedAvg
from .pfedavg_server import PFedAvgServer
from .plugins import (
    ENTRY_POINT_GROUP,
    PluginError,
    registered_algorithm,
    registered_algorithms,
)
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
    cases : Mapping[str, Callable[[int], Any]] (default: empty)
        The configurations the conformance checks of
        :mod:`flwr_prox_strategies.testing` run, name -> factory taking the
        number of nodes (node ids ``1001, 1002, ...``). Together they must set
        every one of the strategy's ``state_fields`` in a round. Empty: the
        strategy with its defaults (``num_clients`` or
        ``min_available_nodes`` set to the number of nodes).
    conf : str | None (default: None)
        For an algorithm installed as a plugin: the package holding its Hydra
        tree (``strategy/<name>.yaml``), as Hydra's ``pkg://`` takes it
        (``"my_plugin.conf"``). None for the pack's own (its ``conf/``).
    """

    strategy: type
    client: type[TorchClient] | None
    rule: type[ClientRule] | None
    deployed: type | None = None
    cases: Mapping[str, Callable[[int], Any]] = field(default_factory=dict)
    conf: str | None = None


#: Every algorithm of the pack, by its conf name (``strategy=<name>``).
ALGORITHMS: dict[str, Algorithm] = {
    "fedavg": Algorithm(FedAvg, FedAvgClient, ClientRule, cases=fedavg.CASES),
    "fedprox": Algorithm(FedProx, FedProxClient, FedProxRule, cases=fedprox.CASES),
    "feddyn": Algorithm(FedDyn, FedDynClient, FedDynRule, cases=feddyn.CASES),
    "feddc": Algorithm(FedDC, FedDCClient, FedDCRule, cases=feddc.CASES),
    "scaffold": Algorithm(Scaffold, ScaffoldClient, ScaffoldRule, cases=scaffold.CASES),
    "apfl": Algorithm(APFL, APFLClient, APFLRule, cases=apfl.CASES),
    "fedepm": Algorithm(FedEPM, FedEPMClient, FedEPMRule, cases=fedepm.CASES),
    "sfedavg": Algorithm(SFedAvg, SFedAvgClient, SFedRule, cases=sfed.SFEDAVG_CASES),
    "sfedprox": Algorithm(
        SFedProx, SFedProxClient, SFedRule, cases=sfed.SFEDPROX_CASES
    ),
    "pfedavg": Algorithm(
        PFedAvg, None, None, deployed=PFedAvgServer, cases=pfedavg.CASES
    ),
}

__all__ = [
    "ALGORITHMS",
    "ENTRY_POINT_GROUP",
    "Algorithm",
    "PluginError",
    "registered_algorithm",
    "registered_algorithms",
]

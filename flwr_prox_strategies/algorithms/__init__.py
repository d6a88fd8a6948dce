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

import pkgutil
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import apfl, fedavg, feddc, feddyn, fedepm, fedprox, pfedavg, scaffold, sfed
from .apfl import APFL
from .fedavg import FedAvg
from .feddc import FedDC
from .feddyn import FedDyn
from .fedepm import FedEPM
from .fedprox import FedProx
from .pfedavg import PFedAvg
from .pfedavg_server import PFedAvgServer
from .plugins import (
    ENTRY_POINT_GROUP,
    PluginError,
    registered_algorithm,
    registered_algorithms,
)
from .scaffold import Scaffold
from .sfed import SFedAvg, SFedProx

if TYPE_CHECKING:  # the client halves import torch: loaded on first use
    from ..core.client.client import TorchClient
    from ..core.client.rule import ClientRule
    from .clients.apfl import APFLClient, APFLRule
    from .clients.fedavg import FedAvgClient
    from .clients.feddc import FedDCClient, FedDCRule
    from .clients.feddyn import FedDynClient, FedDynRule
    from .clients.fedepm import FedEPMClient, FedEPMRule
    from .clients.fedprox import FedProxClient, FedProxRule
    from .clients.scaffold import ScaffoldClient, ScaffoldRule
    from .clients.sfed import SFedAvgClient, SFedProxClient, SFedRule

# The client classes by the module that defines them (PEP 562, :func:`__getattr__`).
_CLIENT_SOURCES = {
    "APFLClient": "clients.apfl",
    "APFLRule": "clients.apfl",
    "FedAvgClient": "clients.fedavg",
    "FedDCClient": "clients.feddc",
    "FedDCRule": "clients.feddc",
    "FedDynClient": "clients.feddyn",
    "FedDynRule": "clients.feddyn",
    "FedEPMClient": "clients.fedepm",
    "FedEPMRule": "clients.fedepm",
    "FedProxClient": "clients.fedprox",
    "FedProxRule": "clients.fedprox",
    "ScaffoldClient": "clients.scaffold",
    "ScaffoldRule": "clients.scaffold",
    "SFedAvgClient": "clients.sfed",
    "SFedProxClient": "clients.sfed",
    "SFedRule": "clients.sfed",
}


def __getattr__(name: str) -> Any:
    """Load a client class on first use: a ServerApp never imports torch."""
    if name not in _CLIENT_SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = pkgutil.resolve_name(_lazy(name))
    globals()[name] = value
    return value


def _lazy(name: str) -> str:
    """Return the dotted path of the client half's class ``name``."""
    return f"{__name__}.{_CLIENT_SOURCES[name]}.{name}"


def _resolved(piece: type | str | None) -> Any:
    return pkgutil.resolve_name(piece) if isinstance(piece, str) else piece


class Algorithm:
    """An algorithm's pieces: its strategy, and the client and rule that match it.

    Parameters
    ----------
    strategy : type
        The strategy class (a :class:`~flwr_prox_strategies.extend.ValidatedFedAvg`
        subclass, or a composite such as P-FedAvg).
    client : type[TorchClient] | str | None
        The matching ``NumPyClient`` class, or its dotted path
        (``"package.module.Class"``), imported when ``client`` is first
        read: the pack names its own so, so that a ServerApp never imports the
        clients' torch code. None for a strategy that composes others (P-FedAvg:
        its clients are those of its inner strategy).
    rule : type[ClientRule] | str | None
        The matching client rule class, or its dotted path; None as ``client``.
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

    __slots__ = ("_client", "_rule", "cases", "conf", "deployed", "strategy")

    def __init__(
        self,
        strategy: type,
        client: type[TorchClient] | str | None,
        rule: type[ClientRule] | str | None,
        deployed: type | None = None,
        cases: Mapping[str, Callable[[int], Any]] | None = None,
        conf: str | None = None,
    ) -> None:
        self.strategy = strategy
        self._client = client
        self._rule = rule
        self.deployed = deployed
        self.cases: Mapping[str, Callable[[int], Any]] = dict(cases or {})
        self.conf = conf

    @property
    def client(self) -> type[TorchClient] | None:
        """The matching ``NumPyClient`` class (imported on first read)."""
        cls = _resolved(self._client)
        self._client = cls
        return cls  # type: ignore[no-any-return]

    @property
    def rule(self) -> type[ClientRule] | None:
        """The matching client rule class (imported on first read)."""
        cls = _resolved(self._rule)
        self._rule = cls
        return cls  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return (
            f"Algorithm(strategy={self.strategy.__name__}, client={self._client!r}, "
            f"rule={self._rule!r}, conf={self.conf!r})"
        )


#: Every algorithm of the pack, by its conf name (``strategy=<name>``).
ALGORITHMS: dict[str, Algorithm] = {
    "fedavg": Algorithm(
        FedAvg,
        _lazy("FedAvgClient"),
        "flwr_prox_strategies.core.client.rule.ClientRule",
        cases=fedavg.CASES,
    ),
    "fedprox": Algorithm(
        FedProx, _lazy("FedProxClient"), _lazy("FedProxRule"), cases=fedprox.CASES
    ),
    "feddyn": Algorithm(
        FedDyn, _lazy("FedDynClient"), _lazy("FedDynRule"), cases=feddyn.CASES
    ),
    "feddc": Algorithm(
        FedDC, _lazy("FedDCClient"), _lazy("FedDCRule"), cases=feddc.CASES
    ),
    "scaffold": Algorithm(
        Scaffold, _lazy("ScaffoldClient"), _lazy("ScaffoldRule"), cases=scaffold.CASES
    ),
    "apfl": Algorithm(APFL, _lazy("APFLClient"), _lazy("APFLRule"), cases=apfl.CASES),
    "fedepm": Algorithm(
        FedEPM, _lazy("FedEPMClient"), _lazy("FedEPMRule"), cases=fedepm.CASES
    ),
    "sfedavg": Algorithm(
        SFedAvg, _lazy("SFedAvgClient"), _lazy("SFedRule"), cases=sfed.SFEDAVG_CASES
    ),
    "sfedprox": Algorithm(
        SFedProx, _lazy("SFedProxClient"), _lazy("SFedRule"), cases=sfed.SFEDPROX_CASES
    ),
    "pfedavg": Algorithm(
        PFedAvg, None, None, deployed=PFedAvgServer, cases=pfedavg.CASES
    ),
}

__all__ = [
    "ALGORITHMS",
    "APFL",
    "ENTRY_POINT_GROUP",
    "APFLClient",
    "APFLRule",
    "Algorithm",
    "FedAvg",
    "FedAvgClient",
    "FedDC",
    "FedDCClient",
    "FedDCRule",
    "FedDyn",
    "FedDynClient",
    "FedDynRule",
    "FedEPM",
    "FedEPMClient",
    "FedEPMRule",
    "FedProx",
    "FedProxClient",
    "FedProxRule",
    "PFedAvg",
    "PFedAvgServer",
    "PluginError",
    "SFedAvg",
    "SFedAvgClient",
    "SFedProx",
    "SFedProxClient",
    "SFedRule",
    "Scaffold",
    "ScaffoldClient",
    "ScaffoldRule",
    "registered_algorithm",
    "registered_algorithms",
]

"""flwr-prox-strategies: the proximal family of federated optimisation for Flower.

The public API: strategies (server side), their clients (a ``NumPyClient`` each,
taking your ``torch.nn.Module`` and data loaders) and client rules (the same
client side, for your own training loop), the adapter that mounts a
``NumPyClient`` on a Message-API ``ClientApp``, the privacy pieces and the
errors a run raises.

>>> from flwr_prox_strategies import FedProx, FedProxClient, to_client_app

Writing a new algorithm? The base classes and hooks are in
:mod:`flwr_prox_strategies.extend`.
"""

import warnings
from typing import Any

from .algorithms.apfl import APFL, APFLClient, APFLRule
from .algorithms.fedavg import FedAvg, FedAvgClient
from .algorithms.feddc import FedDC, FedDCClient, FedDCRule
from .algorithms.feddyn import FedDyn, FedDynClient, FedDynRule
from .algorithms.fedepm import FedEPM, FedEPMClient, FedEPMRule
from .algorithms.fedprox import PROXIMAL_MU_KEY as _PROXIMAL_MU_KEY
from .algorithms.fedprox import FedProx, FedProxClient, FedProxRule
from .algorithms.pfedavg import PFedAvg
from .algorithms.pfedavg_server import PFedAvgServer
from .algorithms.scaffold import Scaffold, ScaffoldClient, ScaffoldRule
from .algorithms.sfed import SFedAvg, SFedAvgClient, SFedProx, SFedProxClient, SFedRule
from .core.client.adapter import to_client_app
from .core.client.dp import DPSGD, PrivacyBudgetExhausted, make_private_model
from .core.client.rule import ClientRule, ProtocolError
from .core.client.secagg import SecAggPlusMod
from .core.privacy.central import ClientSideFixedClipping, ServerSideFixedClipping
from .core.privacy.secagg import SecAggPlus
from .core.privacy.uploads import LaplaceUploadMod
from .core.server.outcome import (
    AggregationStalledError,
    EveryClientRetiredError,
    NoRoundAggregatedError,
)

PROXIMAL_MU_KEY = _PROXIMAL_MU_KEY
"""The train-config key of FedProx's :math:`\\mu`, ``"proximal-mu"``.

:class:`FedProx` sends it every round and :class:`FedProxRule` reads it; it is
the key Flower's own ``FedProx`` sends, so a Flower FedProx client reads the
pack's strategy and the other way round.
"""

__all__ = [
    "APFL",
    "DPSGD",
    "PROXIMAL_MU_KEY",
    "APFLClient",
    "APFLRule",
    "AggregationStalledError",
    "ClientRule",
    "ClientSideFixedClipping",
    "EveryClientRetiredError",
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
    "LaplaceUploadMod",
    "NoRoundAggregatedError",
    "PFedAvg",
    "PFedAvgServer",
    "PrivacyBudgetExhausted",
    "ProtocolError",
    "SFedAvg",
    "SFedAvgClient",
    "SFedProx",
    "SFedProxClient",
    "SFedRule",
    "Scaffold",
    "ScaffoldClient",
    "ScaffoldRule",
    "SecAggPlus",
    "SecAggPlusMod",
    "ServerSideFixedClipping",
    "make_private_model",
    "to_client_app",
]

__version__ = "0.1.0"

# Contributors' names that moved to .extend: still found here, with a warning.
_MOVED_TO_EXTEND = ("TorchClient", "ValidatedFedAvg")


def __getattr__(name: str) -> Any:
    """Return a name moved to :mod:`.extend`, with a ``FutureWarning``."""
    if name in _MOVED_TO_EXTEND:
        warnings.warn(
            f"flwr_prox_strategies.{name} is flwr_prox_strategies.extend.{name} "
            "now (the namespace for writing algorithms); the top-level name will "
            "be removed",
            FutureWarning,
            stacklevel=2,
        )
        from . import extend

        return getattr(extend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

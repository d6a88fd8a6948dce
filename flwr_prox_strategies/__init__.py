"""flwr-prox-strategies: the proximal family of federated optimisation for Flower.

The public API: strategies (server side), their clients (a ``NumPyClient`` each,
taking your ``torch.nn.Module`` and data loaders) and client rules (the same
client side, for your own training loop), the adapter that mounts a
``NumPyClient`` on a Message-API ``ClientApp``, the privacy pieces, a grid
view that hands replies over as they arrive, and the errors a run raises.

>>> from flwr_prox_strategies import FedProx, FedProxClient, to_client_app

Writing a new algorithm? The base classes and hooks are in
:mod:`flwr_prox_strategies.extend`.
"""

import importlib
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # loaded on first use (__getattr__ below); type checkers see them
    from .algorithms import (
        APFL,
        APFLClient,
        APFLRule,
        FedAvg,
        FedAvgClient,
        FedDC,
        FedDCClient,
        FedDCRule,
        FedDyn,
        FedDynClient,
        FedDynRule,
        FedEPM,
        FedEPMClient,
        FedEPMRule,
        FedProx,
        FedProxClient,
        FedProxRule,
        PFedAvg,
        PFedAvgServer,
        Scaffold,
        ScaffoldClient,
        ScaffoldRule,
        SFedAvg,
        SFedAvgClient,
        SFedProx,
        SFedProxClient,
        SFedRule,
    )
    from .core.client.adapter import to_client_app
    from .core.client.dp import DPSGD, PrivacyBudgetExhausted, make_private_model
    from .core.client.rule import ClientRule, ProtocolError
    from .core.client.secagg import SecAggPlusMod
    from .core.client.training import FederatedPart, federated_part
    from .core.privacy.central import ClientSideFixedClipping, ServerSideFixedClipping
    from .core.privacy.distributed import DistributedDP, PrivacyBudgetSpentError
    from .core.privacy.secagg import SecAggPlus
    from .core.privacy.uploads import LaplaceUploadMod
    from .core.server.outcome import (
        AggregationStalledError,
        EveryClientRetiredError,
        NoRoundAggregatedError,
    )
    from .core.transport.grid import PromptGrid

PROXIMAL_MU_KEY: str
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
    "DistributedDP",
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
    "FederatedPart",
    "LaplaceUploadMod",
    "NoRoundAggregatedError",
    "PFedAvg",
    "PFedAvgServer",
    "PrivacyBudgetExhausted",
    "PrivacyBudgetSpentError",
    "PromptGrid",
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
    "federated_part",
    "make_private_model",
    "to_client_app",
]

__version__ = "0.1.0"

# The public names by the module each is loaded from, on first use (PEP 562): a
# SuperNode starts a ClientApp process per message, and the key-exchange stages
# of secure aggregation must not pay for torch and every algorithm.
_SOURCES = {
    # The algorithms' package loads each client half on first use itself.
    ".algorithms": (
        "APFL",
        "APFLClient",
        "APFLRule",
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
        "SFedAvg",
        "SFedAvgClient",
        "SFedProx",
        "SFedProxClient",
        "SFedRule",
        "Scaffold",
        "ScaffoldClient",
        "ScaffoldRule",
    ),
    ".algorithms.fedprox": ("PROXIMAL_MU_KEY",),
    ".core.client.adapter": ("to_client_app",),
    ".core.client.dp": ("DPSGD", "PrivacyBudgetExhausted", "make_private_model"),
    ".core.client.rule": ("ClientRule", "ProtocolError"),
    ".core.client.secagg": ("SecAggPlusMod",),
    ".core.client.training": ("FederatedPart", "federated_part"),
    ".core.privacy.central": ("ClientSideFixedClipping", "ServerSideFixedClipping"),
    ".core.privacy.distributed": ("DistributedDP", "PrivacyBudgetSpentError"),
    ".core.privacy.secagg": ("SecAggPlus",),
    ".core.privacy.uploads": ("LaplaceUploadMod",),
    ".core.transport.grid": ("PromptGrid",),
    ".core.server.outcome": (
        "AggregationStalledError",
        "EveryClientRetiredError",
        "NoRoundAggregatedError",
    ),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

# Contributors' names that moved to .extend: still found here, with a warning.
_MOVED_TO_EXTEND = ("TorchClient", "ValidatedFedAvg")


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use; a moved name with a warning."""
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name], __name__), name)
        globals()[name] = value  # the next lookup finds it without this hook
        return value
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


def __dir__() -> list[str]:
    """Return the module's names, the public ones not yet loaded included."""
    return sorted({*globals(), *__all__})

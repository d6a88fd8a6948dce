"""flwr-prox-strategies: the proximal family of federated optimisation for Flower.

The public API: strategies (server side), their clients (a ``NumPyClient`` each,
taking your ``torch.nn.Module`` and data loaders), and the adapter that mounts a
``NumPyClient`` on a Message-API ``ClientApp``.

>>> from flwr_prox_strategies import FedProx, FedProxClient, to_client_app
"""

from .algorithms.apfl import APFL, APFLClient, APFLRule
from .algorithms.fedavg import FedAvg, FedAvgClient
from .algorithms.feddc import FedDC, FedDCClient, FedDCRule
from .algorithms.feddyn import FedDyn, FedDynClient, FedDynRule
from .algorithms.fedepm import FedEPM, FedEPMClient, FedEPMRule
from .algorithms.fedprox import PROXIMAL_MU_KEY, FedProx, FedProxClient, FedProxRule
from .algorithms.pfedavg import PFedAvg
from .algorithms.scaffold import Scaffold, ScaffoldClient, ScaffoldRule
from .algorithms.sfed import (
    SFedAvg,
    SFedAvgClient,
    SFedProx,
    SFedProxClient,
    SFedRule,
)
from .core.adapter import to_client_app
from .core.central import ClientSideFixedClipping, ServerSideFixedClipping
from .core.client import TorchClient
from .core.dp import DPSGD, PrivacyBudgetExhausted, make_private_model
from .core.privacy import LaplaceUploadMod
from .core.rule import ClientRule, ProtocolError
from .core.strategy import ValidatedFedAvg

__all__ = [
    "APFL",
    "DPSGD",
    "PROXIMAL_MU_KEY",
    "APFLClient",
    "APFLRule",
    "ClientRule",
    "ClientSideFixedClipping",
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
    "PFedAvg",
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
    "ServerSideFixedClipping",
    "TorchClient",
    "ValidatedFedAvg",
    "make_private_model",
    "to_client_app",
]

__version__ = "0.1.0"

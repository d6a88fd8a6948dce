"""flwr-prox-strategies: the proximal family of federated optimisation for Flower.

The public API: strategies (server side), their clients (a ``NumPyClient`` each,
taking your ``torch.nn.Module`` and data loaders), and the adapter that mounts a
``NumPyClient`` on a Message-API ``ClientApp``.

>>> from flwr_prox_strategies import FedProx, FedProxClient, to_client_app
"""

from .algorithms.apfl import APFL, APFLClient
from .algorithms.fedavg import FedAvg, FedAvgClient
from .algorithms.feddc import FedDC, FedDCClient
from .algorithms.feddyn import FedDyn, FedDynClient
from .algorithms.fedepm import FedEPM, FedEPMClient
from .algorithms.fedprox import PROXIMAL_MU_KEY, FedProx, FedProxClient
from .algorithms.pfedavg import PFedAvg
from .algorithms.scaffold import Scaffold, ScaffoldClient
from .algorithms.sfed import SFedAvg, SFedAvgClient, SFedProx, SFedProxClient
from .core.adapter import to_client_app
from .core.central import ClientSideFixedClipping, ServerSideFixedClipping
from .core.client import ProtocolError, TorchClient
from .core.dp import DPSGD, PrivacyBudgetExhausted, make_private_model
from .core.privacy import LaplaceUploadMod
from .core.strategy import ValidatedFedAvg

__all__ = [
    "APFL",
    "DPSGD",
    "PROXIMAL_MU_KEY",
    "APFLClient",
    "ClientSideFixedClipping",
    "FedAvg",
    "FedAvgClient",
    "FedDC",
    "FedDCClient",
    "FedDyn",
    "FedDynClient",
    "FedEPM",
    "FedEPMClient",
    "FedProx",
    "FedProxClient",
    "LaplaceUploadMod",
    "PFedAvg",
    "PrivacyBudgetExhausted",
    "ProtocolError",
    "SFedAvg",
    "SFedAvgClient",
    "SFedProx",
    "SFedProxClient",
    "Scaffold",
    "ScaffoldClient",
    "ServerSideFixedClipping",
    "TorchClient",
    "ValidatedFedAvg",
    "make_private_model",
    "to_client_app",
]

__version__ = "0.1.0"

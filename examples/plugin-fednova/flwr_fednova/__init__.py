"""FedNova for flwr-prox-strategies: an algorithm installed as a plugin.

Registered through the entry point ``fednova = "flwr_fednova:FEDNOVA"`` of the
group ``flwr_prox_strategies.algorithms``: once installed,
``strategy=fednova`` selects it in the pack's experiment and Flower app, and
:data:`FEDNOVA` runs the pack's conformance checks
(``flwr_prox_strategies.testing.conformance_checks(FEDNOVA)``).

The strategy (:mod:`.fednova`) and the client (:mod:`.client`) live apart: the
registry names the client's classes by their dotted paths, so a ServerApp that
loads this plugin imports no torch.
"""

from flwr_prox_strategies.extend import Algorithm

from . import fednova
from .fednova import *  # noqa: F403  (its __all__: keys, the strategy)
from .fednova import CASES, FedNova

#: The algorithm the entry point names: strategy, client, rule (the last two as
#: paths, imported on first use), the conformance cases and the package holding
#: ``strategy/fednova.yaml``.
FEDNOVA = Algorithm(
    FedNova,
    "flwr_fednova.client.FedNovaClient",
    "flwr_fednova.client.FedNovaRule",
    cases=CASES,
    conf="flwr_fednova.conf",
)

__all__ = ["FEDNOVA", *fednova.__all__]

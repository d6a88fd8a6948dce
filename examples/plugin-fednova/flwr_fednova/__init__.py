"""FedNova for flwr-prox-strategies: an algorithm installed as a plugin.

Registered through the entry point ``fednova = "flwr_fednova:FEDNOVA"`` of the
group ``flwr_prox_strategies.algorithms``: once installed,
``strategy=fednova`` selects it in the pack's experiment and Flower app, and
:data:`FEDNOVA` runs the pack's conformance checks
(``flwr_prox_strategies.testing.conformance_checks(FEDNOVA)``).
"""

from flwr_prox_strategies.extend import Algorithm

from . import fednova
from .fednova import *  # noqa: F403  (its __all__: keys, classes)
from .fednova import CASES, FedNova, FedNovaClient, FedNovaRule

#: The algorithm the entry point names: strategy, client, rule, the conformance
#: cases and the package holding ``strategy/fednova.yaml``.
FEDNOVA = Algorithm(
    FedNova, FedNovaClient, FedNovaRule, cases=CASES, conf="flwr_fednova.conf"
)

__all__ = ["FEDNOVA", *fednova.__all__]

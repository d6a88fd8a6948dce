"""FedADMM for flwr-prox-strategies: an algorithm installed as a plugin.

Registered through the entry point ``fedadmm = "flwr_fedadmm:FEDADMM"`` of the
group ``flwr_prox_strategies.algorithms``: once installed,
``strategy=fedadmm`` selects it in the pack's experiment and Flower app, and
:data:`FEDADMM` runs the pack's conformance checks
(``flwr_prox_strategies.testing.conformance_checks(FEDADMM)``).

The strategy (:mod:`.fedadmm`) and the client (:mod:`.client`) live apart: the
registry names the client's classes by their dotted paths, so a ServerApp that
loads this plugin imports no torch.
"""

from flwr_prox_strategies.extend import Algorithm

from . import fedadmm
from .fedadmm import *  # noqa: F403  (its __all__: keys, the strategy)
from .fedadmm import CASES, FedADMM

#: The algorithm the entry point names: strategy, client, rule (the last two as
#: paths, imported on first use), the conformance cases and the package holding
#: ``strategy/fedadmm.yaml``.
FEDADMM = Algorithm(
    strategy=FedADMM,
    client="flwr_fedadmm.client.FedADMMClient",
    rule="flwr_fedadmm.client.FedADMMRule",
    cases=CASES,
    conf="flwr_fedadmm.conf",
)

__all__ = ["FEDADMM", *fedadmm.__all__]

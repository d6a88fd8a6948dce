r"""FedAvg (McMahan et al., 2017): the baseline every benchmark compares with.

Round :math:`t`: sample :math:`S_t`, each :math:`k \in S_t` runs ``E`` epochs
of mini-batch SGD on :math:`f_k` from :math:`\theta_t`, and

.. math::
    \theta_{t+1} = \sum_{k \in S_t} \frac{n_k}{\sum_{j \in S_t} n_j}\, \theta_k .

With ``drop_percent > 0`` it treats stragglers as the FedProx paper's FedAvg
does: they are dropped (the FedProx strategy keeps their partial work instead,
with the same seeded draws).
"""

from __future__ import annotations

from ..core.client import TorchClient
from ..core.strategy import ValidatedFedAvg


class FedAvg(ValidatedFedAvg):
    """Federated averaging with the pack's validation, seeded sampling and stragglers.

    All parameters are those of
    :class:`~flwr_prox_strategies.core.strategy.ValidatedFedAvg` (keyword-only).
    Stragglers are dropped.
    """

    straggler_policy = "drop"


class FedAvgClient(TorchClient):
    """Plain local SGD on the user's model and data (see ``TorchClient``)."""

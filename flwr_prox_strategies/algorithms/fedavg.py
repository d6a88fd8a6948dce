r"""FedAvg (McMahan et al., AISTATS 2017): the baseline every benchmark compares with.

H. B. McMahan, E. Moore, D. Ramage, S. Hampson and B. Agüera y Arcas,
"Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017 (arXiv:1602.05629), Algorithm 1 (FederatedAveraging).

Round :math:`t`: sample :math:`S_t`, each :math:`k \in S_t` runs ``E`` epochs
of mini-batch SGD on :math:`f_k` from :math:`\theta_t`, and

.. math::
    \theta_{t+1} = \sum_{k \in S_t} \frac{n_k}{\sum_{j \in S_t} n_j}\, \theta_k .

With ``drop_percent > 0`` it treats stragglers as the FedProx paper's FedAvg
does: they are dropped (the FedProx strategy keeps their partial work instead,
with the same seeded draws).
"""

from __future__ import annotations

from ..core.docstrings import inherit_parameters
from ..core.server.strategy import ValidatedFedAvg


@inherit_parameters(ValidatedFedAvg)
class FedAvg(ValidatedFedAvg):
    r"""FedAvg strategy: the sample-weighted mean of the clients' models.

    Round :math:`t` samples clients :math:`S_t`, each runs local SGD from
    :math:`\theta_t`, and the server takes
    :math:`\theta_{t+1} = \sum_{k \in S_t} \frac{n_k}{\sum_{j \in S_t} n_j}\,
    \theta_k` (McMahan et al., 2017, Algorithm 1), with the pack's reply
    validation, seeded sampling and checkpoints
    (:class:`~flwr_prox_strategies.extend.ValidatedFedAvg`, whose keyword-only
    parameters it takes). With ``drop_percent`` stragglers are dropped, as the
    FedProx paper's FedAvg baseline does.

    References
    ----------
    H. B. McMahan, E. Moore, D. Ramage, S. Hampson and B. Agüera y Arcas,
    "Communication-Efficient Learning of Deep Networks from Decentralized
    Data", AISTATS 2017. https://arxiv.org/abs/1602.05629
    """

    straggler_policy = "drop"


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: FedAvg(min_available_nodes=n),
    "uniform": lambda n: FedAvg(min_available_nodes=n, weighting="uniform"),
}

"""FedAvg: the client side, the rule and the ``NumPyClient``.

The strategy, the wire keys and the docs of the algorithm are in
:mod:`..fedavg`; this half imports torch, which a ServerApp never needs.
"""

from __future__ import annotations

from ...core.client.client import TorchClient
from ...core.docstrings import inherit_parameters


@inherit_parameters(TorchClient)
class FedAvgClient(TorchClient):
    """FedAvg client: plain local SGD on your model and data.

    The :class:`~flwr_prox_strategies.extend.TorchClient` base with FedAvg's
    rule (:class:`ClientRule`: no extra gradient term, no state); it works with
    every strategy that needs nothing more of its clients (:class:`FedAvg`,
    Flower's own strategies).
    """

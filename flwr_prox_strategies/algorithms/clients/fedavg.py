"""FedAvg: the client side, the pack's ``NumPyClient`` with no rule of its own.

The strategy is in :mod:`..fedavg`; this half imports torch, which a ServerApp
never needs. Its rule is the base ``ClientRule``: plain local training.
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

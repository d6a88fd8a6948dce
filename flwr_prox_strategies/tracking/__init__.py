"""Experiment tracking: TensorBoard, MLflow and Weights & Biases.

The pack's runs log to a tracker when the configuration selects one
(``logger=tensorboard``, ``logger=mlflow``, ``logger=wandb``). In your own
ServerApp, wrap any strategy, the pack's or Flower's, in :class:`Tracked`:

.. code-block:: python

    strategy = Tracked(FedProx(proximal_mu=0.1), TensorBoardTracker("runs/a"))

Each backend needs its library: ``pip install -e ".[tensorboard]"`` from the
root of the pack's clone (or ``[mlflow]``, ``[wandb]``).
"""

from .backends import MLflowTracker, TensorBoardTracker, WandbTracker
from .base import InBackground, Tracker, flat_params, round_metrics, summary_metrics
from .strategy import Tracked

__all__ = [
    "InBackground",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracked",
    "Tracker",
    "WandbTracker",
    "flat_params",
    "round_metrics",
    "summary_metrics",
]

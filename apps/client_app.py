"""The ClientApp `flwr run .` starts: the configured client on this node's partition.

The app's code lives in the package (:mod:`flwr_prox_strategies.experiment.apps`).
"""

from flwr_prox_strategies.experiment.apps import client_app as app

__all__ = ["app"]

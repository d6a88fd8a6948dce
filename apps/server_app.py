"""The ServerApp `flwr run .` starts: compose conf/, run, write results.

The app's code lives in the package (:mod:`flwr_prox_strategies.experiment.apps`).
"""

from flwr_prox_strategies.experiment.apps import server_app as app

__all__ = ["app"]

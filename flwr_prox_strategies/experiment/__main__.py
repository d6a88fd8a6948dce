"""Hydra entry point: ``python -m flwr_prox_strategies.experiment [-m] key=value ...``.

Examples
--------
One run (Flower's engine, 20 SuperNodes)::

    python -m flwr_prox_strategies.experiment strategy=fedavg num-rounds=10

A sweep, summarised in ``multirun/<date>/<time>/summary.csv`` and ``comparison.png``::

    python -m flwr_prox_strategies.experiment -m strategy=fedavg,fedprox \
        strategy.mu=0.001,0.01,0.1 seed=0,1,2
"""

import hydra
from omegaconf import DictConfig

from .config import CONF_DIR
from .sweep import run_job


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> float:
    """Run one job of the (multi)run."""
    return run_job(cfg)


if __name__ == "__main__":
    main()

"""The experiment pipeline: compose, build, run, record (server); build a client.

``apps/server_app.py`` and ``apps/client_app.py`` are thin wrappers around
:func:`run_experiment` and :func:`make_client`; the sweep launcher and the tests
call the same functions, so there is one code path. Each step is a call into the
module that owns it (:mod:`.config`, :mod:`.build`, :mod:`.run`, :mod:`.record`),
as the documentation's architecture page walks through; a new experiment
feature goes into the step it belongs to, not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from omegaconf import DictConfig

from .build import build_experiment, client_recipe
from .config import config_from_run_config
from .record import record_run
from .run import run_rounds


def run_experiment(
    grid: Grid, run_config: Mapping[str, Any], *, cfg: DictConfig | None = None
) -> tuple[Result, Path]:
    """Run the composed experiment on ``grid``; write results and plots.

    With ``resume`` in ``run_config``, the run in that folder continues from
    its checkpoint (:mod:`.checkpoint`): ``Result`` then holds the rounds this
    call ran, numbered as in the whole run; ``results.json`` holds every round.

    Parameters
    ----------
    grid : Grid
        The grid the ServerApp received (or the in-process engine's).
    run_config : Mapping[str, Any]
        Flower's run config: ``overrides``, ``num-rounds``, ``seed``,
        ``output-dir``, ``output-root``, ``resume``.
    cfg : DictConfig | None (default: None)
        The composed configuration, when the caller composed it already.

    Returns
    -------
    tuple[Result, Path]
        Flower's ``Result`` and the output folder.
    """
    if cfg is None:  # names checked here; each target located as it is built
        cfg = config_from_run_config(run_config, locate=False)
    experiment = build_experiment(grid, cfg, run_config)
    outcome = run_rounds(experiment.grid, experiment)
    return record_run(experiment, outcome)


def make_client(context: Context) -> Any:
    """Build this node's client from the composed config and its partition."""
    return client_recipe(context.run_config).client(context.node_config)

"""The ``logger`` config group: a run's experiment tracker, and a sweep's progress.

``logger=tensorboard``, ``logger=mlflow`` or ``logger=wandb`` make a run log,
besides ``results.json``: its resolved configuration (flattened), every round
(:func:`~flwr_prox_strategies.tracking.round_metrics`), its summary, and at the
end its files. Every job of a Hydra sweep logs into the sweep's folder, one
MLflow experiment, one W&B group, one TensorBoard root, each job a run named by
its overrides (:func:`sweep_overrides` adds the folder and group to a job).

The group's ``_target_`` s are the trackers' ``in_folder`` constructors: each
takes the run's ``folder`` (its output folder, or the sweep's), ``run_name``
and ``group`` (filled in by :func:`build_tracker` when the configuration
leaves them null) and its backend's own options.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.common.logger import log
from omegaconf import DictConfig, OmegaConf

from ..tracking import InBackground, Tracker, flat_params, summary_metrics
from .config import instantiate

#: Overrides left out of a run's name: how it ran, not what it is.
UNNAMED = (
    "logger",
    "engine",
    "hydra",
    "num_cpus_per_client",
    "cpus_per_job",
    "ray_address",
    "node_wait_timeout",
    "prompt_replies",
    "client_state",
)


def _key(override: str) -> str:
    return override.lstrip("+~").split("=")[0]


def run_name_of(overrides: Sequence[str], swept: Sequence[str] | None = None) -> str:
    """Name a run by its overrides: the swept ones, or all but how it ran.

    Parameters
    ----------
    overrides : Sequence[str]
        The run's Hydra overrides.
    swept : Sequence[str] | None (default: None)
        The keys a sweep varies (``["strategy", "strategy.mu"]``): only their
        overrides name the run. None: every override but those that say how
        it ran (``logger``, ``engine``, ...).

    Returns
    -------
    str
        ``"strategy=fedprox strategy.mu=0.1"``; ``""`` when none is left.
    """
    if swept:
        return " ".join(o for o in overrides if _key(o) in set(swept))
    return " ".join(o for o in overrides if _key(o).split(".")[0] not in UNNAMED)


def swept_of(value: Any) -> list[str]:
    """Read ``logger.swept``: keys joined by ``:`` (``seed:strategy.mu``) or a list.

    Parameters
    ----------
    value : Any
        The configuration's value (None: no key).

    Returns
    -------
    list[str]
        The keys.
    """
    if not value:
        return []
    if isinstance(value, str):
        return [k for k in value.split(":") if k]
    return [str(k) for k in value]


def tracks(cfg: DictConfig) -> bool:
    """Whether the configuration selects a tracker (``logger`` other than none).

    Parameters
    ----------
    cfg : DictConfig
        The composed configuration.

    Returns
    -------
    bool
        True when ``cfg.logger`` names a backend.
    """
    node = cfg.get("logger")
    return bool(node) and node.get("_target_") is not None


def build_tracker(
    cfg: DictConfig, *, output_dir: Path, overrides: Sequence[str]
) -> Tracker | None:
    """Build the run's tracker from ``cfg.logger`` (None: ``logger=none``).

    ``folder``, ``run_name`` and ``group`` left null in the configuration
    become the output folder, the run's overrides (:func:`run_name_of`, else
    the folder's name) and no group.

    Parameters
    ----------
    cfg : DictConfig
        The composed configuration.
    output_dir : Path
        The run's output folder.
    overrides : Sequence[str]
        The run's Hydra overrides.

    Returns
    -------
    Tracker | None
        The tracker, not yet opened.
    """
    if not tracks(cfg):
        return None
    node = cfg.logger
    target = OmegaConf.masked_copy(node, [k for k in node if k != "swept"])
    return instantiate(  # type: ignore[no-any-return]
        target,
        folder=str(node.get("folder") or output_dir),
        run_name=str(
            node.get("run_name")
            or run_name_of(overrides, swept_of(node.get("swept")))
            or output_dir.name
        ),
        group=node.get("group"),
        _convert_="all",
    )


def open_tracker(
    cfg: DictConfig, *, output_dir: Path, overrides: Sequence[str]
) -> Tracker | None:
    """Start the run's tracker in the background and log the configuration.

    Parameters
    ----------
    cfg, output_dir, overrides
        As :func:`build_tracker`.

    Returns
    -------
    Tracker | None
        An :class:`~flwr_prox_strategies.tracking.InBackground` tracker, or
        None for ``logger=none``.
    """
    tracker = build_tracker(cfg, output_dir=output_dir, overrides=overrides)
    if tracker is None:
        return None
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    background = InBackground(tracker)
    background.log_params(flat_params({str(k): v for k, v in config.items()}))
    log(INFO, "Tracking with %s (in the background)", tracker.name)
    return background


def close_tracker(
    tracker: Tracker | None,
    results: Mapping[str, Any],
    files: Sequence[Path],
    *,
    failed: bool,
) -> None:
    """Log the summary and the files, close the tracker, say where to look.

    Parameters
    ----------
    tracker : Tracker | None
        The run's tracker (None: nothing to do).
    results : Mapping[str, Any]
        The run's ``results.json`` document.
    files : Sequence[Path]
        Files to attach (``results.json``, the plots, the checkpoint).
    failed : bool
        Whether the run failed.
    """
    if tracker is None:
        return
    rounds = results.get("rounds") or []
    step = int(rounds[-1]["round"]) if rounds else 0
    tracker.log_metrics(summary_metrics(results.get("summary", {})), step=step)
    tracker.log_artifacts([f for f in files if f.is_file()])
    tracker.close(failed=failed)
    where = tracker.where()
    if getattr(tracker, "error", None) is None and where:
        log(INFO, "Tracked with %s; to look: %s", tracker.name, where)


def sweep_overrides(
    cfg: DictConfig, sweep_dir: Path, swept: Sequence[str] = ()
) -> list[str]:
    """Return the overrides that put a sweep's job in the sweep's tracker.

    Only the keys the configuration leaves null are set.

    Parameters
    ----------
    cfg : DictConfig
        The job's composed configuration.
    sweep_dir : Path
        The sweep's folder (``hydra.sweep.dir``).
    swept : Sequence[str] (default: ())
        The keys the sweep varies: they name each job's run.

    Returns
    -------
    list[str]
        ``logger.folder=...``, ``logger.group=...`` and ``logger.swept=a:b``
        as needed (none for ``logger=none``).
    """
    if not tracks(cfg):
        return []
    extra = []
    if not cfg.logger.get("folder"):
        extra.append(f"logger.folder={sweep_dir.resolve()}")
    if not cfg.logger.get("group"):
        extra.append(f"logger.group={sweep_name(sweep_dir)}")
    if swept and not cfg.logger.get("swept"):
        # ':'-joined: brackets would be quoted by the shell line of `flwr run`
        extra.append(f"logger.swept={':'.join(swept)}")
    return extra


def sweep_name(sweep_dir: Path) -> str:
    """Name a sweep by its folder: its last two parts (``2026-12-03_10-11-12``).

    One part, the last, when the part before it is not a date.
    """
    parts = sweep_dir.resolve().parts
    last = parts[-2:] if len(parts) > 1 else parts
    try:
        dt.date.fromisoformat(last[0])
    except ValueError:
        return parts[-1]
    return "_".join(last)


def where_for_sweep(cfg: DictConfig, sweep_dir: Path) -> str:
    """Return the command that opens the tracker UI of a whole sweep (``""``: none).

    For the sweep configured by ``cfg`` in the folder ``sweep_dir``:
    ``tensorboard --logdir <sweep>/tensorboard``, ...
    """
    if not tracks(cfg):
        return ""
    tracker = build_tracker(cfg, output_dir=sweep_dir, overrides=())
    return "" if tracker is None else tracker.where()


__all__ = [
    "build_tracker",
    "close_tracker",
    "open_tracker",
    "run_name_of",
    "sweep_name",
    "sweep_overrides",
    "swept_of",
    "tracks",
    "where_for_sweep",
]

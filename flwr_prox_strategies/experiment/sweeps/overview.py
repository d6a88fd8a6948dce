"""A sweep as a whole: its size, the keys it varies, progress as it runs, its summary.

Each job writes ``job.json`` (:data:`JOB_SUMMARY`); after the multirun,
:func:`summarise_sweep` gathers them into ``summary.csv`` and ``comparison.png``.
"""

from __future__ import annotations

import csv
import json
import sys
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.logger import log
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import OverrideParseException
from omegaconf import OmegaConf

from ..results import OBJECTIVES, RESULTS_FILE, pyplot

JOB_SUMMARY = "job.json"

#: Config keys for the job's runner, not the experiment: left out of the
#: overrides the ServerApp gets and of the summary. (A multirun's job gets
#: ``ray_address=127.0.0.1\:6379``, Hydra's escape of the colon, which the
#: shell line of ``flwr run`` would quote.)
_RUNNER_KEYS = ("engine", "ray_address")


def _runner_only(override: str) -> bool:
    """Whether an override sets a key of :data:`_RUNNER_KEYS`."""
    return override.split("=", 1)[0].lstrip("+~") in _RUNNER_KEYS


def _sweep_size_now(arguments: Sequence[str]) -> int | None:
    """Return the current multirun's number of jobs (None: cannot tell).

    ``arguments``: the multirun's overrides (:func:`_sweep_arguments`). A
    search (``hydra/sweeper=search``) runs ``n_trials`` jobs in all.
    """
    sweeper = HydraConfig.get().sweeper
    target = str(sweeper.get("_target_"))
    if target.endswith(".SearchSweeper"):
        return int(sweeper.n_trials)
    return sweep_size(arguments, target)


def _sweep_arguments(sweep_dir: Path) -> list[str]:
    """Return the multirun's command-line overrides (``seed=0,1``, not ``seed=0``).

    Read from the ``multirun.yaml`` the sweeper writes before any job starts:
    a job a launcher runs elsewhere has another command line (submitit's is
    ``python -m submitit.core._submit <folder>``).
    """
    saved = sweep_dir / "multirun.yaml"
    if saved.is_file():
        task = OmegaConf.select(OmegaConf.load(saved), "hydra.overrides.task")
        if task is not None:
            return [str(o) for o in task]
    return sys.argv[1:]


def sweep_size(argv: Sequence[str], sweeper: str) -> int | None:
    """Count the jobs of a sweep from its command line (None: cannot tell).

    The count is Hydra's basic sweeper's: the product of the lengths of the
    comma lists (``strategy=fedavg,fedprox seed=0,1,2``: 6). Another sweeper
    (an optimiser's), or ranges and intervals it samples, give None.

    Parameters
    ----------
    argv : Sequence[str]
        The multirun's command-line arguments.
    sweeper : str
        The sweeper's ``_target_`` (``hydra.sweeper._target_``).

    Returns
    -------
    int | None
        The number of jobs.
    """
    sweeps = _sweeps_of(argv)
    if not sweeper.endswith("BasicSweeper") or sweeps is None:
        return None
    count = 1
    for override in sweeps:
        if not override.is_discrete_sweep():
            return None
        count *= len(list(override.sweep_string_iterator()))
    return count


def swept_keys(argv: Sequence[str]) -> list[str]:
    """Return the keys a sweep's command line varies (``strategy=a,b``: ``strategy``).

    Parameters
    ----------
    argv : Sequence[str]
        The multirun's command-line arguments.

    Returns
    -------
    list[str]
        The keys of its sweep overrides, in order (none if it cannot be parsed).
    """
    return [o.key_or_group for o in _sweeps_of(argv) or []]


def _sweeps_of(argv: Sequence[str]) -> list[Override] | None:
    """Return the sweep overrides of a command line (None: it cannot be parsed)."""
    texts = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(texts)
    except OverrideParseException:
        return None
    return [o for o in parsed if o.is_sweep_override()]


def log_progress(
    sweep_dir: Path,
    job: int,
    overrides: Sequence[str],
    *,
    total: int | None,
    at_once: int = 1,
) -> None:
    """Log which job of how many starts, the time so far and an estimate of the rest.

    Jobs may finish out of order (side by side, on a cluster): the line counts
    the jobs that wrote their ``job.json`` (failed ones apart), the time since
    the sweep started (its ``multirun.yaml``), and estimates the rest as the
    finished jobs' mean wall time times the jobs left, this one included,
    divided by the jobs that run at a time.

    Parameters
    ----------
    sweep_dir : Path
        The sweep's folder.
    job : int
        The job's number (from 0, Hydra's ``job.num``).
    overrides : Sequence[str]
        The job's overrides, for the line.
    total : int | None
        The sweep's number of jobs (None: unknown).
    at_once : int (default: 1)
        How many jobs run at a time.
    """
    records = [json.loads(p.read_text()) for p in sweep_dir.glob(f"*/{JOB_SUMMARY}")]
    times = [float(r.get("wall-time-s") or 0.0) for r in records]
    failed = sum(r.get("status") == "failed" for r in records)
    started = sweep_dir / "multirun.yaml"
    text = f"job {job + 1} of {total}" if total else f"job {job + 1}"
    if records:
        text += f", {len(records)} done"
        if failed:
            text += f" ({failed} failed)"
        if started.is_file():
            text += f" in {_duration(time.time() - started.stat().st_mtime)}"
        if total:
            left = max(total - len(records), 1) * sum(times) / len(times)
            text += f", about {_duration(left / max(at_once, 1))} left"
    log(INFO, "Sweep: %s: %s", text, " ".join(overrides) or "(no overrides)")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


@dataclass(frozen=True)
class SweepOutcome:
    """What :func:`summarise_sweep` wrote and which jobs did not complete.

    Attributes
    ----------
    csv : Path
        ``summary.csv``: one row per job, failed and unfinished ones included.
    plot : Path | None
        ``comparison.png`` (None when no job completed).
    not_completed : list[dict[str, Any]]
        The rows of the jobs that failed (with their ``error``) or never wrote
        their ``job.json`` (``status: unfinished``: killed, pre-empted).
    """

    csv: Path
    plot: Path | None
    not_completed: list[dict[str, Any]]


def _job_folders(sweep_dir: Path) -> list[Path]:
    """Return the sweep's job folders in order (``.hydra/`` is written at start)."""
    found = {p.parent for p in sweep_dir.glob(f"*/{JOB_SUMMARY}")}
    found |= {p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")}
    return sorted(found, key=lambda p: (len(p.name), p.name))


def _job_row(job: Path) -> dict[str, Any]:
    """Return a job's ``job.json``, or an ``unfinished`` row from its overrides."""
    summary = job / JOB_SUMMARY
    if summary.is_file():
        row = json.loads(summary.read_text())
        row.setdefault("status", "completed")  # written before statuses existed
        return {"job": job.name, **row}
    overrides_file = job / ".hydra" / "overrides.yaml"
    overrides: list[Any] = (
        list(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
    )
    return {
        "job": job.name,
        "overrides": " ".join(str(o) for o in overrides if not _runner_only(str(o))),
        "status": "unfinished",
        "error": f"no {JOB_SUMMARY}: the job stopped before it ended (see its log)",
    }


def summarise_sweep(sweep_dir: Path) -> SweepOutcome | None:
    """Write ``summary.csv`` and ``comparison.png`` for the jobs under ``sweep_dir``.

    Jobs may have finished in any order: rows are sorted by job number. A job
    that failed keeps its row, with its ``status`` and ``error``; a job folder
    without ``job.json`` is ``unfinished``. The plot draws the completed jobs.

    Returns
    -------
    SweepOutcome | None
        What was written (None: no job folder under ``sweep_dir``).
    """
    jobs = _job_folders(sweep_dir)
    if not jobs:
        log(INFO, "Sweep summary: no job under %s", sweep_dir)
        return None
    rows = [_job_row(job) for job in jobs]
    csv_path = sweep_dir / "summary.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(
            handle, fieldnames=SUMMARY_FIELDS, extrasaction="ignore"
        )
        writer.writeheader()
        writer.writerows(rows)
    curves: list[tuple[dict[str, str], dict[int, float]]] = []
    for job, row in zip(jobs, rows, strict=True):
        if row["status"] != "completed":
            continue
        results = json.loads((job / RESULTS_FILE).read_text())
        curve = {
            r["round"]: r["central"]["accuracy"]
            for r in results["rounds"]
            if r.get("central", {}).get("accuracy") is not None
        }
        curves.append((_setting(str(row["overrides"])), curve))
    png_path: Path | None = None
    if curves:
        fig = plot_comparison(
            curves, title=f"sweep {sweep_dir.parent.name}/{sweep_dir.name}"
        )
        png_path = sweep_dir / "comparison.png"
        fig.savefig(png_path, dpi=120)
        pyplot().close(fig)
    not_completed = [row for row in rows if row["status"] != "completed"]
    log(
        INFO,
        "Sweep summary: %d of %d jobs completed: %s%s",
        len(rows) - len(not_completed),
        len(rows),
        csv_path,
        f" and {png_path}" if png_path else "",
    )
    print(
        f"Sweep summary: {csv_path}"
        + (f"\nComparison plot: {png_path}" if png_path else ""),
        file=sys.stderr,
    )
    return SweepOutcome(csv_path, png_path, not_completed)


#: summary.csv's columns.
SUMMARY_FIELDS = [
    "job",
    "overrides",
    "status",
    *OBJECTIVES,
    "wall-time-s",
    "strategy",
    "engine",
    "cpus",
    "error",
]


# Overrides that tell jobs of one configuration apart without changing it.
_NOT_A_SETTING = ("seed", "engine")
_LINE_STYLES = ("-", "--", ":", "-.")


def _setting(overrides: str) -> dict[str, str]:
    """Return a job's overrides as ``{key: value}``, seed and engine left out."""
    setting = {}
    for word in overrides.split():
        key, _, value = word.partition("=")
        if key.lstrip("+~") not in _NOT_A_SETTING:
            setting[key] = value
    return setting


def _describe(setting: dict[str, str], keys: Sequence[str]) -> str:
    """Short label: ``fedprox, mu=1, drop_percent=0.9`` (``strategy.`` dropped)."""
    words = []
    for key in keys:
        value = setting.get(key, "(default)")
        if key.lstrip("+") in ("strategy", "experiment"):
            words.append(value)
        else:
            words.append(f"{key.removeprefix('strategy.')}={value}")
    return ", ".join(words)


def plot_comparison(
    curves: Sequence[tuple[dict[str, str], dict[int, float]]], *, title: str
) -> Any:
    """Draw one line per configuration: the mean over its seeds, the min-max band.

    ``curves`` holds one ``(setting, {round: accuracy})`` per job (the setting
    without ``seed``). The legend names only the overrides that differ between
    configurations, the title the ones they share. One colour per value of
    ``strategy`` (or of the first override that differs, when the strategy does
    not), one line style per value of the other differing overrides. A
    configuration whose mean curve equals an earlier one's (FedAvg ignores
    ``strategy.mu``, say) says so in the legend instead of hiding under it, and
    each colour's lines are thinner than the previous colour's, so that a curve
    drawn over a near-equal one leaves it visible as an outline.
    """
    from ..results import integer_rounds

    groups: dict[tuple[tuple[str, str], ...], list[dict[int, float]]] = {}
    for setting, curve in curves:
        groups.setdefault(tuple(setting.items()), []).append(curve)
    settings = [dict(key) for key in groups]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    varying = [k for k in keys if len({s.get(k) for s in settings}) > 1]
    shared = [k for k in keys if k not in varying]
    colour_key = next(
        (k for k in varying if k.lstrip("+") == "strategy"),
        varying[0] if varying else None,
    )
    style_keys = [k for k in varying if k != colour_key]
    colour_of = {
        key: s.get(colour_key or "") for key, s in zip(groups, settings, strict=True)
    }
    colour_values = list(dict.fromkeys(colour_of.values()))
    style_values = list(
        dict.fromkeys(tuple(s.get(k) for k in style_keys) for s in settings)
    )
    plt = pyplot()
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(9, 5))
    drawn: list[tuple[str, np.ndarray, list[int]]] = []
    many_seeds = False
    for key, setting, runs in zip(groups, settings, groups.values(), strict=True):
        rounds = sorted(set.intersection(*(set(c) for c in runs)))
        if not rounds:
            continue
        values = np.array([[c[r] for r in rounds] for c in runs])
        mean = values.mean(axis=0)
        colour_index = colour_values.index(colour_of[key])
        colour = colours(colour_index % 10)
        style_index = style_values.index(tuple(setting.get(k) for k in style_keys))
        label = _describe(setting, varying) or "(defaults)"
        same = next(
            (
                other
                for other, m, r in drawn
                if r == rounds and m.shape == mean.shape and np.array_equal(m, mean)
            ),
            None,
        )
        if same is not None:
            label += f" (same as {same})"
        if len(runs) > 1:
            many_seeds = True
            label += f" ({len(runs)} seeds)"
        ax.plot(
            rounds,
            mean,
            color=colour,
            linestyle=_LINE_STYLES[style_index % len(_LINE_STYLES)],
            marker="." if style_index >= len(_LINE_STYLES) else None,
            # Wider lines first: a curve drawn over an equal one leaves it
            # visible as an outline (FedAvg and FedProx without stragglers).
            linewidth=max(1.2, 3.0 - 0.7 * colour_index),
            label=label,
        )
        if len(runs) > 1:
            low, high = values.min(axis=0), values.max(axis=0)
            ax.fill_between(rounds, low, high, color=colour, alpha=0.12)
        drawn.append((_describe(setting, varying), mean, rounds))
    common = " ".join(f"{k}={settings[0][k]}" for k in shared)
    ax.set(
        xlabel="round",
        ylabel="central test accuracy"
        + (" (mean over seeds, min-max band)" if many_seeds else ""),
        title=title + ("\n" + textwrap.fill(common, 100) if common else ""),
    )
    integer_rounds(ax)
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig

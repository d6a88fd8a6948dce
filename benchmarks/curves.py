"""Per-round accuracy curves of a benchmark's runs, kept as one CSV; and the
pieces the sweep benchmarks share (their parser, their jobs, their table).

A benchmark that plots curves writes them beside its table, so that its figure
can be redrawn (``--plot-only``) without running again: one row per run and
round, the run named by its key columns. Used by ``non_iid.py``,
``personalization.py`` and ``fedprox_synthetic.py``.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections.abc import Callable, Sequence
from pathlib import Path


def sweep_parser(
    doc: str | None, rounds: int, out: str, seeds: bool = False
) -> argparse.ArgumentParser:
    """A sweep benchmark's parser: its docstring, ``--rounds``, ``--out`` and
    (``seeds``) ``--seeds``, 0 1 2 unless given."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", type=Path, default=Path(out))
    if seeds:
        parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    return parser


def save_figure(fig, path: Path, dpi: int = 150) -> None:
    """Write a matplotlib figure to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def complete(results_path: Path) -> bool:
    """Whether a job's ``results.json`` is there and says its run completed."""
    return results_path.is_file() and bool(
        json.loads(results_path.read_text())["summary"].get("complete")
    )


def run_job(overrides: list[str], job: Path, engine: str, clients: int) -> None:
    """Run one job into ``job`` with ``flwr run`` (``engine="flwr"``) or in-process."""
    from flwr_prox_strategies.experiment.sweeps.sweep import flwr_run, run_inprocess

    if engine == "flwr":
        flwr_run(overrides, job, num_supernodes=clients)
    else:
        run_inprocess(overrides, job, clients)


def ensure_run(
    job: Path, overrides: list[str], engine: str, clients: int, restart: bool = False
) -> Path:
    """Run the job unless its run completed (``restart``: an interrupted run's
    files go first); its ``results.json``."""
    results_path = job / "results.json"
    if not complete(results_path):
        if restart and results_path.is_file():
            for old in job.iterdir():
                if old.is_file():
                    old.unlink()
        run_job(overrides, job, engine, clients)
    return results_path


def write_rows(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` as a CSV table, the first row's keys as its columns."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_curves(
    path: Path, key_names: Sequence[str], curves: dict[tuple, list[tuple]]
) -> None:
    """Write ``{key: [(round, accuracy), ...]}`` with the key's columns first."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*key_names, "round", "accuracy"])
        for key, points in curves.items():
            for round_, accuracy in points:
                writer.writerow([*key, round_, accuracy])


def write_tables(
    out: Path, name: str, rows: list[dict], key_names: Sequence[str], curves: dict
) -> None:
    """Write ``<name>.csv`` (the rows) and ``<name>_curves.csv`` into ``out``."""
    write_rows(out / f"{name}.csv", rows)
    write_curves(out / f"{name}_curves.csv", key_names, curves)


def read_curves(
    path: Path, key_types: dict[str, Callable[[str], object]]
) -> dict[tuple, list[tuple[int, float]]]:
    """Read what :func:`write_curves` wrote; ``key_types`` parses each key column."""
    curves: dict[tuple, list[tuple[int, float]]] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            key = tuple(parse(row[name]) for name, parse in key_types.items())
            curves.setdefault(key, []).append(
                (int(row["round"]), float(row["accuracy"]))
            )
    return curves

"""Per-round accuracy curves of a benchmark's runs, kept as one CSV.

A benchmark that plots curves writes them beside its table, so that its figure
can be redrawn (``--plot-only``) without running again: one row per run and
round, the run named by its key columns. Used by ``non_iid.py`` and
``personalization.py``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from pathlib import Path


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

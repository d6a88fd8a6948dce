"""Sweeps beyond one job at a time: parallel jobs on one machine, and tuning.

``--parallel`` runs the README's 8-job sweep (FedAvg against FedProx with
stragglers, 2 seeds, in process) twice on this machine, one job at a time and
then two at a time through Hydra's joblib launcher, and prints wall time, CPU
utilisation (the jobs' user + system CPU time over wall time times cores) and
the speed-up side by side; each sweep's accuracies must agree (the same seeded
jobs). ``--tune`` runs the tuning presets (``+experiment=tune-fedprox``,
``+experiment=tune-feddyn``) and prints the best value beside the papers'
grids. Results: ``benchmarks/results/sweeps/``. Run with nothing else on the
machine: two sweeps side by side distort each other's times::

    python benchmarks/sweeps.py --parallel
    python benchmarks/sweeps.py --tune
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "sweeps"
README_SWEEP = [
    "engine=inprocess",
    "+experiment=fedprox-stragglers",
    "partition=pathological",
    "strategy=fedavg,fedprox",
    "strategy.drop_percent=0,0.9",
    "seed=0,1",
]
#: The papers' grids, beside which the tuned values are reported.
PAPERS = {
    "tune-fedprox": ("strategy.mu", "FedProx paper: best of {0.001, 0.01, 0.1, 1}"),
    "tune-feddyn": ("strategy.alpha", "FedDyn paper: best of {0.001, 0.01, 0.1}"),
}


def _sweep(arguments: list[str], folder: Path) -> dict[str, float]:
    """Run one multirun; return its wall time and its jobs' CPU time."""
    shutil.rmtree(folder, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "flwr_prox_strategies.experiment",
            "-m",
            *arguments,
            f"hydra.sweep.dir={folder}",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall-s": wall, "cpu-s": cpu}


def _accuracies(folder: Path) -> list[str]:
    with open(folder / "summary.csv") as handle:
        return [row["final-accuracy"] for row in csv.DictReader(handle)]


def parallel(work: Path) -> dict[str, object]:
    """Time the README's sweep one job at a time and two at a time."""
    cores = len(os.sched_getaffinity(0))
    runs = {}
    accuracies = {}
    for name, launcher in (
        ("one at a time", []),
        ("2 at a time (joblib)", ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]),
    ):
        folder = work / name.split()[0]
        figures = _sweep([*README_SWEEP, *launcher], folder)
        figures["cpu-utilisation"] = figures["cpu-s"] / (figures["wall-s"] * cores)
        runs[name] = figures
        accuracies[name] = _accuracies(folder)
    one, two = runs.values()
    same = len(set(map(tuple, accuracies.values()))) == 1
    print(f"README's 8-job sweep on {cores} cores (engine=inprocess)")
    print(f"{'launcher':24} {'wall s':>8} {'CPU s':>8} {'CPU use':>8}")
    for name, figures in runs.items():
        print(
            f"{name:24} {figures['wall-s']:8.1f} {figures['cpu-s']:8.1f} "
            f"{figures['cpu-utilisation']:8.0%}"
        )
    speedup = one["wall-s"] / two["wall-s"]
    print(f"speed-up {speedup:.2f}x; the same final accuracies: {same}")
    return {
        "command": "python benchmarks/sweeps.py --parallel",
        "sweep": README_SWEEP,
        "cores": cores,
        "runs": runs,
        "speed-up": speedup,
        "same-accuracies": same,
        "date": time.strftime("%Y-%m-%d"),
    }


def tune(work: Path) -> dict[str, object]:
    """Run the tuning presets; return each best value and the papers' grid."""
    found = {}
    for preset, (key, paper) in PAPERS.items():
        folder = work / preset
        figures = _sweep([f"+experiment={preset}"], folder)
        search = json.loads((folder / "search.json").read_text())
        shutil.copy(folder / "search.png", RESULTS / f"{preset}.png")
        (RESULTS / f"{preset}.json").write_text(json.dumps(search, indent=2))
        best = search["best"]
        found[preset] = {
            "key": key,
            "best": best["params"][key],
            "best-accuracy": best["value"],
            "trials": len(search["trials"]),
            "paper": paper,
            "wall-s": figures["wall-s"],
        }
        print(
            f"{preset}: best {key}={best['params'][key]:.4g} "
            f"(best accuracy {best['value']:.4f}, {len(search['trials'])} trials, "
            f"{figures['wall-s']:.0f} s); {paper}"
        )
    return {
        "command": "python benchmarks/sweeps.py --tune",
        "presets": found,
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", action="store_true")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flwr-prox-sweeps"))
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.parallel:
        figures = parallel(args.work)
        (RESULTS / "parallel.json").write_text(json.dumps(figures, indent=2))
    if args.tune:
        figures = tune(args.work)
        (RESULTS / "tune.json").write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

"""What experiment tracking adds to the main job's wall time, per backend.

The README's main job (FedProx, 20 clients, digits with Dirichlet(0.3) label
skew, the MLP, 30 rounds) with ``logger=none``, ``tensorboard``, ``mlflow`` and
``wandb``, one after the other, ``--repeats`` times in rotating order, after
one warm-up run that is not counted. ``--engine flwr`` runs each as the README
does, ``flwr run`` on 20 simulated SuperNodes (the wall time of the whole
command); ``--engine inprocess`` runs the same ServerApp and ClientApp code in
this process (from ``run_experiment``'s start to its return), where the
ServerApp's own work is not hidden behind the clients'. The tracker's last
writes are included; the table gives the median per backend and its
difference from ``none``. Writes ``benchmarks/tracking_overhead_<engine>.md``
(shown on the docs' tracking page) and ``benchmarks/results/tracking_overhead_<engine>.json``.

Run alone on the machine (a test suite beside it distorts both):
``python benchmarks/tracking_overhead.py [--engine flwr] [--rounds 30] [--repeats 2]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from flwr.common.logger import FLOWER_LOGGER

from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.experiment.appdir import make_client_app
from flwr_prox_strategies.experiment.server import run_experiment
from flwr_prox_strategies.experiment.sweeps.sweep import flwr_run

BACKENDS = ("none", "tensorboard", "mlflow", "wandb")
HERE = Path(__file__).resolve().parent


def run_once(
    backend: str, rounds: int, folder: Path, engine: str
) -> tuple[float, float]:
    """Return the run's wall time and its final accuracy."""
    overrides = [f"num_rounds={rounds}", f"logger={backend}"]
    start = time.perf_counter()
    if engine == "flwr":
        flwr_run(overrides, folder, num_supernodes=20)
    else:
        run_config = {"overrides": " ".join(overrides), "output-dir": str(folder)}
        grid = InProcessGrid(make_client_app(), num_nodes=20, run_config=run_config)
        run_experiment(grid, run_config)
    seconds = time.perf_counter() - start
    results = json.loads((folder / "results.json").read_text())
    return seconds, float(results["summary"]["final-accuracy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine", choices=("flwr", "inprocess"), default="flwr")
    args = parser.parse_args()
    FLOWER_LOGGER.setLevel(logging.WARNING)
    torch.set_num_threads(1)  # as a simulated SuperNode with 1 CPU runs it
    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    accuracy: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        run_once("none", args.rounds, Path(tmp) / "warm-up", args.engine)
        for repeat in range(args.repeats):
            order = (
                BACKENDS[repeat % len(BACKENDS) :] + BACKENDS[: repeat % len(BACKENDS)]
            )
            for backend in order:
                folder = Path(tmp) / f"{backend}-{repeat}"
                seconds, acc = run_once(backend, args.rounds, folder, args.engine)
                times[backend].append(seconds)
                accuracy[backend] = acc
                print(
                    f"{backend:12s} repeat {repeat}: {seconds:7.2f} s, accuracy {acc:.4f}"
                )
    base = statistics.median(times["none"])
    rows = []
    for backend in BACKENDS:
        median = statistics.median(times[backend])
        rows.append(
            {
                "logger": backend,
                "runs-s": [round(t, 2) for t in times[backend]],
                "median-s": round(median, 2),
                "added-s": round(median - base, 2),
                "added-percent": round(100 * (median - base) / base, 1),
                "final-accuracy": accuracy[backend],
            }
        )
    machine = f"{os.cpu_count()} cores, {platform.python_version()}, torch {torch.__version__}"
    command = (
        f"python benchmarks/tracking_overhead.py --engine {args.engine} "
        f"--rounds {args.rounds} --repeats {args.repeats}"
    )
    how = "`flwr run`, 20 SuperNodes" if args.engine == "flwr" else "in process"
    lines = [
        f"The main job ({args.rounds} rounds of FedProx on 20 clients, {how}), "
        f"median of {args.repeats} runs per logger, run alone on {machine}:",
        "",
        "| logger | wall time (median) | added | runs | final accuracy |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        runs = ", ".join(f"{t:.1f}" for t in row["runs-s"])
        added = (
            ""
            if row["logger"] == "none"
            else (f"{row['added-s']:+.2f} s ({row['added-percent']:+.1f}%)")
        )
        lines.append(
            f"| `{row['logger']}` | {row['median-s']:.1f} s | {added} | {runs} s "
            f"| {row['final-accuracy']:.4f} |"
        )
    lines += ["", f"Measured with `{command}`.", ""]
    (HERE / f"tracking_overhead_{args.engine}.md").write_text("\n".join(lines))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"tracking_overhead_{args.engine}.json").write_text(
        json.dumps({"command": command, "machine": machine, "rows": rows}, indent=2)
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()

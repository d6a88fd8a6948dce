"""P-FedAvg over server topologies against FedAvg, with the modelled wall clock.

Fashion-MNIST, MLP 784-200-200-10, 100 clients in 5 groups (partition-id modulo
5), Dirichlet(0.3) label skew, 20% of each group per round (20 clients in all),
1 local epoch, B = 50, lr 0.1, through the experiment layer
(``strategy=pfedavg topology=... topology.servers=5``) on an in-process grid.
Topologies: ring, star, grid (a 1x5 path: 5 is prime), complete; Metropolis
and SDP-optimal weights; FedAvg over all 100 clients (20 per round) as the
reference.

Reports, per run, rho(W), final and best accuracy of the consensus average,
rounds to 80%, the final consensus distance, and from the communication model
(``ops.communication``: model size of the MLP in bits, 10 Mb/s links, 2 s of
client compute, exponential client delays of mean 1 s) the traffic per round
and the modelled round time, speed-up and wall clock to 80% against FedAvg.
Writes ``pfedavg.csv`` and ``pfedavg.png``.

Run (about 20 minutes on 2 cores)::

    python benchmarks/pfedavg.py

``--plot-only`` redraws ``pfedavg.png`` from ``pfedavg.csv`` and the runs'
``results.json`` already in ``--out``, without training.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess
from flwr_prox_strategies.ops.communication import expected_round_times, volumes
from flwr_prox_strategies.ops.graphs import adjacency
from flwr_prox_strategies.ops.mixing import consensus_rate, mixing_matrix

SERVERS = 5
RUNS = {
    "fedavg": None,
    "ring-metropolis": ("ring", "metropolis"),
    "ring-sdp": ("ring", "sdp"),
    "star-metropolis": ("star", "metropolis"),
    "star-sdp": ("star", "sdp"),
    "grid-metropolis": ("grid", "metropolis"),
    "grid-sdp": ("grid", "sdp"),
    "complete": ("complete", "uniform"),
}
MODEL_BITS = 32 * (784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10)


def rounds_to(results: dict, target: float) -> int | None:
    for entry in results["rounds"]:
        if entry.get("central", {}).get("accuracy", 0.0) >= target:
            return int(entry["round"])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.2)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pfedavg"))
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="only redraw pfedavg.png from pfedavg.csv and the runs' results.json "
        "already in --out (trains nothing)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        replot(args)
        return
    common = [
        "dataset=fashion-mnist",
        "model=mlp",
        "partition=dirichlet",
        "partition.alpha=0.3",
        f"num_clients={args.clients}",
        f"num_rounds={args.rounds}",
        f"seed={args.seed}",
        "train.local_epochs=1",
        "train.batch_size=50",
        "train.learning_rate=0.1",
    ]
    per_round = round(args.clients * args.fraction)
    fedavg_time = expected_round_times(
        MODEL_BITS, per_round, [0], 10e6, beta=2.0, delay="exponential", seed=1
    )[0]
    rows, curves = [], {}
    for name in args.runs:
        spec = RUNS[name]
        if spec is None:
            overrides = [
                *common,
                "strategy=fedavg",
                f"strategy.fraction_train={args.fraction}",
            ]
            degrees = [0]
            rho = 0.0
        else:
            topology, mixing = spec
            overrides = [
                *common,
                "strategy=pfedavg",
                f"topology={topology}",
                f"topology.servers={SERVERS}",
                f"topology.mixing={mixing}",
                f"strategy.inner.fraction_train={args.fraction}",
            ]
            adj = adjacency(topology, SERVERS)
            degrees = list(adj.sum(axis=1))
            rho = consensus_rate(mixing_matrix(adj, mixing))
        job = args.out / f"{name}-seed{args.seed}"
        path = job / "results.json"
        if not (
            path.is_file() and json.loads(path.read_text())["summary"].get("complete")
        ):
            run_inprocess(overrides, job, args.clients)
        results = json.loads(path.read_text())
        _, round_t = expected_round_times(
            MODEL_BITS,
            per_round,
            degrees,
            10e6,
            beta=2.0,
            delay="exponential",
            seed=1,
        )
        if spec is None:
            round_t = fedavg_time
        traffic = volumes(MODEL_BITS, per_round, degrees)
        reached = rounds_to(results, args.target)
        last = results["rounds"][-1]
        rows.append(
            {
                "run": name,
                "rho": rho,
                "final": results["summary"]["final-accuracy"],
                "best": results["summary"]["best-accuracy"],
                f"rounds-to-{args.target}": reached,
                "consensus-distance": last.get("train", {}).get(
                    "consensus-distance", 0.0
                ),
                "total-Mb-per-round": (
                    traffic["pfedavg-total"] if spec else traffic["fedavg-total"]
                )
                / 1e6,
                "peak-Mb-per-round": (
                    traffic["pfedavg-peak"] if spec else traffic["fedavg-peak"]
                )
                / 1e6,
                "modelled-s-per-round": round_t,
                "modelled-speedup": fedavg_time / round_t,
                f"modelled-s-to-{args.target}": None
                if reached is None
                else reached * round_t,
            }
        )
        curves[name] = curve_of(results)
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out / "pfedavg.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    times = {row["run"]: row["modelled-s-per-round"] for row in rows}
    plot(curves, times, args.out / "pfedavg.png", args.clients)
    for row in rows:
        print(
            f"{row['run']:<17} rho {row['rho']:.4f} final {row['final']:.4f} best {row['best']:.4f} "
            f"to{args.target} {row[f'rounds-to-{args.target}']} cons {row['consensus-distance']:.3g} "
            f"total {row['total-Mb-per-round']:.1f} Mb peak {row['peak-Mb-per-round']:.1f} Mb "
            f"{row['modelled-s-per-round']:.1f} s/round speed-up {row['modelled-speedup']:.2f}"
        )


def curve_of(results: dict) -> list[tuple[int, float]]:
    """The consensus average's central accuracy per round."""
    return [
        (r["round"], r["central"]["accuracy"])
        for r in results["rounds"]
        if "central" in r
    ]


def replot(args: argparse.Namespace) -> None:
    """Redraw pfedavg.png from pfedavg.csv and each run's results.json."""
    with open(args.out / "pfedavg.csv") as handle:
        rows = list(csv.DictReader(handle))
    times = {row["run"]: float(row["modelled-s-per-round"]) for row in rows}
    curves = {}
    for name in times:
        path = args.out / f"{name}-seed{args.seed}" / "results.json"
        if not path.is_file():
            raise SystemExit(
                f"{path} is missing: run the benchmark without --plot-only"
            )
        curves[name] = curve_of(json.loads(path.read_text()))
    plot(curves, times, args.out / "pfedavg.png", args.clients)


def plot(
    curves: dict[str, list[tuple[int, float]]],
    times: dict[str, float],
    path: Path,
    clients: int,
) -> None:
    """Accuracy per round (top) and against the modelled wall clock (bottom).

    Laid out to read at a page's width (about 800 px): the panels stacked, fonts of
    10-11 pt, one legend outside; colour is the graph, line style the mixing weights.
    """
    colours = {"ring": "C0", "star": "C1", "grid": "C2", "complete": "C3"}
    styles = {"metropolis": "-", "sdp": "--", "uniform": "-"}
    with plt.rc_context({"font.size": 11, "legend.fontsize": 10}):
        fig, (ax_rounds, ax_time) = plt.subplots(
            2, 1, figsize=(9, 8.5), layout="constrained"
        )
        for name, points in curves.items():
            xs, ys = zip(*points, strict=True)
            spec = RUNS.get(name)
            if spec is None:
                style = {"color": "black", "linestyle": (0, (4, 2)), "linewidth": 1.8}
                label = "FedAvg (one server)"
            else:
                topology, mixing = spec
                style = {
                    "color": colours.get(topology, "C4"),
                    "linestyle": styles.get(mixing, "-"),
                    "linewidth": 1.3,
                }
                graph = "path (1×5 grid)" if topology == "grid" else topology
                weights = {"metropolis": "Metropolis", "sdp": "SDP"}.get(mixing)
                label = f"{graph}, {weights}" if weights else graph
            ax_rounds.plot(xs, ys, label=label, **style)
            ax_time.plot(np.array(xs) * times[name] / 60, ys, label=label, **style)
        ax_rounds.set(xlabel="round", ylabel="central accuracy")
        ax_rounds.set_title(
            "per round (consensus average of the servers' models)", loc="left"
        )
        ax_time.set(
            xlabel="modelled wall clock (min): 10 Mb/s links, 2 s compute, "
            "exponential delays",
            ylabel="central accuracy",
        )
        ax_time.set_title("against the modelled wall clock", loc="left")
        for ax in (ax_rounds, ax_time):
            ax.grid(alpha=0.3)
        ax_rounds.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        fig.suptitle(
            f"P-FedAvg, {SERVERS} servers, against FedAvg: Fashion-MNIST, "
            f"{clients} clients, Dirichlet(0.3)"
        )
        fig.savefig(path, dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    main()

"""Non-IID benchmark: FedAvg, FedProx, SCAFFOLD, FedDyn and FedDC through Flower.

The official FedDyn/FedDC codes' MNIST setting, on Fashion-MNIST (conf preset
``experiment/non-iid-official``): 100 clients, 10% participation, MLP
784-200-200-10, E=5, B=50, lr 0.1 decayed by 0.998 per round, weight decay 1e-3,
gradient clipping at 10. Every run is a real ``flwr run`` (managed SuperLink,
Ray simulation, 100 SuperNodes), one per (partition, strategy, seed).

Reports final and best central accuracy, rounds to 80% and 85%, seconds per
round and array bytes sent + received per round; writes ``non_iid.csv`` and
``non_iid.png`` into ``--out``.

Run (the full setting takes hours on 2 cores)::

    python benchmarks/non_iid.py --rounds 200 --seeds 0 1 2 \
        --partitions inner-dirichlet pathological
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from flwr_prox_strategies.experiment.sweep import flwr_run

# The hyper-parameters; FedDyn as its official code (alpha by weight decay).
STRATEGIES = {
    "fedavg": ["strategy=fedavg"],
    "fedprox": ["strategy=fedprox", "strategy.mu=0.0001"],
    "scaffold": ["strategy=scaffold"],
    "feddyn": ["strategy=feddyn", "strategy.alpha=0.01", "client.decoupled_alpha=true"],
    "feddc": ["strategy=feddc", "strategy.alpha=0.1"],
}
PARTITIONS = {
    "inner-dirichlet": ["partition=inner-dirichlet", "partition.alpha=0.3"],
    "pathological": ["partition=pathological", "partition.classes_per_partition=2"],
}


def rounds_to(rounds: list[dict], target: float) -> int | None:
    for entry in rounds:
        acc = entry.get("central", {}).get("accuracy")
        if acc is not None and acc >= target:
            return int(entry["round"])
    return None


def summarise(results: dict) -> dict:
    rounds = results["rounds"]
    trained = [r for r in rounds if "train" in r]
    elapsed = [r["elapsed-s"] for r in rounds]
    per_round = (elapsed[-1] - elapsed[0]) / max(len(rounds) - 1, 1)
    traffic = [
        r["train"].get("bytes-sent", 0) + r["train"].get("bytes-received", 0)
        for r in trained
    ]
    return {
        "final": results["summary"]["final-accuracy"],
        "best": results["summary"]["best-accuracy"],
        "to-80": rounds_to(rounds, 0.80),
        "to-85": rounds_to(rounds, 0.85),
        "s-per-round": per_round,
        "mb-per-round": statistics.mean(traffic) / 2**20 if traffic else None,
        "curve": [
            (r["round"], r["central"]["accuracy"]) for r in rounds if "central" in r
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--partitions", nargs="+", default=list(PARTITIONS), choices=list(PARTITIONS)
    )
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES)
    )
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/non_iid"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for partition in args.partitions:
        for name in args.strategies:
            for seed in args.seeds:
                job = args.out / f"{partition}-{name}-seed{seed}"
                overrides = [
                    "+experiment=non-iid-official",
                    *PARTITIONS[partition],
                    *STRATEGIES[name],
                    f"num-rounds={args.rounds}",
                    f"num-clients={args.clients}",
                    f"seed={seed}",
                ]
                results_path = job / "results.json"
                if not (
                    results_path.is_file()
                    and json.loads(results_path.read_text())["summary"].get("complete")
                ):
                    flwr_run(overrides, job, num_supernodes=args.clients)
                summary = summarise(json.loads(results_path.read_text()))
                curves[(partition, name, seed)] = summary.pop("curve")
                rows.append(
                    {"partition": partition, "strategy": name, "seed": seed, **summary}
                )
                print(json.dumps(rows[-1]), flush=True)
    with open(args.out / "non_iid.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fig, axes = plt.subplots(
        1, len(args.partitions), figsize=(7 * len(args.partitions), 4.5), squeeze=False
    )
    for ax, partition in zip(axes[0], args.partitions, strict=True):
        for name in args.strategies:
            for seed in args.seeds:
                xs, ys = zip(*curves[(partition, name, seed)], strict=True)
                ax.plot(
                    xs,
                    ys,
                    label=f"{name} (seed {seed})" if len(args.seeds) > 1 else name,
                    linewidth=1,
                )
        ax.set(
            title=f"Fashion-MNIST, {partition}, {args.clients} clients, 10%",
            xlabel="round",
            ylabel="central test accuracy",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "non_iid.png", dpi=120)
    print(
        f"{'partition':<16}{'strategy':<10}{'final':>7}{'best':>7}{'to80':>6}{'to85':>6}{'s/rnd':>7}{'MB/rnd':>8}"
    )
    for row in rows:
        print(
            f"{row['partition']:<16}{row['strategy']:<10}{row['final']:>7.4f}{row['best']:>7.4f}"
            f"{row['to-80'] or '-':>6}{row['to-85'] or '-':>6}{row['s-per-round']:>7.2f}{row['mb-per-round']:>8.1f}"
        )


if __name__ == "__main__":
    main()

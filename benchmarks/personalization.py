"""Personalisation benchmark: APFL against FedAvg and FedAvg + local fine-tuning.

Fashion-MNIST, MLP 784-200-200-10, the FedTorch README's APFL setting (lr 0.1,
B = 50, 10 local steps per round); 10 clients with full participation and 100
clients with 10% participation; label skew of 2 classes per client
(pathological) and Dirichlet(0.3). Every client holds out 20% of its partition
and evaluates, every round, the global model and its personalised model on it
(conf preset ``experiment/personalization``).

Methods: APFL with alpha in {0.25, 0.5, 0.75} and adaptive alpha (from 0.5);
FedAvg's global model; FedAvg + fine-tuning (a copy of the global model trained
for 10 local steps before each evaluation, from the same FedAvg run).

Reports, per setting and method, the personalised accuracy over clients (mean
and worst client) at the last round, the global model's on the same splits, and
seconds per round; writes ``personalization.csv`` and ``personalization.png``.

Run (the 20 runs of the defaults, 50 rounds each: about 65 min, measured with
another benchmark sharing the 2 cores)::

    python benchmarks/personalization.py
    python benchmarks/personalization.py --engine flwr   # through `flwr run`
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from flwr_prox_strategies.experiment.sweep import flwr_run, run_inprocess

RUNS = {
    "fedavg": ["strategy=fedavg", "train.finetune_steps=10"],
    "apfl-0.25": ["strategy=apfl", "strategy.alpha=0.25"],
    "apfl-0.5": ["strategy=apfl", "strategy.alpha=0.5"],
    "apfl-0.75": ["strategy=apfl", "strategy.alpha=0.75"],
    "apfl-adaptive": [
        "strategy=apfl",
        "strategy.alpha=0.5",
        "strategy.adaptive_alpha=true",
    ],
}
PARTITIONS = {
    "2-class": ["partition=pathological", "partition.classes_per_partition=2"],
    "dirichlet-0.3": ["partition=dirichlet", "partition.alpha=0.3"],
}
# clients -> participation (FedTorch's README runs 10 clients at k = 1.0)
FEDERATIONS = {10: 1.0, 100: 0.1}


def methods_of(run: str) -> dict[str, str]:
    """Method label -> metric prefix in the federated evaluation."""
    if run == "fedavg":
        return {
            "fedavg (global)": "accuracy",
            "fedavg + fine-tuning": "personal-accuracy",
        }
    return {run: "personal-accuracy"}


def curve(results: dict, prefix: str) -> list[tuple[int, float]]:
    return [
        (r["round"], r["evaluate"][f"{prefix}-clients-mean"])
        for r in results["rounds"]
        if f"{prefix}-clients-mean" in r.get("evaluate", {})
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, nargs="+", default=list(FEDERATIONS))
    parser.add_argument("--partitions", nargs="+", default=list(PARTITIONS))
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--engine", choices=["inprocess", "flwr"], default="inprocess")
    parser.add_argument(
        "--only-complete",
        action="store_true",
        help="tabulate the runs already complete under --out, run nothing",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/personalization")
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for clients in args.clients:
        for partition in args.partitions:
            setting = f"{clients} clients, {partition}"
            for run in args.runs:
                job = args.out / f"{clients}-{partition}-{run}-seed{args.seed}"
                overrides = [
                    "+experiment=personalization",
                    *PARTITIONS[partition],
                    *RUNS[run],
                    f"num_clients={clients}",
                    f"strategy.fraction_train={FEDERATIONS.get(clients, 1.0)}",
                    f"num_rounds={args.rounds}",
                    f"seed={args.seed}",
                ]
                path = job / "results.json"
                if not (
                    path.is_file()
                    and json.loads(path.read_text())["summary"].get("complete")
                ):
                    if args.only_complete:
                        print(f"not run: {job.name}", flush=True)
                        continue
                    if args.engine == "flwr":
                        flwr_run(overrides, job, num_supernodes=clients)
                    else:
                        run_inprocess(overrides, job, clients)
                results = json.loads(path.read_text())
                last = [r for r in results["rounds"] if r.get("evaluate")][-1]
                evaluation = last["evaluate"]
                elapsed = [r["elapsed-s"] for r in results["rounds"]]
                for method, prefix in methods_of(run).items():
                    rows.append(
                        {
                            "clients": clients,
                            "partition": partition,
                            "method": method,
                            "personal-mean": evaluation[f"{prefix}-clients-mean"],
                            "personal-worst": evaluation[f"{prefix}-worst"],
                            "personal-std": evaluation[f"{prefix}-std"],
                            "global-on-clients-mean": evaluation[
                                "accuracy-clients-mean"
                            ],
                            "weighted-avg-personal-mean": evaluation.get(
                                "personal-avg-accuracy-clients-mean"
                            ),
                            "central-accuracy": results["summary"]["final-accuracy"],
                            "alpha-range": (
                                f"{last['train']['apfl-alpha-min']:.3f}-"
                                f"{last['train']['apfl-alpha-max']:.3f}"
                                if "apfl-alpha-min" in last.get("train", {})
                                else ""
                            ),
                            "s-per-round": (elapsed[-1] - elapsed[0])
                            / max(len(elapsed) - 1, 1),
                        }
                    )
                    curves[(setting, method)] = curve(results, prefix)
                    print(json.dumps(rows[-1]), flush=True)
    with open(args.out / "personalization.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    settings = list(dict.fromkeys(setting for setting, _ in curves))
    fig, axes = plt.subplots(
        1, len(settings), figsize=(5.5 * len(settings), 4.5), squeeze=False
    )
    for ax, setting in zip(axes[0], settings, strict=True):
        for (where, method), points in curves.items():
            if where != setting or not points:
                continue
            xs, ys = zip(*points, strict=True)
            style = "--" if method == "fedavg (global)" else "-"
            ax.plot(xs, ys, style, label=method, linewidth=1.2)
        ax.set(
            title=f"Fashion-MNIST, {setting}",
            xlabel="round",
            ylabel="accuracy on clients' held-out splits (mean)",
            ylim=(0, 1),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "personalization.png", dpi=120)
    header = (
        f"{'setting':<28}{'method':<22}{'pers.mean':>10}{'pers.worst':>11}"
        f"{'global':>8}{'w.avg':>7}{'alpha':>13}{'s/rnd':>7}"
    )
    print(header)
    for row in rows:
        wavg = row["weighted-avg-personal-mean"]
        print(
            f"{str(row['clients']) + ' clients, ' + row['partition']:<28}"
            f"{row['method']:<22}{row['personal-mean']:>10.4f}"
            f"{row['personal-worst']:>11.4f}{row['global-on-clients-mean']:>8.4f}"
            f"{wavg if wavg is None else round(wavg, 4)!s:>7}"
            f"{row['alpha-range']:>13}{row['s-per-round']:>7.2f}"
        )


if __name__ == "__main__":
    main()

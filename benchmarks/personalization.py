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
seconds per round; writes ``personalization.csv``, ``personalization_curves.csv``
(the mean over clients at every round of every method), ``personalization.png``
(a 2 x 2 grid, one panel per setting: the mean and the worst client's accuracy of
each method at the last round, from the first CSV) and, from the curves file,
``personalization-curves.png`` (the mean over clients per round, per setting).

Run (the 20 runs of the defaults, 50 rounds each: about 65 min, measured with
another benchmark sharing the 2 cores)::

    python benchmarks/personalization.py
    python benchmarks/personalization.py --engine flwr   # through `flwr run`
    python benchmarks/personalization.py --plot-only     # redraw from the CSVs
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from curves import (
    complete,
    ensure_run,
    read_curves,
    save_figure,
    sweep_parser,
    write_tables,
)

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
PARTITION_LABELS = {
    "2-class": "2 classes per client",
    "dirichlet-0.3": "Dirichlet(0.3)",
}
METHOD_LABELS = {
    "fedavg (global)": "FedAvg\nglobal",
    "fedavg + fine-tuning": "FedAvg +\nfine-tune",
    "apfl-0.25": "APFL\nα = 0.25",
    "apfl-0.5": "APFL\nα = 0.5",
    "apfl-0.75": "APFL\nα = 0.75",
    "apfl-adaptive": "APFL\nadaptive α",
}
FLOAT_COLUMNS = (
    "personal-mean",
    "personal-worst",
    "personal-std",
    "global-on-clients-mean",
    "weighted-avg-personal-mean",
    "central-accuracy",
    "s-per-round",
)


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


def setting_title(clients: int, partition: str) -> str:
    share = FEDERATIONS.get(clients, 1.0)
    joined = "all every round" if share >= 1 else f"{share:.0%} a round"
    return f"{clients} clients ({joined}), {PARTITION_LABELS.get(partition, partition)}"


def read_rows(path: Path) -> list[dict]:
    """The rows of ``personalization.csv``, typed as :func:`main` wrote them."""
    rows = []
    with open(path, newline="") as handle:
        for raw in csv.DictReader(handle):
            row: dict = dict(raw)
            row["clients"] = int(raw["clients"])
            for key in FLOAT_COLUMNS:
                row[key] = float(raw[key]) if raw[key] != "" else None
            rows.append(row)
    return rows


def grid_of(settings: list[tuple[int, str]]):
    """A figure with a panel per (clients, partition): rows clients, columns partitions."""
    clients = list(dict.fromkeys(c for c, _ in settings))
    partitions = list(dict.fromkeys(p for _, p in settings))
    fig, axes = plt.subplots(
        len(clients),
        len(partitions),
        figsize=(max(5 * len(partitions), 8), 4 * len(clients)),
        squeeze=False,
    )
    panels = {
        (c, p): axes[i][j]
        for i, c in enumerate(clients)
        for j, p in enumerate(partitions)
    }
    for key, ax in panels.items():
        if key not in settings:
            ax.set_visible(False)
    return fig, panels


def plot_bars(rows: list[dict], path: Path) -> None:
    """Per setting, each method's mean and worst-client accuracy at the last round."""
    settings = list(dict.fromkeys((r["clients"], r["partition"]) for r in rows))
    with plt.rc_context({"font.size": 10, "axes.titlesize": 10}):
        fig, panels = grid_of(settings)
        width = 0.4
        for (clients, partition), ax in panels.items():
            runs = [
                r
                for r in rows
                if (r["clients"], r["partition"]) == (clients, partition)
            ]
            for k, (key, colour, label) in enumerate(
                (
                    ("personal-mean", "tab:blue", "mean over clients"),
                    ("personal-worst", "tab:orange", "worst client"),
                )
            ):
                xs = [i + (k - 0.5) * width for i in range(len(runs))]
                ys = [r[key] for r in runs]
                ax.bar(xs, ys, width, color=colour, label=label)
                for x, y in zip(xs, ys, strict=True):
                    inside = y >= 0.15  # else the label goes above the bar
                    ax.annotate(
                        f"{y:.3f}",
                        (x, y - 0.02 if inside else y + 0.02),
                        rotation=90,
                        ha="center",
                        va="top" if inside else "bottom",
                        fontsize=9,
                        color="white" if inside else "black",
                    )
            ax.set_xticks(
                range(len(runs)),
                [METHOD_LABELS.get(r["method"], r["method"]) for r in runs],
                fontsize=9,
            )
            ax.set(
                title=setting_title(clients, partition),
                ylabel="accuracy, last round",
                ylim=(0, 1),
            )
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
        handles, labels = next(iter(panels.values())).get_legend_handles_labels()
        fig.suptitle(
            "Fashion-MNIST: personalised accuracy on the clients' held-out splits",
            y=0.985,
            fontsize=11,
        )
        fig.legend(
            handles,
            labels,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.955),
            ncol=2,
            frameon=False,
        )
        fig.tight_layout(rect=(0, 0, 1, 0.925))
        save_figure(fig, path)


def plot_curves(curves: dict, path: Path) -> None:
    """Per setting, each method's mean accuracy over clients per round."""
    settings = list(dict.fromkeys((c, p) for c, p, _ in curves))
    methods = list(dict.fromkeys(m for _, _, m in curves))
    colours = dict(zip(methods, plt.cm.tab10.colors, strict=False))
    with plt.rc_context({"font.size": 10, "axes.titlesize": 10}):
        fig, panels = grid_of(settings)
        for (clients, partition, method), points in curves.items():
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            style = "--" if method == "fedavg (global)" else "-"
            panels[(clients, partition)].plot(
                xs, ys, style, color=colours[method], label=method, linewidth=1.2
            )
        for (clients, partition), ax in panels.items():
            ax.set(
                title=setting_title(clients, partition),
                xlabel="round",
                ylabel="accuracy, mean over clients",
                ylim=(0, 1),
            )
            ax.grid(alpha=0.3)
        handles, labels = next(iter(panels.values())).get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=3, frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.92))
        save_figure(fig, path)


def main() -> None:
    parser = sweep_parser(__doc__, 50, "benchmarks/results/personalization")
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
        "--plot-only",
        action="store_true",
        help="run nothing: redraw the figures from --out's personalization.csv "
        "(and personalization_curves.csv, if there)",
    )
    args = parser.parse_args()
    if args.plot_only:
        plot_bars(
            read_rows(args.out / "personalization.csv"),
            args.out / "personalization.png",
        )
        curves_path = args.out / "personalization_curves.csv"
        if curves_path.is_file():
            plot_curves(
                read_curves(
                    curves_path, {"clients": int, "partition": str, "method": str}
                ),
                args.out / "personalization-curves.png",
            )
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for clients in args.clients:
        for partition in args.partitions:
            for run in args.runs:
                job = args.out / f"{clients}-{partition}-{run}-seed{args.seed}"
                if args.only_complete and not complete(job / "results.json"):
                    print(f"not run: {job.name}", flush=True)
                    continue
                path = ensure_run(
                    job,
                    [
                        "+experiment=personalization",
                        *PARTITIONS[partition],
                        *RUNS[run],
                        f"num_clients={clients}",
                        f"strategy.fraction_train={FEDERATIONS.get(clients, 1.0)}",
                        f"num_rounds={args.rounds}",
                        f"seed={args.seed}",
                    ],
                    args.engine,
                    clients,
                )
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
                    curves[(clients, partition, method)] = curve(results, prefix)
                    print(json.dumps(rows[-1]), flush=True)
    write_tables(
        args.out, "personalization", rows, ("clients", "partition", "method"), curves
    )
    plot_bars(rows, args.out / "personalization.png")
    plot_curves(curves, args.out / "personalization-curves.png")
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

"""Non-IID benchmark: FedAvg, FedProx, SCAFFOLD, FedDyn and FedDC, as the papers ran them.

The official FedDyn/FedDC codes' MNIST setting, on Fashion-MNIST (conf preset
``experiment/non-iid-official``): 100 clients split by the official 'Drichlet'
rule (alpha 0.3, equal sizes), each joining a round with probability 0.1, MLP
784-200-200-10, E=5, B=50, lr 0.1 decayed by 0.998 per round, weight decay 1e-3,
gradient clipping at 10, inputs standardised as the official code does. The
hyper-parameters per algorithm are the official codes' (below); SCAFFOLD divides
its control variate by the undecayed rate, as they do.

``--engine flwr`` (default): every run is a real ``flwr run`` (managed SuperLink,
Ray simulation, 100 SuperNodes). ``--engine inprocess``: the same ServerApp and
ClientApp code on an in-process grid (no Ray, no gRPC, one process: clients run
one after another, so a round takes about as long as through Ray's two workers on
2 cores, but nothing starts up and a run repeats exactly).

Reports, per strategy over the seeds (mean and spread): the mean central accuracy
of the last 10 rounds, the best, rounds to 80% and 85%, seconds per round and
array bytes sent + received per round; writes into ``--out`` ``non_iid.csv`` (one
line per run), ``non_iid_curves.csv`` (every run's central accuracy per round),
``non_iid.md`` (the table) and ``non_iid.png``: per partition, the last-10-round
mean accuracy and the rounds to 85% of every strategy (each seed a dot, the mean ±
sd over the seeds, the papers' official codes' figure where known) and, when the
curves file exists, the mean accuracy per round over the seeds (5-round moving
mean, band: the seeds' smoothed min to max). Finished runs (a complete
``results.json``) are reused, so an interrupted benchmark continues.

Run (the full setting: 15 runs of 200 rounds)::

    python benchmarks/non_iid.py --engine inprocess
    python benchmarks/non_iid.py --plot-only   # redraw from the CSVs, run nothing
"""

from __future__ import annotations

import csv
import itertools
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from curves import ensure_run, read_curves, save_figure, sweep_parser, write_tables
from matplotlib.lines import Line2D

# The official FedDyn/FedDC codes' settings: FedProx mu 1e-4; FedDyn alpha 1e-2
# with its weight decay decoupled (the official penalty); FedDC alpha 0.1.
STRATEGIES = {
    "fedavg": ["strategy=fedavg"],
    "fedprox": ["strategy=fedprox", "strategy.mu=0.0001"],
    "scaffold": ["strategy=scaffold", "strategy.control_lr=base"],
    "feddyn": ["strategy=feddyn", "strategy.alpha=0.01", "client.decoupled_alpha=true"],
    "feddc": ["strategy=feddc", "strategy.alpha=0.1"],
}
PARTITIONS = {
    "official-dirichlet": [],  # the preset's
    "inner-dirichlet": ["partition=inner-dirichlet", "partition.alpha=0.3"],
    "pathological": ["partition=pathological", "partition.classes_per_partition=2"],
}
# The FedDyn/FedDC papers' own code in this setting: last-10 mean,
# rounds to 80% and 85% (FedAvg), as printed beside the pack's figures.
REFERENCE = {
    "fedavg": (0.866, 12, 30),
    "fedprox": (None, None, None),
    "scaffold": (0.869, None, None),
    "feddyn": (0.879, None, None),
    "feddc": (0.869, None, None),
}
LABELS = {
    "fedavg": "FedAvg",
    "fedprox": "FedProx",
    "scaffold": "SCAFFOLD",
    "feddyn": "FedDyn",
    "feddc": "FedDC",
}
# Integer columns of non_iid.csv; the others but partition, strategy and engine
# are floats (an empty cell: a run that never reached the target).
INTEGER_COLUMNS = ("seed", "to-80", "to-85")


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
        "last10": statistics.mean(
            r["central"]["accuracy"] for r in rounds[-10:] if "central" in r
        ),
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


def spread(values: list) -> str:
    """``mean ± sd`` over the seeds (``-`` counts a run that never got there)."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "never"
    text = f"{statistics.mean(reached):.4g}"
    if len(reached) > 1:
        text += f" ± {statistics.stdev(reached):.2g}"
    missed = len(values) - len(reached)
    return text + (f" ({missed} never)" if missed else "")


def table(rows: list[dict], partitions: list[str], strategies: list[str]) -> str:
    """The markdown table benchmarks/README.md quotes, one line per strategy."""
    lines = [
        "| partition | strategy | last 10 | best | rounds to 80% | rounds to 85% "
        "| s/round | MB/round | papers' code: last 10, to 80%, to 85% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for partition in partitions:
        for name in strategies:
            runs = [
                r for r in rows if r["partition"] == partition and r["strategy"] == name
            ]
            if not runs:
                continue
            ref = REFERENCE[name] if partition == "official-dirichlet" else ()
            cells = [
                spread([r["last10"] for r in runs]),
                spread([r["best"] for r in runs]),
                spread([r["to-80"] for r in runs]),
                spread([r["to-85"] for r in runs]),
                f"{statistics.mean(r['s-per-round'] for r in runs):.2f}",
                f"{statistics.mean(r['mb-per-round'] for r in runs):.2f}",
                ", ".join("-" if v is None else f"{v:g}" for v in ref) or "-",
            ]
            lines.append(f"| {partition} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_rows(path: Path) -> list[dict]:
    """The runs of ``non_iid.csv``, typed as :func:`main` wrote them."""
    rows = []
    with open(path, newline="") as handle:
        for raw in csv.DictReader(handle):
            row: dict = {}
            for key, text in raw.items():
                if key in ("partition", "strategy", "engine"):
                    row[key] = text
                elif text == "":
                    row[key] = None
                elif key in INTEGER_COLUMNS:
                    row[key] = int(text)
                else:
                    row[key] = float(text)
            rows.append(row)
    return rows


def moving_mean(values: list[float], width: int = 5) -> list[float]:
    """Mean of each value and the ``width - 1`` before it (fewer at the start)."""
    return [
        statistics.fmean(values[max(0, i - width + 1) : i + 1])
        for i in range(len(values))
    ]


def seed_panel(
    ax,
    values: dict[str, list],
    reference: dict[str, float | None],
    colours: dict[str, tuple],
    digits: int,
) -> None:
    """Per strategy: the seeds as dots, mean ± sd, the official code's value."""
    for i, name in enumerate(values):
        reached = [v for v in values[name] if v is not None]
        if reached:
            step = 0.06
            xs = [
                i - 0.12 + step * (k - (len(reached) - 1) / 2)
                for k in range(len(reached))
            ]
            ax.scatter(xs, reached, s=30, color=colours[name], alpha=0.85, zorder=3)
            mean = statistics.fmean(reached)
            sd = statistics.stdev(reached) if len(reached) > 1 else 0.0
            ax.errorbar(
                i + 0.1,
                mean,
                yerr=sd,
                fmt="_",
                markersize=14,
                color="black",
                capsize=4,
                elinewidth=1.2,
                zorder=4,
            )
            ax.annotate(
                f"{mean:.{digits}f}",
                (i + 0.28, mean),
                fontsize=9,
                va="center",
                ha="left",
            )
        missed = len(values[name]) - len(reached)
        if missed:
            ax.annotate(
                f"{missed} never",
                (i, 0.02),
                xycoords=("data", "axes fraction"),
                fontsize=9,
                ha="center",
            )
        if reference.get(name) is not None:
            ax.scatter(
                i - 0.32,
                reference[name],
                marker="D",
                s=36,
                facecolor="white",
                edgecolor="black",
                linewidth=1.2,
                zorder=4,
            )
    ax.set_xticks(range(len(values)), [LABELS.get(n, n) for n in values])
    ax.set_xlim(-0.6, len(values) - 0.1)
    ax.grid(axis="y", alpha=0.3)


def plot(rows: list[dict], curves: dict, path: Path) -> None:
    """``non_iid.png``: per partition, last-10 accuracy and rounds to 85% by seed.

    A row of two panels per partition (each strategy: a dot per seed, the mean ±
    sd over the seeds, the official code's figure as a white diamond where the
    REFERENCE has one) and, when per-round curves are given, a panel of the mean
    accuracy per round over the seeds below it (5-round moving mean; the band
    runs from the lowest to the highest seed's moving mean).
    """
    partitions = list(dict.fromkeys(r["partition"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    colours = dict(zip(STRATEGIES, plt.cm.tab10.colors, strict=False))
    with_curves = any(key[0] in partitions for key in curves)
    panel_rows = len(partitions) * (2 if with_curves else 1)
    with plt.rc_context({"font.size": 10, "axes.titlesize": 10}):
        fig = plt.figure(figsize=(10, 4 * panel_rows - 0.3 * (panel_rows - 1)))
        grid = fig.add_gridspec(panel_rows, 2)
        row_index = 0
        for partition in partitions:
            runs = [r for r in rows if r["partition"] == partition]
            seeds = sorted({r["seed"] for r in runs})
            official = partition == "official-dirichlet"
            prefix = f"{partition}: " if len(partitions) > 1 else ""
            by = {
                key: {
                    name: [r[key] for r in runs if r["strategy"] == name]
                    for name in strategies
                    if any(r["strategy"] == name for r in runs)
                }
                for key in ("last10", "to-85")
            }
            panels = (  # (column, key, REFERENCE index, digits, y label, title)
                (
                    0,
                    "last10",
                    0,
                    3,
                    "mean test accuracy, last 10 rounds",
                    "accuracy at the end (higher is better)",
                ),
                (
                    1,
                    "to-85",
                    2,
                    1,
                    "rounds to 85% test accuracy",
                    "rounds to 85% (lower is faster)",
                ),
            )
            for column, key, reference, digits, ylabel, title in panels:
                ax = fig.add_subplot(grid[row_index, column])
                seed_panel(
                    ax,
                    by[key],
                    {n: REFERENCE[n][reference] for n in strategies}
                    if official
                    else {},
                    colours,
                    digits=digits,
                )
                ax.set(ylabel=ylabel, title=f"{prefix}{title}")
            row_index += 1
            if with_curves:
                ax = fig.add_subplot(grid[row_index, :])
                shown: list[float] = []  # the means after the first rounds
                for name in strategies:
                    per_seed = [
                        dict(curves[(partition, name, seed)])
                        for seed in seeds
                        if (partition, name, seed) in curves
                    ]
                    if not per_seed:
                        continue
                    xs = sorted(set.intersection(*(set(c) for c in per_seed)))
                    smooth = [moving_mean([c[x] for x in xs]) for c in per_seed]
                    mean = [statistics.fmean(v) for v in zip(*smooth, strict=True)]
                    shown += mean[10:] or mean
                    ax.plot(xs, mean, color=colours[name], label=LABELS.get(name, name))
                    if len(smooth) > 1:
                        ax.fill_between(
                            xs,
                            [min(v) for v in zip(*smooth, strict=True)],
                            [max(v) for v in zip(*smooth, strict=True)],
                            color=colours[name],
                            alpha=0.15,
                            linewidth=0,
                        )
                for level in (0.80, 0.85):
                    ax.axhline(level, color="grey", linewidth=0.6, linestyle="--")
                ax.set(
                    xlabel="round",
                    ylabel="test accuracy (5-round moving mean)",
                    ylim=(
                        min([0.75] + [v - 0.01 for v in shown]),
                        max([0.9] + [v + 0.01 for v in shown]),
                    ),
                    title=f"{prefix}mean over seeds "
                    f"{' '.join(map(str, seeds))}, band: lowest to highest seed",
                )
                ax.grid(alpha=0.3)
                ax.legend(loc="lower right", ncol=len(strategies), fontsize=9)
                row_index += 1
        seeds = sorted({r["seed"] for r in rows})
        mean_sd = fig.axes[0].errorbar(
            [], [], yerr=[], fmt="_", markersize=12, color="black", capsize=4
        )
        fig.legend(
            handles=[
                Line2D(
                    [], [], marker="o", color="grey", linestyle="", label="one seed"
                ),
                mean_sd,
                Line2D(
                    [],
                    [],
                    marker="D",
                    markerfacecolor="white",
                    markeredgecolor="black",
                    color="black",
                    linestyle="",
                    label="papers' official code (one run)",
                ),
            ],
            labels=[
                "one seed",
                "mean ± sd over the seeds",
                "papers' official code (one run)",
            ],
            loc="lower center",
            ncol=3,
            fontsize=9,
            frameon=False,
        )
        where = f", {partitions[0]} partition" if len(partitions) == 1 else ""
        fig.suptitle(
            f"Fashion-MNIST{where}, seeds {' '.join(map(str, seeds))}", fontsize=11
        )
        fig.tight_layout(rect=(0, 0.06 / panel_rows, 1, 1))
        save_figure(fig, path)


def main() -> None:
    parser = sweep_parser(
        __doc__, 200, "benchmarks/results/non_iid-official", seeds=True
    )
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument(
        "--partitions",
        nargs="+",
        default=["official-dirichlet"],
        choices=list(PARTITIONS),
    )
    parser.add_argument(
        "--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES)
    )
    parser.add_argument("--engine", choices=("flwr", "inprocess"), default="flwr")
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="run nothing: redraw non_iid.png and non_iid.md from --out's "
        "non_iid.csv (and non_iid_curves.csv, if there)",
    )
    args = parser.parse_args()
    if args.plot_only:
        rows = read_rows(args.out / "non_iid.csv")
        curves_path = args.out / "non_iid_curves.csv"
        curves = (
            read_curves(curves_path, {"partition": str, "strategy": str, "seed": int})
            if curves_path.is_file()
            else {}
        )
        partitions = list(dict.fromkeys(r["partition"] for r in rows))
        strategies = list(dict.fromkeys(r["strategy"] for r in rows))
        plot(rows, curves, args.out / "non_iid.png")
        text = table(rows, partitions, strategies)
        (args.out / "non_iid.md").write_text(text + "\n")
        print(text)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for partition, name, seed in itertools.product(
        args.partitions, args.strategies, args.seeds
    ):
        job = args.out / f"{partition}-{name}-seed{seed}"
        overrides = [
            "+experiment=non-iid-official",
            *PARTITIONS[partition],
            *STRATEGIES[name],
            f"num_rounds={args.rounds}",
            f"num_clients={args.clients}",
            f"seed={seed}",
        ]
        # an interrupted run starts over
        results_path = ensure_run(
            job, overrides, args.engine, args.clients, restart=True
        )
        summary = summarise(json.loads(results_path.read_text()))
        curves[(partition, name, seed)] = summary.pop("curve")
        rows.append(
            {
                "partition": partition,
                "strategy": name,
                "seed": seed,
                "engine": args.engine,
                **summary,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    write_tables(args.out, "non_iid", rows, ("partition", "strategy", "seed"), curves)
    plot(rows, curves, args.out / "non_iid.png")
    text = table(rows, args.partitions, args.strategies)
    (args.out / "non_iid.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

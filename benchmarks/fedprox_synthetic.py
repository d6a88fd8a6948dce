"""FedProx's synthetic experiment, as its paper ran it: stragglers and heterogeneity.

T. Li et al., "Federated Optimization in Heterogeneous Networks" (MLSys 2020),
Figures 1 and 2, with its authors' settings (``run_fedprox.sh``): the synthetic
federations (``dataset=synthetic``, generated as the official script does: 30
clients, power-law sizes, 60 features, 10 classes, each client's own 90/10
split), multinomial logistic regression, 10 clients per round, E = 20 local
epochs, B = 10, lr 0.01, 200 rounds (conf preset ``experiment/fedprox-synthetic``).

Grid: synthetic-IID, (0,0), (0.5,0.5), (1,1) x 0%, 50%, 90% stragglers (a
straggler runs 1..E-1 epochs) x

* FedAvg, which drops the stragglers before they report;
* FedProx with mu = 0, which keeps their partial work;
* FedProx with mu = 1, the paper's mu for the synthetic data.

Without stragglers FedProx with mu = 0 is FedAvg (the same updates): it is not
run again, FedAvg's curve stands for it. Every run records the global model's
training loss over all clients' training data and its test accuracy on the
pooled test splits each round, as the official code does, and the dissimilarity
B(theta) = E||grad f_k||^2 / ||grad f||^2 over each round's sampled clients
(the pack's dissimilarity monitor; the official code logs the variance
E||grad f_k - grad f||^2 over all 30 clients, = (B - 1) ||grad f||^2 for the
sampled ones, also written).

A seed fixes the federation (``dataset.loader.seed``) and the run (sampling,
initial model, stragglers). Runs go in priority order, seed by seed: the three
straggler levels of synthetic(1,1) (Figure 1's synthetic column), then the other
federations without stragglers (Figure 2), then the rest; a finished run
(complete ``results.json``) is reused, so the grid can be run in pieces and in
parallel (``--worker 0/2`` and ``--worker 1/2`` in two shells); ``--settings`` and
``--drops`` run some cells only. The tables and plots take every finished run of
``--seeds`` (a cell may have fewer seeds than another: the table says how many).

Writes into ``--out``: ``fedprox_synthetic.csv`` (every round of every run),
``fedprox_synthetic.md`` (the table), ``loss.png`` and ``accuracy.png`` (rows:
straggler levels, columns: federations, as the paper's Figure 1) and
``dissimilarity.png`` (Figure 2: training loss, B(theta) and the variance of the
local gradients without stragglers).

Run (100 rounds, one seed of the whole grid: about 1.5 h on 2 cores, two runs at a
time, measured 2026-12-04; the paper's 200 rounds and 3 seeds: about 9 h)::

    python benchmarks/fedprox_synthetic.py --seeds 0 1 2
    python benchmarks/fedprox_synthetic.py --plot-only   # tables and plots of what ran
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from flwr_prox_strategies.experiment.sweep import run_inprocess

SETTINGS = {
    "synthetic-iid": [
        "dataset.loader.iid=true",
        "dataset.loader.alpha=0",
        "dataset.loader.beta=0",
    ],
    "synthetic(0,0)": ["dataset.loader.alpha=0", "dataset.loader.beta=0"],
    "synthetic(0.5,0.5)": ["dataset.loader.alpha=0.5", "dataset.loader.beta=0.5"],
    "synthetic(1,1)": ["dataset.loader.alpha=1", "dataset.loader.beta=1"],
}
DROPS = (0.0, 0.5, 0.9)
METHODS = {
    "FedAvg": ["strategy=fedavg"],
    "FedProx (mu=0)": ["strategy=fedprox", "strategy.mu=0"],
    "FedProx (mu=1)": ["strategy=fedprox", "strategy.mu=1"],
}
COLOURS = {"FedAvg": "tab:green", "FedProx (mu=0)": "tab:orange"}
COLOURS["FedProx (mu=1)"] = "tab:red"
SAME_AS_FEDAVG = "FedProx (mu=0)"  # without stragglers
CLIENTS = 30


def priority(setting: str, drop: float) -> int:
    """Figure 1's synthetic(1,1) column first, then Figure 2, then the rest."""
    if setting == "synthetic(1,1)":
        return 0
    return 1 if drop == 0.0 else 2


def jobs(
    seeds: list[int],
    settings: Sequence[str] = tuple(SETTINGS),
    drops: Sequence[float] = DROPS,
) -> list[tuple[str, float, str, int]]:
    """The runs of the grid (or of its chosen cells), in the order worth running."""
    cells = sorted(
        ((s, d) for s in settings for d in drops), key=lambda c: priority(*c)
    )
    return [
        (setting, drop, method, seed)
        for seed in seeds
        for setting, drop in cells
        for method in METHODS
        if not (drop == 0.0 and method == SAME_AS_FEDAVG)
    ]


def job_dir(out: Path, setting: str, drop: float, method: str, seed: int) -> Path:
    slug = method.lower().replace(" ", "").replace("(", "-").replace(")", "")
    slug = slug.replace("=", "")
    return out / "runs" / f"{setting}-drop{drop:g}-{slug}-seed{seed}"


def complete(path: Path, rounds: int) -> bool:
    if not path.is_file():
        return False
    results = json.loads(path.read_text())
    return bool(results["summary"].get("complete")) and (
        results.get("num-rounds") == rounds
    )


def run(out: Path, job: tuple[str, float, str, int], rounds: int) -> None:
    setting, drop, method, seed = job
    folder = job_dir(out, *job)
    if complete(folder / "results.json", rounds):
        return
    if folder.is_dir():  # an interrupted run starts over
        for old in folder.iterdir():
            if old.is_file():
                old.unlink()
    overrides = [
        "+experiment=fedprox-synthetic",
        *SETTINGS[setting],
        *METHODS[method],
        f"strategy.drop_percent={drop}",
        "strategy.monitor_dissimilarity=true",
        f"dataset.loader.seed={seed}",
        f"seed={seed}",
        f"num_rounds={rounds}",
    ]
    print(f"run: {setting}, {drop:.0%} stragglers, {method}, seed {seed}", flush=True)
    run_inprocess(overrides, folder, CLIENTS, threads=1)


def rows_of(results: dict, job: tuple[str, float, str, int]) -> list[dict]:
    setting, drop, method, seed = job
    rows = []
    for entry in results["rounds"]:
        train = entry.get("train") or {}
        b, g2 = train.get("dissimilarity-b"), train.get("grad-sq-norm-global")
        rows.append(
            {
                "setting": setting,
                "stragglers": drop,
                "method": method,
                "seed": seed,
                "round": entry["round"],
                "train-loss": (entry.get("central-train") or {}).get("loss"),
                "test-accuracy": (entry.get("central") or {}).get("accuracy"),
                "dissimilarity-b": b,
                "grad-variance": (b - 1.0) * g2 if b is not None and g2 else None,
            }
        )
    return rows


def collect(out: Path, seeds: list[int], rounds: int) -> list[dict]:
    """Per-round rows of every finished run; FedAvg's stand for mu=0 at 0%."""
    rows = []
    for job in jobs(seeds):
        path = job_dir(out, *job) / "results.json"
        if complete(path, rounds):
            results = json.loads(path.read_text())
            rows += rows_of(results, job)
            setting, drop, method, seed = job
            if drop == 0.0 and method == "FedAvg":
                rows += rows_of(results, (setting, drop, SAME_AS_FEDAVG, seed))
    return rows


def curves(rows: list[dict], key: str) -> dict[tuple, dict[int, list[float]]]:
    """{(setting, drop, method): {round: [value per seed]}}."""
    table: dict[tuple, dict[int, list[float]]] = {}
    for row in rows:
        if row[key] is None:
            continue
        cell = (row["setting"], row["stragglers"], row["method"])
        table.setdefault(cell, {}).setdefault(row["round"], []).append(row[key])
    return table


def last_mean(per_round: dict[int, list[float]], last: int = 10) -> list[float]:
    """Each seed's mean over the last ``last`` rounds."""
    tail = sorted(per_round)[-last:]
    seeds = min(len(per_round[r]) for r in tail)
    return [statistics.fmean(per_round[r][s] for r in tail) for s in range(seeds)]


def spread(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(rows: list[dict]) -> str:
    loss, acc = curves(rows, "train-loss"), curves(rows, "test-accuracy")
    lines = [
        "| federation | stragglers | method | seeds | training loss, last 10 rounds "
        "| test accuracy, last 10 rounds | best test accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        for drop in DROPS:
            for method in METHODS:
                cell = (setting, drop, method)
                if cell not in acc:
                    continue
                seeds = len(next(iter(acc[cell].values())))
                best = [max(acc[cell][r][s] for r in acc[cell]) for s in range(seeds)]
                same = " (= FedAvg)" if drop == 0.0 and method == SAME_AS_FEDAVG else ""
                lines.append(
                    f"| {setting} | {drop:.0%} | {method}{same} | {seeds} "
                    f"| {spread(last_mean(loss[cell]))} "
                    f"| {spread(last_mean(acc[cell]))} | {spread(best)} |"
                )
    return "\n".join(lines)


def legend_handles(methods) -> list:
    """One line per method, whether or not a panel has it yet."""
    from matplotlib.lines import Line2D

    return [Line2D([], [], color=COLOURS[m], label=m) for m in methods]


def grid_plot(rows: list[dict], key: str, label: str, path: Path, log: bool) -> None:
    """Rows: straggler levels; columns: federations (the paper's Figure 1)."""
    data = curves(rows, key)
    fig, axes = plt.subplots(
        len(DROPS), len(SETTINGS), figsize=(4 * len(SETTINGS), 3 * len(DROPS))
    )
    for i, drop in enumerate(DROPS):
        for j, setting in enumerate(SETTINGS):
            ax = axes[i][j]
            for method in METHODS:
                per_round = data.get((setting, drop, method))
                if not per_round:
                    continue
                xs = sorted(per_round)
                means = [statistics.fmean(per_round[r]) for r in xs]
                style = ":" if drop == 0.0 and method == SAME_AS_FEDAVG else "-"
                ax.plot(xs, means, style, color=COLOURS[method], label=method)
                if min(len(per_round[r]) for r in xs) > 1:
                    ax.fill_between(
                        xs,
                        [min(per_round[r]) for r in xs],
                        [max(per_round[r]) for r in xs],
                        color=COLOURS[method],
                        alpha=0.15,
                    )
            ax.set_title(f"{setting}, {drop:.0%} stragglers", fontsize=9)
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            if i == len(DROPS) - 1:
                ax.set_xlabel("round")
            if j == 0:
                ax.set_ylabel(label)
    fig.legend(handles=legend_handles(METHODS), loc="upper center", ncol=3)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def moving_mean(values: list[float], width: int = 10) -> list[float]:
    """Mean of each value and the ``width - 1`` before it (fewer at the start)."""
    return [
        statistics.fmean(values[max(0, i - width + 1) : i + 1])
        for i in range(len(values))
    ]


def dissimilarity_plot(rows: list[dict], path: Path) -> None:
    """Without stragglers, Figure 2: training loss, B(theta), gradient variance.

    B(theta) = E||grad f_k||^2 / ||grad f||^2 is the dissimilarity of the
    paper's theory; the paper's figure plots the variance E||grad f_k -
    grad f||^2 = (B - 1) ||grad f||^2, which shrinks as the model nears a
    stationary point while B grows. Both are estimated each round from the 10
    sampled clients, so they are noisy: the thin line is the round's value, the
    thick one its 10-round moving mean.
    """
    panels = [
        curves(rows, key) for key in ("train-loss", "dissimilarity-b", "grad-variance")
    ]
    fig, axes = plt.subplots(3, len(SETTINGS), figsize=(4 * len(SETTINGS), 9))
    for j, setting in enumerate(SETTINGS):
        for method in ("FedAvg", "FedProx (mu=1)"):
            for i, data in enumerate(panels):
                per_round = data.get((setting, 0.0, method))
                if not per_round:
                    continue
                xs = sorted(per_round)
                ys = [statistics.fmean(per_round[r]) for r in xs]
                ax = axes[i][j]
                if i == 0:
                    ax.plot(xs, ys, color=COLOURS[method])
                else:
                    ax.plot(xs, ys, color=COLOURS[method], linewidth=0.6, alpha=0.35)
                    ax.plot(xs, moving_mean(ys), color=COLOURS[method], linewidth=1.8)
        axes[0][j].set_title(setting, fontsize=9)
        axes[-1][j].set_xlabel("round")
        for ax in axes[:, j]:
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss")
    axes[1][0].set_ylabel("B(theta), 10 sampled clients")
    axes[2][0].set_ylabel("variance of local gradients")
    fig.legend(
        handles=legend_handles(("FedAvg", "FedProx (mu=1)")), loc="upper center", ncol=2
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--worker",
        default="0/1",
        help="i/n: run every n-th job from the i-th (parallel shells)",
    )
    parser.add_argument(
        "--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS)
    )
    parser.add_argument("--drops", type=float, nargs="+", default=list(DROPS))
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/fedprox_synthetic")
    )
    args = parser.parse_args()
    index, count = (int(v) for v in args.worker.split("/"))
    if not 0 <= index < count:
        parser.error(f"--worker must be i/n with 0 <= i < n, got {args.worker}")
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        if not set(args.drops) <= set(DROPS):
            parser.error(f"--drops must be among {DROPS}")
        for job in jobs(args.seeds, args.settings, args.drops)[index::count]:
            run(args.out, job, args.rounds)
    rows = collect(args.out, args.seeds, args.rounds)
    if not rows:
        raise SystemExit(f"no finished run of {args.rounds} rounds in {args.out}")
    with open(args.out / "fedprox_synthetic.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    grid_plot(rows, "train-loss", "training loss", args.out / "loss.png", log=True)
    grid_plot(
        rows, "test-accuracy", "test accuracy", args.out / "accuracy.png", log=False
    )
    dissimilarity_plot(rows, args.out / "dissimilarity.png")
    text = table(rows)
    (args.out / "fedprox_synthetic.md").write_text(
        f"{args.rounds} rounds; mean ± standard deviation over seeds.\n\n{text}\n"
    )
    print(text)


if __name__ == "__main__":
    main()

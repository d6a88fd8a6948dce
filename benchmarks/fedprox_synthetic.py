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
straggler levels, columns: federations, as the paper's Figure 1),
``dissimilarity.png`` (Figure 2: training loss, B(theta) and the variance of the
local gradients without stragglers), and the same curves at a size a page shows:
``federation-iid.png``, ``federation-0-0.png``, ``federation-0.5-0.5.png`` and
``federation-1-1.png`` (one federation each: training loss and test accuracy,
columns 0%, 50%, 90% stragglers) and ``dissimilarity-overview.png`` (B(theta) and
the variance of the local gradients of the four federations on two panels).

``--plot-only`` runs nothing: it tabulates and plots the finished runs of
``--seeds`` and ``--rounds`` under ``--out/runs`` (rewriting the CSV) or, when
there are none (the runs are not committed), the committed
``fedprox_synthetic.csv`` (left as it is). The committed figures are redrawn by
the last command below.

Run (100 rounds, one seed of the whole grid: about 1.5 h on 2 cores, two runs at a
time, measured 2026-12-04; the paper's 200 rounds and 3 seeds: about 9 h)::

    python benchmarks/fedprox_synthetic.py --seeds 0 1 2
    python benchmarks/fedprox_synthetic.py --plot-only   # tables and plots of what ran
    python benchmarks/fedprox_synthetic.py --rounds 100 --seeds 0 1 2 --plot-only
"""

from __future__ import annotations

import csv
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from curves import save_figure, sweep_parser, write_rows

from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess

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
    save_figure(fig, path, dpi=110)


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
    save_figure(fig, path, dpi=110)


def slug(setting: str) -> str:
    """File-name part of a federation: synthetic(0.5,0.5) -> 0.5-0.5."""
    name = setting.removeprefix("synthetic").strip("-()")
    return name.replace(",", "-")


def read_csv(path: Path, seeds: list[int], rounds: int) -> list[dict]:
    """The rows of ``fedprox_synthetic.csv`` of ``seeds``, typed as written."""
    rows = []
    with open(path, newline="") as handle:
        for raw in csv.DictReader(handle):
            if int(raw["seed"]) not in seeds:
                continue
            row: dict = dict(raw)
            row["stragglers"] = float(raw["stragglers"])
            row["seed"] = int(raw["seed"])
            row["round"] = int(raw["round"])
            for key in (
                "train-loss",
                "test-accuracy",
                "dissimilarity-b",
                "grad-variance",
            ):
                row[key] = float(raw[key]) if raw[key] != "" else None
            rows.append(row)
    held = max((r["round"] for r in rows), default=None)
    if held != rounds:
        raise SystemExit(f"{path} holds runs of {held} rounds, not --rounds {rounds}")
    return rows


PAGE_LABELS = {
    "FedAvg": "FedAvg",
    "FedProx (mu=0)": "FedProx, μ = 0",
    "FedProx (mu=1)": "FedProx, μ = 1",
}


def plain_log_axis(ax) -> None:
    """A log y-axis labelled 0.3, 1, 2 rather than 3 x 10^-1 (page figures).

    Call it after plotting: over more than two decades only the decades are
    labelled, over less than one 0.7 too.
    """
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax.set_yscale("log")
    low, high = ax.get_ylim()
    ratio = high / low
    steps = (1,) if ratio > 100 else (1, 2, 3, 5) if ratio > 10 else (1, 2, 3, 5, 7)
    ticks = [
        step * 10.0**exponent
        for exponent in range(math.floor(math.log10(low)), math.ceil(math.log10(high)))
        for step in steps
    ]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(low, high)


def band(ax, per_round: dict[int, list[float]], colour: str, style: str = "-") -> None:
    """Mean over the seeds, and their min-max band when there are several."""
    xs = sorted(per_round)
    ax.plot(xs, [statistics.fmean(per_round[r]) for r in xs], style, color=colour)
    if min(len(per_round[r]) for r in xs) > 1:
        ax.fill_between(
            xs,
            [min(per_round[r]) for r in xs],
            [max(per_round[r]) for r in xs],
            color=colour,
            alpha=0.15,
            linewidth=0,
        )


def federation_plot(rows: list[dict], setting: str, path: Path) -> None:
    """One federation: training loss and test accuracy, a column per straggler level.

    The same curves as the federation's column of ``loss.png`` and
    ``accuracy.png``, at a size that reads at a page's width; a row shares its
    y-axis, so the straggler levels compare at a glance.
    """
    loss, acc = curves(rows, "train-loss"), curves(rows, "test-accuracy")
    with plt.rc_context({"font.size": 10, "axes.titlesize": 10}):
        fig, axes = plt.subplots(2, len(DROPS), figsize=(10, 6.5), sharey="row")
        for j, drop in enumerate(DROPS):
            seeds = 0
            for method in METHODS:
                same = drop == 0.0 and method == SAME_AS_FEDAVG
                for i, data in enumerate((loss, acc)):
                    per_round = data.get((setting, drop, method))
                    if per_round:
                        band(
                            axes[i][j], per_round, COLOURS[method], ":" if same else "-"
                        )
                        seeds = max(seeds, min(len(v) for v in per_round.values()))
            plural = "s" if seeds != 1 else ""
            axes[0][j].set_title(f"{drop:.0%} stragglers ({seeds} seed{plural})")
            axes[1][j].set_xlabel("round")
            for ax in axes[:, j]:
                ax.grid(alpha=0.3)
        plain_log_axis(axes[0][0])  # the row shares it
        axes[0][0].set_ylabel("training loss (log)")
        axes[1][0].set_ylabel("test accuracy")
        from matplotlib.lines import Line2D

        handles = [
            Line2D([], [], color=COLOURS[m], label=PAGE_LABELS[m]) for m in METHODS
        ]
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.955),
            ncol=3,
            frameon=False,
        )
        fig.suptitle(
            f"{setting}: mean over the seeds (band: lowest to highest seed)",
            y=0.99,
            fontsize=11,
        )
        fig.tight_layout(rect=(0, 0, 1, 0.93))
        save_figure(fig, path)


def dissimilarity_overview(rows: list[dict], path: Path) -> None:
    """Without stragglers: B(theta) and the local gradients' variance, 2 panels.

    Colour: the federation; solid FedAvg, dashed FedProx (mu = 1); each line
    the 10-round moving mean of the mean over the seeds (as the thick lines of
    ``dissimilarity.png``).
    """
    keys = ("dissimilarity-b", "grad-variance")
    data = {key: curves(rows, key) for key in keys}
    shade = dict(
        zip(SETTINGS, ("tab:blue", "tab:green", "tab:orange", "tab:red"), strict=True)
    )
    styles = {"FedAvg": "-", "FedProx (mu=1)": "--"}
    from matplotlib.lines import Line2D

    with plt.rc_context({"font.size": 10, "axes.titlesize": 10}):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
        for ax, key in zip(axes, keys, strict=True):
            for setting in SETTINGS:
                for method, style in styles.items():
                    per_round = data[key].get((setting, 0.0, method))
                    if not per_round:
                        continue
                    xs = sorted(per_round)
                    ys = moving_mean([statistics.fmean(per_round[r]) for r in xs])
                    ax.plot(xs, ys, style, color=shade[setting], linewidth=1.6)
            plain_log_axis(ax)
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        axes[0].set(
            ylabel="B(θ), 10 sampled clients",
            title="dissimilarity B(θ) (grows as ||∇f|| shrinks)",
        )
        axes[1].set(
            ylabel="variance of the local gradients",
            title="variance of the local gradients (paper's Fig. 2)",
        )
        handles = [
            Line2D([], [], color=shade[s], linewidth=2, label=s) for s in SETTINGS
        ] + [
            Line2D([], [], color="black", linestyle=st, label=PAGE_LABELS[m])
            for m, st in styles.items()
        ]
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.94),
            ncol=6,
            fontsize=9,
            frameon=False,
            columnspacing=1.2,
            handlelength=1.8,
        )
        fig.suptitle(
            "No stragglers: 10-round moving mean of the mean over the seeds",
            y=0.99,
            fontsize=11,
        )
        fig.tight_layout(rect=(0, 0, 1, 0.9))
        save_figure(fig, path)


def main() -> None:
    parser = sweep_parser(
        __doc__, 200, "benchmarks/results/fedprox_synthetic", seeds=True
    )
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
    committed = args.out / "fedprox_synthetic.csv"
    if rows:
        write_rows(committed, rows)
    elif args.plot_only and committed.is_file():
        print(f"no finished run under {args.out / 'runs'}: plotting {committed}")
        rows = read_csv(committed, args.seeds, args.rounds)
    if not rows:
        raise SystemExit(f"no finished run of {args.rounds} rounds in {args.out}")
    grid_plot(rows, "train-loss", "training loss", args.out / "loss.png", log=True)
    grid_plot(
        rows, "test-accuracy", "test accuracy", args.out / "accuracy.png", log=False
    )
    dissimilarity_plot(rows, args.out / "dissimilarity.png")
    for setting in SETTINGS:
        federation_plot(rows, setting, args.out / f"federation-{slug(setting)}.png")
    dissimilarity_overview(rows, args.out / "dissimilarity-overview.png")
    text = table(rows)
    (args.out / "fedprox_synthetic.md").write_text(
        f"{args.rounds} rounds; mean ± standard deviation over seeds.\n\n{text}\n"
    )
    print(text)


if __name__ == "__main__":
    main()

"""Privacy benchmark: accuracy against epsilon for FedAvg, FedProx and FedDyn.

Fashion-MNIST, 100 clients, Dirichlet(0.3) label split, MLP 784-200-200-10, 10%
participation, E=1, B=50, lr 0.1; every client trains by DP-SGD (opacus: per-sample
clipping at C=1, Gaussian noise, Poisson sampling, RDP accountant, delta=1e-5) at
each of the noise multipliers given, with clipping only (sigma = 0: what clipping
costs, apart from noise), and without privacy. One script run does every
(strategy, noise) pair on the same engine, so the cost column compares like with
like.

Reports, per run: final, last-five-rounds mean and best central accuracy, the
largest and the mean per-client epsilon at the end, seconds per round and its ratio
to the same strategy without privacy. Writes ``privacy.csv`` (one row per run), ``privacy_curves.csv``
(accuracy and max epsilon per round) and ``privacy.png`` (accuracy against epsilon)
into ``--out``.

Run::

    python benchmarks/privacy.py --rounds 30 --sigmas 0.8 1.2 2.0
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from flwr_prox_strategies.experiment.sweeps.sweep import flwr_run, run_inprocess

STRATEGIES = {
    "fedavg": ["strategy=fedavg"],
    "fedprox": ["strategy=fedprox", "strategy.mu=0.01"],
    "feddyn": ["strategy=feddyn", "strategy.alpha=0.01", "client.decoupled_alpha=true"],
}
SETTING = [
    "dataset=fashion-mnist",
    "model=mlp",
    "partition=dirichlet",
    "partition.alpha=0.3",
    "num_clients=100",
    "strategy.fraction_train=0.1",
    "train.local_epochs=1",
    "train.batch_size=50",
    "train.learning_rate=0.1",
]


def dp_overrides(sigma: float | None, clipping: float) -> list[str]:
    if sigma is None:
        return ["privacy=none"]
    return [
        "privacy=dp-sgd",
        f"privacy.dp.noise_multiplier={sigma}",
        f"privacy.dp.clipping_norm={clipping}",
        "privacy.dp.delta=1e-5",
        "privacy.dp.accountant=rdp",
    ]


def summarise(results: dict) -> dict:
    rounds = results["rounds"]
    elapsed = [r["elapsed-s"] for r in rounds]
    trained = [r for r in rounds if "train" in r]
    last = trained[-1]["train"] if trained else {}
    curve = [
        (
            r["round"],
            r["central"]["accuracy"],
            r.get("train", {}).get("dp-epsilon-total-max", 0.0),
        )
        for r in rounds
        if r.get("central")
    ]
    accuracies = [a for _, a, _ in curve]
    return {
        "final": results["summary"]["final-accuracy"],
        # Ten of 100 clients per round on a Dirichlet(0.3) split: the accuracy
        # swings from round to round, so the last five rounds' mean is the figure.
        "last5": sum(accuracies[-5:]) / len(accuracies[-5:]),
        "best": results["summary"]["best-accuracy"],
        "eps-max": last.get("dp-epsilon-total-max"),
        "eps-mean": last.get("dp-epsilon-total-mean"),
        "s-per-round": (elapsed[-1] - elapsed[0]) / max(len(rounds) - 1, 1),
        "curve": curve,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.8, 1.2, 2.0])
    parser.add_argument("--clipping", type=float, default=1.0)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        choices=["inprocess", "flwr"],
        default="inprocess",
        help="inprocess: the strategies and ClientApp in one process (fast, "
        "timing without simulation overhead); flwr: a real `flwr run` per run",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/privacy"))
    parser.add_argument(
        "--client-cost",
        action="store_true",
        help="only time one client's round, with and without DP-SGD, side by side",
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="only redraw privacy.png from the CSVs already in --out",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.client_cost:
        client_cost()
        return
    if args.replot:
        rows = read_rows(args.out)
        write_table(rows, args.out)
        plot(rows, args.out / "privacy.png")
        return

    rows, curves = [], []
    # sigma = 0: per-example clipping and Poisson sampling without noise (epsilon
    # infinite), which separates what clipping costs from what noise costs.
    noise_levels: list[float | None] = [None, 0.0, *args.sigmas]
    for strategy in args.strategies:
        for sigma in noise_levels:
            overrides = [
                *SETTING,
                *STRATEGIES[strategy],
                *dp_overrides(sigma, args.clipping),
                f"num_rounds={args.rounds}",
                f"seed={args.seed}",
            ]
            with tempfile.TemporaryDirectory() as tmp:
                if args.engine == "flwr":
                    path = flwr_run(overrides, Path(tmp), num_supernodes=100)
                else:
                    path = run_inprocess(overrides, Path(tmp), 100)
                results = json.loads(Path(path).read_text())
            summary = summarise(results)
            label = "none" if sigma is None else f"{sigma:g}"
            rows.append({"strategy": strategy, "sigma": label, **summary})
            curves.extend(
                {
                    "strategy": strategy,
                    "sigma": label,
                    "round": r,
                    "accuracy": a,
                    "epsilon-max": e,
                }
                for r, a, e in summary["curve"]
            )
            print(
                f"{strategy:8s} sigma={label:5s} final {summary['final']:.4f} "
                f"eps-max {summary['eps-max'] or 0:.3f} "
                f"{summary['s-per-round']:.2f} s/round",
                flush=True,
            )
    baseline = {r["strategy"]: r["s-per-round"] for r in rows if r["sigma"] == "none"}
    for row in rows:
        row["cost-x"] = row["s-per-round"] / baseline[row["strategy"]]

    write_table(rows, args.out)
    with open(args.out / "privacy_curves.csv", "w", newline="") as handle:
        writer = csv.DictWriter(
            handle, fieldnames=["strategy", "sigma", "round", "accuracy", "epsilon-max"]
        )
        writer.writeheader()
        writer.writerows(curves)

    print(
        f"\n{'strategy':9s}{'sigma':>6s}{'final':>8s}{'last5':>8s}{'best':>8s}"
        f"{'eps-max':>9s}"
        f"{'eps-mean':>9s}{'s/rnd':>7s}{'cost':>6s}"
    )
    for row in rows:
        none = "-" if row["sigma"] == "none" else "inf"
        eps_max = none if row["eps-max"] is None else f"{row['eps-max']:.3f}"
        eps_mean = none if row["eps-mean"] is None else f"{row['eps-mean']:.3f}"
        print(
            f"{row['strategy']:9s}{row['sigma']:>6s}{row['final']:8.4f}"
            f"{row['last5']:8.4f}{row['best']:8.4f}{eps_max:>9s}{eps_mean:>9s}"
            f"{row['s-per-round']:7.2f}{row['cost-x']:5.1f}x"
        )
    plot(rows, args.out / "privacy.png")


def client_cost(rounds: int = 5) -> None:
    """Time one client's fit (600 examples, MLP, B=50, E=1, one thread), both ways."""
    import time

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from flwr_prox_strategies import DPSGD, FedAvgClient
    from flwr_prox_strategies.core.client.dp import PrivacyLedger
    from flwr_prox_strategies.task.models import MLP

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(600, 784, generator=generator),
        torch.randint(0, 10, (600,), generator=generator),
    )
    for dp in (None, DPSGD(noise_multiplier=1.0, clipping_norm=1.0)):
        client = FedAvgClient(
            MLP(in_features=784, hidden=[200, 200], num_classes=10),
            DataLoader(data, batch_size=50, shuffle=True),
            dp=dp,
            seed=0,
        )
        params = client.get_parameters({})
        start = time.perf_counter()
        for server_round in range(1, rounds + 1):
            params, _, _ = client.fit(
                params, {"server-round": server_round, "local-epochs": 1}
            )
        per_fit = (time.perf_counter() - start) / rounds
        line = f"{'DP-SGD' if dp else 'plain':7s} {per_fit:.3f} s per fit"
        if dp is not None:
            ledger = PrivacyLedger(dp, client.state)
            start = time.perf_counter()
            ledger.epsilon()
            line += (
                f" (of which one RDP evaluation: {time.perf_counter() - start:.3f} s)"
            )
        print(line)


def write_table(rows: list[dict], out: Path) -> None:
    """Write privacy.csv, one row per run."""
    fields = ["strategy", "sigma", "final", "last5", "best", "eps-max", "eps-mean"]
    fields += ["s-per-round", "cost-x"]
    with open(out / "privacy.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_rows(out: Path) -> list[dict]:
    """Rebuild the rows (with their curves) from privacy.csv and privacy_curves.csv."""
    with open(out / "privacy_curves.csv") as handle:
        curves = list(csv.DictReader(handle))
    with open(out / "privacy.csv") as handle:
        rows: list[dict] = list(csv.DictReader(handle))
    for row in rows:
        for key in ("final", "best", "eps-max", "eps-mean"):
            row[key] = float(row[key]) if row[key] else None
        row["curve"] = [
            (int(c["round"]), float(c["accuracy"]), float(c["epsilon-max"] or 0))
            for c in curves
            if (c["strategy"], c["sigma"]) == (row["strategy"], row["sigma"])
        ]
        accuracies = [a for _, a, _ in row["curve"]]
        row["last5"] = sum(accuracies[-5:]) / len(accuracies[-5:])
    return rows


NAMES = {"fedavg": "FedAvg", "fedprox": "FedProx", "feddyn": "FedDyn"}


def plot(rows: list[dict], path: Path) -> None:
    """Top: the trade-off (accuracy against final epsilon); below: each strategy's runs.

    Laid out to read at a page's width (about 800 px): one wide panel over one
    panel per strategy, fonts of 10-11 pt, a legend outside the trade-off panel.
    """
    from matplotlib.lines import Line2D

    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    colours = dict(zip(strategies, ["C0", "C1", "C2", "C3", "C4"], strict=False))
    levels = list(dict.fromkeys(r["sigma"] for r in rows))
    noisy = [s for s in levels if s not in ("none", "0")]
    shades = plt.get_cmap("viridis")(
        [0.15 + 0.7 * i / max(len(noisy) - 1, 1) for i in range(len(noisy))]
    )
    sigma_colour = {
        "none": "black",
        "0": "0.6",
        **dict(zip(noisy, shades, strict=True)),
    }
    with plt.rc_context({"font.size": 11, "legend.fontsize": 10}):
        fig = plt.figure(figsize=(9, 8.5), layout="constrained")
        grid = fig.add_gridspec(2, len(strategies), height_ratios=[1.15, 1])
        ax_trade = fig.add_subplot(grid[0, :])
        epsilons: dict[str, float] = {}
        for strategy in strategies:
            runs = [r for r in rows if r["strategy"] == strategy]
            private = [r for r in runs if r["sigma"] != "none" and r["eps-max"]]
            epsilons.update({r["sigma"]: r["eps-max"] for r in private})
            ax_trade.plot(
                [r["eps-max"] for r in private],
                [r["last5"] for r in private],
                marker="o",
                color=colours[strategy],
            )
            for r in runs:
                style = {"none": "--", "0": ":"}.get(r["sigma"])
                if style:
                    ax_trade.axhline(
                        r["last5"],
                        color=colours[strategy],
                        linestyle=style,
                        linewidth=1,
                    )
        handles = [
            Line2D([], [], color=colours[s], marker="o", label=NAMES.get(s, s))
            for s in strategies
        ]
        handles += [
            Line2D([], [], color="0.3", marker="o", label="DP-SGD (σ above)"),
            Line2D([], [], color="0.3", linestyle="--", label="no privacy"),
            Line2D([], [], color="0.3", linestyle=":", label="clipping only (σ = 0)"),
        ]
        ax_trade.legend(
            handles=handles,
            loc="center left",
            bbox_to_anchor=(1.01, 0.5),
            frameon=False,
        )
        ax_trade.set(
            xlabel="ε at the end (largest client, δ = 1e-5)",
            ylabel="accuracy, mean of rounds 26-30",
        )
        ax_trade.set_title("accuracy against ε", loc="left", pad=24)
        if epsilons:
            ax_sigma = ax_trade.twiny()
            ax_sigma.set_xlim(ax_trade.get_xlim())
            ax_sigma.set_xticks(list(epsilons.values()), [f"σ = {s}" for s in epsilons])
            ax_sigma.tick_params(length=0)
        ax_trade.grid(alpha=0.3)
        first = None
        for column, strategy in enumerate(strategies):
            ax = fig.add_subplot(grid[1, column], sharey=first)
            first = first or ax
            for r in (r for r in rows if r["strategy"] == strategy):
                label = {"none": "no privacy", "0": "σ = 0 (clipping only)"}
                ax.plot(
                    [rnd for rnd, _, _ in r["curve"]],
                    [a for _, a, _ in r["curve"]],
                    color=sigma_colour[r["sigma"]],
                    linewidth=1.2,
                    label=label.get(r["sigma"], f"σ = {r['sigma']}"),
                )
            ax.set_title(NAMES.get(strategy, strategy))
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
            if column:
                ax.tick_params(labelleft=False)
            else:
                ax.set_ylabel("central accuracy")
        fig.legend(
            *first.get_legend_handles_labels(),
            loc="outside lower center",
            ncols=len(levels),
            frameon=False,
            fontsize=9.5,
        )
        fig.suptitle(
            "DP-SGD on every client: Fashion-MNIST, 100 clients, Dirichlet(0.3)"
        )
        fig.savefig(path, dpi=100)
        plt.close(fig)


if __name__ == "__main__":
    main()

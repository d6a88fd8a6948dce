"""FedProx's mu and FedDyn's alpha under SGD and under Adam, on the main job's setting.

The rules add their term to the gradient; an adaptive optimiser then divides
it, coordinate by coordinate, by the running scale of the whole gradient, so
the same mu or alpha pulls differently than under SGD. This measures how much:
the README's main job (digits, 20 clients, Dirichlet(0.3), MLP, 30 rounds,
2 local epochs, batch 16), the in-process engine, each penalty value with
SGD (lr 0.1, the default) and with Adam (lr 0.001, its usual rate; Adam's
moments reset every round as the client rebuilds its optimiser), 3 seeds.

Reports, per optimiser and value, the final and best central accuracy and the
final central loss (mean and spread over seeds), and the mean training loss of
the last round; writes ``adaptive_optimizers.csv`` and ``.md`` and a plot of
the final accuracy against the penalty.

Run (45 runs, about 25 min on 2 cores, measured with other jobs beside it)::

    python benchmarks/adaptive_optimizers.py

``--lightning`` measures the same in ``examples/quickstart-pytorch-lightning``
instead (Flower's Lightning autoencoder on the digits, 4 clients, half of them
a round, 10 rounds, 3 seeds; Adam at Flower's lr 1e-3, SGD at 0.5), where the
penalties pull against a reconstruction loss: the final federated evaluation
loss (lower is better) per optimiser and value, in
``adaptive_optimizers_lightning.md`` (about 3 min)::

    python benchmarks/adaptive_optimizers.py --lightning
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

from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess

OPTIMIZERS = {
    "sgd": ["train.optimizer=sgd", "train.learning_rate=0.1"],
    "adam": ["train.optimizer=adam", "train.learning_rate=0.001"],
}
PENALTIES = {
    "fedprox": ("strategy.mu", [0.0, 0.001, 0.01, 0.1, 1.0]),
    "feddyn": ("strategy.alpha", [0.001, 0.01, 0.1]),
}


def run_one(out: Path, strategy: str, key: str, value: float, opt: str, seed: int):
    job = out / f"{strategy}-{key.split('.')[-1]}{value:g}-{opt}-seed{seed}"
    path = job / "results.json"
    if not (path.is_file() and json.loads(path.read_text())["summary"].get("complete")):
        overrides = [
            f"strategy={strategy}",
            f"{key}={value}",
            *OPTIMIZERS[opt],
            f"seed={seed}",
        ]
        run_inprocess(overrides, job, 20, threads=1)
    return json.loads(path.read_text())


LIGHTNING = {
    "fedprox": ("proximal-mu", [0.0, 0.01, 0.1, 1.0]),
    "feddyn": ("feddyn-alpha", [0.01, 0.1]),
}


def lightning_table(out: Path, seeds: list[int]) -> None:
    """The same penalties in the Lightning example, run in this process."""
    import sys

    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir, parse_config_args

    from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

    example = (
        Path(__file__).resolve().parents[1] / "examples/quickstart-pytorch-lightning"
    )
    sys.path.insert(0, str(example))
    from pytorchlightning_example import client_app, server_app

    lines = [
        "| strategy | penalty | optimizer | final evaluation loss | round-1 loss |",
        "|---|---|---|---|---|",
    ]
    for strategy, (key, values) in LIGHTNING.items():
        for opt in ("sgd", "adam"):
            for value in values:
                finals, firsts = [], []
                for seed in seeds:
                    overrides = (
                        f"algorithm='{strategy}' {key}={value} optimizer='{opt}' "
                        f"num-server-rounds=10 seed={seed} "
                        f"output-path='{out / 'lightning-final.pt'}'"
                    )
                    config = get_fused_config_from_dir(
                        example, parse_config_args([overrides])
                    )
                    grid = InProcessGrid(client_app.app, num_nodes=4, run_config=config)
                    # the ServerApp's context: run 1, node 0
                    context = Context(1, 0, {}, RecordDict(), config)
                    losses = []
                    original = server_app.make_strategy

                    def recording(ctx, original=original, losses=losses):
                        made = original(ctx)
                        inner = made.aggregate_evaluate

                        def aggregate_evaluate(server_round, replies):
                            result = inner(server_round, replies)
                            if result is not None and "eval_loss" in result:
                                losses.append(float(result["eval_loss"]))
                            return result

                        made.aggregate_evaluate = aggregate_evaluate
                        return made

                    server_app.make_strategy = recording
                    try:
                        server_app.main(grid, context)
                    finally:
                        server_app.make_strategy = original
                    finals.append(losses[-1])
                    firsts.append(losses[0])
                sd = statistics.pstdev(finals) if len(finals) > 1 else 0.0
                row = (
                    f"| {strategy} | {key} = {value:g} | {opt} "
                    f"| {statistics.mean(finals):.4f} ± {sd:.4f} "
                    f"| {statistics.mean(firsts):.4f} |"
                )
                print(row, flush=True)
                lines.append(row)
    (out / "adaptive_optimizers_lightning.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/adaptive_optimizers_lightning.md")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--strategies", nargs="+", default=list(PENALTIES))
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/adaptive_optimizers")
    )
    parser.add_argument("--lightning", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.lightning:
        lightning_table(args.out, args.seeds)
        return
    rows = []
    for strategy in args.strategies:
        key, values = PENALTIES[strategy]
        for opt in OPTIMIZERS:
            for value in values:
                finals, bests, losses, train = [], [], [], []
                for seed in args.seeds:
                    results = run_one(args.out, strategy, key, value, opt, seed)
                    summary = results["summary"]
                    last = results["rounds"][-1]
                    finals.append(summary["final-accuracy"])
                    bests.append(summary["best-accuracy"])
                    losses.append(last["central"]["loss"])
                    train.append(last["train"].get("train-loss", float("nan")))
                spread = statistics.pstdev(finals) if len(finals) > 1 else 0.0
                row = {
                    "strategy": strategy,
                    "penalty": key.split(".")[-1],
                    "value": value,
                    "optimizer": opt,
                    "final-accuracy": round(statistics.mean(finals), 4),
                    "final-accuracy-sd": round(spread, 4),
                    "best-accuracy": round(statistics.mean(bests), 4),
                    "final-central-loss": round(statistics.mean(losses), 4),
                    "last-round-train-loss": round(statistics.mean(train), 4),
                    "seeds": len(finals),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    with (args.out / "adaptive_optimizers.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| strategy | penalty | optimizer | final accuracy | best | central loss "
        "| last-round train loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['penalty']} = {r['value']:g} | {r['optimizer']} "
            f"| {r['final-accuracy']:.4f} ± {r['final-accuracy-sd']:.4f} "
            f"| {r['best-accuracy']:.4f} | {r['final-central-loss']:.4f} "
            f"| {r['last-round-train-loss']:.4f} |"
        )
    (args.out / "adaptive_optimizers.md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(
        1, len(args.strategies), figsize=(5 * len(args.strategies), 4)
    )
    axes = [axes] if len(args.strategies) == 1 else list(axes)
    for ax, strategy in zip(axes, args.strategies, strict=True):
        for opt in OPTIMIZERS:
            mine = [
                r for r in rows if r["strategy"] == strategy and r["optimizer"] == opt
            ]
            xs = [max(r["value"], 1e-4) for r in mine]
            ax.errorbar(
                xs,
                [r["final-accuracy"] for r in mine],
                yerr=[r["final-accuracy-sd"] for r in mine],
                marker="o",
                capsize=3,
                label=f"{opt} (lr {OPTIMIZERS[opt][1].split('=')[1]})",
            )
        ax.set_xscale("log")
        name = PENALTIES[strategy][0].split(".")[-1]
        zero = " (0 drawn at 1e-4)" if 0.0 in PENALTIES[strategy][1] else ""
        ax.set_xlabel(f"{name}{zero}")
        ax.set_ylabel("final central accuracy")
        ax.set_title(f"{strategy}: digits, 20 clients, Dirichlet(0.3), 30 rounds")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "adaptive_optimizers.png", dpi=120)
    print(f"wrote {args.out}/adaptive_optimizers.{{csv,md,png}}")


if __name__ == "__main__":
    main()

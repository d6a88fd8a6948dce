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
array bytes sent + received per round; writes ``non_iid.csv``, ``non_iid.md``
(the table) and ``non_iid.png`` into ``--out``. Finished runs (a complete
``results.json``) are reused, so an interrupted benchmark continues.

Run (the full setting: 15 runs of 200 rounds)::

    python benchmarks/non_iid.py --engine inprocess
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

from flwr_prox_strategies.experiment.sweep import flwr_run, run_inprocess

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
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
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/non_iid-official")
    )
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
                    f"num_rounds={args.rounds}",
                    f"num_clients={args.clients}",
                    f"seed={seed}",
                ]
                results_path = job / "results.json"
                if not (
                    results_path.is_file()
                    and json.loads(results_path.read_text())["summary"].get("complete")
                ):
                    if results_path.is_file():  # an interrupted run starts over
                        for old in job.iterdir():
                            if old.is_file():
                                old.unlink()
                    if args.engine == "flwr":
                        flwr_run(overrides, job, num_supernodes=args.clients)
                    else:
                        run_inprocess(overrides, job, args.clients)
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
    with open(args.out / "non_iid.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fig, axes = plt.subplots(
        1, len(args.partitions), figsize=(8 * len(args.partitions), 5), squeeze=False
    )
    colours = dict(zip(args.strategies, plt.cm.tab10.colors, strict=False))
    for ax, partition in zip(axes[0], args.partitions, strict=True):
        for name in args.strategies:
            for seed in args.seeds:
                xs, ys = zip(*curves[(partition, name, seed)], strict=True)
                ax.plot(
                    xs,
                    ys,
                    color=colours[name],
                    label=name if seed == args.seeds[0] else None,
                    linewidth=0.8,
                    alpha=0.8,
                )
        ax.set(
            title=f"Fashion-MNIST, {partition}, {args.clients} clients, p = 0.1, "
            f"seeds {' '.join(map(str, args.seeds))}",
            xlabel="round",
            ylabel="central test accuracy",
            ylim=(0.5, 0.92),
        )
        for level in (0.80, 0.85):
            ax.axhline(level, color="grey", linewidth=0.5, linestyle="--")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "non_iid.png", dpi=120)
    text = table(rows, args.partitions, args.strategies)
    (args.out / "non_iid.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

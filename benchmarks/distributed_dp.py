"""Distributed DP against central DP at the same user-level (epsilon, delta).

The README's main job (digits, 20 clients, Dirichlet(0.3) label skew, MLP, 30
rounds, every client every round) with uniform means, for FedAvg and SCAFFOLD,
each without DP, with central DP (Flower's server-side fixed clipping: clip each
model update to C, Gaussian noise of std z C / n on the mean) and with
distributed DP under SecAgg+ at 16, 18 and 20 bits (each client clips its whole
upload, model and control changes together, to C and adds its share of discrete
Gaussian noise). Distributed DP charges every round with the fewest contributors
the reconstruction threshold allows (t = 12 of 20 at the default 0.6), so its
noise multiplier is z sqrt(n / t): the sum's noise over the t honest clients the
account counts is then z C, central DP's. Epsilon: central DP's from the
Gaussian's RDP over the rounds (the same orders and conversion as the pack's
accountant; no amplification, every client is sampled), distributed DP's from
the run's own ``ddp-epsilon-total``. ``ddp-20-all`` sets the reconstruction
threshold to every client (no dropout tolerated): the account then counts all
n noise shares and the noise multiplier is central DP's own. Central DP's epsilon covers the model only:
SCAFFOLD's control variates leave un-noised; distributed DP's covers them.

Reports per run: final and last-five-rounds central accuracy, epsilon, seconds per
round; writes ``distributed_dp.csv``, ``distributed_dp_curves.csv``,
``distributed_dp.md`` (means over seeds) and ``distributed_dp.png`` into ``--out``.
Time it with nothing else running on the machine.

Run::

    python benchmarks/distributed_dp.py --rounds 30 --seeds 0 1 2
    python benchmarks/distributed_dp.py --plot-only
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path

import numpy as np
from curves import (
    complete,
    ensure_run,
    read_curves,
    save_figure,
    sweep_parser,
    write_tables,
)

from flwr_prox_strategies.ops.privacy.accounting import (
    DEFAULT_ORDERS,
    rdp_to_epsilon,
)

CLIENTS = 20
THRESHOLD = math.ceil(0.6 * CLIENTS)  # SecAggPlus' default reconstruction_threshold
DELTA = 1e-5
STRATEGIES = {"fedavg": ["strategy=fedavg"], "scaffold": ["strategy=scaffold"]}
SETTING = ["strategy.weighting=uniform", f"num_clients={CLIENTS}"]


def privacy_overrides(kind: str, z: float, clip: float) -> list[str]:
    """The overrides of one privacy setting: none, central or ddp-<bits>."""
    if kind == "none":
        return ["privacy=none"]
    if kind == "secagg":  # plain secure aggregation: the cost beside distributed DP
        return ["privacy=none", "secure_aggregation=secaggplus"]
    if kind == "central":
        return [
            "privacy=central",
            f"privacy.central.noise_multiplier={z}",
            f"privacy.central.clipping_norm={clip}",
        ]
    bits = int(kind.split("-")[1])
    if kind.endswith("-all"):  # every client must survive: t = n, z as central's
        threshold, survive = (
            CLIENTS,
            ["secure_aggregation.reconstruction_threshold=1.0"],
        )
    else:
        threshold, survive = THRESHOLD, []
    return [
        *survive,
        "privacy=distributed",
        f"privacy.distributed.noise_multiplier={z * math.sqrt(CLIENTS / threshold)}",
        f"privacy.distributed.l2_clip={clip}",
        f"privacy.distributed.bits={bits}",
        f"privacy.distributed.delta={DELTA}",
    ]


def central_epsilon(z: float, rounds: int) -> float:
    """The Gaussian mechanism's epsilon after ``rounds`` (RDP alpha / 2 z^2)."""
    alphas = np.ceil(np.asarray(DEFAULT_ORDERS))
    return rdp_to_epsilon(DEFAULT_ORDERS, rounds * alphas / (2 * z**2), DELTA)


def summarise(results: dict, kind: str, z: float) -> dict:
    rows = [r for r in results["rounds"] if r["round"] > 0 and "central" in r]
    accuracy = [r["central"]["accuracy"] for r in rows]
    if kind.startswith("ddp"):
        spent = [r["train"]["ddp-epsilon-total"] for r in rows if "train" in r]
        epsilon = float(max(spent, default=0.0))
    elif kind == "central":
        epsilon = central_epsilon(z, len(rows))
    else:
        epsilon = math.inf
    return {
        "final": accuracy[-1],
        "last5": statistics.mean(accuracy[-5:]),
        "epsilon": epsilon,
        "seconds_per_round": results["summary"]["wall-time-s"] / len(rows),
        "curve": [(r["round"], a) for r, a in zip(rows, accuracy, strict=True)],
    }


def main() -> None:
    parser = sweep_parser(__doc__, 30, "benchmarks/results/distributed_dp", seeds=True)
    parser.add_argument("--z", type=float, default=1.0, help="central noise multiplier")
    parser.add_argument("--clip", type=float, default=2.0, help="L2 clip C")
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["none", "central", "secagg", "ddp-16", "ddp-18", "ddp-20"],
    )
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument(
        "--jobs", type=Path, default=None, help="job folders (kept: a rerun resumes)"
    )
    parser.add_argument(
        "--skip-missing",
        action="store_true",
        help="tabulate the complete jobs in --jobs; start none",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        rows, curves = [], {}
        jobs = args.jobs or Path(tempfile.mkdtemp(prefix="distributed-dp-"))
        for name, strategy in STRATEGIES.items():
            for kind in args.kinds:
                for seed in args.seeds:
                    job = jobs / f"{name}-{kind}-{seed}"
                    overrides = [
                        *strategy,
                        *SETTING,
                        *privacy_overrides(kind, args.z, args.clip),
                        f"num_rounds={args.rounds}",
                        f"seed={seed}",
                    ]
                    failed = job / "failed.txt"
                    done = complete(job / "results.json") or failed.is_file()
                    if args.skip_missing and not done:
                        continue  # a table of the runs made, none started
                    try:
                        if not failed.is_file():
                            ensure_run(job, overrides, "inprocess", CLIENTS)
                    except Exception as err:  # a run that stops is a result too
                        failed.write_text(f"{type(err).__name__}: {err}")
                    path = job / "results.json"
                    found = summarise(json.loads(path.read_text()), kind, args.z)
                    found["stopped"] = (
                        failed.read_text()[:160] if failed.is_file() else ""
                    )
                    curves[(name, kind, seed)] = found.pop("curve")
                    rows.append(
                        {"strategy": name, "privacy": kind, "seed": seed, **found}
                    )
                    print(rows[-1], flush=True)
        write_tables(
            args.out, "distributed_dp", rows, ("strategy", "privacy", "seed"), curves
        )
    table(args.out)
    plot(args.out)


def table(out: Path) -> None:
    """Write ``distributed_dp.md``: means over seeds, one line per setting."""
    import csv

    with open(out / "distributed_dp.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["strategy"], row["privacy"]), []).append(row)
    lines = [
        "| strategy | privacy | seeds | final accuracy | last 5 rounds | epsilon "
        "(delta 1e-5) | s / round | runs stopped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (strategy, kind), found in groups.items():
        mean = {
            key: statistics.mean(float(r[key]) for r in found)
            for key in ("final", "last5", "epsilon", "seconds_per_round")
        }
        epsilon = "-" if math.isinf(mean["epsilon"]) else f"{mean['epsilon']:.2f}"
        stopped = sum(1 for r in found if r.get("stopped"))
        lines.append(
            f"| {strategy} | {kind} | {len(found)} | {mean['final']:.4f} | "
            f"{mean['last5']:.4f} | {epsilon} | {mean['seconds_per_round']:.2f} | "
            f"{stopped} |"
        )
    (out / "distributed_dp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(out: Path) -> None:
    """Write ``distributed_dp.png``: mean accuracy per round, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = read_curves(
        out / "distributed_dp_curves.csv",
        {"strategy": str, "privacy": str, "seed": int},
    )
    names = sorted({key[0] for key in curves})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        kinds = sorted({key[1] for key in curves if key[0] == name})
        for kind in kinds:
            runs = [points for key, points in curves.items() if key[:2] == (name, kind)]
            # A run that stopped (diverged) ends early: the mean over its rounds.
            length = min(len(points) for points in runs)
            rounds = [r for r, _ in runs[0][:length]]
            mean = np.mean([[a for _, a in points[:length]] for points in runs], axis=0)
            ax.plot(rounds, mean, label=kind)
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.set_ylabel("central accuracy (mean over seeds)")
        ax.legend()
    save_figure(fig, out / "distributed_dp.png")


if __name__ == "__main__":
    main()

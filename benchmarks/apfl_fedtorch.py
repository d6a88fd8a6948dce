"""APFL against the APFL authors' own code (FedTorch), same setting, same data split.

Setting: the FedTorch README's APFL command (``run_mpi.py -f -ft apfl -n 10 -d mnist
-lg 0.1 -b 50 -c 20 -k 1.0 -fs local_step -l 10 -r 2 -pa 0.5 -fp``) on Fashion-MNIST:
10 clients, all in every round, pathological split of 2 classes per client, 20
rounds of 10 local SGD steps with B = 50, lr 0.1, weight decay 1e-4 (``run_mpi.py``'s
default), fixed alpha = 0.5, and every client evaluates on its own held-out 20%
(the pack's ``+experiment=personalization``). Both sides train the same MLP
784-200-200-10 (Linear + ReLU, biased head), inputs standardised with the pack's
Fashion-MNIST statistics (mean 0.2860, std 0.3530), and use the *same* client
train / held-out indices: the pack's partition for each seed, exported to
FedTorch. The pack runs APFL with ``strategy.mixing=outputs`` (what FedTorch
mixes: ``alpha f(x; v) + (1 - alpha) f(x; w)``); the pack's default parameter
mixing (the paper's) runs beside it as a second pack source, ``pack-parameters``.

Metrics, every round and for seeds 0, 1, 2: the personalised accuracy and the
global model's accuracy, both on the clients' held-out splits, pooled over the
clients (correct / examples, what FedTorch's trackers compute; the pack's
``personal-accuracy`` and ``accuracy``). The two codes do not evaluate at the
same moment (see "What is evaluated" below); the rows are aligned so that
``round`` = the number of aggregations the evaluated model has seen.

Writes into ``--out`` (default ``benchmarks/results/apfl_fedtorch``):
``apfl_fedtorch.csv`` (round, seed, source, personal-accuracy, global-accuracy),
``apfl_fedtorch.md`` (mean and spread over seeds at a few rounds and the last, mean
over rounds, per-round difference pack - FedTorch) and ``apfl_fedtorch.png``
(per-round curves, band = min..max over seeds). Finished pack runs (a complete
``results.json`` under ``--pack-dir``) are reused.

Run::

    # 1. the pack's runs and the partition files for FedTorch
    python benchmarks/apfl_fedtorch.py --export-partition /tmp/apfl_partition
    # 2. FedTorch, once per seed (commands below, also printed by step 1)
    # 3. tabulate
    python benchmarks/apfl_fedtorch.py --fedtorch-logs /tmp/apfl_fedtorch_logs

How FedTorch was run
--------------------
FedTorch (github.com/MLOPTPSU/FedTorch, commit ab8068d) cloned to /tmp/fedtorch and
patched (``git diff`` kept as /tmp/fedtorch.patch, not in this repository):

* ``prepare_data.py``: Fashion-MNIST read from the idx files in ``$FMNIST_IDX_DIR``
  (no download), x / 255 then standardised with ``$FMNIST_NORMALIZE`` (default
  ``0.2860,0.3530``, the pack's); torchvision imported only if installed.
* ``loader/utils.py``: h5py imported only if installed (EMNIST/Shakespeare only).
* ``dataset.py``: ``--partition_file`` (.npz with ``train_<k>``/``val_<k>``: client
  k's training and held-out indices into the training set) replaces FedTorch's own
  label-sorted split and its random 80/20 held-out split; DataLoaders with
  ``num_workers=0`` instead of 5 (one core).
* ``mlp.py``: ``--mlp_plain True`` builds Linear + ReLU layers and a biased head;
  FedTorch's own MLP has BatchNorm1d (batch statistics also at evaluation),
  Dropout(0.25) and a head without bias, which the pack's MLP cannot build.
* ``parameters.py``: the two flags above.
* ``main_centered.py``: seeds Python's, NumPy's and torch's CPU generators with
  ``--manual_seed`` (FedTorch seeds only CUDA) and sets one torch thread.
* torch 2.x: ``metrics.py`` ``correct[:k].view(-1)`` -> ``.reshape(-1)`` (a
  non-contiguous view fails); ``optimizers/sgd.py`` ``zero_grad`` keeps zeroed
  ``.grad`` tensors (``set_to_none=False``, torch 1.6's behaviour), as the server's
  aggregation adds into ``server_param.grad``, which torch 2.x sets to None.

No change to the training or evaluation code. The single-process
``main_centered.py`` was run (no MPI here: no ``mpirun``, and torch's CPU wheel has
no MPI backend) with ``run_mpi.py``'s arguments for the README command
(``-d fashion_mnist``), ``--on_cuda False --is_distributed False``, and
``--num_comms 21`` instead of 20: the server model after the 20th aggregation is
only evaluated at the start of round 21, whose training is dropped (the first
20 rounds are bit-identical to a ``-c 20`` run with the same seed). For S in 0 1 2::

    cd /tmp/fedtorch && FMNIST_IDX_DIR=<shared/data>/fashion-mnist OMP_NUM_THREADS=1 \\
    python main_centered.py $(python <checkout>/benchmarks/apfl_fedtorch.py --fedtorch-args $S) \\
        > /tmp/apfl_fedtorch_logs/seed$S.log

(``--fedtorch-args S`` prints the arguments: ``FEDTORCH_ARGS`` below plus
``--partition_file``, ``--manual_seed`` and ``--checkpoint``.) For reference,
FedTorch's own MLP (BatchNorm1d with batch statistics, Dropout 0.25, head without
bias) ran the same way with ``--mlp_plain False`` appended, into
``seed$S-own-mlp.log`` (source ``fedtorch-own-mlp``; not the pack's model, so
not in the difference table). Each FedTorch run takes about 85 s on one core, each
pack run about 35 s.

What is evaluated (read from FedTorch's ``centered/apfl.py`` and ``eval_centered.py``)
-------------------------------------------------------------------------------
FedTorch's "Personal validation" of round r is ``alpha f(x; v_k) + (1 - alpha)
f(x; w_k)`` with the client's *local* w_k after its 10 steps, before averaging;
the pack's ``personal-accuracy`` of round r mixes omega_k with the new global
model (after averaging). FedTorch's "Global validation" of round r evaluates the
server model at the *start* of round r (after r - 1 aggregations); the pack's
``accuracy`` of round r is the model after r aggregations: FedTorch's global
accuracy is therefore filed under round r - 1 here (its round 0 is the initial
model).

Other differences, by design: FedTorch's personal step uses w_k *after* its SGD
step (the pack: both from step t); centered FedTorch starts v_k from client k's
own random initial weights (its MPI ``main.py`` and the pack: from the global
initial model); FedTorch's lr is divided by 1.01 per local epoch (0.1 -> about
0.097-0.099 here; the pack: constant 0.1). The global models follow the same
algorithm in both (FedAvg of the w_k, uniform weights; alpha fixed, so the pack's
two mixings give the same global model).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from flwr_prox_strategies.experiment.config import compose_config
from flwr_prox_strategies.experiment.data import (
    load_data,
    partition_indices,
    split_held_out,
)
from flwr_prox_strategies.experiment.sweeps.sweep import run_inprocess

SEEDS = (0, 1, 2)
ROUNDS = 20
CLIENTS = 10
ALPHA = 0.5
COMMON = [
    "+experiment=personalization",
    "strategy=apfl",
    f"strategy.alpha={ALPHA}",
    "strategy.weighted_average=false",  # FedTorch has no weighted final models
    "train.weight_decay=0.0001",  # run_mpi.py's default -w
    f"num_rounds={ROUNDS}",
    f"num_clients={CLIENTS}",
]
# source -> extra overrides of the pack
PACK = {
    "pack": ["strategy.mixing=outputs"],
    "pack-parameters": ["strategy.mixing=parameters"],
}
FEDTORCH = "fedtorch"
# FedTorch's own MLP (BatchNorm, Dropout 0.25, head without bias), for reference:
# logs seed<S>-own-mlp.log, run with `--mlp_plain False` appended
FEDTORCH_OWN_MLP = "fedtorch-own-mlp"
FEDTORCH_LOGS = {FEDTORCH: "seed{seed}.log", FEDTORCH_OWN_MLP: "seed{seed}-own-mlp.log"}
# run_mpi.py's arguments for the README's APFL command, on Fashion-MNIST and CPU
FEDTORCH_ARGS = {
    "--avg_model": True,
    "--debug": True,
    "--eval_freq": 1,
    "--stop_criteria": "epoch",
    "--num_epochs": ROUNDS,  # num_epochs_per_comm * num_comms
    "--on_cuda": False,
    "--num_workers": CLIENTS,
    "--blocks": CLIENTS,
    "--world": ",".join(str(i) for i in range(CLIENTS)),
    "--weight_decay": 1e-4,
    "--use_nesterov": False,
    "--in_momentum": False,
    "--in_momentum_factor": 0.9,
    "--out_momentum": False,
    "--out_momentum_factor": 0.9,
    "--local_step": 10,
    "--turn_on_local_step_from": 0,
    "--drop_rate": 0.25,  # unused by the plain MLP
    "--arch": "mlp",
    "--mlp_num_layers": 2,
    "--mlp_hidden_size": 200,
    "--mlp_plain": True,  # patch: the pack's 784-200-200-10 MLP
    "--data": "fashion_mnist",
    "--data_dir": "./data",
    "--batch_size": 50,
    "--partition_data": True,
    "--reshuffle_per_epoch": False,
    "--iid_data": False,
    "--num_class_per_client": 2,
    "--unbalanced": False,
    "--federated": True,
    "--federated_type": "apfl",
    "--federated_sync_type": "local_step",
    # one round more than the README's -c 20: the server model after the 20th
    # aggregation is only evaluated at the start of round 21 (its training is dropped)
    "--num_comms": ROUNDS + 1,
    "--online_client_rate": 1.0,
    "--num_epochs_per_comm": 1,
    "--fed_personal": True,
    "--quantized": False,
    "--compressed": False,
    "--federated_drfa": False,
    "--fed_adaptive_alpha": False,
    "--fed_personal_alpha": ALPHA,
    "--lr_schedule_scheme": "custom_multistep",
    "--lr_change_epochs": ",".join(str(e) for e in range(1, ROUNDS)),
    "--lr_warmup": False,
    "--lr": 0.1,
    "--lr_scale_at_sync": 1.0,
    "--lr_warmup_epochs": 3,
    "--lr_decay": 1.01,
    "--is_distributed": False,  # single process: no torch.distributed group
}
SHOWN_ROUNDS = (1, 5, 10, 15)
LINE = re.compile(
    r"(Personal|Global) performance for validation .*?Prec@1: ([\d.]+).*?Comm: (\d+)"
)

Curves = dict[str, dict[int, dict[int, dict[str, float]]]]  # source, seed, round


def pack_overrides(source: str, seed: int) -> list[str]:
    return [*COMMON, *PACK[source], f"seed={seed}"]


def fedtorch_args(seed: int, partition_dir: Path) -> list[str]:
    args = dict(FEDTORCH_ARGS)
    args["--partition_file"] = str(partition_dir / f"partition-seed{seed}.npz")
    args["--manual_seed"] = seed
    args["--checkpoint"] = f"/tmp/fedtorch_checkpoint/seed{seed}"
    return [str(part) for key, value in args.items() for part in (key, value)]


def run_pack(pack_dir: Path, seeds: Sequence[int]) -> None:
    for source in PACK:
        for seed in seeds:
            job = pack_dir / source / f"seed{seed}"
            path = job / "results.json"
            if path.is_file() and json.loads(path.read_text())["summary"].get(
                "complete"
            ):
                continue
            print(f"running {source} seed {seed} -> {job}", flush=True)
            run_inprocess(pack_overrides(source, seed), job, CLIENTS, threads=1)


def export_partition(out: Path, seeds: Sequence[int]) -> None:
    """Write every client's training and held-out indices, as the pack splits them."""
    out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        cfg = compose_config(pack_overrides("pack", seed))
        fraction = float(cfg.evaluate.local_test_fraction)
        train = load_data(cfg).train
        arrays = {}
        for client, part in enumerate(partition_indices(cfg, CLIENTS)):
            part = np.asarray(part)
            count = len(part)
            held = min(max(1, round(count * fraction)), count - 1)
            order = np.random.default_rng(int(cfg.seed) + client).permutation(count)
            arrays[f"train_{client}"] = part[np.sort(order[held:])]
            arrays[f"val_{client}"] = part[np.sort(order[:held])]
            # the same split as the pack's clients (server.make_client)
            mine, theirs = split_held_out(
                train.subset(part), fraction, seed=int(cfg.seed) + client
            )
            assert np.array_equal(train.subset(arrays[f"train_{client}"]).x, mine.x)
            assert np.array_equal(train.subset(arrays[f"val_{client}"]).x, theirs.x)
        np.savez(out / f"partition-seed{seed}.npz", **arrays)  # type: ignore[arg-type]
        sizes = [len(arrays[f"train_{c}"]) for c in range(CLIENTS)]
        print(f"seed {seed}: train sizes {sizes} -> {out}", flush=True)


def read_pack(pack_dir: Path, seeds: Sequence[int]) -> Curves:
    curves: Curves = {}
    for source in PACK:
        for seed in seeds:
            path = pack_dir / source / f"seed{seed}" / "results.json"
            if not path.is_file():
                continue
            for record in json.loads(path.read_text())["rounds"]:
                ev = record.get("evaluate") or {}
                if "personal-accuracy" not in ev:
                    continue
                curves.setdefault(source, {}).setdefault(seed, {})[record["round"]] = {
                    "personal": ev["personal-accuracy"],
                    "global": ev["accuracy"],
                }
    return curves


def read_fedtorch(logs: Path, seeds: Sequence[int]) -> Curves:
    """Parse FedTorch's stdout (``seed<S>.log``): the validation lines of each round."""
    curves: Curves = {}
    for (source, name), seed in itertools.product(FEDTORCH_LOGS.items(), seeds):
        path = logs / name.format(seed=seed)
        if not path.is_file():
            continue
        rounds: dict[int, dict[str, float]] = defaultdict(dict)
        for match in LINE.finditer(path.read_text()):
            kind, prec, comm = (
                match.group(1),
                float(match.group(2)),
                int(match.group(3)),
            )
            if kind == "Personal":
                rounds[comm]["personal"] = prec / 100
            else:  # the server model at the start of round comm: comm - 1 rounds
                rounds[comm - 1]["global"] = prec / 100
        # the personalised model of the extra round 21 is dropped
        rounds = {r: v for r, v in rounds.items() if r <= ROUNDS}
        if rounds:
            curves.setdefault(source, {})[seed] = dict(sorted(rounds.items()))
    return curves


def spread(values: list[float], *, signed: bool = False) -> str:
    """Mean ± std (sample) in percent; '-' for no values."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * mean:{'+' if signed else ''}.2f} ± {100 * sd:.2f}"


def series(curves: Curves, source: str, metric: str) -> dict[int, list[float]]:
    """Round -> values over seeds."""
    out: dict[int, list[float]] = defaultdict(list)
    for rounds in curves.get(source, {}).values():
        for rnd, values in rounds.items():
            if metric in values:
                out[rnd].append(values[metric])
    return dict(sorted(out.items()))


def write_csv(curves: Curves, path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["round", "seed", "source", "personal-accuracy", "global-accuracy"]
        )
        for source, seeds in curves.items():
            for seed, rounds in sorted(seeds.items()):
                for rnd, values in rounds.items():
                    writer.writerow(
                        [
                            rnd,
                            seed,
                            source,
                            values.get("personal", ""),
                            values.get("global", ""),
                        ]
                    )


def paired(curves: Curves, source: str, metric: str, rnd: int) -> list[float]:
    """Per-seed differences source - FedTorch at one round (same split per seed)."""
    ours, theirs = curves.get(source, {}), curves.get(FEDTORCH, {})
    return [
        ours[seed][rnd][metric] - theirs[seed][rnd][metric]
        for seed in sorted(set(ours) & set(theirs))
        if metric in ours[seed].get(rnd, {}) and metric in theirs[seed].get(rnd, {})
    ]


def write_markdown(curves: Curves, path: Path) -> str:
    sources = [s for s in [*PACK, *FEDTORCH_LOGS] if s in curves]
    seeds = sorted({seed for runs in curves.values() for seed in runs})
    lines = [
        "# APFL: the pack against FedTorch",
        "",
        f"Fashion-MNIST, {CLIENTS} clients (2 classes each, the pack's split, the same",
        f"for both codes), {ROUNDS} rounds of 10 steps, B = 50, lr 0.1, weight decay",
        f"1e-4, alpha = {ALPHA} fixed, MLP 784-200-200-10. Accuracy (%) on the clients'",
        "held-out 20%, pooled over clients; mean ± std over seeds "
        + ", ".join(str(s) for s in seeds)
        + ".",
        "`round` = aggregations the evaluated model has seen. `pack` mixes outputs",
        "as FedTorch does (`strategy.mixing=outputs`); `pack-parameters` is the pack's",
        "default, the paper's parameter mixing (same global model: alpha is fixed).",
        "Personalised: FedTorch mixes with the client's local w_k before averaging,",
        "the pack with the new global model. Mean over rounds: rounds 1 to "
        + f"{ROUNDS}. `{FEDTORCH_OWN_MLP}`: FedTorch with its own MLP (BatchNorm",
        "with batch statistics, Dropout 0.25, no head bias), for reference only.",
        "",
    ]
    rounds = range(1, ROUNDS + 1)
    for metric, title in (("personal", "Personalised"), ("global", "Global model")):
        per_source = {s: series(curves, s, metric) for s in sources}
        shown = [r for r in rounds if r in SHOWN_ROUNDS or r == ROUNDS]
        head = ["source", *[f"round {r}" for r in shown], "mean over rounds"]
        lines += [f"## {title} accuracy", "", "| " + " | ".join(head) + " |"]
        lines.append("|" + "---|" * len(head))
        for source in sources:
            data = per_source[source]
            # mean over rounds, per seed, then spread over seeds
            per_seed = [
                statistics.fmean(
                    runs[r][metric] for r in rounds if metric in runs.get(r, {})
                )
                for runs in curves[source].values()
            ]
            cells = [spread(data.get(r, [])) for r in shown]
            lines.append("| " + " | ".join([source, *cells, spread(per_seed)]) + " |")
        lines.append("")
    ours = [s for s in PACK if s in curves]
    if FEDTORCH in curves and ours:
        lines += [
            "## Per-round difference pack - FedTorch",
            "",
            "Percentage points, mean ± std over seeds of the per-seed differences",
            "(each seed: the same split for both codes, different initial weights).",
            "",
            "| round | "
            + " | ".join(f"{s} personal | {s} global" for s in ours)
            + " |",
            "|---|" + "---|---|" * len(ours),
        ]
        totals: dict[tuple[str, str], list[float]] = defaultdict(list)
        for rnd in rounds:
            cells = [str(rnd)]
            for source in ours:
                for metric in ("personal", "global"):
                    diffs = paired(curves, source, metric, rnd)
                    if diffs:
                        totals[(source, metric)].append(statistics.fmean(diffs))
                    cells.append(spread(diffs, signed=True))
            lines.append("| " + " | ".join(cells) + " |")
        for label, absolute in (("mean", False), ("mean of abs", True)):
            cells = [label]
            for source in ours:
                for metric in ("personal", "global"):
                    diffs = totals[(source, metric)]
                    if not diffs:
                        cells.append("-")
                    elif absolute:
                        cells.append(f"{100 * statistics.fmean(map(abs, diffs)):.2f}")
                    else:
                        cells.append(f"{100 * statistics.fmean(diffs):+.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    text = "\n".join(lines)
    path.write_text(text)
    return text


def plot(curves: Curves, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = {"pack": "C0", "pack-parameters": "C2", FEDTORCH: "C3"}
    styles = {"pack-parameters": "--", FEDTORCH_OWN_MLP: ":"}
    for ax, metric, title in zip(
        axes,
        ("personal", "global"),
        ("personalised model", "global model"),
        strict=True,
    ):
        for source in curves:
            data = series(curves, source, metric)
            if not data:
                continue
            xs = list(data)
            mean = [statistics.fmean(v) for v in data.values()]
            low = [min(v) for v in data.values()]
            high = [max(v) for v in data.values()]
            colour = colours.get(source)
            ax.plot(
                xs,
                mean,
                styles.get(source, "-"),
                label=source,
                color=colour,
                linewidth=1.4,
            )
            ax.fill_between(xs, low, high, color=colour, alpha=0.2)
        ax.set(
            title=f"APFL, Fashion-MNIST 2 classes/client: {title}",
            xlabel="round (aggregations seen)",
            ylabel="accuracy on clients' held-out 20%",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--pack-dir", type=Path, default=Path("/tmp/apfl_pack"))
    parser.add_argument(
        "--export-partition",
        type=Path,
        metavar="DIR",
        help="write partition-seed<S>.npz (client train/held-out indices) for FedTorch",
    )
    parser.add_argument(
        "--fedtorch-logs",
        type=Path,
        metavar="DIR",
        help="FedTorch's stdout per seed, DIR/seed<S>.log",
    )
    parser.add_argument(
        "--fedtorch-args",
        type=int,
        metavar="SEED",
        help="print main_centered.py's arguments for this seed and exit",
    )
    parser.add_argument(
        "--partition-dir",
        type=Path,
        default=Path("/tmp/apfl_partition"),
        help="where --fedtorch-args points FedTorch's --partition_file",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/apfl_fedtorch")
    )
    args = parser.parse_args()
    if args.fedtorch_args is not None:
        print(" ".join(fedtorch_args(args.fedtorch_args, args.partition_dir)))
        return
    if args.export_partition is not None:
        export_partition(args.export_partition, args.seeds)
        for seed in args.seeds:
            print(
                "cd /tmp/fedtorch && FMNIST_IDX_DIR=<shared/data>/fashion-mnist "
                "python main_centered.py "
                + " ".join(fedtorch_args(seed, args.export_partition))
                + f" > LOGS/seed{seed}.log"
            )
    run_pack(args.pack_dir, args.seeds)
    curves = read_pack(args.pack_dir, args.seeds)
    if args.fedtorch_logs is not None:
        curves.update(read_fedtorch(args.fedtorch_logs, args.seeds))
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(curves, args.out / "apfl_fedtorch.csv")
    print(write_markdown(curves, args.out / "apfl_fedtorch.md"))
    plot(curves, args.out / "apfl_fedtorch.png")


if __name__ == "__main__":
    main()

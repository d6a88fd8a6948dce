"""FedEPM's server step at scale, in-process: the sorted centre against the hinted one.

Reproduces the server step of ``benchmarks/scale.py``'s ``pack:fedepm+seen``
case without the Flower engine: the MLP 784-200-200-10 (199,210 float32
parameters), 10 clients sampled a round, FedEPM's ``eta=10`` and ``lam =
eta/2``. Each round the 10 repliers' rows of the table are replaced (new
clients add rows, as the strategy's ``with_rows``), then the centre is taken
twice on the same table: by the sort-based code the pack had before (a
verbatim copy below: every coordinate sorted every round) and by
:func:`table_center` with the current model as its ``hint``. Prints seconds per
round side by side, the largest difference and whether the centres are the
same bits (float64, and after the cast to the model's float32).

The uploads are the current model plus a perturbation: ``sparse`` changes 5%
of the coordinates (FedEPM's l1 threshold leaves the others as they were:
ties with the model, as real uploads give) by N(0, 0.01); ``dense`` changes
every coordinate by N(0, 0.001) (no ties at all). ``--strategy`` also times the
strategy's whole server rule (:meth:`FedEPM.server_update` through the pack's
read-only state wrapper: ``with_rows``, the centre of every tensor, the cast),
old centre against new on the same replies.

``--adult`` runs FedEPM on Adult (``benchmarks/fedepm_adult.py``'s setting, 9
runs) with both centres and compares F/m per round, and with the committed CSV.
Results under ``benchmarks/results/fedepm_server/`` (``--out``). The old centre
is most of the run (seconds a round at 10,000 clients by round 30)::

    python benchmarks/fedepm_server.py --strategy
    python benchmarks/fedepm_server.py --nodes 10000 --kinds sparse
    python benchmarks/fedepm_server.py --nodes 10000 --kinds --strategy
    python benchmarks/fedepm_server.py --nodes --adult
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flwr_prox_strategies.algorithms import fedepm as fedepm_module
from flwr_prox_strategies.core.contract.frozen import call_rule
from flwr_prox_strategies.core.transport.keys import CLIENT_KEY_METRIC
from flwr_prox_strategies.core.transport.records import dict_to_record
from flwr_prox_strategies.ops.elastic_net import table_center, with_rows

OUT = Path(__file__).resolve().parent / "results" / "fedepm_server"
PER_ROUND = 10
ETA = 10.0  # benchmarks/scale.py's FEDEPM overrides
LAM = ETA / 2  # FedEPM's default


# ----------------------------------------------------------- the old centre
# Verbatim from the pack before the hint (sorting every coordinate every round).
def old_elastic_net_center(uploads: np.ndarray, lam: float, eta: float) -> np.ndarray:
    """The sorted centre as it was (reference)."""
    z = np.asarray(uploads, dtype=np.float64)
    m = z.shape[0]
    flat = np.sort(z.reshape(m, -1), axis=0)
    if eta == 0:
        return flat[(m - 1) // 2].reshape(z.shape[1:])
    with np.errstate(invalid="ignore", over="ignore"):
        total = flat.sum(axis=0)
        q = np.arange(1, m + 1, dtype=np.float64)[:, None]
        right_derivative = lam * (2 * q - m) + eta * (m * flat - total)
        first = np.argmax(right_derivative >= 0, axis=0)
        interior = (total - (lam / eta) * (2 * first - m)) / m
    kink = flat[first, np.arange(flat.shape[1])]
    return np.minimum(interior, kink).reshape(z.shape[1:])


def old_weighted_center(
    uploads: np.ndarray, w: np.ndarray, lam: float, eta: float, block: int = 1 << 14
) -> np.ndarray:
    """The sorted weighted centre as it was (reference)."""
    z = np.asarray(uploads)
    r, total_weight = z.shape[0], int(w.sum())
    flat = z.reshape(r, -1)
    out = np.empty(flat.shape[1], dtype=np.float64)
    weight = w.astype(np.float64)
    for start in range(0, flat.shape[1], block):
        cols = np.asarray(flat[:, start : start + block], dtype=np.float64)
        order = np.argsort(cols, axis=0, kind="stable")
        ordered = np.take_along_axis(cols, order, axis=0)
        cumulative = np.cumsum(weight[order], axis=0)
        columns = np.arange(cols.shape[1])
        if eta == 0:
            first = np.argmax(cumulative >= (total_weight - 1) // 2 + 1, axis=0)
            out[start : start + block] = ordered[first, columns]
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            total = weight @ cols
            right_derivative = lam * (2 * cumulative - total_weight) + eta * (
                total_weight * ordered - total
            )
            first = np.argmax(right_derivative >= 0, axis=0)
            before = cumulative[first, columns] - weight[order[first, columns]]
            interior = (
                total - (lam / eta) * (2 * before - total_weight)
            ) / total_weight
        out[start : start + block] = np.minimum(interior, ordered[first, columns])
    return out.reshape(z.shape[1:])


def old_table_center(
    table: np.ndarray,
    lam: float,
    eta: float,
    unseen: int | None,
    hint: np.ndarray | None = None,
) -> np.ndarray:
    """The old ``table_center`` (ignores ``hint``, as it did not take one)."""
    if unseen is None:
        return old_elastic_net_center(table, lam, eta)
    if unseen > 0:
        weights = np.ones(len(table), dtype=np.int64)
        weights[0] = unseen
        return old_weighted_center(table, weights, lam, eta)
    return old_elastic_net_center(table[1:], lam, eta)


# --------------------------------------------------------------- the tables
def mlp_model(seed: int = 0) -> dict[str, np.ndarray]:
    """The scale benchmark's MLP 784-200-200-10 at torch's initialisation."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Linear(784, 200),
        torch.nn.ReLU(),
        torch.nn.Linear(200, 200),
        torch.nn.ReLU(),
        torch.nn.Linear(200, 10),
    )
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def upload(
    rng: np.random.Generator, model: dict[str, np.ndarray], kind: str
) -> dict[str, np.ndarray]:
    """A client's upload: the model, perturbed as ``kind`` says (float32)."""
    out = {}
    for name, x in model.items():
        if kind == "sparse":
            change = rng.normal(size=x.shape) * 0.01
            change[rng.random(x.shape) >= 0.05] = 0.0
        else:
            change = rng.normal(size=x.shape) * 0.001
        out[name] = (x + change).astype(np.float32)
    return out


def compare(old: dict, new: dict) -> dict[str, Any]:
    """Largest |difference| and bit-identity, in float64 and after the cast."""
    diff = max(float(np.max(np.abs(old[k] - new[k]))) for k in old)
    same64 = all(np.array_equal(old[k], new[k]) for k in old)
    same32 = all(
        np.array_equal(old[k].astype(np.float32), new[k].astype(np.float32))
        for k in old
    )
    return {"max-abs-diff": diff, "same-bits-f64": same64, "same-bits-f32": same32}


def centre_rounds(
    nodes: int, rounds: int, table: str, kind: str, seed: int
) -> list[dict[str, Any]]:
    """Time the old and the new centre on each round's table; return the rows."""
    rng = np.random.default_rng(seed)
    model = mlp_model(seed)
    start = dict(model)
    uploads = {
        k: np.repeat(v[None], nodes if table == "dense" else 1, 0)
        for k, v in model.items()
    }
    first_row = 0 if table == "dense" else 1
    slots: dict[int, int] = {}
    rows = []
    for r in range(1, rounds + 1):
        chosen = rng.choice(nodes, PER_ROUND, replace=False)
        replies = [upload(rng, model, kind) for _ in chosen]
        where = [slots.setdefault(int(c), first_row + len(slots)) for c in chosen]
        tick = time.perf_counter()
        uploads = {
            k: with_rows(t, len(slots) + first_row, where, [u[k] for u in replies])
            for k, t in uploads.items()
        }
        copy_s = time.perf_counter() - tick
        unseen = None if table == "dense" else nodes - len(slots)
        tick = time.perf_counter()
        old = {k: old_table_center(t, LAM, ETA, unseen) for k, t in uploads.items()}
        old_s = time.perf_counter() - tick
        tick = time.perf_counter()
        new = {
            k: table_center(t, LAM, ETA, unseen, model[k]) for k, t in uploads.items()
        }
        new_s = time.perf_counter() - tick
        row = {
            "nodes": nodes,
            "table": table,
            "uploads": kind,
            "round": r,
            "rows": len(next(iter(uploads.values()))),
            "with-rows-s": copy_s,
            "old-s": old_s,
            "new-s": new_s,
            **compare(old, new),
            "at-start-frac": float(
                np.mean(np.concatenate([(new[k] == start[k]).ravel() for k in new]))
            ),
        }
        rows.append(row)
        print(
            f"{nodes:>6} {table:>5} {kind:>6} round {r:>2} rows {row['rows']:>5}: "
            f"old {old_s:6.3f} s  new {new_s:6.3f} s  x{old_s / new_s:5.1f}  "
            f"max|diff| {row['max-abs-diff']:.1e}  same bits "
            f"{row['same-bits-f64']}/{row['same-bits-f32']}",
            flush=True,
        )
        model = {k: new[k].astype(np.float32) for k in new}
    return rows


def strategy_rounds(nodes: int, rounds: int, kind: str, seed: int) -> list[dict]:
    """Time FedEPM.server_update (seen table) with the old and the new centre."""
    rng = np.random.default_rng(seed)
    model = mlp_model(seed)
    runs: dict[str, Any] = {}
    for label in ("old", "new"):
        strategy = fedepm_module.FedEPM(
            num_clients=nodes,
            rho=PER_ROUND / nodes,
            k0=1,
            eta=ETA,
            noise=0.0,
            table="seen",
        )
        strategy.global_arrays = dict_to_record(model)
        runs[label] = {
            "strategy": strategy,
            "state": {"uploads": {k: v[None] for k, v in model.items()}, "slots": {}},
        }
    rows = []
    centre = fedepm_module.table_center
    try:
        for r in range(1, rounds + 1):
            chosen = rng.choice(nodes, PER_ROUND, replace=False)
            current = runs["new"]["strategy"].global_arrays.to_numpy_ndarrays()
            base = dict(zip(model, current, strict=True))
            replies = [
                SimpleNamespace(
                    metrics={CLIENT_KEY_METRIC: int(c)},
                    arrays={"arrays": upload(rng, base, kind)},
                )
                for c in chosen
            ]
            seconds, arrays = {}, {}
            for label in ("old", "new"):
                fedepm_module.table_center = (
                    old_table_center if label == "old" else centre
                )
                run = runs[label]
                strategy = run["strategy"]
                tick = time.perf_counter()
                update = call_rule(
                    partial(strategy.server_update, r, replies=replies),
                    run["state"],
                    "FedEPM",
                    strategy.state_fields,
                )
                seconds[label] = time.perf_counter() - tick
                run["state"] = update.state
                strategy.global_arrays = update.arrays
                arrays[label] = update.arrays.to_numpy_ndarrays()
            same = all(
                np.array_equal(a, b)
                for a, b in zip(arrays["old"], arrays["new"], strict=True)
            )
            rows.append(
                {
                    "nodes": nodes,
                    "uploads": kind,
                    "round": r,
                    "old-s": seconds["old"],
                    "new-s": seconds["new"],
                    "same-model": same,
                }
            )
            print(
                f"server_update {nodes:>6} {kind:>6} round {r:>2}: old "
                f"{seconds['old']:6.3f} s  new {seconds['new']:6.3f} s  "
                f"same model {same}",
                flush=True,
            )
    finally:
        fedepm_module.table_center = centre
    return rows


def adult_check(splits: list[int], k0s: list[int]) -> list[dict[str, Any]]:
    """FedEPM on Adult (``benchmarks/fedepm_adult.py``'s run) with both centres.

    Returns per (split, k0): the largest |F/m difference| over the rounds between
    the old and the new centre, and between the new run and the committed
    ``fedepm_adult.csv`` (final F/m and F/m at round 15).
    """
    spec = importlib.util.spec_from_file_location(
        "fedepm_adult", Path(__file__).resolve().parent / "fedepm_adult.py"
    )
    assert spec is not None and spec.loader is not None
    adult = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adult)
    committed = {}
    with open(OUT.parent / "fedepm_adult" / "fedepm_adult.csv", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["method"] == "FedEPM":
                committed[int(row["split"]), int(row["k0"])] = row
    rows = []
    centre = fedepm_module.table_center
    for split in splits:
        for k0 in k0s:
            traces = {}
            try:
                for label in ("old", "new"):
                    fedepm_module.table_center = (
                        old_table_center if label == "old" else centre
                    )
                    trace, *_ = adult.run("FedEPM", k0, split, 20, 0.1, 100, 0.5)
                    traces[label] = np.array([t["f/m"] for t in trace])
            finally:
                fedepm_module.table_center = centre
            new = traces["new"]
            row = {
                "split": split,
                "k0": k0,
                "max |f/m old - new|": float(np.max(np.abs(traces["old"] - new))),
            }
            if (split, k0) in committed:
                saved = committed[split, k0]
                row["|f/m final - committed|"] = abs(
                    new[-1] - float(saved["f/m final"])
                )
                row["|f/m round 15 - committed|"] = abs(
                    new[min(15, len(new) - 1)] - float(saved["f/m at round 15"])
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def summary(rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    """Markdown lines: per case, mean seconds a round old and new, worst diff."""
    lines = [
        "| case | rounds | old s/round (mean, max) | new s/round (mean, max) | "
        "speed-up | max abs diff | same bits f64 / f32 |",
        "|---|---|---|---|---|---|---|",
    ]
    cases: dict[tuple, list[dict]] = {}
    for row in rows:
        cases.setdefault(tuple(row[k] for k in keys), []).append(row)
    for case, group in cases.items():
        old = [g["old-s"] for g in group]
        new = [g["new-s"] for g in group]
        diff = max(g.get("max-abs-diff", 0.0) for g in group)
        same64 = sum(g.get("same-bits-f64", g.get("same-model", False)) for g in group)
        same32 = sum(g.get("same-bits-f32", g.get("same-model", False)) for g in group)
        lines.append(
            f"| {' '.join(map(str, case))} | {len(group)} | "
            f"{np.mean(old):.3f}, {max(old):.3f} | {np.mean(new):.3f}, {max(new):.3f} "
            f"| x{np.mean(old) / np.mean(new):.1f} | {diff:.1e} | "
            f"{same64}/{len(group)} / {same32}/{len(group)} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="*",
        default=[10_000, 1_000],
        help="none: only the Adult check (with --adult)",
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--kinds",
        nargs="*",
        default=["sparse", "dense"],
        help="uploads of the centre's tables; none: skip them (--strategy only)",
    )
    parser.add_argument(
        "--dense-table-nodes",
        type=int,
        default=1_000,
        help="also time the dense table at this many nodes and fewer",
    )
    parser.add_argument("--tables", nargs="+", default=["seen", "dense"])
    parser.add_argument("--strategy", action="store_true")
    parser.add_argument(
        "--adult",
        action="store_true",
        help="also run FedEPM on Adult with both centres (about 10 s a run)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict] = []
    for nodes in args.nodes:
        tables = [
            t for t in args.tables if t == "seen" or nodes <= args.dense_table_nodes
        ]
        for table in tables:
            for kind in args.kinds:
                rows += centre_rounds(nodes, args.rounds, table, kind, args.seed)
    strategy_rows: list[dict] = []
    if args.strategy:
        for nodes in args.nodes:
            strategy_rows += strategy_rounds(nodes, args.rounds, "sparse", args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.adult:
        adult_rows = adult_check([0, 1, 2], [4, 10, 20])
        (args.out / "adult.json").write_text(json.dumps(adult_rows, indent=1))
    lines = ["# FedEPM's server step: sorted centre vs hinted centre", ""]
    if rows:
        (args.out / "centre.json").write_text(json.dumps(rows, indent=1))
        lines += summary(rows, ("nodes", "table", "uploads"))
    if strategy_rows:
        (args.out / "server_update.json").write_text(
            json.dumps(strategy_rows, indent=1)
        )
        lines += ["", "FedEPM.server_update (seen table, sparse uploads):", ""]
        lines += summary(strategy_rows, ("nodes", "uploads"))
    if rows or strategy_rows:
        (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

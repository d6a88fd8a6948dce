"""The synthetic federations' statistics, the pack's over seeds beside the official files.

The FedProx authors ship one draw of each federation (``data/synthetic_*`` in
litian96/FedProx, generated without a seed; only the test files are small enough
to keep). This script prints, per federation, statistics of the clients' test
splits for the pack's generator over ``--seeds`` (mean and range) and, with
``--official DIR`` (a checkout of litian96/FedProx), for the official file:

* samples: the pooled test split's size (10% of each client's samples);
* label skew: mean over clients of the total-variation distance between the
  client's label shares and the pooled ones (0: every client alike);
* majority share: mean over clients of their most frequent label's share;
* input spread: variance over clients of their mean input, averaged over the 60
  coordinates (the generator's ``1 + beta^2``, plus the sampling noise of a small
  test split).

Run::

    python benchmarks/synthetic_stats.py --official /path/to/FedProx
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from flwr_prox_strategies.task.synthetic import load_synthetic

FEDERATIONS = {
    "synthetic_iid": {"iid": True, "alpha": 0.0, "beta": 0.0},
    "synthetic_0_0": {"alpha": 0.0, "beta": 0.0},
    "synthetic_0.5_0.5": {"alpha": 0.5, "beta": 0.5},
    "synthetic_1_1": {"alpha": 1.0, "beta": 1.0},
}
COLUMNS = ("samples", "label skew", "majority share", "input spread")


def statistics(xs: list[np.ndarray], ys: list[np.ndarray]) -> tuple[float, ...]:
    pooled = np.bincount(np.concatenate(ys), minlength=10)
    pooled = pooled / pooled.sum()
    shares = [np.bincount(y, minlength=10) / len(y) for y in ys]
    skew = np.mean([0.5 * np.abs(s - pooled).sum() for s in shares])
    majority = np.mean([s.max() for s in shares])
    spread = np.var(np.stack([x.mean(axis=0) for x in xs]), axis=0).mean()
    return float(sum(len(y) for y in ys)), float(skew), float(majority), float(spread)


def ours(name: str, seed: int) -> tuple[float, ...]:
    data = load_synthetic(seed=seed, **FEDERATIONS[name])
    owners = data.test_owners
    assert owners is not None
    clients = range(int(owners.max()) + 1)
    return statistics(
        [data.test.x[owners == k] for k in clients],
        [data.test.y[owners == k] for k in clients],
    )


def official(folder: Path, name: str) -> tuple[float, ...] | None:
    path = folder / "data" / name / "data" / "test" / "mytest.json"
    if not path.is_file():
        return None
    users = json.loads(path.read_text())["user_data"].values()
    return statistics(
        [np.asarray(u["x"], dtype=np.float64) for u in users],
        [np.asarray(u["y"]).astype(np.int64) for u in users],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(40)))
    parser.add_argument("--official", type=Path, default=None)
    args = parser.parse_args()
    print(f"| federation | source | {' | '.join(COLUMNS)} |")
    print(f"|---|---|{'---|' * len(COLUMNS)}")
    for name in FEDERATIONS:
        rows = np.array([ours(name, seed) for seed in args.seeds])
        cells = [
            f"{mean:.3g} [{low:.3g}, {high:.3g}]"
            for mean, low, high in zip(
                rows.mean(0), rows.min(0), rows.max(0), strict=True
            )
        ]
        print(
            f"| {name} | pack, seeds {len(args.seeds)}: mean [min, max] | "
            f"{' | '.join(cells)} |"
        )
        theirs = official(args.official, name) if args.official else None
        if theirs is not None:
            print(
                f"| {name} | official file | {' | '.join(f'{v:.3g}' for v in theirs)} |"
            )


if __name__ == "__main__":
    main()

"""Aggregation speed and memory: the pack vs Flower's FedAvg vs the numpy floor.

All three aggregate the same train replies (float32 models):

* ``pack``: ``FedAvg.aggregate_train`` of flwr-prox-strategies, validation
  included (keys, dtypes, shapes, payload headers, finiteness, num-examples);
* ``flower``: ``flwr.serverapp.strategy.FedAvg.aggregate_train``;
* ``floor``: an in-place weighted sum ``acc += w * x`` over arrays already in
  memory (no validation, no deserialisation): the cost of the arithmetic alone.

Run: ``python benchmarks/aggregate.py`` (add ``--quick`` for a small smoke run).
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from flwr_prox_strategies import FedAvg
from flwr_prox_strategies.core.inprocess import InProcessGrid


def make_replies(num_clients: int, size: int, seed: int = 0):
    grid = InProcessGrid(lambda m, c: m, num_nodes=num_clients)
    rng = np.random.default_rng(seed)
    model = ArrayRecord({"w": Array(np.zeros(size, np.float32))})
    pack = FedAvg(min_available_nodes=num_clients)
    messages = list(pack.configure_train(1, model, ConfigRecord(), grid))
    arrays, replies = [], []
    for i, message in enumerate(messages):
        x = rng.standard_normal(size, dtype=np.float32)
        arrays.append(x)
        content = RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(x)}),
                "metrics": MetricRecord({"num-examples": 100 + i}),
            }
        )
        replies.append(Message(content, reply_to=message))
    weights = [100.0 + i for i in range(num_clients)]
    return pack, replies, arrays, weights


def floor(arrays: list[np.ndarray], weights: list[float]) -> np.ndarray:
    total = sum(weights)
    acc = arrays[0] * np.float32(weights[0] / total)
    for x, w in zip(arrays[1:], weights[1:], strict=True):
        acc += np.float32(w / total) * x
    return acc


def measure(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best wall time over ``repeats`` and peak traced allocation (MB)."""
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    gc.collect()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return best, peak / 2**20


def run(num_clients: int, size: int, repeats: int) -> None:
    pack, replies, arrays, weights = make_replies(num_clients, size)
    flower = FlowerFedAvg()
    results = {
        "floor (in-place numpy)": measure(lambda: floor(arrays, weights), repeats),
        "pack FedAvg (validated)": measure(
            lambda: pack.aggregate_train(1, replies), repeats
        ),
        "Flower FedAvg": measure(lambda: flower.aggregate_train(1, replies), repeats),
    }
    ours = pack.aggregate_train(1, replies)[0]["w"].numpy()
    theirs = flower.aggregate_train(1, replies)[0]["w"].numpy()
    reference = floor(arrays, weights)
    model_mb = size * 4 / 2**20
    base = results["floor (in-place numpy)"][0]
    print(f"\n{num_clients} clients x {size:,} float32 (model {model_mb:.0f} MB)")
    print(f"{'method':<26}{'seconds':>10}{'x floor':>10}{'peak MB':>10}{'x model':>10}")
    for name, (seconds, peak) in results.items():
        ratio, per_model = seconds / base, peak / model_mb
        print(
            f"{name:<26}{seconds:>10.3f}{ratio:>10.2f}{peak:>10.0f}{per_model:>10.2f}"
        )
    ours_err = np.abs(ours - reference).max()
    theirs_err = np.abs(theirs - reference).max()
    print(
        f"max |pack - floor| = {ours_err:.2e}, max |Flower - floor| = {theirs_err:.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    args = parser.parse_args()
    if args.quick:
        run(10, 100_000, 1)
        return
    run(100, 1_000_000, 3)
    run(20, 10_000_000, 3)


if __name__ == "__main__":
    main()

"""Aggregation speed and memory: the pack vs Flower's FedAvg vs the numpy floor.

All three aggregate the same train replies (float32 models):

* ``pack``: ``FedAvg.aggregate_train`` of flwr-prox-strategies, validation
  included (keys, dtypes, shapes, payload headers, finiteness, num-examples),
  weights normalised as they are applied (overflow-safe); two variants for
  comparison: the weights divided out at the end (the pack before it was made
  overflow-safe) and a float64 accumulator (the strategies' fallback when a
  float32 average of finite replies still overflows);
* ``flower``: ``flwr.serverapp.strategy.FedAvg.aggregate_train``;
* ``floor``: an in-place weighted sum ``acc += w * x`` over arrays already in
  memory (no validation, no deserialisation): the cost of the arithmetic alone,
  on one thread (numpy's). The pack sweeps a large model with the run's CPU
  share of threads (``sweep_threads``); the row "on one thread" is the pack
  with ``OMP_NUM_THREADS=1``.

Run: ``python benchmarks/aggregate.py`` (add ``--quick`` for a small smoke run).
Each size also checks one hostile round: a reply holding 3e38 (finite float32)
among the others, whose true mean fits float32.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from flwr_prox_strategies import FedAvg
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.ops.aggregate import WeightedMean, sweep_threads


class WeightsAtTheEnd(FedAvg):
    """The pack's average before it was overflow-safe: divide by the total last."""

    def weighted_mean(self, replies, record=None):
        name = record or self.arrayrecord_key
        mean = WeightedMean()  # no total: the weights are applied as given
        mean.add_all(
            [reply.arrays[name] for reply in replies],
            [self.reply_weight(reply) for reply in replies],
        )
        return mean.result()


class Float64Accumulator(FedAvg):
    """The pack's average with a float64 accumulator on every round."""

    def weighted_mean(self, replies, record=None):
        self._accumulate_in = np.float64
        try:
            return super().weighted_mean(replies, record)
        finally:
            self._accumulate_in = None


def make_replies(num_clients: int, size: int, seed: int = 0, hostile: bool = False):
    grid = InProcessGrid(lambda m, c: m, num_nodes=num_clients)
    rng = np.random.default_rng(seed)
    model = ArrayRecord({"w": Array(np.zeros(size, np.float32))})
    pack = FedAvg(min_available_nodes=num_clients)
    messages = list(pack.configure_train(1, model, ConfigRecord(), grid))
    arrays, replies = [], []
    for i, message in enumerate(messages):
        x = rng.standard_normal(size, dtype=np.float32)
        if hostile and i == 0:
            x[: max(1, size // 1000)] = 3e38  # finite; the float32 sum overflows
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


def variant(cls: type[FedAvg], num_clients: int, replies) -> FedAvg:
    """A pack strategy configured for the same round as ``replies``."""
    strategy = cls(min_available_nodes=num_clients)
    grid = InProcessGrid(lambda m, c: m, num_nodes=num_clients)
    model = replies[0].content["arrays"]
    strategy.configure_train(1, model, ConfigRecord(), grid)  # same nodes sampled
    return strategy


def hostile_check(num_clients: int, size: int) -> None:
    """One reply holds 3e38: the pack and Flower give the true mean, finite."""
    pack, replies, arrays, weights = make_replies(num_clients, size, hostile=True)
    total = sum(weights)
    pairs = zip(arrays, weights, strict=True)
    truth = sum(w * x.astype(np.float64) for x, w in pairs) / total
    ours = pack.aggregate_train(1, replies)[0]
    old = variant(WeightsAtTheEnd, num_clients, replies).aggregate_train(1, replies)[0]
    theirs = FlowerFedAvg().aggregate_train(1, replies)[0]["w"].numpy()
    assert ours is not None, "the pack kept the previous model"
    mean = ours["w"].numpy()
    error = np.abs(mean - truth).max() / np.abs(truth).max()
    finite = "finite" if np.isfinite(mean).all() else "NOT finite"
    before = "model kept (round void)" if old is None else "aggregated"
    flower = "finite" if np.isfinite(theirs).all() else "NOT finite"
    print(
        f"hostile round (one reply holds 3e38): pack {finite}, max rel. error vs "
        f"the float64 mean {error:.1e}; weights at the end: {before}; Flower: {flower}"
    )


def one_thread(call: Callable[[], object]) -> object:
    """Return ``call()`` with the sweep confined to one thread (a run's share)."""
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return call()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved


def run(num_clients: int, size: int, repeats: int) -> None:
    pack, replies, arrays, weights = make_replies(num_clients, size)
    at_end = variant(WeightsAtTheEnd, num_clients, replies)
    wide = variant(Float64Accumulator, num_clients, replies)
    flower = FlowerFedAvg()
    results = {
        "floor (in-place numpy)": measure(lambda: floor(arrays, weights), repeats),
        "pack FedAvg (validated)": measure(
            lambda: pack.aggregate_train(1, replies), repeats
        ),
        "  on one thread": measure(
            lambda: one_thread(lambda: pack.aggregate_train(1, replies)), repeats
        ),
        "  weights at the end": measure(
            lambda: at_end.aggregate_train(1, replies), repeats
        ),
        "  float64 accumulator": measure(
            lambda: wide.aggregate_train(1, replies), repeats
        ),
        "Flower FedAvg": measure(lambda: flower.aggregate_train(1, replies), repeats),
    }
    ours = pack.aggregate_train(1, replies)[0]["w"].numpy()
    theirs = flower.aggregate_train(1, replies)[0]["w"].numpy()
    reference = floor(arrays, weights)
    model_mb = size * 4 / 2**20
    base = results["floor (in-place numpy)"][0]
    print(
        f"\n{num_clients} clients x {size:,} float32 (model {model_mb:.0f} MB); "
        f"the pack sweeps with {sweep_threads()} thread(s), the floor with one"
    )
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
    hostile_check(num_clients, size)


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

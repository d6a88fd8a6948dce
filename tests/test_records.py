"""Arrays to and from Flower records: the pack's fast paths equal Flower's."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flwr_prox_strategies import FedAvg
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.core.transport.records import (
    array_view,
    to_array,
    to_ndarrays,
)

CASES = [
    np.zeros(0, np.float32),
    np.array(3.0),
    np.arange(6, dtype=np.int64).reshape(2, 3),
    np.ones((2, 3, 4), np.float16),
    np.array([True, False]),
    np.arange(10, dtype=">f4"),
    np.arange(6.0).reshape(2, 3).T,  # not C-ordered
    np.arange(12.0)[::2],  # strided
    np.zeros((1,) * 32, np.float32),
    np.array([1 + 2j]),
    np.array(["ab", "c"]),
    np.arange(5, dtype=np.uint8),
]


@pytest.mark.parametrize("value", CASES, ids=lambda v: f"{v.dtype}{list(v.shape)}")
def test_to_array_is_flowers_array_byte_for_byte(value: np.ndarray) -> None:
    ours = to_array(value)
    flowers = Array(np.array(value, order="C"))
    assert ours.data == flowers.data
    assert (ours.dtype, tuple(ours.shape), ours.stype) == (
        flowers.dtype,
        tuple(flowers.shape),
        flowers.stype,
    )
    np.testing.assert_array_equal(ours.numpy(), value)
    if value.dtype.kind != "U":
        np.testing.assert_array_equal(array_view(ours), value)


def test_to_ndarrays_equals_flowers_numpy_and_owns_its_arrays() -> None:
    # Flower's own Arrays (np.save, Fortran order kept) and the pack's.
    values = [*CASES, np.asfortranarray(np.arange(6.0).reshape(2, 3))]
    record = ArrayRecord()
    for i, value in enumerate(values):
        record[f"flower-{i}"] = Array(value)
        record[f"pack-{i}"] = to_array(value)
    ours = to_ndarrays(record)
    flowers = [array.numpy() for array in record.values()]
    for got, want in zip(ours, flowers, strict=True):
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert got.flags.f_contiguous == want.flags.f_contiguous
        np.testing.assert_array_equal(got, want)
        assert got.flags.writeable
    before = [array.data for array in record.values()]
    for got in ours:
        if got.size and got.dtype.kind in "fiub":
            got.flat[0] = not got.flat[0] if got.dtype.kind == "b" else got.flat[0] + 1
    assert [array.data for array in record.values()] == before


def test_to_array_copies_so_later_writes_do_not_leak_into_the_record() -> None:
    value = np.arange(4, dtype=np.float32)
    array = to_array(value)
    value[:] = -1
    np.testing.assert_array_equal(array.numpy(), np.arange(4, dtype=np.float32))


def _replies(num: int, size: int) -> tuple[FedAvg, list[Message]]:
    grid = InProcessGrid(lambda m, c: m, num_nodes=num)
    strategy = FedAvg(min_available_nodes=num)
    model = ArrayRecord({"w": Array(np.zeros(size, np.float32))})
    rng = np.random.default_rng(0)
    replies = [
        Message(
            RecordDict(
                {
                    "arrays": ArrayRecord(
                        {"w": Array(rng.standard_normal(size, dtype=np.float32))}
                    ),
                    "metrics": MetricRecord({"num-examples": 10 + i}),
                }
            ),
            reply_to=message,
        )
        for i, message in enumerate(
            strategy.configure_train(1, model, ConfigRecord(), grid)
        )
    ]
    return strategy, replies


def test_aggregation_holds_the_accumulator_and_the_result_only() -> None:
    # Each reply is read as a view of its payload, the views are folded into
    # one accumulator and the result's payload is written in one copy:
    # accumulator + result = 2 models.
    # Flower's Array(ndarray) path made it 3 (the np.save stream as well).
    size = 1_000_000
    strategy, replies = _replies(8, size)
    strategy.aggregate_train(1, replies)  # warm caches outside the measurement
    gc.collect()
    tracemalloc.start()
    arrays, _ = strategy.aggregate_train(1, replies)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert arrays is not None
    assert peak / (4 * size) < 2.1
    expected = sum(
        (10 + i) * r.content["arrays"]["w"].numpy().astype(np.float64)
        for i, r in enumerate(replies)
    ) / sum(10 + i for i in range(8))
    np.testing.assert_allclose(arrays["w"].numpy(), expected, rtol=0, atol=1e-6)

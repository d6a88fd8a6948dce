"""Pure maths of ops/: aggregation kernels, proximal term, dissimilarity."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from flwr_prox_strategies.ops import aggregate
from flwr_prox_strategies.ops.aggregate import (
    WeightedMean,
    ZeroTotalWeightError,
    add_scaled_,
    sweep_threads,
    weighted_average,
)
from flwr_prox_strategies.ops.dissimilarity import dissimilarity, sq_norm


def test_weighted_average_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    contributions = [[rng.normal(size=(300, 7)), rng.normal(size=5)] for _ in range(6)]
    weights = rng.uniform(0.5, 3.0, size=6)
    out = weighted_average(contributions, weights)
    for k in range(2):
        expected = np.average([c[k] for c in contributions], axis=0, weights=weights)
        np.testing.assert_allclose(out[k], expected, rtol=1e-12)


def test_large_arrays_use_blocks_and_stay_exact() -> None:
    rng = np.random.default_rng(1)
    a = rng.normal(size=700_001).astype(np.float32)  # not a multiple of the block
    acc = np.ones_like(a)
    add_scaled_(acc, a, 0.25)
    np.testing.assert_array_equal(acc, np.float32(1) + np.float32(0.25) * a)


def test_float32_stays_float32_and_ints_round_back() -> None:
    mean = WeightedMean()
    mean.add({"w": np.ones(3, np.float32), "n": np.array([1, 2], np.int64)}, 1.0)
    mean.add({"w": np.zeros(3, np.float32), "n": np.array([3, 5], np.int64)}, 1.0)
    out = mean.result()
    assert out["w"].dtype == np.float32 and out["n"].dtype == np.int64
    np.testing.assert_array_equal(out["n"], [2, 4])  # 3.5 rounds to even


def test_zero_total_weight_is_a_clear_error() -> None:
    mean = WeightedMean()
    mean.add([np.ones(2)], 0.0)
    with pytest.raises(ZeroTotalWeightError, match="total weight 0"):
        mean.result()
    with pytest.raises(ZeroTotalWeightError):
        WeightedMean().result()


@pytest.mark.parametrize("weight", [-1.0, float("nan"), float("inf")])
def test_invalid_weights_are_refused(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        WeightedMean().add([np.ones(2)], weight)


def test_shape_mismatch_never_broadcasts() -> None:
    mean = WeightedMean()
    mean.add([np.ones(3)], 1.0)
    with pytest.raises(ValueError, match="shape"):
        mean.add([np.ones(1)], 1.0)


def test_dissimilarity() -> None:
    g = [np.array([1.0, 2.0])]
    assert sq_norm(g) == 5.0
    # Two clients whose gradients mostly cancel.
    g1, g2 = np.array([3.0, 1.0]), np.array([-1.0, 1.0])
    mean_sq = 0.5 * (sq_norm([g1]) + sq_norm([g2]))
    norm_mean = sq_norm([0.5 * (g1 + g2)])
    # E||g_k||^2 = (10 + 2) / 2 = 6, ||E g_k||^2 = ||(1, 1)||^2 = 2.
    assert dissimilarity(mean_sq, norm_mean) == pytest.approx(3.0)
    assert dissimilarity(1.0, 0.0) == float("inf")


def _reply_after_reply(
    contributions: list[dict[str, np.ndarray]],
    weights: list[float],
    **options: object,
) -> dict[str, np.ndarray]:
    mean = WeightedMean(**options)  # type: ignore[arg-type]
    for arrays, weight in zip(contributions, weights, strict=True):
        mean.add(arrays, weight)
    return mean.result()


@pytest.mark.parametrize(
    ("dtype", "accumulate_in"),
    [
        (np.float32, None),
        (np.float64, None),
        (np.float16, None),
        (np.float32, np.float64),
        (np.int64, None),
    ],
)
@pytest.mark.parametrize("total", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
def test_add_all_is_bit_identical_to_add_in_turn(
    dtype: type, accumulate_in: type | None, total: bool, threads: int
) -> None:
    # Sizes around the blocks of both kernels (add_scaled_'s 2**18 elements,
    # sweep_scaled_'s 2**18 bytes), one array large enough for three sweep
    # threads, tiny, empty and multi-dimensional arrays.
    rng = np.random.default_rng(7)
    shapes = {
        "big": (1_000_003,),
        "exact": (1 << 17,),
        "matrix": (513, 257),
        "tiny": (3,),
        "one": (),
        "empty": (0, 4),
    }
    contributions = [
        {
            key: (rng.standard_normal(shape) * 100).astype(dtype)
            for key, shape in shapes.items()
        }
        for _ in range(7)
    ]
    weights = [float(w) for w in rng.uniform(0.1, 50.0, size=7)]
    weights[3] = 0.0  # a zero weight is allowed
    options = {
        "accumulate_in": accumulate_in,
        "total": sum(weights) if total else None,
    }
    expected = _reply_after_reply(contributions, weights, **options)
    mean = WeightedMean(**options, threads=threads)  # type: ignore[arg-type]
    mean.add_all(contributions, weights)
    got = mean.result()
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape
        np.testing.assert_array_equal(got[key], value, strict=True)
    assert mean.count == 7 and mean.total_weight == sum(weights)


def test_add_all_matches_the_in_place_floor_on_float32() -> None:
    # benchmarks/aggregate.py's floor: acc = w0 * x0; acc += w_i * x_i.
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(200_003, dtype=np.float32) for _ in range(9)]
    weights = [100.0 + i for i in range(9)]
    total = sum(weights)
    floor = arrays[0] * np.float32(weights[0] / total)
    for x, w in zip(arrays[1:], weights[1:], strict=True):
        floor += np.float32(w / total) * x
    mean = WeightedMean(total=total)
    mean.add_all([[x] for x in arrays], weights)
    np.testing.assert_array_equal(mean.result()["0"], floor, strict=True)


def test_add_all_after_add_continues_the_same_sum() -> None:
    rng = np.random.default_rng(5)
    contributions = [{"w": rng.standard_normal(70_000)} for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    expected = _reply_after_reply(contributions, weights, total=15.0)
    mean = WeightedMean(total=15.0)
    mean.add(contributions[0], weights[0])
    mean.add_all(contributions[1:], weights[1:])
    np.testing.assert_array_equal(mean.result()["w"], expected["w"], strict=True)
    # Without a total, the sum is divided by the total weight, added up one
    # weight at a time as add does (0.1 + 0.2 + 0.3 is not 0.1 + (0.2 + 0.3)).
    thirds = [0.1, 0.2, 0.3]
    expected = _reply_after_reply(contributions[:3], thirds)
    mean = WeightedMean()
    mean.add(contributions[0], thirds[0])
    mean.add_all(contributions[1:3], thirds[1:])
    assert mean.total_weight == 0.1 + 0.2 + 0.3
    np.testing.assert_array_equal(mean.result()["w"], expected["w"], strict=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_add_all_propagates_nan_and_inf(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pools: list[int] = []

    class Pool(aggregate.ThreadPoolExecutor):
        def __init__(self, workers: int) -> None:
            pools.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(aggregate, "ThreadPoolExecutor", Pool)
    n = 1_200_000  # two sweep threads' worth of float32 blocks
    good = [np.ones(n, np.float32)]
    bad = [np.ones(n, np.float32)]
    bad[0][[5, n - 2, n - 1]] = [np.nan, np.inf, np.inf]
    good[0][n - 2] = -np.inf  # inf - inf: numpy's "invalid", silenced
    mean = WeightedMean(total=2.0, threads=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # also in the sweep's threads
        mean.add_all([good, bad], [1.0, 1.0])
    out = mean.result()["0"]
    assert np.isnan(out[[5, n - 2]]).all() and np.isinf(out[n - 1])
    assert np.isfinite(np.delete(out, [5, n - 2, n - 1])).all()
    assert pools == ([] if threads == 1 else [2])


def test_sweep_threads_follow_the_runs_cpu_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert sweep_threads() == 3 and WeightedMean().threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    assert sweep_threads() == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert sweep_threads() == min(len(os.sched_getaffinity(0)), 4)
    monkeypatch.delattr(os, "sched_getaffinity")  # as on macOS and Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert sweep_threads() == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert sweep_threads() == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="threads"):
            WeightedMean(threads=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("contributions", "weights", "match"),
    [
        ([[np.ones(3)], [np.ones(2)]], [1.0, 1.0], "shape"),
        ([{"a": np.ones(3)}, {"b": np.ones(3)}], [1.0, 1.0], "keys"),
        ([[np.ones(3)], [np.ones(3), np.ones(1)]], [1.0, 1.0], "keys"),
        ([[np.ones(3)], [np.ones(3)]], [1.0, -1.0], "weight"),
        ([[np.ones(3)], [np.ones(3)]], [1.0, float("nan")], "weight"),
        ([[np.ones(3)], [np.ones(3)]], [1.0], "weights"),
    ],
)
def test_add_all_refuses_before_adding_anything(
    contributions: list[list[np.ndarray]], weights: list[float], match: str
) -> None:
    mean = WeightedMean()
    mean.add([np.full(3, 2.0)], 1.0)
    with pytest.raises(ValueError, match=match):
        mean.add_all(contributions, weights)
    assert mean.count == 1
    np.testing.assert_array_equal(mean.result()["0"], np.full(3, 2.0))


def test_add_all_of_nothing_adds_nothing() -> None:
    mean = WeightedMean()
    mean.add_all([], [])
    with pytest.raises(ZeroTotalWeightError):
        mean.result()

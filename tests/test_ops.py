"""Pure maths of ops/: aggregation kernels, proximal term, dissimilarity."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_prox_strategies.ops.aggregate import (
    WeightedMean,
    ZeroTotalWeightError,
    add_scaled_,
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

"""FedEPM's server step against a brute-force minimiser of the 1-D objective."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_prox_strategies.ops.elastic_net import (
    elastic_net_center,
    elastic_net_objective,
    soft_threshold,
    weighted_elastic_net_center,
)


def brute_force(z: np.ndarray, lam: float, eta: float) -> float:
    """Every kink and every interval's stationary point (clipped): the best one."""
    z = np.sort(z)
    m = len(z)
    candidates = list(z)
    for below in range(m + 1):  # the interval with `below` uploads under v
        if eta > 0:
            v = (z.sum() - (lam / eta) * (2 * below - m)) / m
            low = z[below - 1] if below > 0 else -np.inf
            high = z[below] if below < m else np.inf
            candidates.append(float(np.clip(v, low, high)))
    values = [
        elastic_net_objective(z[:, None], np.array([c]), lam, eta)[0]
        for c in candidates
    ]
    return candidates[int(np.argmin(values))]


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force_on_random_data(seed: int) -> None:
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 12))
    z = rng.normal(size=(m, 7)) * rng.choice([0.01, 1.0, 100.0])
    if seed % 3 == 0:  # ties: repeated uploads, as stale clients give
        z[: m // 2] = z[0]
    if seed % 4 == 1:
        z = np.round(z, 0)  # ties across many values
    lam, eta = (
        float(rng.choice([0.0, 1e-3, 0.5, 3.0])),
        float(rng.choice([1e-5, 0.1, 2.0])),
    )
    got = elastic_net_center(z, lam, eta)
    for s in range(z.shape[1]):
        want = brute_force(z[:, s], lam, eta)
        f_got = elastic_net_objective(z[:, s : s + 1], got[s : s + 1], lam, eta)[0]
        f_want = elastic_net_objective(z[:, s : s + 1], np.array([want]), lam, eta)[0]
        assert f_got <= f_want + 1e-12 * max(1.0, abs(f_want))
        # strictly convex when eta > 0: the minimiser itself is unique
        assert got[s] == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_limits_mean_and_median() -> None:
    rng = np.random.default_rng(1)
    z = rng.normal(size=(9, 50))
    np.testing.assert_allclose(elastic_net_center(z, 0.0, 1.0), z.mean(0), rtol=1e-14)
    # lambda/eta large: the median (m odd), FedMedian's limit
    np.testing.assert_array_equal(elastic_net_center(z, 1e6, 1e-6), np.median(z, 0))
    np.testing.assert_array_equal(elastic_net_center(z, 1.0, 0.0), np.median(z, 0))
    # m even, l1 dominant: the point of [z_(m/2), z_(m/2+1)] nearest the mean
    z4 = np.array([[0.0], [1.0], [2.0], [10.0]])
    assert elastic_net_center(z4, 1e6, 1.0)[0] == 2.0
    assert elastic_net_center(-z4, 1e6, 1.0)[0] == -2.0


def test_shapes_dtypes_and_errors() -> None:
    z = np.ones((3, 2, 4), dtype=np.float32)
    out = elastic_net_center(z, 0.1, 1.0)
    assert out.shape == (2, 4) and out.dtype == np.float64
    np.testing.assert_array_equal(out, 1.0)
    with pytest.raises(ValueError, match="lam"):
        elastic_net_center(z, -1.0, 1.0)
    with pytest.raises(ValueError, match="both"):
        elastic_net_center(z, 0.0, 0.0)


def test_soft_threshold() -> None:
    x = np.array([-3.0, -0.5, 0.0, 0.2, 2.0])
    np.testing.assert_array_equal(soft_threshold(x, 1.0), [-2.0, 0.0, 0.0, 0.0, 1.0])


@pytest.mark.parametrize("seed", range(12))
def test_weighted_centre_is_the_centre_of_the_repeated_table(seed: int) -> None:
    """One row of weight w stands for w identical uploads (FedEPM's unseen clients)."""
    rng = np.random.default_rng(seed)
    r = int(rng.integers(1, 8))
    z = np.round(rng.normal(size=(r, 3, 5)), int(rng.integers(0, 3)))  # ties too
    weights = rng.integers(1, 6, size=r)
    weights[0] = int(rng.integers(1, 200))  # the initial model's many copies
    lam = float(rng.choice([0.0, 1e-3, 0.5, 3.0]))
    eta = float(rng.choice([0.0, 1e-5, 0.1, 2.0])) if lam > 0 else 1.0
    dense = elastic_net_center(np.repeat(z, weights, axis=0), lam, eta)
    got = weighted_elastic_net_center(z, weights, lam, eta, block=4)  # 4 blocks
    assert got.shape == (3, 5)
    np.testing.assert_allclose(got, dense, rtol=1e-12, atol=1e-12)


def test_weighted_centre_by_hand_and_refusals() -> None:
    # 0 (x3) and 10 (x1): l1 dominant -> the lower median 0; pure mean -> 2.5
    z = np.array([[0.0], [10.0]])
    assert weighted_elastic_net_center(z, [3, 1], 1e6, 1.0)[0] == 0.0
    assert weighted_elastic_net_center(z, [3, 1], 0.0, 1.0)[0] == pytest.approx(2.5)
    assert weighted_elastic_net_center(z, [1, 3], 1.0, 0.0)[0] == 10.0
    with pytest.raises(ValueError, match="one integer weight per row"):
        weighted_elastic_net_center(z, [1.0, 2.0], 1.0, 1.0)
    with pytest.raises(ValueError, match=">= 1"):
        weighted_elastic_net_center(z, [0, 2], 1.0, 1.0)

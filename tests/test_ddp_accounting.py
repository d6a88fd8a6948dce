"""Distributed DP's accounting (`ops.privacy.accounting`) against maths and dp-accounting.

Independent references: dp-accounting's RDP accountant for the continuous
Gaussian (the limit both discrete bounds approach, and a floor neither may go
below), and exact Renyi divergences of the discrete noise laws, summed in log
space over the integers (the bounds must lie above them).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from scipy import special, stats

from flwr_prox_strategies.ops.privacy.accounting import (
    DEFAULT_ORDERS,
    compose,
    ddg_rdp,
    ddg_tau,
    epsilon_after,
    integer_l1_bound,
    rdp_to_epsilon,
    skellam_rdp,
    smallest_contributors,
)
from flwr_prox_strategies.ops.privacy.quantise import rounding_norm_bound

try:  # the reference for the Gaussian comparisons (pip install dp-accounting)
    import dp_accounting
except ImportError:  # pragma: no cover - the maths tests still run
    dp_accounting = None

# dp-accounting pins attrs<24, so it is not in the test extra: CI runs this file
# again in a venv of its own with it (.ci/run's dp-accounting stage), where no test
# may skip.
needs_dp_accounting = pytest.mark.skipif(
    dp_accounting is None, reason="dp-accounting is the reference here"
)

INTEGER_ORDERS = list(range(2, 257))
DELTA = 1e-5


def gaussian_epsilon(noise_multiplier: float, rounds: int, orders: Any) -> float:
    """dp-accounting's epsilon for ``rounds`` Gaussian rounds at DELTA."""
    accountant = dp_accounting.rdp.RdpAccountant(list(orders))
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), rounds)
    return float(accountant.get_epsilon(DELTA))


def ddg_epsilon(l2: float, sigma2: float, n: int, dim: int, rounds: int) -> float:
    rdp = ddg_rdp(
        INTEGER_ORDERS,
        l2_sensitivity=l2,
        l1_sensitivity=integer_l1_bound(l2, dim),
        sigma2=sigma2,
        num_clients=n,
        dim=dim,
    )
    return epsilon_after(rdp, rounds=rounds, delta=DELTA, orders=INTEGER_ORDERS)


def skellam_epsilon(l2: float, mu: float, dim: int, rounds: int) -> float:
    rdp = skellam_rdp(
        INTEGER_ORDERS,
        l2_sensitivity=l2,
        l1_sensitivity=integer_l1_bound(l2, dim),
        mu=mu,
    )
    return epsilon_after(rdp, rounds=rounds, delta=DELTA, orders=INTEGER_ORDERS)


# --- the Gaussian limit, with dp-accounting as the reference ---------------------


@needs_dp_accounting
@pytest.mark.parametrize("rounds", [1, 100, 1000])
def test_ddg_approaches_the_gaussian_and_never_beats_it(rounds: int) -> None:
    # n sigma^2 = 1e4: tau = 10 sum_k exp(-2 pi^2 100 k/(k+1)) underflows to 0.
    n, sigma2, l2, dim = 100, 100.0, 10.0, 1024
    assert ddg_tau(sigma2, n) < 1e-300
    ours = ddg_epsilon(l2, sigma2, n, dim, rounds)
    gaussian = gaussian_epsilon(math.sqrt(n * sigma2) / l2, rounds, INTEGER_ORDERS)
    assert ours >= gaussian * (1 - 1e-12)
    assert ours == pytest.approx(gaussian, rel=1e-9)  # tau = 0: the same curve


@needs_dp_accounting
def test_ddg_pays_for_tau_when_the_local_noise_is_small() -> None:
    # sigma^2 = 0.1: the sum of discrete Gaussians is far from one; tau > 0.
    n, sigma2, l2, dim = 1000, 0.1, 1.0, 16
    assert ddg_tau(sigma2, n) > 1.0
    ours = ddg_epsilon(l2, sigma2, n, dim, 10)
    gaussian = gaussian_epsilon(math.sqrt(n * sigma2) / l2, 10, INTEGER_ORDERS)
    assert ours > gaussian * 1.05


@needs_dp_accounting
def test_skellam_approaches_the_gaussian_from_above_as_mu_grows() -> None:
    # Fixed noise multiplier z = sqrt(mu) / l2 = 2, one coordinate per unit of l2.
    z, dim, rounds = 2.0, 4096, 100
    gaussian = gaussian_epsilon(z, rounds, INTEGER_ORDERS)
    gaps = []
    for mu in (1e2, 1e4, 1e6, 1e8):
        l2 = math.sqrt(mu) / z
        ours = skellam_epsilon(l2, mu, dim, rounds)
        assert ours >= gaussian * (1 - 1e-12)
        gaps.append(ours / gaussian - 1)
    assert gaps == sorted(gaps, reverse=True)
    assert gaps[1] < 0.03  # mu = 1e4: within a few percent
    assert gaps[-1] < 1e-3


def test_both_bounds_are_the_gaussian_rdp_plus_a_nonnegative_term() -> None:
    """Without dp-accounting: alpha Delta^2 / (2 variance) is the floor and the limit."""
    orders = np.arange(2, 65, dtype=float)
    gaussian = orders * 10.0**2 / (2 * 1e4)
    exact = ddg_rdp(
        orders,
        l2_sensitivity=10.0,
        l1_sensitivity=100.0,
        sigma2=100.0,
        num_clients=100,
        dim=100,
    )
    np.testing.assert_allclose(exact, gaussian, rtol=1e-12)
    for mu in (1e2, 1e4, 1e6):
        l2 = math.sqrt(mu) / 10  # noise multiplier 10
        sk = skellam_rdp(orders, l2_sensitivity=l2, l1_sensitivity=l2 * l2, mu=mu)
        floor = orders * l2**2 / (2 * mu)
        assert np.all(sk >= floor)
        # l1 = l2^2: the correction over the floor is (2a + 5) / (2 a mu) <= 9 / (4 mu)
        assert np.max(sk / floor - 1) <= 9 / (4 * mu) * (1 + 1e-6)


@needs_dp_accounting
def test_rdp_to_epsilon_is_dp_accountings_conversion() -> None:
    """Same orders (fractional ones too), same Gaussian RDP: same epsilon."""
    orders = np.asarray(DEFAULT_ORDERS)
    for z, rounds, delta in [(0.8, 1, 1e-5), (1.1, 500, 1e-6), (5.0, 50, 1e-3)]:
        rdp = compose(orders / (2 * z * z), rounds)
        accountant = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
        accountant.compose(dp_accounting.GaussianDpEvent(z), rounds)
        expected = accountant.get_epsilon(delta)
        assert rdp_to_epsilon(orders, rdp, delta) == pytest.approx(expected, rel=1e-6)


def test_the_conversion_is_tighter_than_the_classic_one() -> None:
    orders = np.arange(2, 100, dtype=float)
    rdp = orders * 0.01
    classic = float(np.min(rdp + math.log(1 / DELTA) / (orders - 1)))
    assert 0 < rdp_to_epsilon(orders, rdp, DELTA) < classic


def test_a_tiny_rdp_gives_epsilon_zero() -> None:
    # delta^2 >= 1 - exp(-r): total variation is below delta already.
    assert rdp_to_epsilon([2.0], [1e-12], 0.01) == 0.0
    assert rdp_to_epsilon([2.0, 3.0], [math.inf, math.inf], 0.01) == math.inf


# --- exact Renyi divergences of the noise laws -----------------------------------


def renyi(logp: np.ndarray, logq: np.ndarray, alpha: int) -> float:
    """D_alpha(P || Q) from log-probabilities on a common support.

    Where either underflowed (far tails) the terms are dropped: P's mass there
    must be negligible (below e^-600).
    """
    keep = np.isfinite(logp) & np.isfinite(logq)
    lost = logp[~keep & np.isfinite(logp)]
    assert lost.size == 0 or special.logsumexp(lost) < -600
    terms = alpha * logp[keep] + (1 - alpha) * logq[keep]
    return float(special.logsumexp(terms) / (alpha - 1))


def shifted(logp: np.ndarray, shift: int) -> np.ndarray:
    out = np.full_like(logp, -np.inf)
    out[shift:] = logp[: logp.size - shift]
    return out


def discrete_gaussian_logpmf(sigma2: float, half: int) -> np.ndarray:
    x = np.arange(-half, half + 1, dtype=float)
    logits = -(x**2) / (2 * sigma2)
    return logits - special.logsumexp(logits)


@pytest.mark.parametrize(("n", "sigma2"), [(1, 0.5), (2, 0.5), (3, 0.3), (4, 1.0)])
def test_ddg_bound_lies_above_the_exact_divergence(n: int, sigma2: float) -> None:
    """One coordinate: the sum of n discrete Gaussians, exactly, shifted by 1 or 2."""
    half = 60
    one = np.exp(discrete_gaussian_logpmf(sigma2, half))
    law = one
    for _ in range(n - 1):
        law = np.convolve(law, one)
    with np.errstate(divide="ignore"):
        logp = np.log(law)
    for shift in (1, 2):
        bound = ddg_rdp(
            range(2, 11),
            l2_sensitivity=shift,
            l1_sensitivity=shift,
            sigma2=sigma2,
            num_clients=n,
            dim=1,
        )
        for alpha, eps in zip(range(2, 11), bound, strict=True):
            exact = renyi(shifted(logp, shift), logp, alpha)
            assert exact <= eps * (1 + 1e-9), (n, sigma2, shift, alpha, exact, eps)


@pytest.mark.parametrize("mu", [1.0, 5.0, 50.0])
def test_skellam_bound_lies_above_the_exact_divergence(mu: float) -> None:
    x = np.arange(-400, 401)
    logp = stats.skellam.logpmf(x, mu / 2, mu / 2)
    for shift in (1, 3):
        bound = skellam_rdp(
            range(2, 11), l2_sensitivity=shift, l1_sensitivity=shift, mu=mu
        )
        for alpha, eps in zip(range(2, 11), bound, strict=True):
            exact = renyi(shifted(logp, shift), logp, alpha)
            assert exact <= eps * (1 + 1e-9), (mu, shift, alpha, exact, eps)
            if mu == 50.0:  # and the bound is not loose at moderate noise
                assert eps < 1.5 * exact


# --- the tau term, by hand -------------------------------------------------------


def test_tau_by_hand() -> None:
    # n = 2, sigma^2 = 1/2: one term, k = 1: 10 exp(-2 pi^2 (1/2)(1/2)).
    assert ddg_tau(0.5, 2) == pytest.approx(10 * math.exp(-(math.pi**2) / 2), rel=1e-14)
    assert ddg_tau(0.5, 2) == pytest.approx(0.0719188335582637, rel=1e-12)
    three = 10 * (math.exp(-(math.pi**2) * 0.3) + math.exp(-4 * math.pi**2 * 0.3 / 3))
    assert ddg_tau(0.3, 3) == pytest.approx(three, rel=1e-14)
    assert ddg_tau(0.5, 1) == 0.0


def test_ddg_rdp_by_hand_with_tau() -> None:
    """n = 2, sigma^2 = 1/2, d = 4, Delta_2 = 2, Delta_1 = 4, alpha = 3."""
    tau = 10 * math.exp(-(math.pi**2) / 2)
    s = math.sqrt(2 * 0.5)
    first = 3 * 4 / (2 * s * s) + tau * 4
    second = 3 / 2 * (4 / s**2 + 2 * 4 * tau / s + tau**2 * 4)
    third = 3 / 2 * (2 / s + 2 * tau) ** 2
    (got,) = ddg_rdp(
        [3], l2_sensitivity=2, l1_sensitivity=4, sigma2=0.5, num_clients=2, dim=4
    )
    assert got == pytest.approx(min(first, second, third), rel=1e-14)


def test_skellam_rdp_by_hand() -> None:
    """alpha = 4, Delta_2 = 3, Delta_1 = 5, mu = 10: both corrections, the min."""
    gaussian = 4 * 9 / 20
    correction = min((7 * 9 + 30) / 400, 15 / 20)
    (got,) = skellam_rdp([4], l2_sensitivity=3, l1_sensitivity=5, mu=10)
    assert got == pytest.approx(gaussian + correction, rel=1e-14)


def test_fractional_orders_are_charged_at_the_next_integer() -> None:
    kwargs: dict[str, Any] = {"l2_sensitivity": 3.0, "l1_sensitivity": 5.0, "mu": 7.0}
    assert skellam_rdp([2.5], **kwargs) == pytest.approx(skellam_rdp([3], **kwargs))
    ddg: dict[str, Any] = {
        "l2_sensitivity": 3.0,
        "l1_sensitivity": 5.0,
        "sigma2": 0.4,
        "num_clients": 5,
        "dim": 8,
    }
    assert ddg_rdp([1.01], **ddg) == pytest.approx(ddg_rdp([2], **ddg))


def test_integer_l1_bound() -> None:
    assert integer_l1_bound(3.0, 100) == 9.0  # Delta_2^2 < sqrt(d) Delta_2
    assert integer_l1_bound(30.0, 100) == 300.0  # sqrt(d) Delta_2


# --- monotonicity ---------------------------------------------------------------


def test_epsilon_grows_with_rounds_and_sensitivity_and_shrinks_with_noise() -> None:
    dim = 256
    base = {"l2": rounding_norm_bound(20.0, dim, 1e-3), "sigma2": 4.0, "n": 10}

    def ddg(**change: Any) -> float:
        p = {**base, **change}
        return ddg_epsilon(p["l2"], p["sigma2"], p["n"], dim, change.get("rounds", 10))

    def sk(**change: Any) -> float:
        p = {"l2": base["l2"], "mu": 40.0, **change}
        return skellam_epsilon(p["l2"], p["mu"], dim, change.get("rounds", 10))

    for f in (ddg, sk):
        values = [f(rounds=t) for t in (1, 10, 100, 1000)]
        assert values == sorted(values) and len(set(values)) == 4
        values = [f(l2=c) for c in (5.0, 10.0, 20.0, 40.0)]
        assert values == sorted(values) and len(set(values)) == 4
    values = [ddg(sigma2=s) for s in (0.5, 1.0, 4.0, 16.0)]
    assert values == sorted(values, reverse=True) and len(set(values)) == 4
    values = [ddg(n=n) for n in (2, 5, 20, 100)]
    assert values == sorted(values, reverse=True) and len(set(values)) == 4
    values = [sk(mu=m) for m in (10.0, 40.0, 160.0, 640.0)]
    assert values == sorted(values, reverse=True) and len(set(values)) == 4
    assert epsilon_after(np.ones(3), rounds=0, delta=DELTA, orders=[2, 3, 4]) == 0.0


def test_dropouts_are_accounted_at_the_threshold() -> None:
    assert smallest_contributors(100, 60) == 60
    assert smallest_contributors(100, 60, colluding=10) == 50
    # Fewer contributors, less noise in the sum, a larger epsilon.
    full = ddg_epsilon(10.0, 25.0, 100, 64, 50)
    dropped = ddg_epsilon(10.0, 25.0, smallest_contributors(100, 60), 64, 50)
    assert dropped > full


# --- bad input ------------------------------------------------------------------

GOOD_DDG: dict[str, Any] = {
    "l2_sensitivity": 1.0,
    "l1_sensitivity": 1.0,
    "sigma2": 1.0,
    "num_clients": 2,
    "dim": 4,
}
GOOD_SK: dict[str, Any] = {"l2_sensitivity": 1.0, "l1_sensitivity": 1.0, "mu": 1.0}


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: ddg_rdp([2], **{**GOOD_DDG, "sigma2": 0.0}), "sigma2"),
        (lambda: ddg_rdp([2], **{**GOOD_DDG, "sigma2": -1.0}), "sigma2"),
        (lambda: ddg_rdp([2], **{**GOOD_DDG, "sigma2": math.nan}), "sigma2"),
        (lambda: ddg_rdp([2], **{**GOOD_DDG, "num_clients": 0}), "num_clients"),
        (lambda: ddg_rdp([2], **{**GOOD_DDG, "num_clients": 2.0}), "num_clients"),
        (lambda: ddg_rdp([2], **{**GOOD_DDG, "dim": 0}), "dim"),
        (lambda: ddg_rdp([2], **{**GOOD_DDG, "l2_sensitivity": -1}), "l2_sensitivity"),
        (lambda: ddg_rdp([2], **{**GOOD_DDG, "l1_sensitivity": -1}), "l1_sensitivity"),
        (lambda: ddg_rdp([1.0], **GOOD_DDG), "orders"),
        (lambda: ddg_rdp([0.5, 2], **GOOD_DDG), "orders"),
        (lambda: ddg_rdp([], **GOOD_DDG), "orders"),
        (lambda: ddg_rdp([math.inf], **GOOD_DDG), "orders"),
        (lambda: skellam_rdp([2], **{**GOOD_SK, "mu": 0}), "mu"),
        (lambda: skellam_rdp([2], **{**GOOD_SK, "mu": -3.0}), "mu"),
        (lambda: skellam_rdp([1], **GOOD_SK), "orders"),
        (lambda: skellam_rdp([2], **{**GOOD_SK, "l2_sensitivity": math.inf}), "l2"),
        (lambda: rdp_to_epsilon([2], [1.0], 0.0), "delta"),
        (lambda: rdp_to_epsilon([2], [1.0], 1.0), "delta"),
        (lambda: rdp_to_epsilon([2], [1.0], -0.1), "delta"),
        (lambda: rdp_to_epsilon([1.0], [1.0], 1e-5), "orders"),
        (lambda: rdp_to_epsilon([2, 3], [1.0], 1e-5), "rdp"),
        (lambda: rdp_to_epsilon([2], [-1.0], 1e-5), "rdp"),
        (lambda: compose([1.0], -1), "rounds"),
        (lambda: compose([-1.0], 1), "rdp"),
        (lambda: ddg_tau(0.0, 2), "sigma2"),
        (lambda: integer_l1_bound(1.0, 0), "dim"),
        (lambda: smallest_contributors(0, 1), "num_clients"),
        (lambda: smallest_contributors(10, 11), "threshold"),
        (lambda: smallest_contributors(10, 0), "threshold"),
        (lambda: smallest_contributors(10, 5, colluding=5), "colluding"),
        (lambda: smallest_contributors(10, 5, colluding=-1), "colluding"),
    ],
)
def test_bad_input_names_the_parameter(call: Any, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()

"""Distributed DP's integer pieces (`ops.privacy.noise`, `.quantise`) against their maths.

Every sampler is checked against its closed-form law: moments and probabilities
are summed exactly over the integers, and each empirical estimate must lie
within five standard errors of them (the standard errors are derived beside
each check). Seeds are fixed, so the suite is deterministic.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from scipy import stats

from flwr_prox_strategies.ops.privacy.noise import (
    _bernoulli_exp,
    discrete_gaussian,
    skellam,
)
from flwr_prox_strategies.ops.privacy.quantise import (
    conditional_randomized_rounding,
    inverse_randomized_hadamard,
    modular_unwrap,
    modular_wrap,
    randomized_hadamard,
    rounding_norm_bound,
    smallest_safe_bits,
)

N = 100_000
Z = 5.0  # every statistical check: within five standard errors


def discrete_gaussian_pmf(sigma2: float) -> tuple[np.ndarray, np.ndarray]:
    """Support ``|x| <= 50 sigma`` and ``P[x] = e^{-x^2/2s^2} / sum_y e^{-y^2/2s^2}``.

    The mass beyond ``50 sigma`` is below ``e^{-1250}``: nothing in float64.
    """
    reach = int(50 * math.sqrt(sigma2)) + 2
    support = np.arange(-reach, reach + 1)
    weights = np.exp(-(support.astype(np.float64) ** 2) / (2 * sigma2))
    return support, weights / weights.sum()


# --- discrete Gaussian ---------------------------------------------------------


@pytest.mark.parametrize("sigma2", [0.5, 2.0, 10.0])
def test_discrete_gaussian_matches_its_closed_form(sigma2: float) -> None:
    draws = discrete_gaussian(sigma2, N, np.random.default_rng(20260))
    assert draws.dtype == np.int64 and draws.shape == (N,)
    support, pmf = discrete_gaussian_pmf(sigma2)
    variance = float(np.sum(pmf * support**2))  # the mean is 0 by symmetry
    fourth = float(np.sum(pmf * support.astype(np.float64) ** 4))
    # Mean: standard error sqrt(Var / N).
    assert abs(draws.mean()) <= Z * math.sqrt(variance / N)
    # Second moment about the known mean 0: mean of X^2, whose standard error is
    # sqrt((E X^4 - (E X^2)^2) / N).
    second = float(np.mean(draws.astype(np.float64) ** 2))
    assert abs(second - variance) <= Z * math.sqrt((fourth - variance**2) / N)
    # The exact variance is a little below sigma2 (Canonne et al. 2020) but close.
    assert variance <= sigma2 + 1e-12
    # The pmf at 0, +-1, +-2: binomial standard errors sqrt(p (1 - p) / N).
    for x in (-2, -1, 0, 1, 2):
        p = float(pmf[support == x][0])
        observed = float(np.mean(draws == x))
        assert abs(observed - p) <= Z * math.sqrt(p * (1 - p) / N), x
    # The tail P[|X| > 3 sigma].
    tail = float(pmf[np.abs(support) > 3 * math.sqrt(sigma2)].sum())
    observed = float(np.mean(np.abs(draws) > 3 * math.sqrt(sigma2)))
    assert abs(observed - tail) <= Z * math.sqrt(tail * (1 - tail) / N) + 1 / N


@pytest.mark.parametrize("sigma2", [0.5, 2.0, 10.0])
def test_discrete_gaussian_passes_a_chi_square_test(sigma2: float) -> None:
    """Pearson's chi-square over every value with expected count >= 20, tails merged."""
    draws = discrete_gaussian(sigma2, N, np.random.default_rng(20261))
    support, pmf = discrete_gaussian_pmf(sigma2)
    cells = support[pmf * N >= 20]
    low, high = int(cells.min()), int(cells.max())
    expected = [float(pmf[support < low].sum())]
    observed = [int(np.sum(draws < low))]
    for x in range(low, high + 1):
        expected.append(float(pmf[support == x][0]))
        observed.append(int(np.sum(draws == x)))
    expected.append(float(pmf[support > high].sum()))
    observed.append(int(np.sum(draws > high)))
    counts = np.array(expected) * N
    statistic = float(np.sum((np.array(observed) - counts) ** 2 / counts))
    degrees = len(counts) - 1
    assert statistic < stats.chi2.ppf(1 - 1e-6, degrees), (statistic, degrees)


def test_discrete_gaussian_is_exact_for_a_fraction_with_a_large_denominator() -> None:
    """sigma2 = 123457/1000000: the acceptance test leaves int64 (Python ints)."""
    sigma2 = Fraction(123457, 1_000_000)
    draws = discrete_gaussian(sigma2, 40_000, np.random.default_rng(3))
    support, pmf = discrete_gaussian_pmf(float(sigma2))
    for x in (-1, 0, 1):
        p = float(pmf[support == x][0])
        se = math.sqrt(p * (1 - p) / draws.size)
        assert abs(float(np.mean(draws == x)) - p) <= Z * se


def test_discrete_gaussian_reads_floats_and_fractions_alike() -> None:
    """A float is read as its nearest fraction of denominator <= 10**6."""
    a = discrete_gaussian(0.5, (3, 4), np.random.default_rng(9))
    b = discrete_gaussian(Fraction(1, 2), (3, 4), np.random.default_rng(9))
    assert a.shape == (3, 4)
    np.testing.assert_array_equal(a, b)
    c = discrete_gaussian(0.5, (3, 4), np.random.default_rng(9))
    np.testing.assert_array_equal(a, c)  # a fixed seed, the same draws
    assert discrete_gaussian(2, 0, np.random.default_rng(0)).shape == (0,)


@pytest.mark.parametrize(
    ("num", "den"), [(7, 3), (0, 1), (1, 1), (123456789, 10**19 + 7)]
)
def test_bernoulli_exp_has_probability_exp_minus_gamma(num: int, den: int) -> None:
    """The building block: P[True] = e^{-num/den}, also beyond int64 (den > 2**63)."""
    size = 40_000
    ones = np.ones(size, dtype=object)
    draws = _bernoulli_exp(ones * num, ones * den, np.random.default_rng(5))
    p = math.exp(-num / den)
    assert abs(float(draws.mean()) - p) <= Z * math.sqrt(p * (1 - p) / size) + 1e-12


# --- Skellam -------------------------------------------------------------------


@pytest.mark.parametrize("mu", [0.7, 3.0, 50.0])
def test_skellam_has_mean_zero_and_variance_mu(mu: float) -> None:
    draws = skellam(mu, N, np.random.default_rng(11))
    assert draws.dtype == np.int64 and draws.shape == (N,)
    assert abs(draws.mean()) <= Z * math.sqrt(mu / N)
    # Cumulants of Pois(mu/2) - Pois(mu/2): k2 = k4 = mu, so E X^4 = mu + 3 mu^2
    # and the standard error of mean(X^2) is sqrt((mu + 2 mu^2) / N).
    second = float(np.mean(draws.astype(np.float64) ** 2))
    assert abs(second - mu) <= Z * math.sqrt((mu + 2 * mu**2) / N)


def test_skellam_with_mu_zero_is_zero() -> None:
    assert not skellam(0.0, (2, 5), np.random.default_rng(0)).any()


# --- randomised Hadamard ---------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8, 16])
def test_the_rotation_is_orthonormal_hadamard_times_signs(n: int) -> None:
    """Column j of the map is e_j's image: +-(-1)^popcount(i & j) / sqrt(n)."""
    matrix = np.column_stack([randomized_hadamard(np.eye(n)[j], 7) for j in range(n)])
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(n), atol=1e-12)
    sylvester = np.array(
        [[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)]
    )
    signs = matrix * math.sqrt(n) * sylvester  # D's diagonal, repeated down a column
    np.testing.assert_allclose(np.abs(signs), 1.0, atol=1e-12)
    np.testing.assert_allclose(signs, np.broadcast_to(signs[0], signs.shape))


@pytest.mark.parametrize("dim", [1, 5, 64, 1000])
def test_the_inverse_rotation_undoes_it_and_norms_are_kept(dim: int) -> None:
    x = np.random.default_rng(dim).normal(size=dim)
    y = randomized_hadamard(x, 42)
    assert y.size == 1 << (dim - 1).bit_length() and y.dtype == np.float64
    assert math.isclose(np.linalg.norm(y), np.linalg.norm(x), rel_tol=1e-12)
    back = inverse_randomized_hadamard(y, 42, dim)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-12)


def test_different_seeds_rotate_differently() -> None:
    x = np.random.default_rng(0).normal(size=100)
    a, b = randomized_hadamard(x, 1), randomized_hadamard(x, 2)
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, randomized_hadamard(x, 1))
    assert not np.allclose(inverse_randomized_hadamard(a, 2, 100), x)


# --- conditional randomised rounding --------------------------------------------


def test_the_rounding_bound_is_the_papers_formula() -> None:
    # c = 3, d = 16, beta = e^{-2}: sqrt(2 log(1/beta)) = 2, so the second bound is
    # sqrt(9 + 4 + 2 (3 + 2)) = sqrt(23) < 3 + 4 = 7.
    assert rounding_norm_bound(3.0, 16, math.exp(-2)) == pytest.approx(math.sqrt(23))
    # c = 0, d = 1, beta = e^{-50}: sqrt(0 + 1/4 + 10 * 1/2) > 0 + 1, so c + sqrt(d).
    assert rounding_norm_bound(0.0, 1, math.exp(-50)) == pytest.approx(1.0)


def test_rounding_is_unbiased_integer_and_within_the_bound() -> None:
    rng = np.random.default_rng(17)
    x = rng.uniform(-3, 3, size=16)
    c = float(np.linalg.norm(x))
    beta = 0.01
    bound = rounding_norm_bound(c, x.size, beta)
    trials = 20_000
    draws = np.array(
        [
            conditional_randomized_rounding(x, beta=beta, norm_bound=c, rng=rng)
            for _ in range(trials)
        ]
    )
    assert draws.dtype == np.int64
    assert np.all((draws == np.floor(x)) | (draws == np.floor(x) + 1))
    assert np.all(np.linalg.norm(draws, axis=1) <= bound)
    # Unconditioned, each coordinate is floor + Bernoulli(f): mean x, standard
    # error sqrt(f (1 - f) / trials). A redraw happens with probability q <= beta
    # and moves a coordinate by < 1, so conditioning shifts the mean by at most
    # q / (1 - q) <= beta / (1 - beta).
    f = x - np.floor(x)
    slack = Z * np.sqrt(f * (1 - f) / trials) + beta / (1 - beta)
    assert np.all(np.abs(draws.mean(axis=0) - x) <= slack)


def test_rounding_redraws_until_the_bound_holds() -> None:
    """x = (0.5): with beta = 0.99 the bound sqrt(1/2 + 0.14) < 1 refuses 1."""
    x = np.array([0.5])
    assert rounding_norm_bound(0.5, 1, 0.99) < 1
    outcomes = []
    rng = np.random.default_rng(23)
    for _ in range(60):
        try:
            kw: dict[str, Any] = {"beta": 0.99, "norm_bound": 0.5, "rng": rng}
            outcomes.append(
                int(conditional_randomized_rounding(x, max_tries=1, **kw)[0])
            )
        except RuntimeError as error:
            assert "max_tries" in str(error)
            outcomes.append(-1)
    assert set(outcomes) == {0, -1}  # never 1; refused about half the time
    for _ in range(20):
        out = conditional_randomized_rounding(x, beta=0.99, norm_bound=0.5, rng=rng)
        assert out.tolist() == [0]


# --- modular arithmetic ----------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 8, 32, 62])
def test_wrap_then_unwrap_is_the_identity_on_the_centred_range(bits: int) -> None:
    half = 1 << (bits - 1)
    rng = np.random.default_rng(bits)
    v = rng.integers(-half, half, size=1000)
    v[:2] = [-half, half - 1]
    wrapped = modular_wrap(v, bits)
    assert wrapped.min() >= 0 and wrapped.max() < 2 * half
    np.testing.assert_array_equal(modular_unwrap(wrapped, bits), v)


def test_modular_sums_unwrap_to_the_true_sum_when_it_fits() -> None:
    bits = 12  # the centred range is [-2048, 2048)
    rng = np.random.default_rng(4)
    clients = [rng.integers(-400, 400, size=50) for _ in range(5)]  # |sum| < 2000
    total = np.zeros(50, dtype=np.int64)
    for v in clients:
        total = (total + modular_wrap(v, bits)) % (1 << bits)
    np.testing.assert_array_equal(modular_unwrap(total, bits), np.sum(clients, axis=0))
    # Beyond the range the sum wraps around: 5 * 500 = 2500 reads as 2500 - 4096.
    over = sum(modular_wrap(np.array([500]), bits) for _ in range(5)) % (1 << bits)
    assert modular_unwrap(over, bits).tolist() == [2500 - 4096]


def test_smallest_safe_bits_worked_by_hand() -> None:
    # 5 clients of |v| <= 100, no noise: M = 500 < 512 = 2^9, and 500 >= 256.
    assert smallest_safe_bits(num_clients=5, linf_bound=100, noise_stddev=0) == 10
    # 4 clients, B = 10, sigma = 2, k = 6: M = 40 + 6 * 2 * 2 = 64, not < 2^6.
    kw = {"num_clients": 4, "linf_bound": 10, "noise_stddev": 2.0, "num_stddevs": 6}
    assert smallest_safe_bits(**kw) == 8
    assert smallest_safe_bits(num_clients=1, linf_bound=0, noise_stddev=0) == 2


# --- the pipeline, without noise and with it -------------------------------------


def run_pipeline(noise: str) -> None:
    """clip -> rotate -> scale -> round (+ noise) -> wrap -> modular sum -> back."""
    rng = np.random.default_rng(31)
    n, dim, clip, scale, beta, seed = 5, 100, 1.0, 50.0, 1e-3, 77
    padded = 1 << (dim - 1).bit_length()  # 128
    updates = [rng.normal(scale=0.5, size=dim) for _ in range(n)]
    clipped = [u * min(1.0, clip / float(np.linalg.norm(u))) for u in updates]
    delta = rounding_norm_bound(scale * clip, padded, beta)
    sigma2 = 4.0
    stddev = math.sqrt(sigma2) if noise != "none" else 0.0
    bits = smallest_safe_bits(num_clients=n, linf_bound=delta, noise_stddev=stddev)
    total = np.zeros(padded, dtype=np.int64)
    rounded_sum = np.zeros(padded, dtype=np.int64)
    for x in clipped:
        scaled = scale * randomized_hadamard(x, seed)
        rounded = conditional_randomized_rounding(
            scaled, beta=beta, norm_bound=scale * clip, rng=rng
        )
        assert np.linalg.norm(rounded) <= delta
        rounded_sum += rounded
        if noise == "gaussian":
            rounded = rounded + discrete_gaussian(sigma2, padded, rng)
        elif noise == "skellam":
            rounded = rounded + skellam(sigma2, padded, rng)
        total = (total + modular_wrap(rounded, bits)) % (1 << bits)
    summed = modular_unwrap(total, bits)
    estimate = inverse_randomized_hadamard(summed / scale, seed, dim)
    truth = np.sum(clipped, axis=0)
    if noise == "none":
        # The integers come back exactly: the modular sum is the rounded sum.
        np.testing.assert_array_equal(summed, rounded_sum)
        # Client i's rounding error e_i has |e_ij| < 1 on all 128 coordinates, so
        # ||sum_i e_i|| < n sqrt(128); dividing by s and rotating back (a crop of
        # an isometry) keeps the bound: ||estimate - truth|| < n sqrt(128) / s.
        error = float(np.linalg.norm(estimate - truth))
        assert error < n * math.sqrt(padded) / scale
    else:
        # The noise is n independent draws of variance ~sigma2 per coordinate:
        # its L2 norm on 128 coordinates, scaled back, is about
        # sqrt(128 n sigma2) / s; the rounding adds < n sqrt(128) / s.
        error = float(np.linalg.norm(estimate - truth))
        noise_norm = math.sqrt(padded * n * sigma2) / scale
        assert error < n * math.sqrt(padded) / scale + 2 * noise_norm


@pytest.mark.parametrize("noise", ["none", "gaussian", "skellam"])
def test_the_pipeline_recovers_the_sum(noise: str) -> None:
    run_pipeline(noise)


# --- bad input -------------------------------------------------------------------

RNG = np.random.default_rng(0)
BAD_INPUT = [
    ("sigma2", lambda: discrete_gaussian(0.0, 3, RNG)),
    ("sigma2", lambda: discrete_gaussian(-1.0, 3, RNG)),
    ("sigma2", lambda: discrete_gaussian(float("nan"), 3, RNG)),
    ("sigma2", lambda: discrete_gaussian(1e-9, 3, RNG)),
    ("sigma2", lambda: discrete_gaussian(Fraction(-1, 2), 3, RNG)),
    ("size", lambda: discrete_gaussian(1.0, -2, RNG)),
    ("mu", lambda: skellam(-0.1, 3, RNG)),
    ("mu", lambda: skellam(float("inf"), 3, RNG)),
    ("x", lambda: randomized_hadamard(np.zeros((2, 2)), 0)),
    ("x", lambda: randomized_hadamard(np.zeros(0), 0)),
    ("x", lambda: randomized_hadamard(np.array([np.nan]), 0)),
    ("seed", lambda: randomized_hadamard(np.ones(3), -1)),
    ("y", lambda: inverse_randomized_hadamard(np.ones(3), 0, 3)),
    ("dim", lambda: inverse_randomized_hadamard(np.ones(4), 0, 5)),
    ("dim", lambda: inverse_randomized_hadamard(np.ones(4), 0, 0)),
    ("beta", lambda: rounding_norm_bound(1.0, 4, 0.0)),
    ("beta", lambda: rounding_norm_bound(1.0, 4, 1.0)),
    ("norm_bound", lambda: rounding_norm_bound(-1.0, 4, 0.5)),
    ("dim", lambda: rounding_norm_bound(1.0, 0, 0.5)),
    (
        "beta",
        lambda: conditional_randomized_rounding(
            np.ones(4), beta=1.5, norm_bound=2.0, rng=RNG
        ),
    ),
    (
        "norm_bound",
        lambda: conditional_randomized_rounding(
            np.ones(4), beta=0.1, norm_bound=1.0, rng=RNG
        ),
    ),
    (
        "max_tries",
        lambda: conditional_randomized_rounding(
            np.ones(4), beta=0.1, norm_bound=2.0, rng=RNG, max_tries=0
        ),
    ),
    ("bits", lambda: modular_wrap(np.ones(3, dtype=np.int64), 1)),
    ("bits", lambda: modular_wrap(np.ones(3, dtype=np.int64), 63)),
    ("v", lambda: modular_wrap(np.ones(3), 8)),
    ("v", lambda: modular_unwrap(np.array([256]), 8)),
    ("v", lambda: modular_unwrap(np.array([-1]), 8)),
    ("bits", lambda: modular_unwrap(np.array([1]), 0)),
    (
        "num_clients",
        lambda: smallest_safe_bits(num_clients=0, linf_bound=1, noise_stddev=1),
    ),
    (
        "linf_bound",
        lambda: smallest_safe_bits(num_clients=2, linf_bound=-1, noise_stddev=1),
    ),
    (
        "noise_stddev",
        lambda: smallest_safe_bits(num_clients=2, linf_bound=1, noise_stddev=-1),
    ),
    (
        "num_stddevs",
        lambda: smallest_safe_bits(
            num_clients=2, linf_bound=1, noise_stddev=1, num_stddevs=0
        ),
    ),
    (
        "62 bits",
        lambda: smallest_safe_bits(num_clients=2, linf_bound=2.0**62, noise_stddev=0),
    ),
]


@pytest.mark.parametrize(
    ("name", "call"), BAD_INPUT, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_INPUT)]
)
def test_bad_input_raises_naming_the_parameter(name: str, call: Any) -> None:
    with pytest.raises(ValueError, match=name):
        call()


def test_the_functions_leave_their_inputs_untouched() -> None:
    x = np.array([0.25, -1.5, 2.0])
    before = x.copy()
    randomized_hadamard(x, 3)
    conditional_randomized_rounding(
        x, beta=0.1, norm_bound=3.0, rng=np.random.default_rng(0)
    )
    np.testing.assert_array_equal(x, before)
    y = np.array([1.0, -2.0, 0.5, 4.0])
    inverse_randomized_hadamard(y, 3, 3)
    np.testing.assert_array_equal(y, [1.0, -2.0, 0.5, 4.0])
    v = np.array([-3, 5, 7])
    modular_wrap(v, 4)
    np.testing.assert_array_equal(v, [-3, 5, 7])

r"""Exact integer noise for distributed DP: the discrete Gaussian and Skellam.

The discrete Gaussian is sampled exactly (Canonne, Kamath & Steinke, NeurIPS
2020): every acceptance test is decided in integer arithmetic, never by rounding
a floating-point Gaussian. Skellam noise (Agarwal, Kairouz & Liu, NeurIPS 2021)
is the difference of two Poisson draws.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from ..checks import check_non_negative

#: A float ``sigma2`` is read as the nearest fraction with at most this denominator.
SIGMA2_DENOMINATOR = 10**6
#: Below this, an integer denominator leaves numpy's int64 fast path safely.
_INT64_SAFE = 2**62
#: The base of the digits of a uniform in [0, 1) compared lazily with a fraction.
_DIGIT = 2**62


def _bernoulli_ratio(
    num: NDArray[np.object_], den: NDArray[np.object_], rng: np.random.Generator
) -> NDArray[np.bool_]:
    """Return i.i.d. ``Bernoulli(num / den)`` draws, exactly (``0 <= num <= den``).

    Small denominators: a uniform integer ``u`` of ``[0, den)`` and ``u < num``.
    Large ones (Python ints): a uniform real of [0, 1) read one base-``2**62``
    digit at a time and compared with the digits of ``num / den`` until they
    differ (a tie, probability ``2**-62``, reads the next digit).
    """
    if num.size == 0:
        return np.zeros(0, dtype=bool)
    if int(np.max(den)) < _INT64_SAFE:
        high = den.astype(np.int64)
        return np.asarray(rng.integers(0, high) < num.astype(np.int64), dtype=bool)
    out = np.zeros(num.size, dtype=bool)
    rest = num.astype(object)
    den = den.astype(object)
    active = np.arange(num.size)
    while active.size:
        digit = rng.integers(0, _DIGIT, size=active.size).astype(object)
        scaled = rest[active] * _DIGIT
        whole = scaled // den[active]
        out[active[np.asarray(digit < whole, dtype=bool)]] = True
        tie = np.asarray(digit == whole, dtype=bool)
        rest[active[tie]] = scaled[tie] - whole[tie] * den[active][tie]
        active = active[tie]
    return out


def _bernoulli_exp_at_most_one(
    num: NDArray[np.object_], den: NDArray[np.object_], rng: np.random.Generator
) -> NDArray[np.bool_]:
    r"""Return ``Bernoulli(exp(-num/den))`` draws for ``0 <= num/den <= 1``.

    Canonne, Kamath & Steinke (2020), Alg. 1: draw ``A_k ~ Bernoulli(gamma/k)``
    for ``k = 1, 2, ...`` until the first ``A_k = 0``; output 1 iff that ``k`` is
    odd. :math:`P[k \text{ odd}] = \sum_j (-1)^j \gamma^j / j! = e^{-\gamma}`.
    """
    result = np.zeros(num.size, dtype=bool)
    active = np.arange(num.size)
    k = 1
    while active.size:
        success = _bernoulli_ratio(num[active], den[active] * k, rng)
        result[active[~success]] = k % 2 == 1
        active = active[success]
        k += 1
    return result


def _bernoulli_exp(
    num: NDArray[np.object_], den: NDArray[np.object_], rng: np.random.Generator
) -> NDArray[np.bool_]:
    """Return ``Bernoulli(exp(-num/den))`` draws for any ``num/den >= 0``.

    ``exp(-gamma) = exp(-1) ** floor(gamma) * exp(-(gamma - floor(gamma)))``: the
    draw is 1 iff ``floor(gamma)`` draws of ``Bernoulli(exp(-1))`` and one of
    ``Bernoulli(exp(-frac(gamma)))`` all are (Canonne et al. 2020, Alg. 1).
    """
    whole = num // den
    rest = num - whole * den
    remaining = whole.astype(np.int64)
    alive = np.ones(num.size, dtype=bool)
    ones = np.ones(num.size, dtype=object)
    while True:
        todo = np.flatnonzero(alive & (remaining > 0))
        if not todo.size:
            break
        alive[todo] = _bernoulli_exp_at_most_one(ones[todo], ones[todo], rng)
        remaining[todo] -= 1
    todo = np.flatnonzero(alive)
    alive[todo] = _bernoulli_exp_at_most_one(rest[todo], den[todo], rng)
    return alive


def _discrete_laplace(
    t: int, count: int, rng: np.random.Generator
) -> NDArray[np.int64]:
    """Return at most ``count`` i.i.d. draws of ``P[x] ∝ exp(-|x|/t)`` on the integers.

    Canonne et al. (2020), Alg. 2 with an integer scale ``t``, run on ``count``
    candidates at once: the rejected ones are dropped, so fewer come back.
    """
    u = rng.integers(0, t, size=count)
    keep = _bernoulli_exp_at_most_one(
        u.astype(object), np.full(count, t, dtype=object), rng
    )
    u = u[keep]
    # v counts the Bernoulli(exp(-1)) successes before the first failure.
    v = np.zeros(u.size, dtype=np.int64)
    active = np.arange(u.size)
    while active.size:
        ones = np.ones(active.size, dtype=object)
        success = _bernoulli_exp_at_most_one(ones, ones, rng)
        v[active[success]] += 1
        active = active[success]
    x = u + t * v
    negative = rng.integers(0, 2, size=x.size).astype(bool)
    keep = ~(negative & (x == 0))  # -0 would count zero twice
    return np.where(negative, -x, x)[keep].astype(np.int64)


def _sigma2_fraction(sigma2: float | Fraction) -> Fraction:
    """Return ``sigma2`` as the exact rational that discrete_gaussian uses."""
    if isinstance(sigma2, bool) or not isinstance(
        sigma2, Fraction | int | float | np.integer | np.floating
    ):
        raise ValueError(f"sigma2 must be a number or a Fraction, got {sigma2!r}")
    if isinstance(sigma2, Fraction | int | np.integer):
        value = Fraction(int(sigma2)) if not isinstance(sigma2, Fraction) else sigma2
    else:
        if not (math.isfinite(float(sigma2)) and float(sigma2) > 0):
            raise ValueError(f"sigma2 must be finite and > 0, got {sigma2!r}")
        value = Fraction(float(sigma2)).limit_denominator(SIGMA2_DENOMINATOR)
    if value <= 0:
        raise ValueError(
            f"sigma2 must be > 0 (floats are read to 1/{SIGMA2_DENOMINATOR}), "
            f"got {sigma2!r}"
        )
    return value


def _shape(size: int | tuple[int, ...]) -> tuple[int, ...]:
    shape = (size,) if isinstance(size, int | np.integer) else tuple(size)
    if any(isinstance(n, bool) or not isinstance(n, int | np.integer) for n in shape):
        raise ValueError(f"size must be an int or a tuple of ints, got {size!r}")
    if any(n < 0 for n in shape):
        raise ValueError(f"size must be >= 0, got {size!r}")
    return tuple(int(n) for n in shape)


def discrete_gaussian(
    sigma2: float | Fraction, size: int | tuple[int, ...], rng: np.random.Generator
) -> NDArray[np.int64]:
    r"""Return exact i.i.d. discrete Gaussian draws :math:`N_\mathbb{Z}(0,\sigma^2)`.

    :math:`P[X = x] \propto \exp(-x^2 / (2\sigma^2))` for every integer :math:`x`
    (Canonne, Kamath & Steinke, "The Discrete Gaussian for Differential Privacy",
    NeurIPS 2020, Alg. 3): a discrete Laplace draw :math:`Y` of scale
    :math:`t = \lfloor\sigma\rfloor + 1` is kept with probability
    :math:`\exp(-(|Y| - \sigma^2/t)^2 / (2\sigma^2))`. Every Bernoulli is drawn
    from uniform integers compared with rationals (no floating point), so the
    output has exactly the stated law for the rational :math:`\sigma^2` used.
    Its variance is slightly below :math:`\sigma^2` (Canonne et al. 2020).

    Parameters
    ----------
    sigma2 : float or fractions.Fraction
        The scale :math:`\sigma^2 > 0`. A ``Fraction`` or ``int`` is used exactly;
        a float is read as ``Fraction(sigma2).limit_denominator(10**6)``, the
        nearest rational with denominator at most :data:`SIGMA2_DENOMINATOR`
        (``0.5`` -> ``1/2``, ``2.0`` -> ``2``; any float is moved by less
        than ``1e-6``).
    size : int or tuple of int
        The shape of the output.
    rng : numpy.random.Generator
        The source of uniform integers.

    Returns
    -------
    numpy.ndarray
        ``int64`` draws of shape ``size``.

    Raises
    ------
    ValueError
        ``sigma2`` not a positive number, ``size`` not a shape.
    """
    value = _sigma2_fraction(sigma2)
    shape = _shape(size)
    total = math.prod(shape)
    p, q = value.numerator, value.denominator
    t = math.isqrt(p * q) // q + 1  # floor(sqrt(p/q)) + 1, exactly
    den_value = 2 * p * q * t * t  # gamma = (|y| t q - p)^2 / (2 p q t^2)
    found: list[NDArray[np.int64]] = []
    have = 0
    while have < total:
        want = total - have
        y = _discrete_laplace(t, 2 * want + 64, rng)
        num = (np.abs(y).astype(object) * (t * q) - p) ** 2
        den = np.full(y.size, den_value, dtype=object)
        accepted = y[_bernoulli_exp(num, den, rng)][:want]
        found.append(accepted)
        have += accepted.size
    out = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    return out.astype(np.int64).reshape(shape)


def skellam(
    mu: float, size: int | tuple[int, ...], rng: np.random.Generator
) -> NDArray[np.int64]:
    r"""Return i.i.d. Skellam draws :math:`\mathrm{Pois}(\mu/2) - \mathrm{Pois}(\mu/2)`.

    Mean 0, variance :math:`\mu` (Agarwal, Kairouz & Liu, "The Skellam Mechanism
    for Differentially Private Federated Learning", NeurIPS 2021). A sum of
    independent Skellam draws is Skellam with the summed :math:`\mu`, so
    :math:`n` clients that each add :math:`\mu` give the server :math:`n\mu`.

    Parameters
    ----------
    mu : float
        The variance :math:`\mu \geq 0` (``0`` gives zeros).
    size : int or tuple of int
        The shape of the output.
    rng : numpy.random.Generator
        The source of the two Poisson draws.

    Returns
    -------
    numpy.ndarray
        ``int64`` draws of shape ``size``.

    Raises
    ------
    ValueError
        ``mu`` negative or not finite, ``size`` not a shape.
    """
    check_non_negative("mu", mu)
    shape = _shape(size)
    half = float(mu) / 2.0
    first = rng.poisson(half, size=shape).astype(np.int64)
    second = rng.poisson(half, size=shape).astype(np.int64)
    return first - second

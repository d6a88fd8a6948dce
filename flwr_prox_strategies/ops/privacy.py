r"""Laplace noise on uploads; the integer pieces of distributed DP (no flwr).

An upload :math:`u` whose L1 sensitivity (the largest change of :math:`u`, in
the L1 norm, when one sample of the client's data changes) is :math:`\Delta`
is :math:`\varepsilon`-differentially private once every coordinate gets
independent :math:`\mathrm{Laplace}(0, b)` noise with :math:`b = \Delta /
\varepsilon` (Dwork & Roth, Thm. 3.6). Uploads compose: a client that uploads
:math:`T` times spends at most :math:`\sum_t \varepsilon_t` (basic composition).

Distributed DP under secure aggregation (Kairouz, Liu & Steinke, "The Distributed
Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation", ICML
2021; Agarwal, Kairouz & Liu, "The Skellam Mechanism for Differentially Private
Federated Learning", NeurIPS 2021) needs integer uploads: each client clips its
update, rotates it (:func:`randomized_hadamard`), scales it, rounds it to the
integers (:func:`conditional_randomized_rounding`), adds integer noise
(:func:`discrete_gaussian` or :func:`skellam`) and wraps it into
:math:`\mathbb{Z}_{2^b}` (:func:`modular_wrap`, :func:`smallest_safe_bits`); the
server unwraps the modular sum and undoes the scaling and the rotation. These
functions are the pure maths of those steps; no strategy uses them yet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray


def laplace_scale(sensitivity: float, epsilon: float) -> float:
    r"""Return the scale :math:`b = \Delta/\varepsilon` giving pure epsilon-DP."""
    if not (np.isfinite(sensitivity) and sensitivity >= 0):
        raise ValueError(f"sensitivity must be finite and >= 0, got {sensitivity!r}")
    if not (np.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon!r}")
    return float(sensitivity) / float(epsilon)


def add_laplace_noise(
    arrays: Sequence[NDArray[np.floating]], scale: float, rng: np.random.Generator
) -> list[NDArray[np.floating]]:
    """Return copies of ``arrays`` with i.i.d. ``Laplace(0, scale)`` noise added.

    The noise is drawn in float64 and the result cast back to each array's
    dtype; ``scale = 0`` returns exact copies.
    """
    if not (np.isfinite(scale) and scale >= 0):
        raise ValueError(f"scale must be finite and >= 0, got {scale!r}")
    noisy = []
    for array in arrays:
        value = np.asarray(array)
        if scale == 0 or not np.issubdtype(value.dtype, np.floating):
            noisy.append(value.copy())
            continue
        noise = rng.laplace(0.0, scale, size=value.shape)
        noisy.append((value.astype(np.float64) + noise).astype(value.dtype))
    return noisy


# --- Distributed DP under secure aggregation: integer noise, rotation, rounding ---

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
    if isinstance(mu, bool) or not (
        isinstance(mu, int | float | np.integer | np.floating)
        and math.isfinite(float(mu))
        and mu >= 0
    ):
        raise ValueError(f"mu must be finite and >= 0, got {mu!r}")
    shape = _shape(size)
    half = float(mu) / 2.0
    first = rng.poisson(half, size=shape).astype(np.int64)
    second = rng.poisson(half, size=shape).astype(np.int64)
    return first - second


def _walsh_hadamard(v: NDArray[np.float64]) -> NDArray[np.float64]:
    """Return ``H v`` for the orthonormal Sylvester Hadamard matrix (``len(v) = 2**k``).

    The butterfly: ``k`` passes, each pairing entry ``i`` with ``i + h`` inside
    blocks of ``2h`` (``h = 1, 2, 4, ...``) into their sum and difference;
    ``O(n log n)``. ``H`` is symmetric and ``H H = I``.
    """
    n = v.size
    out = v.astype(np.float64, copy=True)
    h = 1
    while h < n:
        blocks = out.reshape(-1, 2, h)
        out = np.stack(
            (blocks[:, 0, :] + blocks[:, 1, :], blocks[:, 0, :] - blocks[:, 1, :]),
            axis=1,
        ).reshape(n)
        h *= 2
    return out / math.sqrt(n)


def _signs(seed: int, n: int) -> NDArray[np.float64]:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    return rng.integers(0, 2, size=n).astype(np.float64) * 2.0 - 1.0


def randomized_hadamard(x: NDArray[np.floating], seed: int) -> NDArray[np.float64]:
    r"""Return :math:`H D x`: ``x`` zero-padded to a power of two, flipped, rotated.

    :math:`D` is a diagonal of random signs from ``numpy.random.default_rng(seed)``
    and :math:`H` the orthonormal Walsh-Hadamard matrix, so the map is a rotation
    (it keeps the L2 norm) that spreads the mass of ``x`` over the coordinates,
    making them small and alike before rounding (Kairouz et al. 2021).

    Parameters
    ----------
    x : numpy.ndarray
        A 1-D finite vector of length :math:`d \geq 1`.
    seed : int
        The seed of the signs (clients and server share it).

    Returns
    -------
    numpy.ndarray
        The ``float64`` rotated vector, of length the next power of two :math:`\geq d`.

    Raises
    ------
    ValueError
        ``x`` not 1-D, empty or not finite; ``seed`` not an int ``>= 0``.
    """
    vector = np.asarray(x)
    if vector.ndim != 1 or vector.size == 0:
        raise ValueError(f"x must be a non-empty 1-D vector, got shape {vector.shape}")
    vector = vector.astype(np.float64)
    if not np.all(np.isfinite(vector)):
        raise ValueError("x must be finite")
    n = 1 << (vector.size - 1).bit_length()
    padded = np.zeros(n, dtype=np.float64)
    padded[: vector.size] = vector
    return _walsh_hadamard(_signs(seed, n) * padded)


def inverse_randomized_hadamard(
    y: NDArray[np.floating], seed: int, dim: int
) -> NDArray[np.float64]:
    r"""Return :math:`(D H y)_{:d}`, undoing :func:`randomized_hadamard`.

    :math:`H` is symmetric and orthonormal and :math:`D^2 = I`, so
    :math:`D H (H D x) = x`; the padding is cropped.

    Parameters
    ----------
    y : numpy.ndarray
        A 1-D vector whose length is a power of two.
    seed : int
        The seed the forward rotation used.
    dim : int
        The length :math:`d` of the original vector, at most ``len(y)``.

    Returns
    -------
    numpy.ndarray
        The ``float64`` vector of length ``dim``.

    Raises
    ------
    ValueError
        ``y`` not 1-D or not of a power-of-two length; ``dim`` outside
        ``[1, len(y)]``; ``seed`` not an int ``>= 0``.
    """
    vector = np.asarray(y)
    n = vector.size
    if vector.ndim != 1 or n == 0 or n & (n - 1):
        raise ValueError(f"y must be 1-D of a power-of-two length, got {vector.shape}")
    if (
        isinstance(dim, bool)
        or not isinstance(dim, int | np.integer)
        or not 1 <= dim <= n
    ):
        raise ValueError(f"dim must be an int in [1, {n}], got {dim!r}")
    return (_signs(seed, n) * _walsh_hadamard(vector.astype(np.float64)))[: int(dim)]


def _positive_finite(name: str, value: float, *, allow_zero: bool = False) -> float:
    number = isinstance(value, int | float | np.integer | np.floating)
    if isinstance(value, bool) or not (number and math.isfinite(float(value))):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if float(value) < 0 or (float(value) == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return float(value)


def rounding_norm_bound(norm_bound: float, dim: int, beta: float) -> float:
    r"""Return the L2 bound that conditional randomised rounding enforces.

    For :math:`x \in \mathbb{R}^d` with :math:`\|x\|_2 \leq c`, the unbiased
    randomised rounding :math:`\tilde x` satisfies, with probability at least
    :math:`1 - \beta`,

    .. math::

        \|\tilde x\|_2^2 \leq c^2 + \frac{d}{4}
        + \sqrt{2 \log(1/\beta)} \left(c + \frac{\sqrt d}{2}\right),

    and always :math:`\|\tilde x\|_2 \leq c + \sqrt d` (every coordinate moves by
    less than 1). The bound is the smaller of the two (Kairouz, Liu & Steinke,
    ICML 2021, the conditional rounding step of the client's algorithm):

    .. math::

        \Delta_2 = \min\left\{c + \sqrt d,\;
        \sqrt{c^2 + \tfrac{d}{4} + \sqrt{2\log(1/\beta)}
        \left(c + \tfrac{\sqrt d}{2}\right)}\right\}.

    It bounds the L2 norm of one client's integer upload, whatever its data: what
    the privacy analysis of the noisy sum takes as that client's contribution.

    Parameters
    ----------
    norm_bound : float
        :math:`c \geq 0`, the clipping bound of the (already scaled) vectors.
    dim : int
        The dimension :math:`d \geq 1`.
    beta : float
        :math:`\beta \in (0, 1)`, the probability that one rounding misses it.

    Returns
    -------
    float
        :math:`\Delta_2`.

    Raises
    ------
    ValueError
        ``norm_bound`` negative, ``dim < 1``, ``beta`` outside ``(0, 1)``.
    """
    c = _positive_finite("norm_bound", norm_bound, allow_zero=True)
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise ValueError(f"dim must be an int >= 1, got {dim!r}")
    number = isinstance(beta, int | float | np.integer | np.floating)
    if isinstance(beta, bool) or not (number and 0 < float(beta) < 1):
        raise ValueError(f"beta must be in (0, 1), got {beta!r}")
    root_d = math.sqrt(int(dim))
    tail = math.sqrt(2 * math.log(1 / float(beta)))
    squared = c * c + int(dim) / 4 + tail * (c + root_d / 2)
    return min(c + root_d, math.sqrt(squared))


def conditional_randomized_rounding(
    x: NDArray[np.floating],
    *,
    beta: float,
    norm_bound: float,
    rng: np.random.Generator,
    max_tries: int = 100,
) -> NDArray[np.int64]:
    r"""Round ``x`` to integers, unbiasedly, redrawing until within :math:`\Delta_2`.

    Each coordinate becomes :math:`\lfloor x_i \rfloor + 1` with probability
    :math:`x_i - \lfloor x_i \rfloor` and :math:`\lfloor x_i \rfloor` otherwise
    (so :math:`E[\tilde x] = x`); the whole vector is drawn again while
    :math:`\|\tilde x\|_2 > \Delta_2` (:func:`rounding_norm_bound` of
    ``norm_bound``, ``len(x)`` and ``beta``; Kairouz, Liu & Steinke, ICML 2021).
    A draw is refused with probability at most ``beta``, so the conditioning
    moves the mean by at most about ``beta``. The bound uses the clipping bound
    :math:`c`, not :math:`\|x\|_2`: the sensitivity must not depend on the data.
    The up/down choice compares ``rng.random()`` with the float fractional part.

    Parameters
    ----------
    x : numpy.ndarray
        A 1-D finite vector, already rotated and scaled, with
        :math:`\|x\|_2 \leq` ``norm_bound``.
    beta : float
        :math:`\beta \in (0, 1)` of the bound.
    norm_bound : float
        The clipping bound :math:`c` of ``x`` (in the scaled units).
    rng : numpy.random.Generator
        The source of the rounding.
    max_tries : int
        The number of draws before giving up (each fails with probability at most
        ``beta``).

    Returns
    -------
    numpy.ndarray
        The ``int64`` rounded vector, of L2 norm at most :math:`\Delta_2`.

    Raises
    ------
    ValueError
        ``x`` not 1-D, empty, not finite or longer than ``norm_bound``; ``beta``
        outside ``(0, 1)``; ``norm_bound`` negative; ``max_tries < 1``.
    RuntimeError
        No draw within ``max_tries`` met the bound.
    """
    vector = np.asarray(x)
    if vector.ndim != 1 or vector.size == 0:
        raise ValueError(f"x must be a non-empty 1-D vector, got shape {vector.shape}")
    vector = vector.astype(np.float64)
    if not np.all(np.isfinite(vector)) or np.max(np.abs(vector)) >= 2.0**62:
        raise ValueError("x must be finite and below 2**62 in magnitude")
    bound = rounding_norm_bound(norm_bound, vector.size, beta)
    if float(np.linalg.norm(vector)) > float(norm_bound) * (1 + 1e-9) + 1e-12:
        raise ValueError(
            f"x has L2 norm {float(np.linalg.norm(vector))!r} above norm_bound "
            f"{norm_bound!r}; clip it first"
        )
    tries = isinstance(max_tries, int | np.integer) and not isinstance(max_tries, bool)
    if not (tries and max_tries >= 1):
        raise ValueError(f"max_tries must be an int >= 1, got {max_tries!r}")
    floor = np.floor(vector)
    fraction = vector - floor
    for _ in range(int(max_tries)):
        rounded = floor + (rng.random(vector.size) < fraction)
        if float(np.linalg.norm(rounded)) <= bound:
            return rounded.astype(np.int64)
    raise RuntimeError(
        f"no rounding within the L2 bound {bound!r} in max_tries={max_tries} draws"
    )


def _bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer):
        raise ValueError(f"bits must be an int in [2, 62], got {bits!r}")
    if not 2 <= bits <= 62:
        raise ValueError(f"bits must be in [2, 62], got {bits!r}")
    return int(bits)


def _integers(name: str, v: NDArray[np.integer]) -> NDArray[np.int64]:
    array = np.asarray(v)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64)


def modular_wrap(v: NDArray[np.integer], bits: int) -> NDArray[np.int64]:
    r"""Return ``v`` modulo :math:`2^b`, in :math:`[0, 2^b)`, for secure aggregation.

    Sums of wrapped vectors, taken modulo :math:`2^b`, equal the wrapped true sum;
    :func:`modular_unwrap` recovers that sum when it lies in
    :math:`[-2^{b-1}, 2^{b-1})`.

    Parameters
    ----------
    v : numpy.ndarray
        Signed integers (any integer dtype, within int64).
    bits : int
        The bit width :math:`b \in [2, 62]` (62 leaves int64 room to add two
        wrapped values before reducing).

    Returns
    -------
    numpy.ndarray
        ``int64`` values in :math:`[0, 2^b)`, of the shape of ``v``.

    Raises
    ------
    ValueError
        ``v`` not integers, ``bits`` outside ``[2, 62]``.
    """
    width = _bits(bits)
    return np.mod(_integers("v", v), np.int64(1) << width)


def modular_unwrap(v: NDArray[np.integer], bits: int) -> NDArray[np.int64]:
    r"""Return the centred representative in :math:`[-2^{b-1}, 2^{b-1})` of each ``v``.

    The inverse of :func:`modular_wrap` on that range.

    Parameters
    ----------
    v : numpy.ndarray
        Integers in :math:`[0, 2^b)`.
    bits : int
        The bit width :math:`b \in [2, 62]`.

    Returns
    -------
    numpy.ndarray
        ``int64`` values, of the shape of ``v``.

    Raises
    ------
    ValueError
        ``v`` not integers or outside :math:`[0, 2^b)`, ``bits`` outside ``[2, 62]``.
    """
    width = _bits(bits)
    array = _integers("v", v)
    modulus = np.int64(1) << width
    if array.size and (array.min() < 0 or array.max() >= modulus):
        raise ValueError(f"v must lie in [0, 2**{width}) to unwrap")
    return np.where(array >= modulus // 2, array - modulus, array)


def smallest_safe_bits(
    *,
    num_clients: int,
    linf_bound: float,
    noise_stddev: float,
    num_stddevs: float = 6.0,
) -> int:
    r"""Return the smallest bit width whose centred range holds the noisy sum, w.h.p.

    Each of :math:`n` clients uploads integers with :math:`|v_j| \leq B` (the
    L2 bound :math:`\Delta_2` of :func:`rounding_norm_bound` is always a valid
    :math:`B`) plus noise of standard deviation :math:`\sigma` per coordinate.
    A coordinate of the sum is at most :math:`M = nB + k\sqrt{n}\sigma` in
    magnitude unless its noise exceeds :math:`k` standard deviations of the
    summed noise; the discrete Gaussian is sub-Gaussian with variance proxy
    :math:`\sigma^2` (Canonne, Kamath & Steinke 2020), so that has probability at
    most :math:`2e^{-k^2/2}` per coordinate (for Skellam, about that). The width
    is the smallest :math:`b \geq 2` with :math:`M < 2^{b-1}`, so every integer
    of :math:`[-M, M]` unwraps to itself.

    Parameters
    ----------
    num_clients : int
        :math:`n \geq 1`.
    linf_bound : float
        :math:`B \geq 0`, a bound on every coordinate of one client's rounded
        upload before noise.
    noise_stddev : float
        :math:`\sigma \geq 0`, one client's noise standard deviation per
        coordinate (``sqrt(sigma2)`` or ``sqrt(mu)``).
    num_stddevs : float
        :math:`k > 0`.

    Returns
    -------
    int
        The bit width :math:`b`.

    Raises
    ------
    ValueError
        A parameter out of range, or :math:`M` needing more than 62 bits.
    """
    clients = isinstance(num_clients, int | np.integer)
    if isinstance(num_clients, bool) or not (clients and num_clients >= 1):
        raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
    bound = _positive_finite("linf_bound", linf_bound, allow_zero=True)
    stddev = _positive_finite("noise_stddev", noise_stddev, allow_zero=True)
    k = _positive_finite("num_stddevs", num_stddevs)
    largest = int(num_clients) * bound + k * math.sqrt(int(num_clients)) * stddev
    for width in range(2, 63):
        if largest < 2 ** (width - 1):
            return width
    raise ValueError(
        f"the sum may reach {largest!r}, beyond 62 bits: lower linf_bound, "
        "noise_stddev or num_clients"
    )

r"""Integer uploads for distributed DP: rotation, rounding, modular wrapping.

A client's clipped update is rotated (:func:`randomized_hadamard`, so that no
coordinate carries much of its norm), scaled, rounded to the integers without
bias and within a norm bound (:func:`conditional_randomized_rounding`, Kairouz,
Liu & Steinke, ICML 2021) and wrapped into :math:`\mathbb{Z}_{2^b}`
(:func:`modular_wrap`, :func:`smallest_safe_bits`) for secure aggregation.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from ..checks import check_int, check_non_negative, check_positive, check_probability


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
    rng = np.random.default_rng(check_int("seed", seed, 0))
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
    c = check_non_negative("norm_bound", norm_bound)
    check_int("dim", dim, 1)
    check_probability("beta", beta)
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


def bit_width(bits: int) -> int:
    """Return ``bits`` as an int, refusing a width outside ``[2, 62]`` by name."""
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
    width = bit_width(bits)
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
    width = bit_width(bits)
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
    bound = check_non_negative("linf_bound", linf_bound)
    stddev = check_non_negative("noise_stddev", noise_stddev)
    k = check_positive("num_stddevs", num_stddevs)
    largest = int(num_clients) * bound + k * math.sqrt(int(num_clients)) * stddev
    for width in range(2, 63):
        if largest < 2 ** (width - 1):
            return width
    raise ValueError(
        f"the sum may reach {largest!r}, beyond 62 bits: lower linf_bound, "
        "noise_stddev or num_clients"
    )

r"""SecAgg+'s neighbourhood size: the smallest ring keeping a round private and whole.

SecAgg+ (Bell et al., CCS 2020, "Secure single-server aggregation with
(poly)logarithmic overhead") masks each client only with its neighbours in a
random graph, so its cost grows as :math:`O(\log n)` instead of :math:`O(n)`.
The pack's graph is a ring: the ``n`` sampled nodes in a uniformly random
order, each with the :math:`h = \lfloor k/2 \rfloor` nodes on either side (a
Harary graph; ``k = 2h + 1`` counts the node itself). Among the ``n`` nodes,
:math:`C = \lceil \gamma n \rceil` are corrupt (they collude with the server)
and :math:`D = \lceil \delta n \rceil` drop out (rounded up: one of five, not
none). :func:`neighbourhood_size` returns the smallest odd ``k`` and a
threshold ``t > k/2`` for which, computed exactly for this ring
(hypergeometric tails, union bounds over the nodes):

(a) privacy: :math:`n \, P[X_a \ge t] \le 2^{-\sigma}`, :math:`X_a \sim
    \mathrm{Hyp}(n - 1, C, k - 1)` the corrupt nodes among a node's ``k - 1``
    neighbours (``t`` of them could rebuild both its secrets);
(b) connectivity: the honest survivors stay connected, or the server learns
    the sums of the parts. On the ring they split iff two disjoint runs of
    ``h`` consecutive nodes are all removed (corrupt or dropped, :math:`R = C +
    D`); at most :math:`n^2/2` pairs of such runs, each removed with
    probability :math:`\prod_{i<2h} (R - i)/(n - i) \le (R/n)^{2h}`: require
    :math:`\frac{n^2}{2} \prod_{i<2h} \frac{R-i}{n-i} \le 2^{-\sigma}`;
(c) correctness: :math:`n \, P[X_c \ge k - t] \le 2^{-\eta}`, :math:`X_c \sim
    \mathrm{Hyp}(n - 1, D, k - 1)` the dropped nodes among a node's
    neighbours: a secret needs ``t`` surviving holders (the node itself not
    counted, and all ``D`` dropped among the others: conservative for every
    node).

:math:`\sigma = 40` is the statistical security parameter Bell et al. use;
:math:`\eta = 20` bounds a round that cannot be unmasked (it then keeps the
previous model: a cost, no leak) to one in a million. ``k`` grows as
:math:`\log n`; when no ``k < n`` qualifies, every node masks with every
other (``k = n``: SecAgg).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from ..checks import check_positive

#: Bell et al.'s statistical security parameter: privacy fails w.p. <= 2**-40.
SECURITY_BITS = 40
#: A round fails to unmask with probability at most 2**-20.
CORRECTNESS_BITS = 20
#: The fraction of sampled clients assumed to collude with the server.
CORRUPT_FRACTION = 0.1
#: The fraction of sampled clients assumed to drop out during a round.
DROPOUT_FRACTION = 0.1


class Neighbourhood(NamedTuple):
    """A round's neighbourhood size ``k`` (the node included) and threshold ``t``."""

    size: int
    threshold: int


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def hypergeometric_tail(
    population: int, marked: int, draws: int, at_least: int
) -> float:
    """Return ``P[X >= at_least]``, ``X`` the marked among ``draws`` drawn unordered.

    Parameters
    ----------
    population : int
        Items to draw from.
    marked : int
        Marked items among them.
    draws : int
        Items drawn without replacement.
    at_least : int
        The least count of marked items drawn.

    Returns
    -------
    float
        The tail probability, summed term by term (exact up to rounding).
    """
    low = max(at_least, 0, draws - (population - marked))
    high = min(marked, draws)
    if low > high:
        return 0.0
    total = _log_comb(population, draws)
    return min(
        1.0,
        math.fsum(
            math.exp(
                _log_comb(marked, j) + _log_comb(population - marked, draws - j) - total
            )
            for j in range(low, high + 1)
        ),
    )


def runs_removed(n: int, removed: int, run: int) -> float:
    """Return ``P[two given disjoint runs of `run` nodes are all removed]``.

    Parameters
    ----------
    n : int
        Nodes on the ring.
    removed : int
        Nodes removed, uniformly at random.
    run : int
        The length ``h`` of each run.
    """
    if 2 * run > removed:
        return 0.0
    p = 1.0
    for i in range(2 * run):
        p *= (removed - i) / (n - i)
    return p


def _counts(
    n: int, corrupt_fraction: float, dropout_fraction: float
) -> tuple[int, int]:
    # Rounded up: a positive fraction of a small federation is one node, not
    # none (round(0.1 * 5) = 0 would assume a server colluding with nobody).
    corrupt = math.ceil(round(corrupt_fraction * n, 9))
    return corrupt, min(n - corrupt, math.ceil(round(dropout_fraction * n, 9)))


def privacy_failure(n: int, size: int, threshold: int, corrupt: int) -> float:
    """Return the union bound (a): some node has ``threshold`` corrupt neighbours.

    Parameters
    ----------
    n : int
        Sampled nodes.
    size : int
        ``k``, the neighbourhood (the node included).
    threshold : int
        ``t``.
    corrupt : int
        Corrupt nodes among the ``n``.
    """
    return n * hypergeometric_tail(n - 1, corrupt, size - 1, threshold)


def disconnection_failure(n: int, size: int, removed: int) -> float:
    """Return the union bound (b): the survivors of the ring split in two.

    Parameters
    ----------
    n : int
        Sampled nodes.
    size : int
        ``k``, the neighbourhood (the node included).
    removed : int
        Corrupt and dropped nodes together.
    """
    if size >= n:
        return 0.0  # everyone with everyone: one part
    return n * n / 2 * runs_removed(n, removed, size // 2)


def correctness_failure(n: int, size: int, threshold: int, dropped: int) -> float:
    """Return the union bound (c): some node keeps fewer than ``threshold`` holders.

    Parameters
    ----------
    n : int
        Sampled nodes.
    size : int
        ``k``, the neighbourhood (the node included).
    threshold : int
        ``t``.
    dropped : int
        Nodes that drop out among the ``n``.
    """
    return n * hypergeometric_tail(n - 1, dropped, size - 1, size - threshold)


def check_settings(
    *,
    threshold: float | None,
    security_bits: float,
    correctness_bits: float,
    corrupt_fraction: float,
    dropout_fraction: float,
) -> None:
    """Raise ValueError naming the first setting :func:`neighbourhood_size` refuses.

    Parameters
    ----------
    threshold : int | float | None
        A fraction in (0, 1], a count, or None (at most one half, no ``k < n``
        qualifies).
    security_bits : float
        ``sigma`` > 0.
    correctness_bits : float
        ``eta`` > 0.
    corrupt_fraction : float
        ``gamma`` in [0, 0.5).
    dropout_fraction : float
        ``delta`` in [0, 0.5).
    """
    check_positive("security_bits", security_bits)
    check_positive("correctness_bits", correctness_bits)
    # Above one half, no threshold above half a neighbourhood keeps out the
    # corrupt (or lets the survivors in), at any size.
    for name, value in (
        ("corrupt_fraction", corrupt_fraction),
        ("dropout_fraction", dropout_fraction),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0.0 <= value < 0.5
        ):
            raise ValueError(f"{name} must be a number in [0, 0.5), got {value!r}")
    if threshold is not None and (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or (isinstance(threshold, float) and not 0.0 < threshold <= 1.0)
        or (isinstance(threshold, int) and threshold < 1)
    ):
        raise ValueError(
            "reconstruction_threshold must be None, a fraction in (0, 1] or a "
            f"count >= 1, got {threshold!r}"
        )


def fraction_threshold(fraction: float, size: int) -> int:
    """Return ``ceil(fraction * size)``, at least 2 (0.6 of 4 is 3, not 2).

    Parameters
    ----------
    fraction : float
        The threshold as a fraction of the neighbourhood.
    size : int
        The neighbourhood.
    """
    return max(2, math.ceil(round(fraction * size, 9)))


@functools.lru_cache(maxsize=256)
def neighbourhood_size(
    n: int,
    *,
    threshold: int | float | None = None,
    security_bits: float = SECURITY_BITS,
    correctness_bits: float = CORRECTNESS_BITS,
    corrupt_fraction: float = CORRUPT_FRACTION,
    dropout_fraction: float = DROPOUT_FRACTION,
    everyone_threshold: float = 0.6,
) -> Neighbourhood:
    """Return the smallest ring neighbourhood and its threshold for ``n`` nodes.

    The smallest odd ``k < n`` with a threshold ``t > k/2`` meeting (a), (b)
    and (c) of the module's docstring; the least such ``t`` (it survives the
    most dropouts). When none does, ``k = n`` (everyone) and ``t`` from
    ``threshold``, or ``everyone_threshold`` (SecAgg's default 0.6) if None.

    Parameters
    ----------
    n : int
        The round's sampled nodes (>= 1).
    threshold : int | float | None
        A fixed fraction of the neighbourhood (``t = ceil(threshold * k)``,
        at least 2), a fixed count, or None to choose the least ``t`` that
        qualifies.
    security_bits : float
        ``sigma``: (a) and (b) fail with probability at most ``2**-sigma``.
    correctness_bits : float
        ``eta``: (c) fails with probability at most ``2**-eta``.
    corrupt_fraction : float
        ``gamma``: the fraction of the ``n`` colluding with the server.
    dropout_fraction : float
        ``delta``: the fraction of the ``n`` that drop out.
    everyone_threshold : float
        The threshold's fraction when everyone masks with everyone and
        ``threshold`` is None.

    Returns
    -------
    Neighbourhood
        ``(size, threshold)``.

    Raises
    ------
    ValueError
        ``n`` below 1 or a setting out of range (named).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    check_settings(
        threshold=threshold,
        security_bits=security_bits,
        correctness_bits=correctness_bits,
        corrupt_fraction=corrupt_fraction,
        dropout_fraction=dropout_fraction,
    )
    corrupt, dropped = _counts(n, corrupt_fraction, dropout_fraction)
    secure, correct = 2.0**-security_bits, 2.0**-correctness_bits
    for size in range(3, n, 2):
        if disconnection_failure(n, size, corrupt + dropped) > secure:
            continue
        candidates = (
            range(size // 2 + 1, size + 1)
            if threshold is None
            else [_threshold_at(threshold, size)]
        )
        for t in candidates:
            if 2 * t <= size or t > size:
                continue
            if privacy_failure(n, size, t, corrupt) > secure:
                continue  # a larger t may pass
            if correctness_failure(n, size, t, dropped) <= correct:
                return Neighbourhood(size, t)
            break  # larger t only lose more to dropouts
    # As SecAgg's own sizing: a threshold above ``n`` fails the round, named.
    return Neighbourhood(
        n, _threshold_at(everyone_threshold if threshold is None else threshold, n)
    )


def _threshold_at(threshold: int | float, size: int) -> int:
    if isinstance(threshold, int):
        return threshold
    return fraction_threshold(threshold, size)

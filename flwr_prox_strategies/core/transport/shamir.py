r"""Shamir secret sharing over GF(2^31 - 1), with error-correcting recovery.

The scheme, the field, the encoding of bytes and the Berlekamp–Welch recovery
of :func:`recover`: ``docs/explanation/secure-aggregation.md``.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

#: The field's modulus: the Mersenne prime 2**31 - 1.
PRIME = 2**31 - 1
_PIECE = 3  # secret bytes per field element: 2**24 < PRIME
_Elements = NDArray[np.int64]


class ShamirError(ValueError):
    """No ``threshold`` of the shares given rebuild a valid secret."""


@dataclass(frozen=True)
class Recovery:
    """A recovered secret and the holders whose shares disagree with it.

    Attributes
    ----------
    secret : bytes
        The secret, which passed the caller's ``valid`` check.
    disagreeing : tuple of int
        The x of every share that is malformed or off the dealer's
        polynomials, sorted.
    """

    secret: bytes
    disagreeing: tuple[int, ...]


def split(secrets: Sequence[bytes], threshold: int, num: int) -> list[list[bytes]]:
    """Share every secret among ``num`` holders, any ``threshold`` rebuilding it.

    Parameters
    ----------
    secrets : Sequence of bytes
        The secrets, of any lengths (also 0).
    threshold : int
        The number of shares that rebuild a secret, ``1 <= threshold <= num``.
    num : int
        The number of holders, below :data:`PRIME`.

    Returns
    -------
    list of list of bytes
        ``shares[i][j]``: holder ``j``'s share of ``secrets[i]``, the
        secret's polynomials at ``x = j + 1`` as little-endian uint32. The
        share holds no x: the caller gives it back with the holder's position.
    """
    if not 1 <= num < PRIME:
        raise ValueError(f"num must be in [1, {PRIME}), got {num!r}")
    if not 1 <= threshold <= num:
        raise ValueError(f"threshold must be in [1, num={num}], got {threshold!r}")
    if any(len(secret) >= PRIME for secret in secrets):
        raise ValueError(f"secrets must be shorter than {PRIME} bytes")
    vectors = [_encode(bytes(secret)) for secret in secrets]
    constants = np.concatenate([np.zeros(0, np.int64), *vectors])
    coefficients = _random_elements(constants.size * (threshold - 1))
    rows = [constants, *coefficients.reshape(threshold - 1, constants.size)]
    x = np.arange(1, num + 1, dtype=np.int64)[:, None]
    values = np.zeros((num, constants.size), np.int64)
    for row in reversed(rows):  # Horner; each step stays below 2**63
        values = (values * x + row) % PRIME
    ends = np.cumsum([vector.size for vector in vectors])
    return [
        [values[j, end - vector.size : end].astype("<u4").tobytes() for j in range(num)]
        for vector, end in zip(vectors, ends, strict=True)
    ]


def combine(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """Rebuild a secret from the first ``threshold`` shares, trusting them.

    Parameters
    ----------
    shares : Mapping of int to bytes
        x (the holder's position + 1) -> share.
    threshold : int
        The sharing's threshold: this many shares are used, the rest ignored.

    Returns
    -------
    bytes
        The secret the shares interpolate to.
    """
    _checked(threshold, list(shares))
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares, fewer than the threshold {threshold}")
    chosen = list(shares.items())[:threshold]
    values = [_parse(share) for _, share in chosen]
    if len({value.size for value in values}) > 1:
        raise ValueError("the shares differ in length")
    nodes = np.array([x for x, _ in chosen], np.int64)
    return _decode(_evaluate(nodes, np.stack(values), np.zeros(1, np.int64))[0])


def recover(
    shares: Mapping[int, bytes],
    threshold: int,
    valid: Callable[[bytes], bool] = lambda secret: True,
    max_subsets: int = 20_000,
) -> Recovery:
    """Rebuild a secret from shares some of which may be wrong, and name those.

    Parameters
    ----------
    shares : Mapping of int to bytes
        x (the holder's position + 1) -> share; malformed ones are allowed.
    threshold : int
        The sharing's threshold.
    valid : Callable[[bytes], bool]
        The caller's check of a candidate secret (e.g. against a hash
        commitment); a candidate that fails it is never returned. Beyond the
        decoding radius only this check tells the right subset of shares.
    max_subsets : int
        Search subsets of ``threshold`` shares only if there are at most
        this many (default: 20 000).

    Returns
    -------
    Recovery
        The secret and every share that disagrees with it. It is found
        whenever ``threshold`` shares are good and either at most
        ``(N - threshold) // 2`` of the ``N`` shares are bad or
        ``C(N, threshold) <= max_subsets``.
    """
    _checked(threshold, list(shares))
    parsed, malformed = {}, []
    for x, share in shares.items():
        try:
            parsed[x] = _parse(share)
        except ValueError:
            malformed.append(x)
    by_size: dict[int, list[int]] = {}
    for x, value in parsed.items():
        by_size.setdefault(value.size, []).append(x)
    # The good shares' length first: it is the most common one when the bad
    # shares are fewer than the good ones.
    for size, xs in sorted(by_size.items(), key=lambda item: -len(item[1])):
        if len(xs) < threshold:
            continue
        nodes, values = np.array(xs, np.int64), np.stack([parsed[x] for x in xs])
        found = _recover_aligned(nodes, values, threshold, valid, max_subsets)
        if found is not None:
            others = [x for x in parsed if parsed[x].size != size]
            return Recovery(found[0], tuple(sorted(malformed + others + found[1])))
    raise ShamirError(
        f"{len(shares)} shares, threshold {threshold}: no {threshold} of them "
        f"rebuild a valid secret (fewer than {threshold} good shares, or more bad "
        f"ones than decoding corrects and over max_subsets={max_subsets} subsets)"
    )


def recover_many(
    sharings: Sequence[tuple[Mapping[int, bytes], Callable[[bytes], bool]]],
    threshold: int,
    max_subsets: int = 20_000,
) -> list[Recovery | ShamirError]:
    """Run :func:`recover` on many secrets at once; the same answers.

    The common case is vectorised over the secrets: every share well-formed and
    of one length, the first ``threshold`` shares rebuilding a valid secret
    that at most ``(N - threshold) // 2`` shares disagree with. Secrets of the
    same share count and length are interpolated together (one pass per
    share, over all of them); any other secret goes through :func:`recover`.

    Parameters
    ----------
    sharings : Sequence of (Mapping of int to bytes, Callable[[bytes], bool])
        Each secret's shares (x -> share) and its ``valid`` check.
    threshold : int
        The sharings' threshold.
    max_subsets : int
        As :func:`recover`'s (default: 20 000).

    Returns
    -------
    list of Recovery or ShamirError
        One per secret, in order: its recovery, or the error :func:`recover`
        raises for it.
    """
    results: list[Recovery | ShamirError | None] = [None] * len(sharings)
    groups: dict[tuple[int, int], list[tuple[int, _Elements, _Elements]]] = {}
    for index, (shares, _) in enumerate(sharings):
        _checked(threshold, list(shares))
        try:
            parsed = [_parse(share) for share in shares.values()]
        except ValueError:
            continue  # malformed: recover() sorts it out
        if len(parsed) < threshold or len({v.size for v in parsed}) != 1:
            continue
        groups.setdefault((len(parsed), parsed[0].size), []).append(
            (index, np.array(list(shares), np.int64), np.stack(parsed))
        )
    for (count, _), members in groups.items():
        nodes = np.stack([m[1] for m in members])
        values = np.stack([m[2] for m in members])
        # Every secret's polynomials through its first t shares, at 0 and at
        # the x of each of its other shares.
        at = np.concatenate(
            [np.zeros((len(members), 1), np.int64), nodes[:, threshold:]], 1
        )
        found = _evaluate_many(nodes[:, :threshold], values[:, :threshold], at)
        radius = (count - threshold) // 2
        for row, (index, member_nodes, _) in enumerate(members):
            try:
                secret = _decode(found[row, 0])
            except ValueError:
                continue
            if not sharings[index][1](secret):
                continue
            off = np.any(found[row, 1:] != values[row, threshold:], axis=1)
            if int(off.sum()) <= radius:
                bad = sorted(int(x) for x in member_nodes[threshold:][off])
                results[index] = Recovery(secret, tuple(bad))
    out: list[Recovery | ShamirError] = []
    for index, result in enumerate(results):
        if result is None:
            shares, valid = sharings[index]
            try:
                result = recover(shares, threshold, valid, max_subsets)
            except ShamirError as err:
                result = err
        out.append(result)
    return out


def _evaluate_many(nodes: _Elements, values: _Elements, at: _Elements) -> _Elements:
    """Return :func:`_evaluate` of many sharings at once, shaped (m, a, L).

    ``nodes`` is (m, t), ``values`` (m, t, L) and ``at`` (m, a): sharing ``i``'s
    polynomials through ``(nodes[i, j], values[i, j])`` at ``at[i]``.
    """
    m, t = nodes.shape
    numerators = np.ones((m, at.shape[1], t), np.int64)
    denominators = np.ones((m, t), np.int64)
    for i in range(t):
        factor = (at[:, :, None] - nodes[:, i, None, None]) % PRIME
        factor = np.broadcast_to(factor, numerators.shape).copy()
        factor[:, :, i] = 1
        numerators = numerators * factor % PRIME
        difference = (nodes - nodes[:, i, None]) % PRIME
        difference[:, i] = 1
        denominators = denominators * difference % PRIME
    basis = numerators * _inverse(denominators)[:, None, :] % PRIME
    result = np.zeros((m, at.shape[1], values.shape[2]), np.int64)
    for j in range(t):
        result = (result + basis[:, :, j, None] * values[:, j, None, :]) % PRIME
    return result


def _inverse(elements: _Elements) -> _Elements:
    """Return each element's inverse mod p (Fermat: ``e**(p - 2)``), vectorised."""
    result = np.ones_like(elements)
    base = elements % PRIME
    exponent = PRIME - 2
    while exponent:
        if exponent & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        exponent >>= 1
    return result


def _recover_aligned(
    nodes: _Elements,
    values: _Elements,
    threshold: int,
    valid: Callable[[bytes], bool],
    max_subsets: int,
) -> tuple[bytes, list[int]] | None:
    """Recover from well-formed shares of one length: the secret and bad x's."""
    radius = (len(nodes) - threshold) // 2
    # Two polynomials of degree < t that each agree with N - radius shares
    # meet at >= t points, so are one: such a candidate is the dealer's.
    found = _attempt(nodes, values, list(range(threshold)), valid)
    if found is not None and len(found[1]) <= radius:
        return found
    if radius:
        # Coefficients drawn after the shares arrived: no holder can aim at them.
        mixed = (values * _random_elements(values.shape[1]) % PRIME).sum(1) % PRIME
        good = _error_free(nodes, mixed, threshold, radius)
        if good is not None:
            found = _attempt(nodes, values, good[:threshold], valid)
            if found is not None and len(found[1]) <= radius:
                return found
    if math.comb(len(nodes), threshold) <= max_subsets:
        for subset in itertools.combinations(range(len(nodes)), threshold):
            found = _attempt(nodes, values, list(subset), valid)
            if found is not None:
                return found
    return None


def _attempt(
    nodes: _Elements,
    values: _Elements,
    chosen: list[int],
    valid: Callable[[bytes], bool],
) -> tuple[bytes, list[int]] | None:
    """Interpolate from ``chosen``; if valid, the secret and the x's off it."""
    at_zero = _evaluate(nodes[chosen], values[chosen], np.zeros(1, np.int64))
    try:
        secret = _decode(at_zero[0])
    except ValueError:
        return None
    if not valid(secret):
        return None
    rest = np.setdiff1d(np.arange(len(nodes)), chosen)
    predicted = _evaluate(nodes[chosen], values[chosen], nodes[rest])
    off = np.any(predicted != values[rest], axis=1)
    return secret, [int(x) for x in nodes[rest][off]]


def _error_free(
    nodes: _Elements, received: _Elements, threshold: int, errors: int
) -> list[int] | None:
    r"""Berlekamp–Welch: positions surely right if at most ``errors`` are wrong.

    Solves :math:`Q(x_i) = y_i E(x_i)` with :math:`E` monic of degree
    ``errors`` and :math:`\deg Q <` ``errors + threshold``. Any solution has
    :math:`Q = fE` (two solutions agree at :math:`N > \deg(QE')` points), so
    :math:`E` vanishes at every wrong position: :math:`E(x_i) \neq 0` marks a
    right one.
    """
    powers = np.ones((len(nodes), errors + threshold + 1), np.int64)
    for degree in range(1, powers.shape[1]):
        powers[:, degree] = powers[:, degree - 1] * nodes % PRIME
    locator_terms = received[:, None] * powers[:, :errors] % PRIME
    matrix = np.concatenate([powers[:, : errors + threshold], -locator_terms], 1)
    solution = _solve(matrix, received * powers[:, errors] % PRIME)
    if solution is None:
        return None
    lower = powers[:, :errors] * solution[errors + threshold :] % PRIME
    locator = (lower.sum(1) + powers[:, errors]) % PRIME
    good = [int(i) for i in np.flatnonzero(locator)]
    return good if len(good) >= threshold else None


def _solve(matrix: _Elements, rhs: _Elements) -> _Elements | None:
    """One solution of ``matrix @ u = rhs`` mod p (free unknowns 0), or None."""
    system = np.concatenate([matrix, rhs[:, None]], 1) % PRIME
    pivots: list[int] = []
    for column in range(matrix.shape[1]):
        row = len(pivots)
        if row == len(system):
            break
        candidates = np.flatnonzero(system[row:, column])
        if not candidates.size:
            continue
        system[[row, row + candidates[0]]] = system[[row + candidates[0], row]]
        system[row] = system[row] * pow(int(system[row, column]), PRIME - 2, PRIME)
        system[row] %= PRIME
        factors = system[:, column].copy()
        factors[row] = 0
        system = (system - factors[:, None] * system[row]) % PRIME
        pivots.append(column)
    if np.any(system[len(pivots) :, -1]):
        return None  # a row reads 0 = nonzero
    solution = np.zeros(matrix.shape[1], np.int64)
    solution[pivots] = system[: len(pivots), -1]
    return solution


def _evaluate(nodes: _Elements, values: _Elements, at: _Elements) -> _Elements:
    """Evaluate the polynomials through ``(nodes[j], values[j, :])`` at ``at``."""
    # basis[k, j]: the j-th Lagrange polynomial at at[k], the product over
    # m != j of (at[k] - nodes[m]) / (nodes[j] - nodes[m]).
    numerators = np.ones((len(at), len(nodes)), np.int64)
    denominators = np.ones(len(nodes), np.int64)
    for m, node in enumerate(nodes):
        factor = np.repeat((at[:, None] - node) % PRIME, len(nodes), 1)
        factor[:, m] = 1
        numerators = numerators * factor % PRIME
        difference = (nodes - node) % PRIME
        difference[m] = 1
        denominators = denominators * difference % PRIME
    inverses = [pow(int(d), PRIME - 2, PRIME) for d in denominators]  # Fermat
    basis = numerators * np.array(inverses, np.int64) % PRIME
    result = np.zeros((len(at), values.shape[1]), np.int64)
    for j in range(len(nodes)):
        result = (result + basis[:, j : j + 1] * values[j]) % PRIME
    return result


def _random_elements(count: int) -> _Elements:
    # 64 bits from the OS's CSPRNG, reduced mod p: off uniform by less than
    # p / 2**64 < 2**-33 in total variation, which is negligible.
    raw = np.frombuffer(os.urandom(8 * count), dtype="<u8")
    return (raw % PRIME).astype(np.int64)


def _encode(secret: bytes) -> _Elements:
    padded = np.frombuffer(secret + bytes(-len(secret) % _PIECE), np.uint8)
    pieces = padded.reshape(-1, _PIECE).astype(np.int64)
    return np.concatenate([[len(secret)], pieces @ [1, 1 << 8, 1 << 16]])


def _decode(elements: _Elements) -> bytes:
    length, pieces = int(elements[0]), elements[1:]
    if len(pieces) != -(-length // _PIECE):
        raise ValueError(f"a {length}-byte secret in {len(pieces)} pieces")
    if np.any(pieces >> (8 * _PIECE)):
        raise ValueError(f"a piece of the secret is {8 * _PIECE} bits or more")
    data = pieces.astype("<u4").view(np.uint8).reshape(-1, 4)[:, :_PIECE].tobytes()
    if any(data[length:]):
        raise ValueError("the padding of the secret is not zero")
    return data[:length]


def _parse(share: bytes) -> _Elements:
    if not share or len(share) % 4:
        raise ValueError(f"a share is whole uint32s, got {len(share)} bytes")
    values = np.frombuffer(share, "<u4").astype(np.int64)
    if np.any(values >= PRIME):
        raise ValueError(f"a share holds a value >= {PRIME}")
    return values


def _checked(threshold: int, xs: Sequence[int]) -> None:
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold!r}")
    if any(not 1 <= x < PRIME for x in xs):
        raise ValueError(f"shares' x must be in [1, {PRIME}), got {sorted(xs)}")

"""Shamir sharing over GF(2^31 - 1) (``core.transport.shamir``): the maths, checked independently.

The reference below is Lagrange interpolation in plain Python integers, and the
encoding is rebuilt by hand from the byte layout, so the module is checked
against a computation it does not share code with, not only against itself.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import struct
from collections.abc import Callable

import numpy as np
import pytest

from flwr_prox_strategies.core.transport.shamir import (
    PRIME,
    Recovery,
    ShamirError,
    combine,
    recover,
    recover_many,
    split,
)

LENGTHS = [0, 1, 2, 3, 31, 32, 33, 241]


def elements_of(secret: bytes) -> list[int]:
    """The encoding by hand: the length, then 3-byte little-endian pieces."""
    pieces = [secret[i : i + 3].ljust(3, b"\0") for i in range(0, len(secret), 3)]
    return [len(secret), *(int.from_bytes(piece, "little") for piece in pieces)]


def values_of(share: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(share) // 4}I", share))


def share_of(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def lagrange(points: dict[int, int], z: int) -> int:
    """The polynomial through ``points`` (x -> y) at ``z``, in Python integers."""
    total = 0
    for xj, yj in points.items():
        weight = 1
        for xm in points:
            if xm != xj:
                weight = weight * (z - xm) * pow(xj - xm, PRIME - 2, PRIME) % PRIME
        total = (total + yj * weight) % PRIME
    return total


def commitment(secret: bytes) -> Callable[[bytes], bool]:
    digest = hashlib.sha256(secret).digest()
    return lambda candidate: hashlib.sha256(candidate).digest() == digest


def holders(shares: list[bytes]) -> dict[int, bytes]:
    return {j + 1: share for j, share in enumerate(shares)}


def corrupted(share: bytes, element: int) -> bytes:
    """``share`` with one element moved by 1: still well formed, now wrong."""
    values = values_of(share)
    values[element % len(values)] = (values[element % len(values)] + 1) % PRIME
    return share_of(values)


# ------------------------------------------------------------------ round trip


@pytest.mark.parametrize("threshold, num", [(1, 1), (1, 4), (3, 5), (5, 5), (4, 7)])
def test_any_threshold_shares_rebuild_every_secret(threshold: int, num: int) -> None:
    rng = random.Random(threshold * 100 + num)
    secrets = [rng.randbytes(length) for length in LENGTHS]
    shares = split(secrets, threshold, num)
    assert len(shares) == len(secrets)
    for secret, row in zip(secrets, shares, strict=True):
        assert len(row) == num
        assert all(len(s) == 4 * len(elements_of(secret)) for s in row)
        chosen = rng.sample(range(num), threshold)
        assert combine({j + 1: row[j] for j in chosen}, threshold) == secret
        assert recover(holders(row), threshold) == Recovery(secret, ())


def test_no_secrets_no_shares() -> None:
    assert split([], 2, 3) == []


# --------------------------------------------------- the maths, by a second hand


def test_one_holder_threshold_shares_are_the_encoding_itself() -> None:
    # t = 1: constant polynomials, so every share is the element vector.
    # b"abcd": length 4, pieces "abc" -> 0x636261 and "d" -> 0x64 (zero-padded).
    expected = struct.pack("<3I", 4, 0x636261, 0x64)
    assert split([b"abcd"], 1, 3) == [[expected] * 3]


@pytest.mark.parametrize(
    "coefficients",
    [[3], [PRIME - 1], [2**30 + 7], [3, PRIME - 2], [PRIME - 5, 1, 2**31 - 100]],
)
@pytest.mark.parametrize("length", [0, 5, 33])
def test_combine_rebuilds_a_hand_built_sharing(
    coefficients: list[int], length: int
) -> None:
    # f(x) = e + c1 x + c2 x^2 + ... mod p for every element e, in Python ints;
    # large coefficients make the values wrap around p.
    secret = bytes(range(7, 7 + length))
    threshold = len(coefficients) + 1
    shares = {
        x: share_of(
            [
                (e + sum(c * x ** (k + 1) for k, c in enumerate(coefficients))) % PRIME
                for e in elements_of(secret)
            ]
        )
        for x in (2, 5, 9, 11)
    }
    for subset in itertools.permutations(shares, threshold):
        assert combine({x: shares[x] for x in subset}, threshold) == secret


@pytest.mark.parametrize("threshold, num", [(2, 4), (3, 6), (6, 6)])
def test_split_lies_on_polynomials_of_degree_below_threshold(
    threshold: int, num: int
) -> None:
    secret = bytes(range(40))
    (row,) = split([secret], threshold, num)
    columns = list(zip(*(values_of(share) for share in row), strict=True))
    for element, column in zip(elements_of(secret), columns, strict=True):
        first = {x: column[x - 1] for x in range(1, threshold + 1)}
        assert lagrange(first, 0) == element
        for x in range(threshold + 1, num + 1):
            assert lagrange(first, x) == column[x - 1]


def test_threshold_minus_one_shares_fit_every_one_byte_secret() -> None:
    # Perfect hiding: for any value v, the t - 1 shares seen and the point
    # (0, encoding of v) lie on one polynomial of degree < t, whose share at
    # another x completes a set that combine() rebuilds as v.
    threshold, num = 3, 5
    (row,) = split([b"\x2a"], threshold, num)
    seen = {x: values_of(row[x - 1]) for x in (2, 4)}
    for value in range(256):
        points = [{0: e} for e in elements_of(bytes([value]))]
        for element, column in enumerate(points):
            column.update({x: values[element] for x, values in seen.items()})
        completing = share_of([lagrange(column, 5) for column in points])
        rebuilt = combine({**{x: row[x - 1] for x in seen}, 5: completing}, threshold)
        assert rebuilt == bytes([value])


def test_sharing_is_random() -> None:
    secret = b"the same secret"
    first, second = split([secret, secret], 2, 3)
    assert first != second
    assert split([secret], 2, 3)[0] != first


# ------------------------------------------------------------ robust recovery


@pytest.mark.parametrize(
    "num, threshold, position",
    [
        (num, threshold, position)
        for num, threshold in [(6, 4), (5, 3), (7, 4), (10, 6), (4, 3)]
        for position in range(num)
    ],
)
def test_one_corrupt_share_anywhere_is_found_and_named(
    num: int, threshold: int, position: int
) -> None:
    secret = bytes(range(1, 33))
    (row,) = split([secret], threshold, num)
    row[position] = corrupted(row[position], element=position)
    found = recover(holders(row), threshold, valid=commitment(secret))
    assert found == Recovery(secret, (position + 1,))


@pytest.mark.parametrize("colluding", [False, True])
@pytest.mark.parametrize("num, threshold, bad", [(20, 10, 2), (20, 10, 5), (9, 4, 2)])
def test_welch_berlekamp_corrects_up_to_its_radius_without_a_check(
    num: int, threshold: int, bad: int, colluding: bool
) -> None:
    # max_subsets=1: no subset search, and the first t shares include a bad
    # one, so only the decoding finds the secret. Colluding holders send
    # shares of one other secret: consistent with each other, still outvoted.
    assert bad == 2 or bad == (num - threshold) // 2
    secret, other = b"k" * 32, b"z" * 32
    row, forged = split([secret, other], threshold, num)
    liars = [0, *random.Random(num + bad).sample(range(1, num), bad - 1)]
    for j in liars:
        row[j] = forged[j] if colluding else corrupted(row[j], element=j)
    found = recover(holders(row), threshold, max_subsets=1)
    assert found == Recovery(secret, tuple(sorted(j + 1 for j in liars)))


def test_colluders_holding_the_first_threshold_positions_do_not_win() -> None:
    # The first t shares all lie on a forged secret's polynomials: they alone
    # rebuild it, but 15 of the 20 shares disagree, more than decoding's radius
    # of 7, so the forged secret is not taken; the honest one is.
    secret, other = b"honest" * 5, b"forged" * 5
    row, forged = split([secret, other], 5, 20)
    row[:5] = forged[:5]
    assert recover(holders(row), 5, max_subsets=1) == Recovery(secret, (1, 2, 3, 4, 5))


def test_a_share_wrong_in_one_element_only_is_named() -> None:
    secret = bytes(range(241))
    (row,) = split([secret], 10, 20)
    for j, element in [(0, 0), (3, 40), (17, 81)]:  # the length, a middle, the last
        row[j] = corrupted(row[j], element)
    found = recover(holders(row), 10, max_subsets=1)
    assert found == Recovery(secret, (1, 4, 18))


def test_beyond_the_radius_a_subset_search_finds_the_committed_secret() -> None:
    # 8 shares, t = 3: decoding corrects 2; here 4 liars agree on a forged
    # secret (4 >= t of them rebuild it), and only the commitment tells.
    secret, other = b"genuine secret", b"forged secret!"
    row, forged = split([secret, other], 3, 8)
    for j in (0, 2, 5, 7):
        row[j] = forged[j]
    found = recover(holders(row), 3, valid=commitment(secret))
    assert found == Recovery(secret, (1, 3, 6, 8))
    assert recover(holders(row), 3, valid=commitment(other)).secret == other
    with pytest.raises(ShamirError, match="8 shares, threshold 3"):
        recover(holders(row), 3, valid=commitment(secret), max_subsets=50)


def test_fewer_than_threshold_good_shares_is_an_error() -> None:
    secret = b"x" * 32
    (row,) = split([secret], 3, 5)
    for j in (1, 2, 4):
        row[j] = corrupted(row[j], element=j)
    with pytest.raises(ShamirError, match="5 shares, threshold 3: no 3 of them"):
        recover(holders(row), 3, valid=commitment(secret))
    with pytest.raises(ShamirError):
        recover(holders(row[:2]), 3)


def test_a_secret_the_check_rejects_is_never_returned() -> None:
    (row,) = split([b"the only secret"], 3, 5)
    with pytest.raises(ShamirError, match="rebuild a valid secret"):
        recover(holders(row), 3, valid=lambda candidate: False)
    with pytest.raises(ShamirError):
        recover(holders(row), 3, valid=commitment(b"another secret"))


@pytest.mark.parametrize(
    "malform",
    [
        lambda share: share[:-4],  # one element short: a length of its own
        lambda share: share[:-1],  # not whole uint32s
        lambda share: b"",
        lambda share: struct.pack("<I", 0xFFFFFFFF) + share[4:],
        lambda share: share[:-4] + struct.pack("<I", PRIME),  # p itself is out
        lambda share: share + bytes(4),  # well formed, one element too many
    ],
)
def test_malformed_shares_are_named_and_refused_by_combine(
    malform: Callable[[bytes], bytes],
) -> None:
    secret = bytes(range(32))
    (row,) = split([secret], 3, 6)
    row[1], row[4] = malform(row[1]), malform(row[4])
    found = recover(holders(row), 3, valid=commitment(secret))
    assert found == Recovery(secret, (2, 5))
    with pytest.raises(ValueError):
        combine({2: row[1], 1: row[0], 3: row[2]}, 3)


@pytest.mark.parametrize(
    "elements",
    [[4, 1], [1, 0x100], [1, 2**24], [0, 0], [2**20]],
    ids=["pieces-short", "padding-not-zero", "piece-too-wide", "extra-piece", "long"],
)
def test_an_inconsistent_encoding_is_refused(elements: list[int]) -> None:
    # Constant polynomials (t = 1): the share is the encoding as it stands.
    with pytest.raises(ValueError):
        combine({1: share_of(elements)}, 1)
    with pytest.raises(ShamirError):
        recover({1: share_of(elements), 2: share_of(elements)}, 1)


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize(
    "threshold, num, name",
    [(0, 3, "threshold"), (4, 3, "threshold"), (1, 0, "num"), (1, PRIME, "num")],
)
def test_split_refuses_bad_parameters_naming_them(
    threshold: int, num: int, name: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        split([b"s"], threshold, num)


def test_combine_and_recover_refuse_bad_parameters_naming_them() -> None:
    (row,) = split([b"s"], 2, 3)
    for rebuild in (combine, recover):
        with pytest.raises(ValueError, match=r"^threshold must be"):
            rebuild(holders(row), 0)
        with pytest.raises(ValueError, match="x must be"):
            rebuild({0: row[0], 1: row[1]}, 2)
    with pytest.raises(ValueError, match="fewer than the threshold 3"):
        combine(holders(row[:2]), 3)


def test_shares_are_little_endian_uint32_below_the_prime() -> None:
    (row,) = split([bytes(range(100))], 5, 9)
    values = np.frombuffer(b"".join(row), "<u4")
    assert values.max() < PRIME


def test_recover_many_gives_what_recover_gives_secret_by_secret():
    """Vectorised over secrets: the same secrets, the same holders named, the
    same errors, whatever is wrong with the shares (and secrets of two lengths)."""
    rng = random.Random(3)
    t, k = 5, 9
    sharings, expected = [], []
    for i in range(48):
        secret = bytes(rng.randrange(256) for _ in range(32 if i % 2 else 45))
        shares = split([secret], t, k)[0]
        given = {x + 1: shares[x] for x in range(k) if rng.random() > 0.15}
        first = list(given)
        kind = i % 8
        if kind == 1 and len(first) > t:  # a wrong share past the first t
            given[first[-1]] = bytes([given[first[-1]][0] ^ 1]) + given[first[-1]][1:]
        elif kind == 2:  # a wrong share among the first t
            given[first[0]] = given[first[0]][:4] + bytes(4) + given[first[0]][8:]
        elif kind == 3:  # a malformed one
            given[first[1]] = b"abc"
        elif kind == 4:  # too few good ones
            for x in first[1:]:
                given[x] = struct.pack("<I", rng.randrange(PRIME)) * (
                    len(given[x]) // 4
                )
        elif kind == 5:  # another length
            given[first[2]] = given[first[2]] + bytes(4)
        valid = (lambda s: lambda candidate: candidate == s)(secret)
        sharings.append((given, valid))
        try:
            expected.append(recover(given, t, valid))
        except ShamirError as err:
            expected.append(err)
    got = recover_many(sharings, t)
    for want, have in zip(expected, got, strict=True):
        if isinstance(want, ShamirError):
            assert isinstance(have, ShamirError) and str(have) == str(want)
        else:
            assert have == want
    assert any(isinstance(r, ShamirError) for r in got)
    assert any(isinstance(r, Recovery) and r.disagreeing for r in got)

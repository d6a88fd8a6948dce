"""`ops.privacy.encoding` against its maths: a whole upload through distributed DP.

The clients encode (clip, rotate, scale, round, add noise, wrap), secure
aggregation sums modulo 2**bits, the server decodes. Every check is derived
beside it: the rounding moves each rotated coordinate by less than one step,
the inverse rotation is orthonormal, so the decoded error's covariance is known
in closed form; statistical checks allow five standard errors. Seeds are fixed,
so the suite is deterministic.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from flwr_prox_strategies.ops.privacy.encoding import (
    DDPSettings,
    UploadLayout,
    check_bits,
    clip_l2,
    decode_sum,
    encode_upload,
    flatten_records,
    linf_bound,
    upload_layout,
)
from flwr_prox_strategies.ops.privacy.quantise import (
    inverse_randomized_hadamard,
    randomized_hadamard,
)

Z = 5.0  # every statistical check: within five standard errors
SEED = 1234  # the round's rotation seed, shared by the clients


def scaffold_upload(rng: np.random.Generator, scale: float) -> dict:
    """A SCAFFOLD-like upload: a model delta and a control delta, mixed shapes."""
    return {
        "model": {
            "conv.weight": scale * rng.normal(size=(2, 3, 2)),
            "fc.bias": scale * rng.normal(size=(3,)).astype(np.float32),
            "fc.weight": scale * rng.normal(size=(5,)),
        },
        "control": {
            "conv.weight": scale * rng.normal(size=(2, 3, 2)),
            "fc.weight": scale * rng.normal(size=(1, 5)),
        },
    }


def secure_sum(uploads: list[np.ndarray], bits: int) -> np.ndarray:
    """What secure aggregation reveals: the sum of the wrapped vectors mod 2**bits."""
    total = np.zeros_like(uploads[0])
    for values in uploads:
        total = np.mod(total + values, np.int64(1) << bits)
    return total


def rotation_matrix(seed: int, dim: int, padded: int) -> np.ndarray:
    """M with decode's float step = M @ (scaled integer sum): rows of D H, cropped."""
    columns = [
        inverse_randomized_hadamard(np.eye(padded)[j], seed, dim) for j in range(padded)
    ]
    return np.stack(columns, axis=1)


# --- the round trip without noise ------------------------------------------------


@pytest.mark.parametrize("granularity", [1e-3, 0.05])
def test_the_sum_of_five_uploads_decodes_within_the_rounding_bound(
    granularity: float,
) -> None:
    """|rounding error| < 1 per rotated coordinate, so < sqrt(D) in L2 per client.

    The decoded error is gamma * (D H)(sum of errors), cropped: the rotation is
    orthonormal and cropping shortens, so its L2 norm is < n * gamma * sqrt(D).
    """
    rng = np.random.default_rng(1)
    n = 5
    clients = [scaffold_upload(rng, scale) for scale in (0.1, 0.5, 1.0, 3.0, 10.0)]
    settings = DDPSettings(l2_clip=4.0, bits=32, granularity=granularity, num_clients=n)
    layout = upload_layout(clients[0])
    assert layout.dim == 37 and layout.padded_dim == 64
    assert check_bits(settings, layout.dim) <= settings.bits
    encoded = [
        encode_upload(c, settings, round_seed=SEED, rng=rng, layout=layout)
        for c in clients
    ]
    assert all(e.values.dtype == np.int64 for e in encoded)
    assert all(e.values.min() >= 0 and e.values.max() < 2**32 for e in encoded)
    decoded = decode_sum(
        secure_sum([e.values for e in encoded], 32), layout, settings, round_seed=SEED
    )
    expected = sum(clip_l2(flatten_records(c, layout), 4.0)[0] for c in clients)
    error = flatten_records(decoded, layout) - expected
    bound = n * granularity * math.sqrt(layout.padded_dim)
    float32_slack = 1e-6 * float(np.linalg.norm(expected))
    assert float(np.linalg.norm(error)) <= bound + float32_slack
    # The clients above the clip were clipped (the factor says so), not the others.
    factors = [e.clip_factor for e in encoded]
    norms = [float(np.linalg.norm(flatten_records(c, layout))) for c in clients]
    for factor, norm in zip(factors, norms, strict=True):
        assert factor == (1.0 if norm <= 4.0 else pytest.approx(4.0 / norm))
    assert factors[0] == 1.0 and factors[-1] < 1.0
    # Shapes and dtypes come back; the order of the input dicts does not matter.
    for name, arrays in clients[0].items():
        for key, array in arrays.items():
            assert decoded[name][key].shape == array.shape
            assert decoded[name][key].dtype == array.dtype


def test_the_layout_needs_no_client_data_and_ignores_dict_order() -> None:
    rng = np.random.default_rng(2)
    client = scaffold_upload(rng, 1.0)
    zeros = {n: {k: np.zeros_like(a) for k, a in r.items()} for n, r in client.items()}
    shuffled = {n: dict(reversed(r.items())) for n, r in reversed(client.items())}
    assert upload_layout(zeros) == upload_layout(client) == upload_layout(shuffled)
    assert [(e.name, e.key) for e in upload_layout(client).entries] == [
        ("control", "conv.weight"),
        ("control", "fc.weight"),
        ("model", "conv.weight"),
        ("model", "fc.bias"),
        ("model", "fc.weight"),
    ]
    settings = DDPSettings(l2_clip=100.0, bits=40, granularity=1e-4, local_variance=2)
    first = encode_upload(client, settings, round_seed=3, rng=np.random.default_rng(9))
    second = encode_upload(
        shuffled, settings, round_seed=3, rng=np.random.default_rng(9)
    )
    np.testing.assert_array_equal(first.values, second.values)


# --- clipping --------------------------------------------------------------------


def test_a_long_upload_is_clipped_to_exactly_l2_clip_and_a_short_one_untouched() -> (
    None
):
    rng = np.random.default_rng(3)
    long = rng.normal(size=50) * 10
    clipped, factor = clip_l2(long, 2.5)
    assert float(np.linalg.norm(clipped)) == pytest.approx(2.5, rel=1e-12)
    assert factor == pytest.approx(2.5 / float(np.linalg.norm(long)), rel=1e-12)
    np.testing.assert_allclose(clipped, long * factor, rtol=1e-15)
    short = long / float(np.linalg.norm(long))  # norm 1 < 2.5
    same, one = clip_l2(short, 2.5)
    assert one == 1.0
    np.testing.assert_array_equal(same, short)
    # Through the whole encoding: one client, a fine grid, so the decoded upload is
    # the clipped one within gamma * sqrt(D), and its norm is l2_clip within that.
    gamma = 1e-6
    settings = DDPSettings(l2_clip=2.5, bits=40, granularity=gamma)
    records = {"delta": {"w": long.reshape(5, 10)}}
    encoded = encode_upload(records, settings, round_seed=SEED, rng=rng)
    assert encoded.clip_factor == pytest.approx(factor, rel=1e-12)
    decoded = decode_sum(encoded.values, encoded.layout, settings, round_seed=SEED)
    tolerance = gamma * math.sqrt(encoded.layout.padded_dim)
    back = decoded["delta"]["w"].ravel()
    assert float(np.linalg.norm(back - clipped)) <= tolerance
    assert abs(float(np.linalg.norm(back)) - 2.5) <= tolerance
    short_records = {"delta": {"w": short.reshape(5, 10)}}
    assert encode_upload(
        short_records, settings, round_seed=SEED, rng=rng
    ).clip_factor == (1.0)


# --- noise -----------------------------------------------------------------------


def discrete_gaussian_variance(sigma2: float) -> float:
    """The exact variance of N_Z(0, sigma2): summed over |x| <= 50 sigma + 2."""
    reach = int(50 * math.sqrt(sigma2)) + 2
    x = np.arange(-reach, reach + 1, dtype=np.float64)
    weights = np.exp(-(x**2) / (2 * sigma2))
    return float(np.sum(weights * x**2) / np.sum(weights))


@pytest.mark.parametrize("noise", ["gaussian", "skellam"])
def test_the_decoded_noise_is_unbiased_and_isotropic(noise: str) -> None:
    """The decoded error's covariance, in closed form, against 300 rounds.

    In the rotated integer domain client c's error at coordinate j is its rounding
    error (variance p_cj (1 - p_cj) <= 1/4, p_cj the fractional part there) plus
    its noise (variance V: mu for Skellam, the exact discrete Gaussian variance,
    a little below sigma2), all independent. Decoding multiplies by gamma and
    applies M (the rows of D H kept), so the error has mean 0 and covariance

        Sigma = gamma^2 (n V I + M diag(R) M^T),  R_j = sum_c p_cj (1 - p_cj):

    the noise's part is isotropic because M M^T = I (M is orthonormal rows), and
    n V gamma^2 <= Sigma_ii <= n (V + 1/4) gamma^2. Standard errors over T rounds
    (near-Gaussian errors): sqrt(Sigma_ii / T) for a mean, sqrt(2 / (T - 1))
    Sigma_ii for a variance, sqrt((Sigma_ii Sigma_kk + Sigma_ik^2) / T) for a
    covariance.
    """
    trials, n, gamma, local = 300, 5, 0.01, 3.0
    rng = np.random.default_rng(4)
    clients = [
        {"model": {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)}}
        for _ in range(n)
    ]
    settings = DDPSettings(
        l2_clip=10.0,
        bits=24,
        noise=noise,  # type: ignore[arg-type]
        local_variance=local,
        granularity=gamma,
        num_clients=n,
    )
    layout = upload_layout(clients[0])
    dim, padded = layout.dim, layout.padded_dim
    check_bits(settings, dim)
    truth = sum(clip_l2(flatten_records(c, layout), 10.0)[0] for c in clients)
    errors = np.empty((trials, dim))
    for t in range(trials):
        uploads = [
            encode_upload(c, settings, round_seed=SEED, rng=rng).values for c in clients
        ]
        decoded = decode_sum(secure_sum(uploads, 24), layout, settings, round_seed=SEED)
        errors[t] = flatten_records(decoded, layout) - truth
    variance = local if noise == "skellam" else discrete_gaussian_variance(local)
    fractions = [
        np.mod(
            randomized_hadamard(clip_l2(flatten_records(c, layout), 10.0)[0], SEED)
            / gamma,
            1.0,
        )
        for c in clients
    ]
    rounding = sum(p * (1 - p) for p in fractions)
    m = rotation_matrix(SEED, dim, padded)
    np.testing.assert_allclose(m @ m.T, np.eye(dim), atol=1e-12)
    sigma = gamma**2 * (n * variance * np.eye(dim) + m @ np.diag(rounding) @ m.T)
    diagonal = np.diag(sigma)
    assert np.all(diagonal >= n * variance * gamma**2 - 1e-15)
    assert np.all(diagonal <= n * (variance + 0.25) * gamma**2 + 1e-15)
    # Mean 0 per coordinate.
    assert np.all(np.abs(errors.mean(axis=0)) <= Z * np.sqrt(diagonal / trials))
    # The covariance, every entry (the means are known to be 0).
    measured = errors.T @ errors / trials
    se = np.sqrt((np.outer(diagonal, diagonal) + sigma**2) / trials)
    assert np.all(np.abs(measured - sigma) <= Z * se)
    # Pooled over the coordinates (independent but for the small rounding part).
    pooled = float(np.mean(np.diag(measured)))
    assert abs(pooled - float(diagonal.mean())) <= Z * float(diagonal.mean()) * (
        math.sqrt(2 / (trials * dim))
    )


# --- wrap-around -----------------------------------------------------------------


def test_a_sum_beyond_the_width_decodes_wrong_and_check_bits_refuses_it() -> None:
    """Five copies of e_1 (norm 1 = l2_clip), gamma = 1/64, D = 4.

    Rotated, each coordinate of e_1 is +-1/2, scaled +-32 exactly, so rounding
    keeps it and the integer sum is +-160 per coordinate: beyond 2**7 = 128, so
    bits = 8 wraps it (160 - 256 = -96), while 160 < 2**8 fits bits = 9.
    """
    n, gamma = 5, 1 / 64
    records = {"model": {"w": np.array([1.0, 0.0, 0.0, 0.0])}}
    layout = upload_layout(records)

    def decoded(bits: int) -> np.ndarray:
        settings = DDPSettings(l2_clip=1.0, bits=bits, granularity=gamma, num_clients=n)
        rng = np.random.default_rng(5)
        uploads = [
            encode_upload(records, settings, round_seed=SEED, rng=rng).values
            for _ in range(n)
        ]
        total = secure_sum(uploads, bits)
        return decode_sum(total, layout, settings, round_seed=SEED)["model"]["w"]

    scaled = randomized_hadamard(records["model"]["w"], SEED) / gamma
    np.testing.assert_array_equal(np.abs(scaled), 32.0)
    assert n * 32 >= 2 ** (8 - 1)
    assert float(np.max(np.abs(decoded(8) - [5.0, 0, 0, 0]))) > 1.0  # wrong
    np.testing.assert_allclose(decoded(9), [5.0, 0, 0, 0], atol=1e-12)

    narrow = DDPSettings(l2_clip=1.0, bits=8, granularity=gamma, num_clients=n)
    with pytest.raises(ValueError, match=r"bits=8 is too small") as refused:
        check_bits(narrow, layout.dim)
    match = re.search(r"smallest width that works is bits=(\d+)", str(refused.value))
    assert match is not None
    width = int(match.group(1))
    # The heuristic bounds one client's coordinate by min(Delta_2, spread + 1): here
    # Delta_2 = 64 + sqrt(4) = 66 at most, so n B <= 330 < 2**9: width 10 at most.
    assert linf_bound(narrow, layout.dim) <= 66.0
    assert 9 <= width <= 10
    wide = DDPSettings(l2_clip=1.0, bits=width, granularity=gamma, num_clients=n)
    assert check_bits(wide, layout.dim) == width
    below = DDPSettings(l2_clip=1.0, bits=width - 1, granularity=gamma, num_clients=n)
    with pytest.raises(ValueError, match=rf"bits={width}\b"):
        check_bits(below, layout.dim)
    np.testing.assert_allclose(decoded(width), [5.0, 0, 0, 0], atol=1e-12)
    # Noise needs room too: six standard deviations of the summed noise.
    noisy = DDPSettings(
        l2_clip=1.0, bits=width, granularity=gamma, num_clients=n, local_variance=1e4
    )
    with pytest.raises(ValueError, match="smallest width that works"):
        check_bits(noisy, layout.dim)


def test_the_heuristic_bounds_rotated_coordinates_of_many_uploads() -> None:
    """Across 200 random uploads of norm l2_clip, no rotated coordinate passes B - 1."""
    rng = np.random.default_rng(6)
    settings = DDPSettings(l2_clip=3.0, bits=30, granularity=1e-3)
    dim = 100
    bound = linf_bound(settings, dim) - 1.0
    for seed in range(200):
        x = rng.normal(size=dim) * rng.exponential(size=dim)
        x *= 3.0 / float(np.linalg.norm(x))
        rotated = randomized_hadamard(x, seed) / 1e-3
        assert float(np.max(np.abs(rotated))) <= bound


# --- bad input -------------------------------------------------------------------

GOOD = {"l2_clip": 1.0, "bits": 16}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("l2_clip", 0.0),
        ("l2_clip", -1.0),
        ("l2_clip", math.nan),
        ("bits", 1),
        ("bits", 63),
        ("bits", 8.0),
        ("bits", True),
        ("beta", 0.0),
        ("beta", 1.0),
        ("noise", "laplace"),
        ("local_variance", -1.0),
        ("local_variance", math.inf),
        ("granularity", 0.0),
        ("granularity", "1"),
        ("num_clients", 0),
        ("num_clients", 2.5),
    ],
)
def test_bad_settings_name_their_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must"):
        DDPSettings(**{**GOOD, field: value})  # type: ignore[arg-type]


def test_settings_are_frozen_and_keyword_only() -> None:
    settings = DDPSettings(**GOOD)  # type: ignore[arg-type]
    assert settings.beta == pytest.approx(math.exp(-0.5))
    with pytest.raises(AttributeError):
        settings.bits = 20  # type: ignore[misc]
    with pytest.raises(TypeError):
        DDPSettings(1.0, 16)  # type: ignore[misc]


def test_bad_uploads_and_sums_name_the_parameter() -> None:
    settings = DDPSettings(l2_clip=1.0, bits=16, granularity=0.01)
    rng = np.random.default_rng(7)
    good = {"m": {"w": np.ones(3)}}

    def encode(records: object, **kwargs: object) -> object:
        options: dict = {"round_seed": 1, "rng": rng, **kwargs}
        return encode_upload(records, settings, **options)  # type: ignore[arg-type]

    for records, pattern in [
        ({}, "records"),
        ([], "records"),
        ({"m": {}}, "records must hold at least one value"),
        ({"m": np.ones(3)}, r"records\['m'\]"),
        ({"m": {"w": np.ones(3, dtype=np.int64)}}, r"records\['m'\]\['w'\].*float"),
        ({"m": {1: np.ones(3)}}, "key"),
        ({2: {"w": np.ones(3)}}, "name"),
        ({"m": {"w": np.array([1.0, np.nan])}}, "records must be finite"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            encode(records)
    layout = upload_layout(good)
    with pytest.raises(ValueError, match="layout"):
        encode({"m": {"w": np.ones(4)}}, layout=layout)
    with pytest.raises(ValueError, match="layout"):
        encode({"m": {"w": np.ones(3, dtype=np.float32)}}, layout=layout)
    with pytest.raises(ValueError, match="round_seed"):
        encode(good, round_seed=-1)
    with pytest.raises(ValueError, match="rng"):
        encode(good, rng=7)
    with pytest.raises(ValueError, match="settings"):
        encode_upload(good, {"bits": 16}, round_seed=1, rng=rng)  # type: ignore[arg-type]

    values = encode(good).values  # type: ignore[attr-defined]
    for bad, pattern in [
        (values.astype(np.float64), "wrapped_sum must hold integers"),
        (values[:2], r"wrapped_sum must have shape \(4,\)"),
        (values.reshape(2, 2), "wrapped_sum must have shape"),
        (values + 2**16, r"wrapped_sum must lie in \[0, 2\*\*16\)"),
        (values - 2**16, "wrapped_sum must lie"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            decode_sum(bad, layout, settings, round_seed=1)
    with pytest.raises(ValueError, match="layout"):
        decode_sum(values, UploadLayout(()), settings, round_seed=1)
    with pytest.raises(ValueError, match="layout"):
        decode_sum(
            values, upload_layout({"m": {"w": np.ones(5)}}), settings, round_seed=1
        )
    with pytest.raises(ValueError, match="round_seed"):
        decode_sum(values, layout, settings, round_seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim"):
        check_bits(settings, 0)
    with pytest.raises(ValueError, match="l2_clip"):
        clip_l2(np.ones(2), 0.0)


# --- no side effects -------------------------------------------------------------


def test_a_clients_arrays_are_not_modified() -> None:
    rng = np.random.default_rng(8)
    client = scaffold_upload(rng, 10.0)  # far above the clip: the copy is scaled
    before = {n: {k: a.copy() for k, a in r.items()} for n, r in client.items()}
    settings = DDPSettings(l2_clip=1.0, bits=24, granularity=1e-3, local_variance=4)
    encoded = encode_upload(client, settings, round_seed=SEED, rng=rng)
    assert encoded.clip_factor < 1.0
    for name, arrays in before.items():
        for key, array in arrays.items():
            assert client[name][key].dtype == array.dtype
            np.testing.assert_array_equal(client[name][key], array)

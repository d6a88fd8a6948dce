r"""Encode a whole upload for distributed DP, and decode the secure sum of many.

Under secure aggregation a client uploads every record the strategy sums
(``secure_sums()``) at once. :func:`encode_upload` flattens them into one vector
(sorted record names, then sorted keys), clips it to L2 norm :math:`C`, rotates it
(:func:`~.quantise.randomized_hadamard`, one seed per round shared by all
clients), divides by the granularity :math:`\gamma`, rounds it to integers
(:func:`~.quantise.conditional_randomized_rounding` with bound :math:`C/\gamma`),
adds integer noise (:mod:`.noise`) and wraps it into :math:`\mathbb{Z}_{2^b}`
(Kairouz, Liu & Steinke, ICML 2021; Agarwal, Kairouz & Liu, NeurIPS 2021).
:func:`decode_sum` unwraps the modular sum, multiplies by :math:`\gamma`, undoes
the rotation and splits the vector back into records. :func:`upload_layout`
builds the layout from the model alone, so the server needs no client's data.
:class:`~flwr_prox_strategies.SecAggPlus` uses both under
:class:`~flwr_prox_strategies.DistributedDP` (through
``core/transport/ddp.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ..checks import (
    check_choice,
    check_int,
    check_non_negative,
    check_positive,
    check_probability,
)
from .noise import discrete_gaussian, skellam
from .quantise import (
    bit_width,
    conditional_randomized_rounding,
    inverse_randomized_hadamard,
    modular_unwrap,
    modular_wrap,
    randomized_hadamard,
    rounding_norm_bound,
    smallest_safe_bits,
)

#: The probability, per upload, that :func:`check_bits`'s L-inf heuristic misses
#: a rotated coordinate (the union bound over the coordinates is inside it).
LINF_FAILURE = 2.0**-30

Records = Mapping[str, Mapping[str, NDArray[np.floating]]]


@dataclass(frozen=True, kw_only=True)
class DDPSettings:
    r"""How a client encodes its upload for distributed DP.

    Parameters
    ----------
    l2_clip : float
        :math:`C > 0`, the L2 bound of the whole flattened upload.
    bits : int
        :math:`b \in [2, 62]`: secure aggregation sums modulo :math:`2^b`.
    beta : float
        :math:`\beta \in (0, 1)`, the probability that one conditional rounding
        misses its norm bound (:func:`~.quantise.rounding_norm_bound`);
        :math:`e^{-1/2}` as in Kairouz, Liu & Steinke (2021).
    noise : {"gaussian", "skellam"}
        The discrete Gaussian (:func:`~.noise.discrete_gaussian`) or Skellam
        (:func:`~.noise.skellam`) noise each client adds.
    local_variance : float
        One client's noise variance per coordinate, in the integer domain,
        :math:`\geq 0` (``sigma2`` or ``mu``; 0 adds none).
    granularity : float
        :math:`\gamma > 0`, the step of the integer domain: values are divided by
        it before rounding.
    num_clients : int
        :math:`n \geq 1`, the clients expected to contribute to one sum.

    Raises
    ------
    ValueError
        A field out of range; the message names it.
    """

    l2_clip: float
    bits: int
    beta: float = math.exp(-0.5)
    noise: Literal["gaussian", "skellam"] = "gaussian"
    local_variance: float = 0.0
    granularity: float = 1.0
    num_clients: int = 1

    def __post_init__(self) -> None:
        """Refuse a field out of range, naming it."""
        check_positive("l2_clip", self.l2_clip)
        bit_width(self.bits)
        check_probability("beta", self.beta)
        check_choice("noise", self.noise, ("gaussian", "skellam"))
        check_non_negative("local_variance", self.local_variance)
        check_positive("granularity", self.granularity)
        check_int("num_clients", self.num_clients, 1)


class LayoutEntry(NamedTuple):
    """One array of an upload: where it comes from and what it looks like."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class UploadLayout:
    """The arrays of an upload, in the order they are flattened.

    Parameters
    ----------
    entries : tuple of LayoutEntry
        Record name, key, shape and dtype of every array: names sorted, then
        keys sorted within a name.
    """

    entries: tuple[LayoutEntry, ...]

    @property
    def dim(self) -> int:
        """The length of the flattened upload."""
        return sum(math.prod(entry.shape) for entry in self.entries)

    @property
    def padded_dim(self) -> int:
        """The length after rotation: the next power of two >= :attr:`dim`."""
        return 1 << (max(self.dim, 1) - 1).bit_length()


class EncodedUpload(NamedTuple):
    """What :func:`encode_upload` returns."""

    #: ``int64`` values in ``[0, 2**bits)``, of length ``layout.padded_dim``.
    values: NDArray[np.int64]
    #: ``min(1, l2_clip / norm)``: what the flattened upload was multiplied by.
    clip_factor: float
    #: The arrays, in the order they were flattened.
    layout: UploadLayout


def upload_layout(records: Records) -> UploadLayout:
    """Return the layout of ``records``: sorted names, then sorted keys.

    Parameters
    ----------
    records : Mapping[str, Mapping[str, numpy.ndarray]]
        Record name -> key -> float array (the records ``secure_sums()``
        declares); the server can pass the model's arrays, with zeros.

    Returns
    -------
    UploadLayout
        Names, keys, shapes and dtypes, in flattening order.

    Raises
    ------
    ValueError
        ``records`` empty, with no values, with a name or key not a ``str``,
        or with an array not of a float dtype.
    """
    if not isinstance(records, Mapping) or not records:
        raise ValueError("records must be a non-empty mapping name -> arrays")
    entries = []
    for name in sorted(records, key=_sort_key("records", "name")):
        arrays = records[name]
        if not isinstance(arrays, Mapping):
            raise ValueError(f"records[{name!r}] must be a mapping key -> array")
        for key in sorted(arrays, key=_sort_key(f"records[{name!r}]", "key")):
            array = np.asarray(arrays[key])
            if not np.issubdtype(array.dtype, np.floating):
                raise ValueError(
                    f"records[{name!r}][{key!r}] must be a float array, "
                    f"got dtype {array.dtype}"
                )
            entries.append(LayoutEntry(name, key, array.shape, array.dtype.str))
    layout = UploadLayout(tuple(entries))
    if layout.dim == 0:
        raise ValueError("records must hold at least one value")
    return layout


def _sort_key(where: str, what: str) -> Callable[[object], str]:
    def key(value: object) -> str:
        if not isinstance(value, str):
            raise ValueError(f"every {what} of {where} must be a str, got {value!r}")
        return value

    return key


def flatten_records(records: Records, layout: UploadLayout) -> NDArray[np.float64]:
    """Return ``records`` as one ``float64`` vector in ``layout``'s order (a copy).

    Parameters
    ----------
    records : Mapping[str, Mapping[str, numpy.ndarray]]
        Record name -> key -> float array.
    layout : UploadLayout
        The layout ``records`` must have (:func:`upload_layout`).

    Returns
    -------
    numpy.ndarray
        The ``float64`` vector of length ``layout.dim``.

    Raises
    ------
    ValueError
        ``records`` not of ``layout`` (names, keys, shapes or dtypes), or not
        finite.
    """
    found = upload_layout(records)
    if found != layout:
        raise ValueError(
            "records do not match layout: "
            f"{_describe(found)} against {_describe(layout)}"
        )
    parts = [
        np.asarray(records[entry.name][entry.key], dtype=np.float64).ravel()
        for entry in layout.entries
    ]
    vector = np.concatenate(parts)  # always a new array
    if not np.all(np.isfinite(vector)):
        raise ValueError("records must be finite")
    return vector


def _describe(layout: UploadLayout) -> str:
    return ", ".join(
        f"{e.name}/{e.key}{list(e.shape)}:{e.dtype}" for e in layout.entries
    )


def clip_l2(
    vector: NDArray[np.floating], l2_clip: float
) -> tuple[NDArray[np.float64], float]:
    """Return ``vector`` scaled down to L2 norm ``l2_clip`` if longer, and the factor.

    Parameters
    ----------
    vector : numpy.ndarray
        A finite 1-D vector (not modified).
    l2_clip : float
        The bound :math:`C > 0`.

    Returns
    -------
    tuple[numpy.ndarray, float]
        The ``float64`` clipped copy and ``min(1, C / ||vector||_2)``.

    Raises
    ------
    ValueError
        ``l2_clip`` not finite and positive.
    """
    check_positive("l2_clip", l2_clip)
    out = np.array(vector, dtype=np.float64, copy=True)
    norm = float(np.linalg.norm(out))
    factor = 1.0 if norm <= float(l2_clip) else float(l2_clip) / norm
    if factor < 1.0:
        out *= factor
    return out, factor


def linf_bound(settings: DDPSettings, dim: int) -> float:
    r"""Return the heuristic bound on one client's rounded coordinate, before noise.

    With :math:`c = C/\gamma` and :math:`D` the padded dimension, the rotated
    coordinate :math:`(HDx)_i = \sum_j H_{ij} s_j x_j` has
    :math:`|H_{ij}| = 1/\sqrt D` and independent random signs :math:`s_j`, so by
    Hoeffding :math:`P[|(HDx)_i| > t] \leq 2 e^{-t^2 D / (2c^2)}`; the union over
    the :math:`D` coordinates gives, with probability at least
    :math:`1 - \delta` (:data:`LINF_FAILURE`),
    :math:`\max_i |(HDx)_i| \leq c\sqrt{2\ln(2D/\delta)/D}`. Rounding adds less
    than 1. The bound is the smaller of that plus 1 and the rounding's L2 bound
    :math:`\Delta_2` (:func:`~.quantise.rounding_norm_bound`), which always
    holds. It is a heuristic: it assumes the signs are independent of the data.

    Parameters
    ----------
    settings : DDPSettings
        The encoding.
    dim : int
        The length of the flattened upload, :math:`\geq 1`.

    Returns
    -------
    float
        The bound :math:`B`.

    Raises
    ------
    ValueError
        ``dim`` not an int ``>= 1``.
    """
    check_int("dim", dim, 1)
    padded = 1 << (int(dim) - 1).bit_length()
    c = float(settings.l2_clip) / float(settings.granularity)
    hard = rounding_norm_bound(c, padded, float(settings.beta))
    spread = c * math.sqrt(2 * math.log(2 * padded / LINF_FAILURE) / padded) + 1.0
    return min(hard, spread)


def check_bits(settings: DDPSettings, dim: int) -> int:
    r"""Return the smallest safe bit width; refuse ``settings.bits`` below it.

    The sum of :math:`n` uploads, each within :func:`linf_bound` :math:`B` per
    coordinate before noise of standard deviation
    :math:`\sqrt{\text{local\_variance}}`, must unwrap to itself:
    :func:`~.quantise.smallest_safe_bits` (six standard deviations of the summed
    noise) gives the width.

    Parameters
    ----------
    settings : DDPSettings
        The encoding; ``settings.num_clients`` is :math:`n`.
    dim : int
        The length of the flattened upload (``UploadLayout.dim``).

    Returns
    -------
    int
        The smallest width that works (``<= settings.bits``).

    Raises
    ------
    ValueError
        ``settings.bits`` below the smallest width that works (the message names
        it), the sum needing more than 62 bits, or ``dim`` not an int ``>= 1``.
    """
    needed = smallest_safe_bits(
        num_clients=int(settings.num_clients),
        linf_bound=linf_bound(settings, dim),
        noise_stddev=math.sqrt(float(settings.local_variance)),
    )
    if settings.bits < needed:
        raise ValueError(
            f"bits={settings.bits} is too small: {settings.num_clients} summed "
            f"uploads of dim {dim} may wrap around; the smallest width that "
            f"works is bits={needed}"
        )
    return needed


def _seed(round_seed: int) -> int:
    return check_int("round_seed", round_seed, 0)


def encode_upload(
    records: Records,
    settings: DDPSettings,
    *,
    round_seed: int,
    rng: np.random.Generator,
    layout: UploadLayout | None = None,
) -> EncodedUpload:
    r"""Return one client's upload as integers modulo :math:`2^b`, ready to mask.

    Flatten (sorted names, then sorted keys), clip to L2 norm ``l2_clip``, rotate
    with :func:`~.quantise.randomized_hadamard` (``round_seed``, the same on every
    client of a round), divide by ``granularity``, round with
    :func:`~.quantise.conditional_randomized_rounding` (bound
    ``l2_clip / granularity``), add ``local_variance`` of integer noise and wrap.
    The width is not checked here: the server calls :func:`check_bits` once.

    Parameters
    ----------
    records : Mapping[str, Mapping[str, numpy.ndarray]]
        Record name -> key -> float array (not modified).
    settings : DDPSettings
        The encoding.
    round_seed : int
        The rotation's seed, ``>= 0``.
    rng : numpy.random.Generator
        The client's own randomness (rounding and noise).
    layout : UploadLayout, optional
        The layout the server expects; ``records`` must then have it.

    Returns
    -------
    EncodedUpload
        ``values`` (``int64`` in ``[0, 2**bits)``, length ``layout.padded_dim``),
        ``clip_factor`` and ``layout``.

    Raises
    ------
    ValueError
        ``records`` malformed or not of ``layout``, ``settings`` not a
        :class:`DDPSettings`, ``round_seed`` not an int ``>= 0``, ``rng`` not a
        generator.
    """
    if not isinstance(settings, DDPSettings):
        raise ValueError(f"settings must be a DDPSettings, got {settings!r}")
    seed = _seed(round_seed)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {rng!r}")
    expected = upload_layout(records) if layout is None else layout
    vector = flatten_records(records, expected)
    clipped, factor = clip_l2(vector, settings.l2_clip)
    step = float(settings.granularity)
    scaled = randomized_hadamard(clipped, seed) / step
    rounded = conditional_randomized_rounding(
        scaled,
        beta=float(settings.beta),
        norm_bound=float(settings.l2_clip) / step,
        rng=rng,
    )
    variance = float(settings.local_variance)
    if variance > 0:
        if settings.noise == "gaussian":
            rounded = rounded + discrete_gaussian(variance, rounded.size, rng)
        else:
            rounded = rounded + skellam(variance, rounded.size, rng)
    return EncodedUpload(modular_wrap(rounded, settings.bits), factor, expected)


def decode_sum(
    wrapped_sum: NDArray[np.integer],
    layout: UploadLayout,
    settings: DDPSettings,
    *,
    round_seed: int,
) -> dict[str, dict[str, NDArray[np.floating]]]:
    r"""Return the records summed over the clients, from their sum modulo :math:`2^b`.

    Unwrap to :math:`[-2^{b-1}, 2^{b-1})`, multiply by ``granularity``, undo the
    rotation (:func:`~.quantise.inverse_randomized_hadamard`) and split into the
    arrays of ``layout``, cast to their dtypes. The result is the sum of the
    clipped uploads plus the summed rounding error and noise (times
    ``granularity``), provided the sum did not wrap around (:func:`check_bits`).

    Parameters
    ----------
    wrapped_sum : numpy.ndarray
        The 1-D integer sum of the clients' ``values`` modulo ``2**bits``, in
        ``[0, 2**bits)``, of length ``layout.padded_dim``.
    layout : UploadLayout
        The layout the clients encoded with.
    settings : DDPSettings
        The encoding.
    round_seed : int
        The rotation's seed of the round.

    Returns
    -------
    dict[str, dict[str, numpy.ndarray]]
        Record name -> key -> the summed array.

    Raises
    ------
    ValueError
        ``wrapped_sum`` not 1-D integers in ``[0, 2**bits)`` of length
        ``layout.padded_dim``; ``layout`` not an :class:`UploadLayout` with
        values; ``settings`` not a :class:`DDPSettings`; ``round_seed`` bad.
    """
    if not isinstance(layout, UploadLayout) or layout.dim == 0:
        raise ValueError(f"layout must be a non-empty UploadLayout, got {layout!r}")
    if not isinstance(settings, DDPSettings):
        raise ValueError(f"settings must be a DDPSettings, got {settings!r}")
    seed = _seed(round_seed)
    total = np.asarray(wrapped_sum)
    if not np.issubdtype(total.dtype, np.integer):
        raise ValueError(f"wrapped_sum must hold integers, got dtype {total.dtype}")
    if total.shape != (layout.padded_dim,):
        raise ValueError(
            f"wrapped_sum must have shape ({layout.padded_dim},) for this layout, "
            f"got {total.shape}"
        )
    modulus = 1 << settings.bits
    if total.size and (int(total.min()) < 0 or int(total.max()) >= modulus):
        raise ValueError(f"wrapped_sum must lie in [0, 2**{settings.bits})")
    centred = modular_unwrap(total.astype(np.int64), settings.bits)
    scaled = centred.astype(np.float64) * float(settings.granularity)
    vector = inverse_randomized_hadamard(scaled, seed, layout.dim)
    out: dict[str, dict[str, NDArray[np.floating]]] = {}
    start = 0
    for entry in layout.entries:
        size = math.prod(entry.shape)
        piece = vector[start : start + size].reshape(entry.shape)
        out.setdefault(entry.name, {})[entry.key] = piece.astype(np.dtype(entry.dtype))
        start += size
    return out

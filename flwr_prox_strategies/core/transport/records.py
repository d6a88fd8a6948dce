"""Conversions between Flower records and numpy, and array layouts for validation."""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord
from numpy.typing import NDArray

NUMPY_STYPE = "numpy.ndarray"


@dataclass(frozen=True)
class ArraySpec:
    """Expected dtype and shape of one named array of a reply.

    Parameters
    ----------
    dtype : str
        The numpy dtype's name (``"float32"``).
    shape : tuple[int, ...]
        The array's shape.
    """

    dtype: str
    shape: tuple[int, ...]


RecordSpec = dict[str, ArraySpec]
"""The layout a reply's ArrayRecord must have: array key -> :class:`ArraySpec`.

Ordered: the order is the ``NumPyClient``'s list order (the model's
``state_dict`` order). :meth:`ValidatedFedAvg.expected_train_arrays
<flwr_prox_strategies.extend.ValidatedFedAvg.expected_train_arrays>` returns one
per ArrayRecord a train reply must carry; an empty one only checks the name.
"""


def spec_of(record: ArrayRecord) -> RecordSpec:
    """Return the layout (key order, dtype, shape) of an ``ArrayRecord``."""
    return {
        key: ArraySpec(str(arr.dtype), tuple(arr.shape)) for key, arr in record.items()
    }


def array_view(array: Array) -> NDArray:
    """Return a read-only numpy view of an ``Array``'s payload, without a copy.

    ``Array.numpy()`` goes through ``np.load`` on a ``BytesIO`` and copies the
    payload; aggregation only reads it, so a view over the bytes is enough. The
    ``.npy`` header is parsed and checked against the ``Array``'s declared dtype
    and shape, so a payload that lies about its metadata is refused.

    Raises
    ------
    ValueError
        If the payload is not a well-formed ``.npy`` buffer matching the metadata.
    """
    if array.stype != NUMPY_STYPE:
        raise ValueError(f"unsupported serialisation type {array.stype!r}")
    data = array.data
    shape = tuple(array.shape)
    # Fast path: the exact header np.save writes for the declared dtype and shape.
    layout = _expected_layout(array.dtype, shape)
    if layout is not None:
        header, dtype, count = layout
        if len(data) - len(header) == count * dtype.itemsize and data.startswith(
            header
        ):
            flat = np.frombuffer(data, dtype=dtype, count=count, offset=len(header))
            return flat.reshape(shape)
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    except ValueError as err:
        raise ValueError(f"malformed .npy payload: {err}") from err
    if dtype.hasobject:
        raise ValueError("object arrays are not accepted")
    if str(dtype) != array.dtype or tuple(shape) != tuple(array.shape):
        raise ValueError(
            f"payload holds {dtype}{list(shape)} but the Array declares "
            f"{array.dtype}{list(array.shape)}"
        )
    offset = stream.tell()
    count = int(np.prod(shape, dtype=np.int64))
    if len(data) - offset != count * dtype.itemsize:
        raise ValueError(
            f"payload has {len(data) - offset} bytes, expected {count * dtype.itemsize}"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.reshape(shape, order="F" if fortran else "C")


@functools.lru_cache(maxsize=1024)
def _expected_layout(
    dtype: str, shape: tuple[int, ...]
) -> tuple[bytes, np.dtype, int] | None:
    """Return the ``.npy`` header, the dtype and the element count of a layout.

    Cached: every reply of a round has the same layouts, and ``np.dtype`` of a
    name and ``np.prod`` of a shape cost microseconds each, per array.
    """
    header = _expected_header(dtype, shape)
    if header is None:
        return None
    return header, np.dtype(dtype), math.prod(shape)


@functools.lru_cache(maxsize=1024)
def _expected_header(dtype: str, shape: tuple[int, ...]) -> bytes | None:
    try:
        descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    except TypeError:
        return None
    buffer = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def to_array(value: NDArray) -> Array:
    """Return ``Array(value)`` with the payload built in one copy.

    Flower's ``Array(ndarray)`` writes ``np.save`` into a ``BytesIO`` and copies
    its value out, so a model-sized array briefly exists three times (the
    array, the stream, the payload): the peak of every aggregation. Here the
    payload is the ``.npy`` header ``np.save`` writes followed by the array's
    bytes, joined in one allocation; the result equals ``Array(value)`` byte for
    byte (object, non-C-ordered and unusual dtypes take Flower's path).

    Parameters
    ----------
    value : NDArray
        The array; copied once, into the payload.

    Returns
    -------
    Array
        The same ``Array`` Flower's constructor builds.
    """
    array = np.asarray(value)
    if array.dtype.hasobject or not array.flags.c_contiguous:
        return Array(np.array(array, order="C", copy=None))
    header = _expected_header(str(array.dtype), tuple(array.shape))
    if header is None:
        return Array(array)
    payload = memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    data = b"".join((header, payload))
    return Array(
        dtype=str(array.dtype), shape=tuple(array.shape), stype=NUMPY_STYPE, data=data
    )


def array_of_npy(data: bytes) -> Array:
    """Return the ``Array`` whose payload is the ``.npy`` bytes ``data``.

    The bytes np.save writes for a C-ordered array become the payload as they
    are (what :func:`to_array` builds); any other ``.npy`` is read and rebuilt.

    Raises
    ------
    ValueError
        If ``data`` is not a ``.npy`` payload, or holds objects.
    """
    # The header np.save writes, up to its newline (version 1.0: a 2-byte size).
    size = 10 + int.from_bytes(data[8:10], "little") if len(data) >= 10 else 0
    layout = _npy_layout(data[:size]) if data[:8] == b"\x93NUMPY\x01\x00" else None
    if layout is not None:
        dtype, shape, count = layout
        if len(data) == size + count * dtype.itemsize:
            return Array(dtype=str(dtype), shape=shape, stype=NUMPY_STYPE, data=data)
    return to_array(np.lib.format.read_array(io.BytesIO(data), allow_pickle=False))


@functools.lru_cache(maxsize=1024)
def _npy_layout(header: bytes) -> tuple[np.dtype, tuple[int, ...], int] | None:
    """Return (dtype, shape, count) of a ``.npy`` header :func:`to_array` writes.

    None for any other header (version, order or spacing).

    Cached: parsing a header evaluates its text, and a model's state files
    hold the same dozen headers at every read.
    """
    try:
        stream = io.BytesIO(header[8:])  # after the magic
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    except ValueError:
        return None
    layout = None if fortran else _expected_layout(str(dtype), tuple(shape))
    if layout is None or layout[0] != header:
        return None
    return layout[1], tuple(shape), layout[2]


def to_ndarrays(record: ArrayRecord) -> list[NDArray]:
    """Return the record's arrays as writable numpy arrays, in key order.

    Each is one copy of the payload read through :func:`array_view`: the same
    values, dtype, shape and memory order as ``Array.numpy()``, without
    ``np.load`` parsing every ``.npy`` header again (a client reads a dozen
    arrays a call; at thousands of nodes that parse was a tenth of its call).
    """
    return [np.array(array_view(arr), copy=True, order="K") for arr in record.values()]


def to_record(
    arrays: Sequence[NDArray], keys: Sequence[str] | None = None
) -> ArrayRecord:
    """Build an ``ArrayRecord`` from a list of arrays, with the given key order.

    Parameters
    ----------
    arrays : Sequence[NDArray]
        The arrays.
    keys : Sequence[str] | None
        Their names; ``"0", "1", ...`` when None (Flower's own convention).
    """
    if keys is None:
        keys = [str(i) for i in range(len(arrays))]
    if len(keys) != len(arrays):
        raise ValueError(f"{len(arrays)} arrays for {len(keys)} keys")
    record = ArrayRecord()
    for key, value in zip(keys, arrays, strict=True):
        record[key] = to_array(value)
    return record


def dict_to_record(arrays: Mapping[str, NDArray]) -> ArrayRecord:
    """Build an ``ArrayRecord`` from a name -> array mapping, keeping its order.

    Parameters
    ----------
    arrays : Mapping[str, NDArray]
        Array key -> numpy array (copied into the record, C-ordered).

    Returns
    -------
    ArrayRecord
        The record, its keys in the mapping's order.

    See Also
    --------
    record_to_dict : the inverse.
    """
    return to_record(list(arrays.values()), list(arrays.keys()))


def record_is_finite(record: ArrayRecord) -> bool:
    """Return True when no floating array of ``record`` holds NaN or inf."""
    for array in record.values():
        view = array_view(array)
        if np.issubdtype(view.dtype, np.inexact) and not np.isfinite(view).all():
            return False
    return True


def record_to_dict(record: ArrayRecord) -> dict[str, NDArray]:
    """Return the record's arrays as writable numpy arrays, keyed and ordered.

    Parameters
    ----------
    record : ArrayRecord
        A model (or any ArrayRecord of numpy arrays).

    Returns
    -------
    dict[str, NDArray]
        Array key -> a writable copy, in the record's key order.

    See Also
    --------
    dict_to_record : the inverse.
    """
    return {key: arr.numpy() for key, arr in record.items()}


def float_keys(arrays: Mapping[str, NDArray]) -> list[str]:
    """Keys of the floating-point arrays (the ones algorithms do maths on)."""
    return [k for k, v in arrays.items() if np.issubdtype(v.dtype, np.floating)]

"""Readers of the data sets' own files: idx (Fashion-MNIST) and UCI Adult's records."""

from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# --------------------------------------------------------------------------- idx files

# Type byte of the idx header -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class _Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


def _read_exactly(stream: _Readable, size: int, path: Path) -> bytes:
    """Read ``size`` bytes or raise ``ValueError`` for a truncated file."""
    data = stream.read(size)
    if len(data) != size:
        raise ValueError(f"{path} is truncated: wanted {size} bytes, got {len(data)}")
    return data


def read_idx(
    path: str | os.PathLike[str], *, max_items: int | None = None
) -> np.ndarray:
    """Read an idx file (the MNIST format), optionally gzipped.

    Parameters
    ----------
    path : str or PathLike
        File to read; a name ending in ``.gz`` is decompressed on the fly.
    max_items : int or None, default None
        Read only the first ``max_items`` entries along the first axis.

    Returns
    -------
    np.ndarray
        Array with the shape given in the header, in native byte order.
    """
    if max_items is not None and max_items < 0:
        raise ValueError(f"max_items must be >= 0 or None, got {max_items!r}")
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as stream:
        magic = _read_exactly(stream, 4, path)
        if magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
            raise ValueError(f"{path} is not an idx file (magic {magic.hex()})")
        dtype, ndim = _IDX_DTYPES[magic[2]], magic[3]
        dims = [
            int(d) for d in np.frombuffer(_read_exactly(stream, 4 * ndim, path), ">u4")
        ]
        if ndim and max_items is not None:
            dims[0] = min(dims[0], max_items)
        count = int(np.prod(dims))
        # Only the requested rows are decompressed: tests read a few thousand.
        body = _read_exactly(stream, count * dtype.itemsize, path)
    return np.frombuffer(body, dtype).reshape(dims).astype(dtype.newbyteorder("="))


# --------------------------------------------------------------------- Fashion-MNIST

_FASHION_FILES = {
    ("train", "x"): "train-images-idx3-ubyte",
    ("train", "y"): "train-labels-idx1-ubyte",
    ("test", "x"): "t10k-images-idx3-ubyte",
    ("test", "y"): "t10k-labels-idx1-ubyte",
}


def _idx_file(folder: Path, stem: str) -> Path | None:
    """Return ``folder/stem`` or ``folder/stem.gz``, whichever exists."""
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _has_fashion_files(folder: Path) -> bool:
    return all(_idx_file(folder, stem) for stem in _FASHION_FILES.values())


def _fashion_split(
    folder: Path, split: str, limit: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Read one split's images (uint8, n x 28 x 28) and labels from idx files."""
    x_path = _idx_file(folder, _FASHION_FILES[(split, "x")])
    y_path = _idx_file(folder, _FASHION_FILES[(split, "y")])
    if x_path is None or y_path is None:
        raise FileNotFoundError(f"Fashion-MNIST {split} files missing in {folder}")
    images = read_idx(x_path, max_items=limit)
    labels = read_idx(y_path, max_items=limit)
    if len(images) != len(labels):
        raise ValueError(f"{x_path} and {y_path} hold different numbers of items")
    return images, labels


# --------------------------------------------------------------------------- Adult

ADULT_COLUMNS = (
    "age",
    "workclass",
    "fnlwgt",
    "education",
    "education-num",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "capital-gain",
    "capital-loss",
    "hours-per-week",
    "native-country",
)
ADULT_CATEGORICAL = (
    "workclass",
    "education",
    "marital-status",
    "occupation",
    "relationship",
    "race",
    "sex",
    "native-country",
)


def _has_adult_files(folder: Path) -> bool:
    return (folder / "adult.data").is_file() and (folder / "adult.test").is_file()


def _read_adult_file(path: Path) -> list[list[str]]:
    """Return the stripped fields of every record (comment and blank lines skipped)."""
    rows = []
    with path.open(encoding="ascii") as handle:
        for number, raw in enumerate(handle, start=1):
            line = raw.strip()
            # adult.test opens with "|1x3 Cross validator"; both files end blank.
            if not line or line.startswith("|"):
                continue
            fields = [field.strip() for field in line.split(",")]
            if len(fields) != len(ADULT_COLUMNS) + 1:
                raise ValueError(
                    f"{path}:{number}: expected 15 fields, got {len(fields)}"
                )
            rows.append(fields)
    return rows


# Parsing takes ~0.5 s and experiments reload the same files many times; the
# modification times in the key make an edited file be read again.
@functools.lru_cache(maxsize=2)
def _parse_adult(
    test_file: tuple[Path, int], data_file: tuple[Path, int]
) -> tuple[np.ndarray, np.ndarray]:
    """Parse adult.test then adult.data into the encoded matrix and labels."""
    rows = _read_adult_file(test_file[0]) + _read_adult_file(data_file[0])
    table = np.array(rows, dtype=str)
    table = table[(table != "?").all(axis=1)]
    x = np.empty((len(table), len(ADULT_COLUMNS)), dtype=np.float64)
    for j, column in enumerate(ADULT_COLUMNS):
        if column in ADULT_CATEGORICAL:
            # np.unique sorts by code point, the order of the authors' encoding.
            _, x[:, j] = np.unique(table[:, j], return_inverse=True)
        else:
            x[:, j] = table[:, j].astype(np.float64)
    y = (np.char.rstrip(table[:, -1], ".") == ">50K").astype(np.int64)
    return x, y


def _unit_columns(x: np.ndarray) -> np.ndarray:
    """Scale every column to unit Euclidean norm (all-zero columns left as is)."""
    norms = np.linalg.norm(x, axis=0)
    return x / np.where(norms > 0, norms, 1.0)

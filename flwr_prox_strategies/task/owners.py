"""Partitions the data already fixes: a file of client ids, a data set's own clients."""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .official import _check_partition_count

# Key of the client ids in an ``.npz`` file holding more than one array.
PARTITION_FILE_KEY = "partition"
_PARTITION_FILE_TYPES = (".npy", ".npz", ".csv")


def _read_npz_ids(path: Path) -> np.ndarray:
    with np.load(path, allow_pickle=False) as archive:
        if PARTITION_FILE_KEY in archive.files:
            return np.asarray(archive[PARTITION_FILE_KEY])
        if len(archive.files) == 1:
            return np.asarray(archive[archive.files[0]])
        raise ValueError(
            f"partition file {path} holds arrays {archive.files}: save one array, "
            f"or the client ids under the key {PARTITION_FILE_KEY!r}"
        )


def _read_csv_ids(path: Path) -> np.ndarray:
    """Read one integer per line; a first line not starting with a digit is a header."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    numbers = [(row, text) for row, text in enumerate(lines, start=1) if text]
    if numbers and not re.match(r"[+-]?\d", numbers[0][1]):
        numbers = numbers[1:]
    ids = []
    for row, text in numbers:
        try:
            ids.append(int(text))
        except ValueError:
            raise ValueError(
                f"partition file {path}, line {row}: {text!r} is not an integer "
                "client id (one integer per line)"
            ) from None
    return np.asarray(ids, dtype=np.int64)


def _read_client_ids(path: Path) -> np.ndarray:
    """Load the raw client-id array of ``path`` (``.npy``, ``.npz`` or ``.csv``)."""
    if not path.is_file():
        raise ValueError(f"partition file {path} does not exist or is not a file")
    suffix = path.suffix.lower()
    if suffix not in _PARTITION_FILE_TYPES:
        raise ValueError(
            f"partition file {path}: unsupported type {suffix!r}, use one of "
            f"{', '.join(_PARTITION_FILE_TYPES)}"
        )
    try:
        if suffix == ".npy":
            return np.asarray(np.load(path, allow_pickle=False))
        if suffix == ".npz":
            return _read_npz_ids(path)
        return _read_csv_ids(path)
    except (OSError, EOFError, UnicodeDecodeError, zipfile.BadZipFile) as err:
        raise ValueError(f"partition file {path} cannot be read: {err}") from err
    except ValueError as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"partition file {path} cannot be read: {err}") from err


def _integer_client_ids(raw: np.ndarray, path: Path) -> np.ndarray:
    """Return ``raw`` as a 1-D int64 array, refusing non-integer or negative ids."""
    ids = raw.reshape(-1) if raw.ndim == 2 and 1 in raw.shape else raw
    if ids.ndim != 1:
        raise ValueError(
            f"partition file {path}: expected one client id per training index "
            f"(a 1-D array), got shape {raw.shape}"
        )
    if np.issubdtype(ids.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(ids) | (ids != np.round(ids)))
        if bad.size:
            raise ValueError(
                f"partition file {path}: non-integer client id {float(ids[bad[0]])} "
                f"at index {bad[0]}"
            )
    elif ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"partition file {path}: client ids must be integers, got dtype {ids.dtype}"
        )
    ids = ids.astype(np.int64)
    negative = np.flatnonzero(ids < 0)
    if negative.size:
        raise ValueError(
            f"partition file {path}: negative client id {ids[negative[0]]} at index "
            f"{negative[0]}"
        )
    return ids


def _check_client_ids(
    ids: np.ndarray,
    path: Path,
    *,
    num_samples: int,
    num_partitions: int,
    allow_empty: bool,
) -> None:
    """Refuse ids that do not give every training index one of the clients."""
    if len(ids) != num_samples:
        raise ValueError(
            f"partition file {path} has {len(ids)} client ids but the training set "
            f"has {num_samples} samples (one id per training index, in its order)"
        )
    if ids.max() >= num_partitions:
        raise ValueError(
            f"partition file {path} has client ids up to {ids.max()} "
            f"({len(np.unique(ids))} distinct) but num_partitions={num_partitions}: "
            f"ids must be 0..{num_partitions - 1}"
        )
    empty = np.flatnonzero(np.bincount(ids, minlength=num_partitions) == 0)
    if empty.size and not allow_empty:
        raise ValueError(
            f"partition file {path}: client ids are not contiguous "
            f"0..{num_partitions - 1}, clients {empty[:10].tolist()} have no samples "
            "(empty clients); set allow_empty=true to accept them"
        )


def file_partition(
    labels: np.ndarray | Sequence[int],
    *,
    num_partitions: int,
    path: str | os.PathLike[str],
    seed: int = 0,
    allow_empty: bool = False,
) -> list[np.ndarray]:
    """Split indices as a file says: one client id per training index.

    Runs another library's split exactly: save its client id of every training
    sample, in the training set's order, and pass the file.

    Parameters
    ----------
    labels : np.ndarray or Sequence[int]
        Labels of the training set (only their number is used).
    num_partitions : int
        Number of clients; the ids must be ``0..num_partitions-1``.
    path : str or os.PathLike
        ``.npy`` (one 1-D integer array), ``.npz`` (one array, or the key
        ``"partition"``) or ``.csv`` (one integer per line, optional header
        line). A relative path is relative to the process's working directory;
        every process that builds a client reads it.
    seed : int, default 0
        Unused: the file fixes the split.
    allow_empty : bool, default False
        Accept clients with no samples (ids in ``0..num_partitions-1`` that
        the file does not use).

    Returns
    -------
    list of np.ndarray
        Sorted int64 indices of each client's samples.

    Raises
    ------
    ValueError
        Naming the file and the problem: missing or unreadable, unsupported
        type, non-integer or negative ids, a length other than the number of
        labels, ids beyond ``num_partitions - 1``, or empty clients.
    """
    del seed
    num_samples = len(np.asarray(labels))
    num_partitions = _check_partition_count(num_partitions, num_samples)
    file = Path(os.path.expanduser(os.fspath(path)))
    ids = _integer_client_ids(_read_client_ids(file), file)
    _check_client_ids(
        ids,
        file,
        num_samples=num_samples,
        num_partitions=num_partitions,
        allow_empty=bool(allow_empty),
    )
    return [np.flatnonzero(ids == client) for client in range(num_partitions)]


def natural_partition(
    labels: np.ndarray | Sequence[int],
    *,
    num_partitions: int,
    owners: np.ndarray | None,
    seed: int = 0,
) -> list[np.ndarray]:
    """Split indices by the client each sample was generated for.

    The data set itself says who owns what (``TrainTest.train_owners``: the
    FedProx paper's synthetic federations); the pack's pipeline passes it to
    any partition function with an ``owners`` parameter.

    Parameters
    ----------
    labels : np.ndarray or Sequence[int]
        Labels of the training set (only their number is used).
    num_partitions : int
        Number of clients: must equal the data set's number of clients.
    owners : np.ndarray or None
        The client of every training sample; None when the data set has none.
    seed : int, default 0
        Unused: the data fixes the split.

    Returns
    -------
    list of np.ndarray
        Sorted int64 indices of the samples of each of the data set's clients.

    Raises
    ------
    ValueError
        If the data set has no natural clients, or ``num_partitions`` is not
        their number (the message says which value to set).
    """
    del seed
    if owners is None:
        raise ValueError(
            "partition=natural needs a data set generated per client (dataset="
            "synthetic); this data set is pooled: choose another partition"
        )
    owners = np.asarray(owners, dtype=np.int64)
    if len(owners) != len(np.asarray(labels)):
        raise ValueError(
            f"owners has {len(owners)} entries for {len(np.asarray(labels))} samples"
        )
    count = int(owners.max()) + 1 if owners.size else 0
    if num_partitions != count:
        raise ValueError(
            f"partition=natural: the data set has {count} clients, but "
            f"num_partitions={num_partitions}; set num_clients={count} (and "
            "num_partitions, if you set it)"
        )
    return [np.flatnonzero(owners == client) for client in range(count)]

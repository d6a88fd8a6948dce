"""Data set loaders returning plain numpy arrays.

The rest of the pack only sees :class:`ArrayDataset` and :class:`TrainTest`, so
it does not depend on a data set library. Features are float32 of shape
``(n, num_features)`` (images flattened and scaled to [0, 1]) and labels int64.

Files are looked for, in order, in ``$FLWR_PROX_DATA_DIR/<name>``, in
``shared/data/<name>`` under any ancestor of the working directory or of this
file (the project keeps offline copies there), and in
``/usr/share/datasets/<name>``. Fashion-MNIST alone may then be downloaded
from the Hugging Face hub.
"""

from __future__ import annotations

import functools
import gzip
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .._optional import require

__all__ = [
    "ADULT_CATEGORICAL",
    "ADULT_COLUMNS",
    "DATA_DIR_ENV",
    "LOADERS",
    "ArrayDataset",
    "TrainTest",
    "adult_matrix",
    "candidate_dirs",
    "hub_split_to_arrays",
    "load_adult",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "read_idx",
]

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "FLWR_PROX_DATA_DIR"
_SYSTEM_DATA_DIR = Path("/usr/share/datasets")
_HUB_FASHION_MNIST = "zalando-datasets/fashion_mnist"


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """Features and labels of a classification data set.

    Parameters
    ----------
    x : np.ndarray
        Features, converted to contiguous float32 of shape ``(n, features)``.
    y : np.ndarray
        Labels, converted to int64 of shape ``(n,)``, each in
        ``[0, num_classes)``.
    num_classes : int
        Number of classes of the task (not necessarily all present in ``y``).

    Raises
    ------
    ValueError
        If ``x`` is not 2-D, ``y`` is not 1-D of the same length, ``y`` holds
        non-integer labels or labels outside ``[0, num_classes)``, or
        ``num_classes < 1``.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        """Coerce dtypes and check shapes."""
        x = np.ascontiguousarray(self.x, dtype=np.float32)
        y = np.asarray(self.y)
        if x.ndim != 2:
            raise ValueError(f"x must be 2-D (n, features), got shape {x.shape}")
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"y must have shape ({len(x)},), got {y.shape}")
        if y.size and not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"y must hold integer labels, got dtype {y.dtype}")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")
        y = y.astype(np.int64)
        if y.size and (y.min() < 0 or y.max() >= self.num_classes):
            raise ValueError(f"y must lie in [0, num_classes={self.num_classes})")
        # The dataclass is frozen; this is the documented way to normalise fields.
        object.__setattr__(self, "x", x)
        object.__setattr__(self, "y", y)

    def __len__(self) -> int:
        """Return the number of samples."""
        return len(self.y)

    @property
    def num_features(self) -> int:
        """Number of features per sample."""
        return int(self.x.shape[1])

    def subset(self, indices: Sequence[int] | np.ndarray) -> ArrayDataset:
        """Return the samples at ``indices`` (integer indices or boolean mask).

        Parameters
        ----------
        indices : Sequence[int] or np.ndarray
            Row indices, or a boolean mask of length ``len(self)``.

        Returns
        -------
        ArrayDataset
            A copy holding the selected rows, in the given order.
        """
        idx = np.asarray(indices)
        if idx.dtype != np.bool_:
            # An empty list comes in as float64; it still selects nothing.
            idx = idx.astype(np.int64)
        return ArrayDataset(x=self.x[idx], y=self.y[idx], num_classes=self.num_classes)


@dataclass(frozen=True, eq=False)
class TrainTest:
    """A named train/test pair of :class:`ArrayDataset`.

    Parameters
    ----------
    train, test : ArrayDataset
        The two splits, with the same feature count and number of classes.
    name : str
        Name of the data set (``"digits"``, ``"fashion-mnist"``, ``"adult"``).
    num_features : int
        Number of features per sample.
    num_classes : int
        Number of classes.
    train_owners, test_owners : np.ndarray or None (default: None)
        For a data set generated per client (the FedProx paper's synthetic
        federations), the client each training and test sample belongs to
        (int64, one per sample, clients numbered from 0); ``partition=natural``
        splits the training set by them. None for a pooled data set.

    Raises
    ------
    ValueError
        If an owners array is not one integer per sample of its split.
    """

    train: ArrayDataset
    test: ArrayDataset
    name: str
    num_features: int
    num_classes: int
    train_owners: np.ndarray | None = None
    test_owners: np.ndarray | None = None

    def __post_init__(self) -> None:
        """Check the owners arrays against their splits."""
        for field_name, split in (
            ("train_owners", self.train),
            ("test_owners", self.test),
        ):
            owners = getattr(self, field_name)
            if owners is None:
                continue
            owners = np.asarray(owners)
            if owners.shape != (len(split),) or not (
                owners.size == 0 or np.issubdtype(owners.dtype, np.integer)
            ):
                raise ValueError(
                    f"{field_name} must hold one integer per sample "
                    f"({len(split)}), got shape {owners.shape} and dtype {owners.dtype}"
                )
            if owners.size and owners.min() < 0:
                raise ValueError(f"{field_name} must be >= 0")
            object.__setattr__(self, field_name, owners.astype(np.int64))

    @property
    def num_owners(self) -> int | None:
        """Number of natural clients (None for a pooled data set)."""
        if self.train_owners is None:
            return None
        return int(self.train_owners.max()) + 1 if self.train_owners.size else 0


# --------------------------------------------------------------------------- paths


def candidate_dirs(name: str) -> list[Path]:
    """Return the directories searched for data set ``name``, in order.

    Parameters
    ----------
    name : str
        Folder name of the data set, e.g. ``"fashion-mnist"`` or ``"adult"``.

    Returns
    -------
    list of Path
        ``$FLWR_PROX_DATA_DIR/<name>`` (if the variable is set), then
        ``<ancestor>/shared/data/<name>`` for every ancestor of the working
        directory and of this module, then ``/usr/share/datasets/<name>``.
    """
    found: list[Path] = []
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        found.append(Path(env).expanduser() / name)
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        found += [a / "shared" / "data" / name for a in (start, *start.parents)]
    found.append(_SYSTEM_DATA_DIR / name)
    # Both walks usually meet at the same ancestors.
    return list(dict.fromkeys(found))


def _find_dir(
    name: str,
    data_dir: str | os.PathLike[str] | None,
    is_complete: Callable[[Path], bool],
) -> tuple[Path | None, list[Path]]:
    """Return the first complete data directory and the list of places tried."""
    places = [Path(data_dir).expanduser()] if data_dir is not None else None
    tried = places if places is not None else candidate_dirs(name)
    for place in tried:
        if place.is_dir() and is_complete(place):
            return place, tried
    return None, tried


def _not_found_message(name: str, files: str, tried: list[Path], source: str) -> str:
    """Explain where data set ``name`` was searched for and how to provide it."""
    listing = "\n".join(f"  - {p}" for p in tried)
    return (
        f"{name} data not found: {files} missing. Searched:\n{listing}\n"
        f"Put the files in one of these folders, pass data_dir=..., or set "
        f"{DATA_DIR_ENV} to a folder holding a '{name}' sub-folder. "
        f"Source: {source}"
    )


# --------------------------------------------------------------------------- digits


def load_digits(*, test_fraction: float = 0.2, seed: int = 0) -> TrainTest:
    """Load scikit-learn's 8x8 digits (1,797 samples, embedded in the package).

    Parameters
    ----------
    test_fraction : float, default 0.2
        Fraction of samples in the test split, in (0, 1).
    seed : int, default 0
        Seed of the stratified split.

    Returns
    -------
    TrainTest
        64 features scaled to [0, 1] (pixels / 16), 10 classes; 1,437 training
        and 360 test samples with the default fraction.

    Raises
    ------
    ValueError
        If ``test_fraction`` is not in (0, 1).
    ImportError
        If scikit-learn is not installed (the ``[experiment]`` extra).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    # Imported lazily: scikit-learn takes a second to import.
    require("sklearn", "experiment", "the digits data set")
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_load_digits()
    x = np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0)
    y = np.asarray(bunch.target, dtype=np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return TrainTest(
        train=ArrayDataset(x_tr, y_tr, 10),
        test=ArrayDataset(x_te, y_te, 10),
        name="digits",
        num_features=64,
        num_classes=10,
    )


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


def _fashion_from_hub() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Download Fashion-MNIST with ``datasets`` (needs network access)."""
    hf_datasets = require("datasets", "experiment", "downloading Fashion-MNIST")

    dataset_dict = hf_datasets.load_dataset(_HUB_FASHION_MNIST)
    return {
        split: hub_split_to_arrays(dataset_dict[split]) for split in ("train", "test")
    }


def hub_split_to_arrays(split: Any) -> tuple[np.ndarray, np.ndarray]:
    """Convert a Hugging Face split with ``image``/``label`` columns to arrays.

    Parameters
    ----------
    split : datasets.Dataset
        Split whose ``image`` column holds PIL images (or arrays).

    Returns
    -------
    tuple of np.ndarray
        uint8 images ``(n, H, W)`` and int64 labels ``(n,)``.
    """
    images = np.stack([np.asarray(img, dtype=np.uint8) for img in split["image"]])
    labels = np.asarray(list(split["label"]), dtype=np.int64)
    return images, labels


def _to_array_dataset(images: np.ndarray, labels: np.ndarray) -> ArrayDataset:
    x = images.reshape(len(images), -1).astype(np.float32) / np.float32(255.0)
    return ArrayDataset(x, labels.astype(np.int64), 10)


def load_fashion_mnist(
    *,
    data_dir: str | os.PathLike[str] | None = None,
    max_train: int | None = None,
    max_test: int | None = None,
    download: bool = True,
) -> TrainTest:
    """Load Fashion-MNIST from the original idx files.

    Parameters
    ----------
    data_dir : str | os.PathLike | None, default None
        Folder holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
        ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (each may be
        gzipped with a ``.gz`` suffix). ``None`` searches, in order,
        ``$FLWR_PROX_DATA_DIR/fashion-mnist``, ``shared/data/fashion-mnist``
        under any ancestor of the working directory or of the package, and
        ``/usr/share/datasets/fashion-mnist``.
    max_train, max_test : int or None, default None
        Keep only the first rows of each split (for fast tests).
    download : bool, default True
        When ``data_dir`` is None and no folder is found, download
        ``zalando-datasets/fashion_mnist`` from the Hugging Face hub.

    Returns
    -------
    TrainTest
        784 features in [0, 1] (pixels / 255), 10 classes, 60,000 training and
        10,000 test samples unless limited.

    Raises
    ------
    FileNotFoundError
        If the files are not found and cannot be downloaded (the message
        lists the folders searched).
    ValueError
        If ``max_train`` or ``max_test`` is not None or >= 1.
    """
    for name, limit in (("max_train", max_train), ("max_test", max_test)):
        if limit is not None and limit < 1:
            raise ValueError(
                f"{name} must be a positive integer or None, got {limit!r}"
            )
    folder, tried = _find_dir("fashion-mnist", data_dir, _has_fashion_files)
    if folder is not None:
        logger.debug("Reading Fashion-MNIST from %s", folder)
        train = _fashion_split(folder, "train", max_train)
        test = _fashion_split(folder, "test", max_test)
    else:
        train, test = _fashion_fallback(tried, download=download and data_dir is None)
        train = (train[0][:max_train], train[1][:max_train])
        test = (test[0][:max_test], test[1][:max_test])
    return TrainTest(
        train=_to_array_dataset(*train),
        test=_to_array_dataset(*test),
        name="fashion-mnist",
        num_features=784,
        num_classes=10,
    )


def _fashion_fallback(
    tried: list[Path], *, download: bool
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Download Fashion-MNIST, or raise ``FileNotFoundError`` saying where to put it."""
    message = _not_found_message(
        "fashion-mnist",
        "the idx files train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
        "t10k-images-idx3-ubyte[.gz] and t10k-labels-idx1-ubyte[.gz]",
        tried,
        "https://github.com/zalandoresearch/fashion-mnist or the Hugging Face "
        f"data set {_HUB_FASHION_MNIST}",
    )
    if not download:
        raise FileNotFoundError(message)
    logger.info("Fashion-MNIST not found locally; downloading %s", _HUB_FASHION_MNIST)
    try:
        splits = _fashion_from_hub()
    # Any failure of the optional download (no package, no network, hub error)
    # must surface as the not-found error that tells the user what to do.
    except (ImportError, OSError, ValueError, RuntimeError) as err:
        raise FileNotFoundError(f"{message}\nDownload failed: {err!r}") from err
    return splits["train"], splits["test"]


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
_ADULT_SOURCE = (
    "UCI Machine Learning Repository, https://archive.ics.uci.edu/dataset/2/adult"
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


def adult_matrix(
    data_dir: str | os.PathLike[str] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Return the FedEPM authors' 45,222 x 14 Adult matrix, unshuffled.

    Rows are ``adult.test`` then ``adult.data``, without rows holding a ``?``;
    the 14 attributes keep their order (``age``, ``workclass``, ...,
    ``native-country``), and each
    categorical one is replaced by the 0-based rank of its value among the
    sorted values present in those rows.

    Parameters
    ----------
    data_dir : str | os.PathLike | None, default None
        Folder holding ``adult.data`` and ``adult.test``; ``None`` searches,
        in order, ``$FLWR_PROX_DATA_DIR/adult``, ``shared/data/adult`` under
        any ancestor of the working directory or of the package, and
        ``/usr/share/datasets/adult``.

    Returns
    -------
    x : np.ndarray
        float64, shape (45222, 14), not normalised.
    y : np.ndarray
        int64, shape (45222,): 1 for ">50K" (24.78 %), else 0.

    Raises
    ------
    FileNotFoundError
        If the two files are not found (the message lists the folders
        searched).
    ValueError
        If a record of the files does not have 15 fields.
    """
    folder, tried = _find_dir("adult", data_dir, _has_adult_files)
    if folder is None:
        raise FileNotFoundError(
            _not_found_message(
                "adult", "adult.data and adult.test", tried, _ADULT_SOURCE
            )
        )
    files = (folder / "adult.test", folder / "adult.data")
    x, y = _parse_adult(*((p.resolve(), p.stat().st_mtime_ns) for p in files))
    # Copies, so that callers cannot corrupt the cached parse.
    return x.copy(), y.copy()


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


def load_adult(
    *,
    data_dir: str | os.PathLike[str] | None = None,
    normalize: bool = True,
    seed: int = 0,
    test_fraction: float = 0.0,
) -> TrainTest:
    """Load UCI Adult processed as in the FedEPM experiments.

    Takes :func:`adult_matrix`, scales each column to unit Euclidean norm (if
    ``normalize``), then shuffles the rows with ``seed``, as the authors'
    solver does before splitting rows among clients.

    Parameters
    ----------
    data_dir : str | os.PathLike | None, default None
        Folder holding ``adult.data`` and ``adult.test``; ``None`` searches as
        :func:`adult_matrix` does.
    normalize : bool, default True
        Scale every column of the whole matrix to unit Euclidean norm.
    seed : int, default 0
        Seed of the row shuffle and of the train/test split.
    test_fraction : float, default 0.0
        With 0 the train and the test set are both the full shuffled set (the
        FedEPM paper reports the training objective); in (0, 1) a seeded
        stratified split of the shuffled rows.

    Returns
    -------
    TrainTest
        14 features (float32), 2 classes.

    Raises
    ------
    FileNotFoundError
        If the two files are not found.
    ValueError
        If ``test_fraction`` is not in [0, 1).
    ImportError
        If ``test_fraction > 0`` and scikit-learn is not installed.

    References
    ----------
    S. Zhou and G. Y. Li, "Exact Penalty Method for Federated Learning", 2022
    (its Adult experiment). Data: UCI Machine Learning Repository,
    https://archive.ics.uci.edu/dataset/2/adult
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction!r}")
    x, y = adult_matrix(data_dir)
    if normalize:
        x = _unit_columns(x)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    if test_fraction == 0.0:
        full = ArrayDataset(x, y, 2)
        train, test = full, full
    else:
        require("sklearn", "experiment", "the Adult data set's test split")
        from sklearn.model_selection import train_test_split

        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=test_fraction, random_state=seed, stratify=y
        )
        train, test = ArrayDataset(x_tr, y_tr, 2), ArrayDataset(x_te, y_te, 2)
    return TrainTest(
        train=train, test=test, name="adult", num_features=14, num_classes=2
    )


# --------------------------------------------------------------------------- dispatch

LOADERS: dict[str, Callable[..., TrainTest]] = {
    "digits": load_digits,
    "fashion-mnist": load_fashion_mnist,
    "adult": load_adult,
}


def load_dataset(name: str, **kwargs: Any) -> TrainTest:
    """Load a data set by name.

    Parameters
    ----------
    name : str
        One of ``"digits"``, ``"fashion-mnist"``, ``"adult"``.
    **kwargs
        Keyword arguments of the loader.

    Returns
    -------
    TrainTest
        The loaded data set.

    Raises
    ------
    ValueError
        If ``name`` is not one of the three, or a loader's argument is invalid.
    FileNotFoundError, ImportError
        As the loader.
    """
    try:
        loader = LOADERS[name]
    except KeyError:
        valid = ", ".join(repr(n) for n in LOADERS)
        raise ValueError(f"name must be one of {valid}, got {name!r}") from None
    return loader(**kwargs)

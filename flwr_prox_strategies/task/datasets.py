"""Data set loaders returning plain numpy arrays.

Each returns a :class:`~.arrays.TrainTest`; the files are read by :mod:`.files`.

Files are looked for, in order, in ``$FLWR_PROX_DATA_DIR/<name>``, in
``shared/data/<name>`` under any ancestor of the working directory or of this
file (the project keeps offline copies there), and in
``/usr/share/datasets/<name>``. Fashion-MNIST alone may then be downloaded
from the Hugging Face hub.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .._optional import require
from .arrays import ArrayDataset, TrainTest
from .files import (
    _FASHION_FILES,
    ADULT_CATEGORICAL,
    ADULT_COLUMNS,
    _fashion_split,
    _has_adult_files,
    _has_fashion_files,
    _idx_file,
    _parse_adult,
    _unit_columns,
    read_idx,
)

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
        f"{DATA_DIR_ENV} to a folder holding a '{name}' sub-folder (under "
        "`flwr run`, in the environment that starts the SuperLink: an already "
        "running managed SuperLink keeps the environment it started with, so "
        "stop it first, `pkill -f flower-superlink`). "
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


def fashion_mnist_train_labels(
    *,
    data_dir: str | os.PathLike[str] | None = None,
    max_train: int | None = None,
    max_test: int | None = None,
    download: bool = True,
) -> np.ndarray:
    """Return the training labels :func:`load_fashion_mnist` gives, images unread.

    What partitioning reads (a ServerApp sizes every client's partition and
    never trains): the label file alone, 60 KB, where the images are 180 MB as
    float32. Without the files, the whole loader's labels.

    Parameters
    ----------
    data_dir, max_train, max_test, download
        As :func:`load_fashion_mnist` (``max_test`` is unused).

    Returns
    -------
    np.ndarray
        int64 labels, in the order of ``load_fashion_mnist(...).train.y``.
    """
    folder, _ = _find_dir("fashion-mnist", data_dir, _has_fashion_files)
    labels = (
        None if folder is None else _idx_file(folder, _FASHION_FILES[("train", "y")])
    )
    if labels is None:
        loaded = load_fashion_mnist(
            data_dir=data_dir, max_train=max_train, max_test=max_test, download=download
        )
        return loaded.train.y
    return read_idx(labels, max_items=max_train).astype(np.int64)


#: Loaders that can give their training labels without their features: the
#: experiment's ServerApp partitions from these (``train_labels``).
load_fashion_mnist.train_labels = fashion_mnist_train_labels  # type: ignore[attr-defined]


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


_ADULT_SOURCE = (
    "UCI Machine Learning Repository, https://archive.ics.uci.edu/dataset/2/adult"
)


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

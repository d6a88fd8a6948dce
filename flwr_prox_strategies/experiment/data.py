"""Data for the pack's experiments: load once per process, partition, wrap.

On a deployment every message starts a new ClientApp process, which would import
scikit-learn (the digits) and Hugging Face ``datasets`` (the Dirichlet split)
again each time: seconds per message. The digits and every partition index are
therefore also kept on disk (:func:`cache_dir`), keyed by what determines them:
the loader's or partitioner's config, a hash of the labels being split, of the
pack's ``task`` code and the versions of the libraries that compute them. Only
the pack's own loaders and partitioners are cached (a cache cannot see a user's
function change), and ``FLWR_PROX_CACHE_DIR=""`` turns the cache off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from ..task.datasets import ArrayDataset, TrainTest
from .config import instantiate

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

CACHE_DIR_ENV = "FLWR_PROX_CACHE_DIR"
# Loaders whose data ships inside a library (its version is in the key); loaders
# that read the user's files are not cached, as a cache could not see them change.
_CACHED_LOADERS = ("flwr_prox_strategies.task.datasets.load_digits",)
_VERSIONED = ("flwr-prox-strategies", "numpy", "scikit-learn", "datasets")


def cache_dir() -> Path | None:
    """Return the folder data and partitions are cached in, or None (no cache).

    ``$FLWR_PROX_CACHE_DIR``, else ``$XDG_CACHE_HOME/flwr-prox-strategies``
    (``~/.cache``); None when the variable is set to an empty string.
    """
    value = os.environ.get(CACHE_DIR_ENV)
    if value is not None:
        return Path(value).expanduser() if value else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flwr-prox-strategies"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


@functools.cache
def _task_code_hash() -> str:
    """Hash of the pack's loaders and partitioners (a code change is a new key)."""
    digest = hashlib.sha256()
    for path in sorted((Path(__file__).parents[1] / "task").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cached(
    kind: str,
    key: list[Any],
    compute: Callable[[], dict[str, np.ndarray]],
    names: Sequence[str] | None = None,
) -> dict[str, np.ndarray]:
    """Return ``compute()``, read from or written to the disk cache.

    ``names``: read only these arrays from the cache (all of them are
    computed and written when it misses).
    """
    folder = cache_dir()
    if folder is None:
        return compute()
    versions = [_version(d) for d in _VERSIONED]
    digest = hashlib.sha256(
        json.dumps([key, versions, _task_code_hash()]).encode()
    ).hexdigest()[:32]
    path = folder / f"{kind}-{digest}.npz"
    with contextlib.suppress(OSError, ValueError, KeyError), np.load(path) as saved:
        return {name: saved[name] for name in (names or saved.files)}
    arrays = compute()
    # A cache that cannot be written (read-only home) only costs time.
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp.npz")
        with os.fdopen(fd, "wb") as out:
            np.savez(out, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)  # atomic: concurrent ClientApps may race here
    return arrays


def load_data(cfg: DictConfig) -> TrainTest:
    """Load ``cfg.dataset``, standardised as its ``normalize`` key says.

    Cached per process (Ray workers load it once). ``normalize`` names an entry
    of the data set's ``stats`` (``{mean, std}``), or ``none``; a data set
    without the key (Adult: the loader scales its features) is left as loaded.
    """
    loader = OmegaConf.to_yaml(cfg.dataset.loader)
    choice = str(cfg.dataset.get("normalize", "none"))
    if choice == "none":
        return _load(loader)
    stats = cfg.dataset.get("stats") or {}
    if choice not in stats:
        raise ValueError(
            f"dataset.normalize={choice!r} is not one of {sorted(stats)} or 'none' "
            f"(the stats in conf/dataset/{cfg.dataset.get('name')}.yaml)"
        )
    mean, std = float(stats[choice]["mean"]), float(stats[choice]["std"])
    if not std > 0:
        raise ValueError(f"dataset.stats.{choice}.std must be > 0, got {std}")
    return _standardised(loader, mean, std)


@functools.lru_cache(maxsize=4)
def _standardised(loader_yaml: str, mean: float, std: float) -> TrainTest:
    data = _load(loader_yaml)

    def scaled(split: ArrayDataset) -> ArrayDataset:
        x = (split.x - np.float32(mean)) / np.float32(std)
        return ArrayDataset(x, split.y, split.num_classes)

    return dataclasses.replace(data, train=scaled(data.train), test=scaled(data.test))


def _is_cached_loader(loader: Any) -> bool:
    return isinstance(loader, DictConfig) and loader.get("_target_") in _CACHED_LOADERS


def _loaded_arrays(loader: Any) -> dict[str, np.ndarray]:
    data: TrainTest = instantiate(loader)
    return {
        "train-x": data.train.x,
        "train-y": data.train.y,
        "test-x": data.test.x,
        "test-y": data.test.y,
        "info": np.array([data.name, data.num_features, data.num_classes]),
    }


@functools.lru_cache(maxsize=4)
def _load(loader_yaml: str) -> TrainTest:
    loader = OmegaConf.create(loader_yaml)
    if not _is_cached_loader(loader):
        return instantiate(loader)
    arrays = _cached("data", [loader_yaml], lambda: _loaded_arrays(loader))
    name, num_features, num_classes = (str(v) for v in arrays["info"])
    return TrainTest(
        train=ArrayDataset(arrays["train-x"], arrays["train-y"], int(num_classes)),
        test=ArrayDataset(arrays["test-x"], arrays["test-y"], int(num_classes)),
        name=name,
        num_features=int(num_features),
        num_classes=int(num_classes),
    )


@functools.lru_cache(maxsize=4)
def _train_labels(loader_yaml: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Return the training labels and owners: all that partitioning reads.

    The ServerApp partitions (for every client's size) but never trains: the
    features stay unread where the loader can give its labels alone (the disk
    cache, Fashion-MNIST's label file), else they are loaded and let go
    (Fashion-MNIST's images are 180 MB as float32, which every ServerApp
    process used to hold for the run).
    """
    loader = OmegaConf.create(loader_yaml)
    if not _is_cached_loader(loader):
        # A loader that reads its labels alone (its ``train_labels``, as
        # Fashion-MNIST's) leaves the features unread; any other is loaded
        # outside _load's cache, so only the labels outlive this call.
        bound = instantiate(loader, _partial_=True)
        reader = getattr(bound.func, "train_labels", None)
        if reader is not None:
            return np.asarray(reader(*bound.args, **bound.keywords)), None
        data: TrainTest = _load.__wrapped__(loader_yaml)
        return data.train.y, data.train_owners
    arrays = _cached(
        "data", [loader_yaml], lambda: _loaded_arrays(loader), names=("train-y",)
    )
    return arrays["train-y"], None


@functools.lru_cache(maxsize=4)
def _partitions(
    loader_yaml: str, partition_yaml: str, num_partitions: int, seed: int
) -> tuple[np.ndarray, ...]:
    labels, owners = _train_labels(loader_yaml)
    config = OmegaConf.create(partition_yaml)

    def split() -> dict[str, np.ndarray]:
        partition = instantiate(config)
        extra = {}
        if "owners" in inspect.signature(partition).parameters:
            extra["owners"] = owners  # the data set's own clients
        parts = partition(labels, num_partitions=num_partitions, seed=seed, **extra)
        return {str(i): np.asarray(part) for i, part in enumerate(parts)}

    target = config.get("_target_", "") if isinstance(config, DictConfig) else ""
    # A partition read from a file is cheap to read and could change in place.
    reads_file = isinstance(config, DictConfig) and "path" in config
    if reads_file or not str(target).startswith("flwr_prox_strategies."):
        return tuple(split().values())
    labels_hash = hashlib.sha256(labels.tobytes()).hexdigest()
    if owners is not None:
        labels_hash += hashlib.sha256(owners.tobytes()).hexdigest()
    key = [partition_yaml, num_partitions, seed, labels_hash]
    arrays = _cached("partition", key, split)
    return tuple(arrays[str(i)] for i in range(num_partitions))


def partition_indices(cfg: DictConfig, num_partitions: int) -> tuple[np.ndarray, ...]:
    """Return every client's training-sample indices (seeded, alike on every node)."""
    return _partitions(
        OmegaConf.to_yaml(cfg.dataset.loader),
        OmegaConf.to_yaml(cfg.partition),
        num_partitions,
        int(cfg.seed),
    )


def client_partition(
    cfg: DictConfig, partition_id: int, num_partitions: int
) -> ArrayDataset:
    """Return the training data of one client (seeded, identical on every node)."""
    parts = partition_indices(cfg, num_partitions)
    return partition_of(load_data(cfg).train, parts, partition_id)


def partition_of(
    train: ArrayDataset, parts: Sequence[np.ndarray], partition_id: int
) -> ArrayDataset:
    """Return client ``partition_id``'s share of ``train`` (``parts``' indices)."""
    if not 0 <= partition_id < len(parts):
        raise ValueError(f"partition-id {partition_id} not in [0, {len(parts)})")
    return train.subset(parts[partition_id])


def partition_sizes(cfg: DictConfig, num_partitions: int) -> list[int]:
    """Sizes of every client's partition (for logs and results)."""
    return [len(p) for p in partition_indices(cfg, num_partitions)]


def to_loader(
    data: ArrayDataset, *, batch_size: int, shuffle: bool, **kwargs: Any
) -> DataLoader:
    """Wrap arrays in a ``DataLoader`` (float32 inputs, int64 labels)."""
    import torch  # the clients' and central evaluation's: the server needs none
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y))
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, **kwargs)


def split_held_out(
    data: ArrayDataset, fraction: float, *, seed: int
) -> tuple[ArrayDataset, ArrayDataset]:
    """Split a client's data into (train, held-out), seeded; both non-empty."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(
            f"evaluate.local_test_fraction must be in (0, 1), got {fraction}"
        )
    count = len(data)
    held = min(max(1, round(count * fraction)), count - 1)
    if count < 2:
        raise ValueError("a client with fewer than 2 examples cannot hold data out")
    order = np.random.default_rng(seed).permutation(count)
    return data.subset(np.sort(order[held:])), data.subset(np.sort(order[:held]))

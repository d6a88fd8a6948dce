"""Data for the pack's experiments: load once per process, partition, wrap."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from ..task.datasets import ArrayDataset, TrainTest
from .config import instantiate


@functools.lru_cache(maxsize=4)
def _load(loader_yaml: str) -> TrainTest:
    return instantiate(OmegaConf.create(loader_yaml))


def load_data(cfg: DictConfig) -> TrainTest:
    """Load ``cfg.dataset`` (cached per process: Ray workers load it once)."""
    return _load(OmegaConf.to_yaml(cfg.dataset.loader))


@functools.lru_cache(maxsize=4)
def _partitions(
    loader_yaml: str, partition_yaml: str, num_partitions: int, seed: int
) -> tuple[np.ndarray, ...]:
    data = _load(loader_yaml)
    split = instantiate(OmegaConf.create(partition_yaml))
    return tuple(split(data.train.y, num_partitions=num_partitions, seed=seed))


def client_partition(
    cfg: DictConfig, partition_id: int, num_partitions: int
) -> ArrayDataset:
    """Return the training data of one client (seeded, identical on every node)."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} not in [0, {num_partitions})")
    parts = _partitions(
        OmegaConf.to_yaml(cfg.dataset.loader),
        OmegaConf.to_yaml(cfg.partition),
        num_partitions,
        int(cfg.seed),
    )
    return load_data(cfg).train.subset(parts[partition_id])


def partition_sizes(cfg: DictConfig, num_partitions: int) -> list[int]:
    """Sizes of every client's partition (for logs and results)."""
    parts = _partitions(
        OmegaConf.to_yaml(cfg.dataset.loader),
        OmegaConf.to_yaml(cfg.partition),
        num_partitions,
        int(cfg.seed),
    )
    return [len(p) for p in parts]


def to_loader(
    data: ArrayDataset, *, batch_size: int, shuffle: bool, **kwargs: Any
) -> DataLoader:
    """Wrap arrays in a ``DataLoader`` (float32 inputs, int64 labels)."""
    dataset = TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y))
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, **kwargs)


def split_held_out(
    data: ArrayDataset, fraction: float, *, seed: int
) -> tuple[ArrayDataset, ArrayDataset]:
    """Split a client's data into (train, held-out), seeded; both non-empty."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"local-test-fraction must be in (0, 1), got {fraction}")
    count = len(data)
    held = min(max(1, round(count * fraction)), count - 1)
    if count < 2:
        raise ValueError("a client with fewer than 2 examples cannot hold data out")
    order = np.random.default_rng(seed).permutation(count)
    return data.subset(np.sort(order[held:])), data.subset(np.sort(order[:held]))

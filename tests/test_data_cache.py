"""The on-disk cache of data and partitions (one ClientApp process per message)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from flwr_prox_strategies.experiment import data
from flwr_prox_strategies.experiment.config import compose_config
from flwr_prox_strategies.experiment.server import make_client

from .helpers import node_context


def fresh_process() -> None:
    """Forget the in-process caches, as a new ClientApp process would."""
    data._load.cache_clear()
    data._standardised.cache_clear()
    data._partitions.cache_clear()
    data._train_labels.cache_clear()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    monkeypatch.setenv(data.CACHE_DIR_ENV, str(tmp_path))
    fresh_process()
    yield tmp_path
    fresh_process()


def parts(overrides: str, num_partitions: int = 5) -> list[np.ndarray]:
    cfg = compose_config(overrides)
    return [
        data.client_partition(cfg, i, num_partitions).y for i in range(num_partitions)
    ]


def test_a_new_process_reads_data_and_partitions_from_disk(cache, monkeypatch):
    first = parts("partition=dirichlet")
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == [
        "data",
        "partition",
    ]
    fresh_process()

    def no_compute(*args, **kwargs):
        raise AssertionError("computed again instead of read from the cache")

    monkeypatch.setattr(data, "instantiate", no_compute)
    second = parts("partition=dirichlet")
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_cached_equals_computed(cache, monkeypatch):
    cached = parts("partition=dirichlet partition.alpha=0.5")
    fresh_process()
    monkeypatch.setenv(data.CACHE_DIR_ENV, "")  # no cache at all
    computed = parts("partition=dirichlet partition.alpha=0.5")
    for a, b in zip(cached, computed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(list(cache.iterdir())) == 2  # the uncached run wrote nothing


def test_what_decides_the_split_is_in_the_key(cache):
    parts("partition=dirichlet")
    parts("partition=dirichlet", num_partitions=4)
    parts("partition=dirichlet partition.alpha=0.9")
    parts("partition=dirichlet seed=1")
    parts("partition=iid")
    names = [p.name for p in cache.iterdir()]
    assert sum(n.startswith("partition-") for n in names) == 5
    assert sum(n.startswith("data-") for n in names) == 1


def test_a_users_partitioner_and_file_loaders_are_not_cached(cache, monkeypatch):
    monkeypatch.setenv("FLWR_PROX_ALLOWED_TARGETS", "tests.test_data_cache.every_other")
    cfg = compose_config("dataset=adult partition=iid")
    data.client_partition(cfg, 0, 3)
    names = [p.name for p in cache.iterdir()]
    assert names and all(n.startswith("partition-") for n in names)  # no data-*
    fresh_process()
    cfg = compose_config(
        "partition=iid partition._target_=tests.test_data_cache.every_other"
    )
    data.client_partition(cfg, 0, 2)
    assert len(list(cache.iterdir())) == 2  # digits now, no new partition file


def every_other(labels, *, num_partitions: int, seed: int, **_):
    return [np.arange(i, len(labels), num_partitions) for i in range(num_partitions)]


def test_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(data.CACHE_DIR_ENV, str(blocked / "cache"))
    fresh_process()
    try:
        context = node_context(3, 1, 4, "num_clients=4 model=logreg")
        assert make_client(context) is not None
    finally:
        fresh_process()


def test_a_partition_file_changed_in_place_is_read_again(cache, tmp_path):
    ids = tmp_path / "clients.npy"
    cfg = compose_config(f"partition=file partition.path={ids}")
    n = len(data.load_data(cfg).train.y)
    np.save(ids, np.arange(n) % 2)
    first = data.client_partition(cfg, 0, 2)
    fresh_process()
    np.save(ids, (np.arange(n) + 1) % 2)  # the same path, the other half
    second = data.client_partition(cfg, 0, 2)
    assert len(first) + len(second) == n
    assert not [p for p in cache.iterdir() if p.name.startswith("partition-")]


def test_the_server_partitions_from_the_labels_without_holding_the_images(cache):
    # The ServerApp computes every client's partition size but never trains:
    # a new process reads only the labels from the cache, not the images.
    cfg = compose_config("partition=dirichlet")
    sizes = data.partition_sizes(cfg, 5)
    fresh_process()
    assert data.partition_sizes(cfg, 5) == sizes
    assert data._load.cache_info().currsize == 0  # no TrainTest with images kept
    labels, owners = data._train_labels(data.OmegaConf.to_yaml(cfg.dataset.loader))
    assert owners is None and labels.ndim == 1
    # and the clients' partitions are those sizes
    assert [len(p) for p in parts("partition=dirichlet")] == sizes


def test_a_loader_not_cached_on_disk_is_let_go_after_partitioning(cache):
    # The same for a data set read on every call (not cached on disk): its
    # labels stay in the process, its features do not.
    cfg = compose_config("dataset=synthetic")
    sizes = data.partition_sizes(cfg, 5)
    assert data._load.cache_info().currsize == 0
    assert [len(p) for p in parts("dataset=synthetic")] == sizes

"""Tests of flwr_prox_strategies.task: models, data set loaders, partitions."""

from __future__ import annotations

import csv
import gzip
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from flwr_prox_strategies.task import datasets as ds_mod
from flwr_prox_strategies.task.datasets import (
    ADULT_CATEGORICAL,
    ADULT_COLUMNS,
    DATA_DIR_ENV,
    ArrayDataset,
    adult_matrix,
    candidate_dirs,
    load_adult,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    read_idx,
)
from flwr_prox_strategies.task.models import CNN, MLP, LogisticRegression
from flwr_prox_strategies.task.partition import (
    SCHEMES,
    label_histogram,
    partition_dataset,
    partition_indices,
)

# ------------------------------------------------------------------------ helpers


def _shared_data(name: str) -> Path | None:
    """Return the project's offline copy of data set ``name``, if present."""
    for folder in candidate_dirs(name):
        if folder.is_dir() and any(folder.iterdir()):
            return folder
    return None


needs_fashion = pytest.mark.skipif(
    _shared_data("fashion-mnist") is None, reason="Fashion-MNIST files not found"
)
needs_adult = pytest.mark.skipif(
    _shared_data("adult") is None, reason="Adult files not found"
)


def _mean_label_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    counts = label_histogram(labels, parts, int(labels.max()) + 1).astype(float)
    probs = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(probs > 0, -probs * np.log(probs), 0.0)
    return float(terms.sum(axis=1).mean())


@pytest.fixture(scope="module")
def digits():
    return load_digits()


@pytest.fixture(scope="module")
def fashion():
    return load_fashion_mnist()


@pytest.fixture(scope="module")
def adult():
    return adult_matrix()


# ------------------------------------------------------------------------- models


@pytest.mark.parametrize(
    ("model", "batch"),
    [
        (LogisticRegression(), torch.rand(5, 64)),
        (LogisticRegression(), torch.rand(5, 1, 8, 8)),
        (MLP(), torch.rand(5, 784)),
        (MLP(), torch.rand(5, 1, 28, 28)),
        (MLP(in_features=64, hidden=[32]), torch.rand(5, 64)),
        (MLP(in_features=64, hidden=()), torch.rand(5, 64)),
        (CNN(), torch.rand(5, 1, 28, 28)),
        (CNN(), torch.rand(5, 784)),
        (CNN(), torch.rand(5, 28, 28)),
        (CNN(image_size=8), torch.rand(5, 64)),
        (CNN(in_channels=3, image_size=32), torch.rand(5, 3 * 32 * 32)),
    ],
)
def test_model_output_shape(model, batch):
    out = model(batch)
    assert out.shape == (5, 10)
    assert out.dtype == torch.float32


def test_model_num_classes_and_dtype():
    for model in (
        LogisticRegression(num_classes=2, in_features=14),
        MLP(num_classes=2, in_features=14),
        CNN(num_classes=2),
    ):
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert LogisticRegression(num_classes=2, in_features=14)(
        torch.rand(3, 14)
    ).shape == (
        3,
        2,
    )


def test_architectures_match_the_papers():
    cnn_params = sum(p.numel() for p in CNN().parameters())
    mlp_params = sum(p.numel() for p in MLP().parameters())
    assert cnn_params == 1_663_370  # FedAvg paper's CNN on 28x28 inputs
    assert mlp_params == 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10


@pytest.mark.parametrize("cls", [LogisticRegression, MLP, CNN])
def test_model_init_is_seeded(cls):
    torch.manual_seed(3)
    first = cls().state_dict()
    torch.manual_seed(3)
    second = cls().state_dict()
    torch.manual_seed(4)
    third = cls().state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], third[k]) for k in first)


@pytest.mark.parametrize(
    ("factory", "param"),
    [
        (lambda: LogisticRegression(in_features=0), "in_features"),
        (lambda: LogisticRegression(num_classes=-1), "num_classes"),
        (lambda: MLP(hidden=[200, 0]), "hidden"),
        (lambda: MLP(hidden="200"), "hidden"),
        (lambda: MLP(in_features=2.5), "in_features"),
        (lambda: CNN(image_size=2), "image_size"),
        (lambda: CNN(in_channels=0), "in_channels"),
    ],
)
def test_model_bad_arguments(factory, param):
    with pytest.raises(ValueError, match=param):
        factory()


def test_models_take_keywords_only():
    with pytest.raises(TypeError):
        LogisticRegression(64, 10)  # type: ignore[misc]


def test_cnn_rejects_wrong_flat_size():
    with pytest.raises(ValueError, match="shape"):
        CNN()(torch.rand(2, 100))


# ------------------------------------------------------------------------- digits


def test_digits_shapes_and_range(digits):
    assert (len(digits.train), len(digits.test)) == (1437, 360)
    assert digits.train.x.shape == (1437, 64)
    assert (digits.num_features, digits.num_classes, digits.name) == (64, 10, "digits")
    assert digits.train.x.dtype == np.float32
    assert digits.train.y.dtype == np.int64
    for split in (digits.train, digits.test):
        assert split.x.min() == 0.0
        assert split.x.max() == 1.0
        assert set(np.unique(split.y)) == set(range(10))


def test_digits_split_is_seeded_and_stratified(digits):
    again = load_digits()
    other = load_digits(seed=1)
    assert np.array_equal(again.train.x, digits.train.x)
    assert np.array_equal(again.test.y, digits.test.y)
    assert not np.array_equal(other.test.y, digits.test.y)
    share = np.bincount(digits.test.y) / np.bincount(digits.train.y)
    assert np.allclose(share, 0.25, atol=0.03)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_digits_bad_fraction(fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        load_digits(test_fraction=fraction)


def test_array_dataset_subset_and_checks():
    data = ArrayDataset(np.arange(12).reshape(6, 2), np.array([0, 1, 2, 0, 1, 2]), 3)
    assert data.x.dtype == np.float32
    assert data.y.dtype == np.int64
    assert len(data) == 6
    assert data.num_features == 2
    part = data.subset([4, 1])
    assert np.array_equal(part.y, [1, 1])
    assert np.array_equal(part.x, [[8, 9], [2, 3]])
    assert len(data.subset(data.y == 0)) == 2
    assert len(data.subset([])) == 0
    with pytest.raises(ValueError, match="y must lie"):
        ArrayDataset(np.zeros((2, 2)), np.array([0, 3]), 3)
    with pytest.raises(ValueError, match="y must have shape"):
        ArrayDataset(np.zeros((2, 2)), np.array([0]), 3)
    with pytest.raises(ValueError, match="x must be 2-D"):
        ArrayDataset(np.zeros(2), np.array([0, 1]), 3)


def test_load_dataset_dispatch():
    assert load_dataset("digits", seed=0).name == "digits"
    with pytest.raises(ValueError, match="'digits', 'fashion-mnist', 'adult'"):
        load_dataset("mnist")


# ---------------------------------------------------------------------- idx files


def _write_idx(path: Path, array: np.ndarray, code: int) -> None:
    header = bytes([0, 0, code, array.ndim]) + np.array(array.shape, ">u4").tobytes()
    body = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if path.suffix == ".gz":
        with gzip.open(path, "wb") as handle:
            handle.write(body)
    else:
        path.write_bytes(body)


@pytest.mark.parametrize("name", ["plain-idx", "zipped-idx.gz"])
def test_read_idx_round_trip(tmp_path, name):
    images = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    _write_idx(tmp_path / name, images, 0x08)
    assert np.array_equal(read_idx(tmp_path / name), images)
    assert np.array_equal(read_idx(tmp_path / name, max_items=2), images[:2])
    ints = np.array([-5, 70000, 3], dtype=np.int32)
    _write_idx(tmp_path / "ints", ints, 0x0C)
    assert np.array_equal(read_idx(tmp_path / "ints"), ints)


def test_read_idx_rejects_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x01\x07")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 9, 1, 2]))
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "short")


# ------------------------------------------------------------------ Fashion-MNIST


@needs_fashion
def test_fashion_mnist_full(fashion):
    assert fashion.train.x.shape == (60000, 784)
    assert fashion.test.x.shape == (10000, 784)
    assert fashion.train.x.dtype == np.float32
    assert np.array_equal(np.bincount(fashion.train.y), np.full(10, 6000))
    assert np.array_equal(np.bincount(fashion.test.y), np.full(10, 1000))
    assert fashion.train.x.min() >= 0.0 and fashion.train.x.max() == 1.0
    assert (fashion.num_features, fashion.num_classes) == (784, 10)


@needs_fashion
def test_fashion_mnist_max_rows(fashion):
    small = load_fashion_mnist(max_train=500, max_test=50)
    assert (len(small.train), len(small.test)) == (500, 50)
    assert np.array_equal(small.train.x, fashion.train.x[:500])
    assert np.array_equal(small.test.y, fashion.test.y[:50])


@needs_fashion
def test_fashion_mnist_env_var(tmp_path, monkeypatch):
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    for source in _shared_data("fashion-mnist").iterdir():
        (folder / source.name).symlink_to(source)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert candidate_dirs("fashion-mnist")[0] == folder
    assert len(load_fashion_mnist(max_train=10, max_test=10).train) == 10


def test_candidate_dirs_walk_up_to_shared(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    places = candidate_dirs("adult")
    assert places[0] == tmp_path / "shared" / "data" / "adult"
    repo_parent = Path(ds_mod.__file__).resolve().parents[3]
    assert repo_parent / "shared" / "data" / "adult" in places
    assert places[-1] == Path("/usr/share/datasets/adult")
    assert len(places) == len(set(places))


def test_fashion_mnist_explicit_dir_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=DATA_DIR_ENV) as info:
        load_fashion_mnist(data_dir=tmp_path)
    assert str(tmp_path) in str(info.value)


def test_fashion_mnist_fallback(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere"
    monkeypatch.setattr(ds_mod, "candidate_dirs", lambda name: [missing])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_fashion_mnist(download=False)

    def offline():
        raise OSError("no network")

    monkeypatch.setattr(ds_mod, "_fashion_from_hub", offline)
    with pytest.raises(FileNotFoundError, match="no network"):
        load_fashion_mnist()

    images = np.full((4, 28, 28), 255, dtype=np.uint8)
    labels = np.arange(4)
    hub = {"train": (images, labels), "test": (images[:2], labels[:2])}
    monkeypatch.setattr(ds_mod, "_fashion_from_hub", lambda: hub)
    loaded = load_fashion_mnist(max_train=3)
    assert loaded.train.x.shape == (3, 784)
    assert loaded.train.x.max() == 1.0
    assert len(loaded.test) == 2


def test_hub_split_to_arrays():
    datasets = pytest.importorskip("datasets")
    pil = pytest.importorskip("PIL.Image")
    images = [pil.fromarray(np.full((28, 28), i, dtype=np.uint8)) for i in range(3)]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.Value("int64")}
    )
    split = datasets.Dataset.from_dict(
        {"image": images, "label": [2, 0, 1]}, features=features
    )
    x, y = ds_mod.hub_split_to_arrays(split)
    assert x.shape == (3, 28, 28)
    assert x.dtype == np.uint8
    assert np.array_equal(x[:, 0, 0], [0, 1, 2])
    assert np.array_equal(y, [2, 0, 1])


# -------------------------------------------------------------------------- Adult


def _read_adult_csv(path: Path) -> list[list[str]]:
    with path.open() as handle:
        rows = [
            [v.strip() for v in row]
            for row in csv.reader(handle)
            if len(row) == 15 and not row[0].startswith("|")
        ]
    return [row for row in rows if "?" not in row]


@needs_adult
def test_adult_matrix_shape_and_labels(adult):
    x, y = adult
    assert x.shape == (45222, 14)
    assert x.dtype == np.float64
    assert y.dtype == np.int64
    assert round(float(y.mean()), 4) == 0.2478
    assert int(y.sum()) == 11208
    for j, column in enumerate(ADULT_COLUMNS):
        if column in ADULT_CATEGORICAL:
            # Every rank from 0 to (number of present values - 1) occurs.
            assert np.array_equal(np.unique(x[:, j]), np.arange(x[:, j].max() + 1))


@needs_adult
def test_adult_first_row_is_first_test_record(adult):
    x, y = adult
    folder = _shared_data("adult")
    rows = _read_adult_csv(folder / "adult.test") + _read_adult_csv(
        folder / "adult.data"
    )
    assert len(rows) == 45222
    first = rows[0]
    assert first[:2] == ["25", "Private"]
    expected = []
    for j, column in enumerate(ADULT_COLUMNS):
        if column in ADULT_CATEGORICAL:
            present = sorted({row[j] for row in rows})
            expected.append(present.index(first[j]))
        else:
            expected.append(float(first[j]))
    assert np.array_equal(x[0], expected)
    # Ranks worked out by hand: Private among the 7 workclasses present, 11th
    # among 16 educations, Never-married, Machine-op-inspct, Own-child, Black, Male.
    assert x[0, :10].tolist() == [25, 2, 226802, 1, 7, 4, 6, 3, 2, 1]
    assert y[0] == 0
    assert np.array_equal(y, [r[14].rstrip(".") == ">50K" for r in rows])


@needs_adult
def test_load_adult_normalized_and_shuffled(adult):
    x, _ = adult
    data = load_adult()
    assert data.train is data.test
    assert (data.num_features, data.num_classes, len(data.train)) == (14, 2, 45222)
    norms = np.linalg.norm(data.train.x.astype(np.float64), axis=0)
    assert np.allclose(norms, 1.0, atol=1e-5)
    raw = load_adult(normalize=False)
    assert not np.array_equal(raw.train.x, x.astype(np.float32))
    assert np.array_equal(
        np.sort(raw.train.x[:, 2]), np.sort(x[:, 2]).astype(np.float32)
    )
    again = load_adult()
    other = load_adult(seed=1)
    assert np.array_equal(again.train.x, data.train.x)
    assert not np.array_equal(other.train.y, data.train.y)


@needs_adult
def test_load_adult_split():
    data = load_adult(test_fraction=0.2, seed=3)
    assert len(data.train) + len(data.test) == 45222
    assert len(data.test) == 9045
    assert abs(data.test.y.mean() - 0.2478) < 0.002
    with pytest.raises(ValueError, match="test_fraction"):
        load_adult(test_fraction=1.0)


def test_adult_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="UCI"):
        adult_matrix(tmp_path)


# ---------------------------------------------------------------------- partition


@pytest.fixture(scope="module")
def labels(digits):
    return digits.train.y


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partitions_disjoint_cover_and_reproducible(labels, scheme):
    parts = partition_indices(labels, num_partitions=20, scheme=scheme, seed=5)
    assert len(parts) == 20
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0)  # sorted, no duplicates
        assert len(part) > 0
    merged = np.concatenate(parts)
    assert np.array_equal(np.sort(merged), np.arange(len(labels)))
    again = partition_indices(labels, num_partitions=20, scheme=scheme, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_indices(labels, num_partitions=20, scheme=scheme, seed=6)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_partitions_ignore_label_values(labels, scheme):
    dense = partition_indices(labels, num_partitions=10, scheme=scheme, seed=2)
    shifted = partition_indices(
        labels * 3 + 7, num_partitions=10, scheme=scheme, seed=2
    )
    assert all(np.array_equal(a, b) for a, b in zip(dense, shifted, strict=True))


def test_iid_sizes_balanced(labels):
    sizes = [len(p) for p in partition_indices(labels, num_partitions=20)]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_skew_stronger_than_iid(labels):
    iid = partition_indices(labels, num_partitions=20, scheme="iid")
    skewed = partition_indices(labels, num_partitions=20, scheme="dirichlet")
    inner = partition_indices(labels, num_partitions=20, scheme="inner-dirichlet")
    iid_entropy = _mean_label_entropy(labels, iid)
    assert _mean_label_entropy(labels, skewed) < iid_entropy - 0.3
    assert _mean_label_entropy(labels, inner) < iid_entropy - 0.3
    # Default minimum size for 1,437 samples and 20 partitions is 10.
    assert min(len(p) for p in skewed) >= 10


def test_dirichlet_unreachable_min_size(labels):
    with pytest.raises(ValueError, match="min_partition_size"):
        partition_indices(
            labels,
            num_partitions=20,
            scheme="dirichlet",
            alpha=0.05,
            min_partition_size=65,
        )


def test_inner_dirichlet_sizes(labels):
    equal = partition_indices(labels, num_partitions=20, scheme="inner-dirichlet")
    assert sorted({len(p) for p in equal}) == [71, 72]
    skewed = partition_indices(
        labels,
        num_partitions=20,
        scheme="inner-dirichlet",
        size_sigma=0.8,
        min_partition_size=5,
    )
    sizes = np.array([len(p) for p in skewed])
    assert sizes.sum() == len(labels)
    assert sizes.min() >= 5
    assert sizes.max() > 2 * sizes.min()


@pytest.mark.parametrize("mode", ["first-deterministic", "random", "deterministic"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_classes_per_partition(labels, mode, k):
    parts = partition_indices(
        labels,
        num_partitions=20,
        scheme="pathological",
        classes_per_partition=k,
        class_assignment_mode=mode,
    )
    counts = label_histogram(labels, parts, 10)
    assert np.all((counts > 0).sum(axis=1) <= k)


def test_pathological_unused_classes_logged(labels, caplog):
    with caplog.at_level(logging.WARNING):
        parts = partition_indices(
            labels, num_partitions=3, scheme="pathological", classes_per_partition=2
        )
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged) < len(labels)
    assert "unassigned" in caplog.text


def test_partition_dataset_and_histogram(digits):
    parts = partition_dataset(digits.train, num_partitions=5, scheme="dirichlet")
    assert sum(len(p) for p in parts) == len(digits.train)
    assert all(isinstance(p, ArrayDataset) and p.num_classes == 10 for p in parts)
    indices = partition_indices(digits.train.y, num_partitions=5, scheme="dirichlet")
    hist = label_histogram(digits.train.y, indices, 10)
    assert hist.shape == (5, 10)
    assert np.array_equal(hist.sum(axis=0), np.bincount(digits.train.y))
    assert np.array_equal(hist[0], np.bincount(parts[0].y, minlength=10))
    with pytest.raises(ValueError, match="num_classes"):
        label_histogram(digits.train.y, indices, 5)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"num_partitions": 0}, "num_partitions"),
        ({"num_partitions": 2000}, "num_partitions"),
        ({"num_partitions": 2.0}, "num_partitions"),
        ({"num_partitions": 5, "scheme": "shards"}, "scheme"),
        ({"num_partitions": 5, "alpha": 0.0}, "alpha"),
        ({"num_partitions": 5, "alpha": float("nan")}, "alpha"),
        ({"num_partitions": 5, "seed": -1}, "seed"),
        ({"num_partitions": 5, "classes_per_partition": 0}, "classes_per_partition"),
        (
            {
                "num_partitions": 5,
                "scheme": "pathological",
                "classes_per_partition": 11,
            },
            "classes_per_partition",
        ),
        ({"num_partitions": 5, "min_partition_size": -1}, "min_partition_size"),
        ({"num_partitions": 5, "min_partition_size": 300}, "min_partition_size"),
        ({"num_partitions": 5, "size_sigma": -0.5}, "size_sigma"),
        ({"num_partitions": 5, "class_assignment_mode": "x"}, "class_assignment_mode"),
    ],
)
def test_partition_bad_arguments(labels, kwargs, param):
    with pytest.raises(ValueError, match=param):
        partition_indices(labels, **kwargs)


@pytest.mark.parametrize("bad", [np.array([0.5, 1.0]), np.zeros((2, 2), int), []])
def test_partition_bad_labels(bad):
    with pytest.raises(ValueError, match="labels"):
        partition_indices(bad, num_partitions=1)


def test_missing_data_says_where_it_looked_and_what_a_running_superlink_keeps(
    tmp_path,
) -> None:
    from flwr_prox_strategies.task.datasets import adult_matrix

    with pytest.raises(FileNotFoundError) as caught:
        adult_matrix(data_dir=tmp_path)
    message = str(caught.value)
    assert str(tmp_path) in message and "FLWR_PROX_DATA_DIR" in message
    assert "keeps the environment it started with" in message


@needs_fashion
@pytest.mark.parametrize("max_train", [None, 500])
def test_fashion_mnist_labels_alone_are_the_loaders_labels(max_train) -> None:
    from flwr_prox_strategies.experiment import data
    from flwr_prox_strategies.experiment.config import compose_config
    from flwr_prox_strategies.task.datasets import (
        fashion_mnist_train_labels,
        load_fashion_mnist,
    )

    labels = fashion_mnist_train_labels(max_train=max_train)
    expected = load_fashion_mnist(max_train=max_train).train.y
    assert labels.dtype == expected.dtype and np.array_equal(labels, expected)
    # What the ServerApp partitions from: the labels, the images never loaded.
    data._load.cache_clear()
    data._train_labels.cache_clear()
    cfg = compose_config("dataset=fashion-mnist")
    y, owners = data._train_labels(data.OmegaConf.to_yaml(cfg.dataset.loader))
    assert owners is None and np.array_equal(y, load_fashion_mnist().train.y)
    assert data._load.cache_info().currsize == 0

"""The official FedDyn/FedDC split rules and the split read from a file (issue 14)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from flwr_prox_strategies.experiment import data
from flwr_prox_strategies.experiment.config import compose_config
from flwr_prox_strategies.task.partition import (
    file_partition,
    official_dirichlet_partition,
    official_iid_partition,
)

# --------------------------------------------------------------------- reference


def official_split(
    labels: np.ndarray,
    n_client: int,
    seed: int,
    rule: str,
    rule_arg: float = 0.3,
    unbalanced_sgm: float = 0.0,
    n_cls: int = 10,
) -> list[np.ndarray]:
    """``DatasetObject.set_data`` of gaoliang13/FedDC's utils_dataset.py, step by step.

    Its global-RNG calls, in its order, on the labels alone; each client's
    slot ``k`` holds the index (into ``labels``) of the official ``clnt_x[c][k]``.
    """
    trn_y = labels.reshape(-1, 1)
    np.random.seed(seed)
    rand_perm = np.random.permutation(len(trn_y))
    trn_y = trn_y[rand_perm]

    n_data_per_clnt = int((len(trn_y)) / n_client)
    clnt_data_list = np.random.lognormal(
        mean=np.log(n_data_per_clnt), sigma=unbalanced_sgm, size=n_client
    )
    clnt_data_list = (clnt_data_list / np.sum(clnt_data_list) * len(trn_y)).astype(int)
    diff = np.sum(clnt_data_list) - len(trn_y)
    if diff != 0:
        for clnt_i in range(n_client):
            if clnt_data_list[clnt_i] > diff:
                clnt_data_list[clnt_i] -= diff
                break

    if rule == "Drichlet":
        cls_priors = np.random.dirichlet(alpha=[rule_arg] * n_cls, size=n_client)
        prior_cumsum = np.cumsum(cls_priors, axis=1)
        idx_list = [np.where(trn_y == i)[0] for i in range(n_cls)]
        cls_amount = [len(idx_list[i]) for i in range(n_cls)]
        clnt_idx = [np.full(clnt_data_list[c], -1) for c in range(n_client)]
        while np.sum(clnt_data_list) != 0:
            curr_clnt = np.random.randint(n_client)
            if clnt_data_list[curr_clnt] <= 0:
                continue
            clnt_data_list[curr_clnt] -= 1
            curr_prior = prior_cumsum[curr_clnt]
            while True:
                cls_label = np.argmax(np.random.uniform() <= curr_prior)
                if cls_amount[cls_label] <= 0:
                    continue
                cls_amount[cls_label] -= 1
                sample = idx_list[cls_label][cls_amount[cls_label]]
                clnt_idx[curr_clnt][clnt_data_list[curr_clnt]] = rand_perm[sample]
                break
        return clnt_idx

    assert rule == "iid"
    cum_sum = np.concatenate(([0], np.cumsum(clnt_data_list)))
    return [rand_perm[cum_sum[c] : cum_sum[c + 1]] for c in range(n_client)]


@pytest.fixture
def global_rng_restored() -> Iterator[None]:
    """The reference seeds numpy's global generator: put it back afterwards."""
    state = np.random.get_state()
    yield
    np.random.set_state(state)


def synthetic_labels(size: int, num_classes: int = 10, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_classes, size)


def assert_same_lists(ours: list[np.ndarray], theirs: list[np.ndarray]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


# -------------------------------------------------------------- official-dirichlet


@pytest.mark.parametrize(
    ("size", "clients", "seed", "alpha", "sigma"),
    [
        (1200, 10, 20, 0.6, 0.0),  # the papers' seed for Dirichlet runs
        (1003, 7, 0, 0.5, 0.0),  # a remainder: client 0 takes it
        (2000, 10, 3, 0.5, 0.0),  # float truncation: 209, 199, ..., 199
        (900, 6, 23, 1.0, 0.3),  # unbalanced sizes (unbalanced_sgm)
    ],
)
def test_official_dirichlet_is_the_official_assignment(
    global_rng_restored, size, clients, seed, alpha, sigma
):
    labels = synthetic_labels(size)
    ours = official_dirichlet_partition(
        labels, num_partitions=clients, seed=seed, alpha=alpha, size_sigma=sigma
    )
    theirs = official_split(labels, clients, seed, "Drichlet", alpha, sigma)
    assert_same_lists(ours, theirs)


@pytest.mark.parametrize(("size", "clients", "seed"), [(1000, 10, 23), (1003, 7, 4)])
@pytest.mark.parametrize("sigma", [0.0, 0.3])
def test_official_iid_is_the_official_assignment(
    global_rng_restored, size, clients, seed, sigma
):
    labels = synthetic_labels(size)
    ours = official_iid_partition(
        labels, num_partitions=clients, seed=seed, size_sigma=sigma
    )
    assert_same_lists(ours, official_split(labels, clients, seed, "iid", 0.3, sigma))


def test_official_dirichlet_sizes_disjointness_and_determinism():
    labels = synthetic_labels(2000)
    parts = official_dirichlet_partition(labels, num_partitions=10, seed=3)
    # Equal sizes, as far as the official float arithmetic goes: 2000 / 10 comes out
    # as 199.99999999999997 for each client, truncated; client 0 takes the rest.
    assert [len(p) for p in parts] == [209] + [199] * 9
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined) == 2000
    again = official_dirichlet_partition(labels, num_partitions=10, seed=3)
    assert_same_lists(parts, again)
    other = official_dirichlet_partition(labels, num_partitions=10, seed=4)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_official_dirichlet_remainder_goes_to_client_zero():
    parts = official_dirichlet_partition(
        synthetic_labels(1003), num_partitions=10, seed=1, alpha=1.0
    )
    assert [len(p) for p in parts] == [103] + [100] * 9


def test_official_dirichlet_follows_each_clients_prior():
    labels = synthetic_labels(20_000)
    clients, alpha, seed = 10, 1.0, 2
    parts = official_dirichlet_partition(
        labels, num_partitions=clients, seed=seed, alpha=alpha
    )
    # Replay the priors: permutation, the size draws, then the Dirichlet draw.
    rng = np.random.RandomState(seed)
    rng.permutation(len(labels))
    rng.lognormal(size=clients)
    priors = rng.dirichlet([alpha] * 10, size=clients)
    shares = np.stack([np.bincount(labels[p], minlength=10) / len(p) for p in parts])
    # Classes run out towards the end, so shares only roughly follow the prior.
    assert np.abs(shares - priors).mean() < 0.5 * np.abs(shares - 0.1).mean()
    assert np.corrcoef(shares.ravel(), priors.ravel())[0, 1] > 0.9


def test_official_rules_leave_the_global_generator_alone():
    np.random.seed(11)
    expected = np.random.random_sample(3)
    np.random.seed(11)
    official_dirichlet_partition(synthetic_labels(300), num_partitions=3, seed=5)
    official_iid_partition(synthetic_labels(300), num_partitions=3, seed=5)
    np.testing.assert_array_equal(np.random.random_sample(3), expected)


def test_official_dirichlet_refuses_a_split_the_official_loop_never_ends():
    # Seed 0 gives client 6 a prior on classes that run out first (checked against
    # the reference: its redraw loop would need ~1e9 draws per sample).
    with pytest.raises(ValueError, match="client 6's class prior"):
        official_dirichlet_partition(
            np.random.default_rng(0).integers(0, 10, 3001),
            num_partitions=7,
            seed=0,
            alpha=0.1,
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_partitions": 0}, "num_partitions"),
        ({"num_partitions": 101}, "exceeds"),
        ({"num_partitions": 2, "alpha": 0.0}, "alpha"),
        ({"num_partitions": 2, "seed": 2**32}, "below 2"),
        ({"num_partitions": 2, "num_classes": 5}, "num_classes"),
    ],
)
def test_official_dirichlet_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        official_dirichlet_partition(synthetic_labels(100), **kwargs)


def test_official_dirichlet_refuses_negative_labels():
    with pytest.raises(ValueError, match="non-negative"):
        official_dirichlet_partition(np.array([0, -1, 2]), num_partitions=1)


# ------------------------------------------------------------------------- file


def client_ids(size: int = 30, clients: int = 3) -> np.ndarray:
    return np.random.default_rng(1).permutation(np.arange(size) % clients)


def expected_parts(ids: np.ndarray, clients: int) -> list[np.ndarray]:
    return [np.flatnonzero(ids == c) for c in range(clients)]


def write_ids(path: Path, ids: np.ndarray, *, header: str | None = None) -> Path:
    if path.suffix == ".npy":
        np.save(path, ids)
    elif path.suffix == ".npz":
        np.savez(path, ids)
    else:
        lines = ([header] if header else []) + [str(int(i)) for i in ids]
        path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name", ["ids.npy", "ids.npz", "ids.csv"])
def test_file_partition_round_trip(tmp_path, name):
    ids = client_ids()
    path = write_ids(tmp_path / name, ids)
    parts = file_partition(np.zeros(30, int), num_partitions=3, path=path)
    assert_same_lists(parts, expected_parts(ids, 3))


def test_file_partition_csv_header_and_npz_key(tmp_path):
    ids = client_ids()
    csv = write_ids(tmp_path / "ids.csv", ids, header="client")
    npz = tmp_path / "ids.npz"
    np.savez(npz, labels=np.zeros(30), partition=ids)
    for path in (csv, npz, str(csv)):
        parts = file_partition(np.zeros(30, int), num_partitions=3, path=path)
        assert_same_lists(parts, expected_parts(ids, 3))


def test_file_partition_accepts_integral_floats(tmp_path):
    ids = client_ids()
    path = tmp_path / "ids.npy"
    np.save(path, ids.astype(float))
    parts = file_partition(np.zeros(30, int), num_partitions=3, path=path)
    assert_same_lists(parts, expected_parts(ids, 3))


def test_file_partition_empty_client_only_when_allowed(tmp_path):
    ids = client_ids() * 2  # clients 0, 2, 4 of 5
    path = write_ids(tmp_path / "ids.npy", ids)
    with pytest.raises(ValueError, match=r"not contiguous.*\[1, 3\].*allow_empty"):
        file_partition(np.zeros(30, int), num_partitions=5, path=path)
    parts = file_partition(
        np.zeros(30, int), num_partitions=5, path=path, allow_empty=True
    )
    assert [len(p) for p in parts] == [10, 0, 10, 0, 10]


def save_npy(tmp_path: Path, array: np.ndarray) -> Path:
    path = tmp_path / "ids.npy"
    np.save(path, array)
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: save_npy(d, client_ids(29)), "has 29 client ids but .* 30 samples"),
        (lambda d: save_npy(d, client_ids(30, 4)), r"ids up to 3 .*num_partitions=3"),
        (lambda d: save_npy(d, client_ids() % 2), r"not contiguous.*\[2\]"),
        (lambda d: save_npy(d, client_ids() + 0.5), "non-integer client id 0.5"),
        (lambda d: save_npy(d, client_ids() - 1), "negative client id -1"),
        (lambda d: save_npy(d, client_ids().astype(str)), "must be integers"),
        (lambda d: save_npy(d, client_ids() > 0), "must be integers"),
        (lambda d: save_npy(d, client_ids().reshape(5, 6)), "shape"),
        (lambda d: d / "missing.npy", "missing.npy does not exist"),
        (lambda d: d, "is not a file"),
        (lambda d: write_text(d / "x.npy", "garbage"), "x.npy cannot be read"),
        (lambda d: write_text(d / "x.npz", "garbage"), "x.npz cannot be read"),
        (lambda d: write_text(d / "x.txt", "0\n1\n"), "unsupported type '.txt'"),
        (lambda d: write_text(d / "x.csv", "id\n0\n1.5\n"), "line 3: '1.5'"),
        (lambda d: write_text(d / "x.csv", "0,1\n"), "line 1: '0,1'"),
        (lambda d: write_bytes(d / "x.csv", b"\xff\xfe\xfa"), "x.csv cannot be read"),
        (lambda d: two_arrays(d / "x.npz"), r"holds arrays .*'partition'"),
    ],
)
def test_file_partition_refuses_malformed_files(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ValueError, match=message) as info:
        file_partition(np.zeros(30, int), num_partitions=3, path=path)
    assert str(path) in str(info.value)


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def write_bytes(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def two_arrays(path: Path) -> Path:
    np.savez(path, a=np.zeros(30, int), b=np.zeros(30, int))
    return path


# ------------------------------------------------------------- through the config


@pytest.fixture
def no_disk_cache(monkeypatch) -> Iterator[None]:
    monkeypatch.setenv(data.CACHE_DIR_ENV, "")
    data._partitions.cache_clear()
    yield
    data._partitions.cache_clear()


def labels_of(overrides: str, clients: int) -> list[np.ndarray]:
    cfg = compose_config(overrides)
    return [data.client_partition(cfg, i, clients).y for i in range(clients)]


def test_conf_official_dirichlet_runs_the_official_rule(no_disk_cache):
    cfg = compose_config("partition=official-dirichlet seed=20")
    train = data.load_data(cfg).train
    parts = official_dirichlet_partition(train.y, num_partitions=4, seed=20, alpha=0.3)
    got = labels_of("partition=official-dirichlet seed=20", 4)
    for idx, y in zip(parts, got, strict=True):
        np.testing.assert_array_equal(train.y[idx], y)


def test_conf_file_reads_the_given_file(tmp_path, no_disk_cache):
    train = data.load_data(compose_config("")).train
    ids = np.arange(len(train.y)) % 3
    path = write_ids(tmp_path / "split.npy", ids)
    got = labels_of(f"partition=file partition.path={path}", 3)
    for client, y in enumerate(got):
        np.testing.assert_array_equal(train.y[ids == client], y)


def test_conf_custom_calls_the_named_function_with_its_parameters(no_disk_cache):
    target = "flwr_prox_strategies.task.partition.official_iid_partition"
    got = labels_of(
        f"partition=custom partition._target_={target} "
        "+partition.size_sigma=0.3 seed=3",
        3,
    )
    train = data.load_data(compose_config("")).train
    parts = official_iid_partition(train.y, num_partitions=3, seed=3, size_sigma=0.3)
    for idx, y in zip(parts, got, strict=True):
        np.testing.assert_array_equal(train.y[idx], y)

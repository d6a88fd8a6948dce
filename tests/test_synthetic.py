"""The FedProx paper's synthetic federations and the natural partition.

What the generator must do is the official description (Li et al., MLSys 2020,
Section 5.1, and its authors' generate_synthetic.py): client sizes
floor(LogNormal(4, 2)) + 50, 60 features with covariance diag(j^-1.2), labels
argmax(W_k x + b_k), each client's own 90/10 split, and input means
v_k ~ N(B_k, 1) with B_k ~ N(0, beta).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flwr_prox_strategies.experiment.config import compose_config
from flwr_prox_strategies.experiment.data import client_partition, partition_sizes
from flwr_prox_strategies.task.datasets import ArrayDataset, TrainTest
from flwr_prox_strategies.task.partition import natural_partition
from flwr_prox_strategies.task.synthetic import client_sizes, load_synthetic

from .helpers import run_app


def _per_client(data: TrainTest) -> tuple[np.ndarray, np.ndarray]:
    assert data.train_owners is not None and data.test_owners is not None
    count = data.num_owners
    assert count is not None
    train = np.bincount(data.train_owners, minlength=count)
    test = np.bincount(data.test_owners, minlength=count)
    return train, test


def _label_skew(data: TrainTest) -> float:
    """Mean total-variation distance of the clients' label shares to the pooled."""
    assert data.train_owners is not None
    pooled = np.bincount(data.train.y, minlength=data.num_classes) / len(data.train)
    distances = []
    for client in np.unique(data.train_owners):
        labels = data.train.y[data.train_owners == client]
        share = np.bincount(labels, minlength=data.num_classes) / len(labels)
        distances.append(0.5 * np.abs(share - pooled).sum())
    return float(np.mean(distances))


def _spread_of_input_means(data: TrainTest) -> float:
    """Variance over clients of their mean input, averaged over coordinates."""
    assert data.train_owners is not None
    means = [
        data.train.x[data.train_owners == c].mean(axis=0)
        for c in np.unique(data.train_owners)
    ]
    return float(np.var(np.stack(means), axis=0).mean())


def test_client_sizes_follow_the_official_power_law() -> None:
    sizes = client_sizes(np.random.RandomState(0), 20_000)
    assert sizes.min() >= 50 and sizes.dtype == np.int64
    # floor(LogNormal(4, 2)) + 50: log(n - 50 + U) is N(4, 2) before the floor.
    logs = np.log(sizes - 50 + 0.5)
    assert np.median(logs) == pytest.approx(4.0, abs=0.05)
    assert np.std(logs) == pytest.approx(2.0, abs=0.06)


def test_each_client_splits_its_own_samples_90_10() -> None:
    data = load_synthetic(alpha=0.5, beta=0.5, seed=3)
    train, test = _per_client(data)
    totals = train + test
    np.testing.assert_array_equal(totals, client_sizes(np.random.RandomState(3), 30))
    np.testing.assert_array_equal(train, (0.9 * totals).astype(int))
    assert data.num_owners == 30 and data.num_features == 60 and data.num_classes == 10
    assert len(data.train) == train.sum() and len(data.test) == test.sum()
    # x ~ N(v_k, diag(j^-1.2)): the within-client variance of feature j.
    within = np.concatenate(
        [
            data.train.x[data.train_owners == c]
            - data.train.x[data.train_owners == c].mean(0)
            for c in range(30)
        ]
    ).var(axis=0)
    expected = np.arange(1, 61) ** -1.2
    np.testing.assert_allclose(within, expected, rtol=0.15)


def test_labels_are_the_argmax_of_one_linear_model_per_client() -> None:
    """Each client's labels are separable by a linear model (zero training error
    of a least-squares one-vs-rest fit is too strict; the argmax rule leaves
    every class region convex): a multinomial fit on one client reaches 100%."""
    data = load_synthetic(alpha=1, beta=1, seed=1, num_clients=3)
    assert data.train_owners is not None
    torch = pytest.importorskip("torch")
    client = int(np.argmax(np.bincount(data.train_owners)))
    rows = data.train_owners == client
    x = torch.from_numpy(data.train.x[rows]).double()
    y = torch.from_numpy(data.train.y[rows])
    weights = torch.zeros(60, 10, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(10, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS(
        [weights, bias], max_iter=500, line_search_fn="strong_wolfe"
    )

    def closure():
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weights + bias, y)
        loss.backward()
        return loss

    optimiser.step(closure)
    accuracy = ((x @ weights + bias).argmax(1) == y).double().mean().item()
    assert accuracy > 0.99


def test_beta_spreads_the_clients_inputs_and_iid_has_one_distribution() -> None:
    """v_k ~ N(B_k, 1), B_k ~ N(0, beta): the clients' input means vary by
    1 + beta^2 per coordinate; IID clients share one distribution and one model."""
    seeds = range(4)
    spread = {
        beta: np.mean(
            [
                _spread_of_input_means(load_synthetic(alpha=beta, beta=beta, seed=s))
                for s in seeds
            ]
        )
        for beta in (0.0, 0.5, 1.0)
    }
    assert spread[0.0] == pytest.approx(1.0, abs=0.2)
    assert spread[0.5] == pytest.approx(1.25, abs=0.25)
    assert spread[1.0] == pytest.approx(2.0, abs=0.4)
    assert spread[0.0] < spread[0.5] < spread[1.0]
    iid = [load_synthetic(alpha=0, beta=0, iid=True, seed=s) for s in seeds]
    assert max(_spread_of_input_means(d) for d in iid) < 0.01
    skew_iid = np.mean([_label_skew(d) for d in iid])
    skew_0 = np.mean(
        [_label_skew(load_synthetic(alpha=0, beta=0, seed=s)) for s in seeds]
    )
    skew_1 = np.mean(
        [_label_skew(load_synthetic(alpha=1, beta=1, seed=s)) for s in seeds]
    )
    # Each non-IID client has its own model: labels far from the pooled shares.
    assert skew_iid < 0.2 < 0.6 < skew_0 <= skew_1 + 0.02


def test_alpha_shifts_every_class_alike_so_the_data_do_not_change() -> None:
    """W_k ~ N(u_k, 1) and b_k ~ N(u_k, 1) add u_k (1'x + 1) to every logit:
    the argmax, hence the data, do not depend on alpha (the official script's
    draws are the same whatever alpha is)."""
    for seed in range(3):
        base = load_synthetic(alpha=0, beta=1, seed=seed)
        for alpha in (0.5, 1.0, 5.0):
            other = load_synthetic(alpha=alpha, beta=1, seed=seed)
            np.testing.assert_array_equal(base.train.x, other.train.x)
            np.testing.assert_array_equal(base.train.y, other.train.y)
            np.testing.assert_array_equal(base.test.y, other.test.y)


def test_seeded_and_distinct() -> None:
    first, again = load_synthetic(seed=5), load_synthetic(seed=5)
    np.testing.assert_array_equal(first.train.x, again.train.x)
    np.testing.assert_array_equal(first.test.y, again.test.y)
    assert len(load_synthetic(seed=6).train) != len(first.train)
    assert load_synthetic(iid=True, alpha=0, beta=0).name == "synthetic-iid"
    assert first.name == "synthetic(1,1)"


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("alpha", -0.1),
        ("beta", float("nan")),
        ("num_clients", 0),
        ("dimension", 0),
        ("num_classes", 1),
        ("seed", -1),
        ("train_fraction", 1.0),
    ],
)
def test_bad_arguments_name_themselves(keyword: str, value: float) -> None:
    with pytest.raises(ValueError, match=keyword):
        load_synthetic(**{keyword: value})


def test_owners_must_match_their_split() -> None:
    split = ArrayDataset(np.zeros((3, 2)), np.zeros(3, dtype=int), 2)
    with pytest.raises(ValueError, match="train_owners"):
        TrainTest(split, split, "x", 2, 2, train_owners=np.zeros(2, dtype=int))
    with pytest.raises(ValueError, match="test_owners"):
        TrainTest(split, split, "x", 2, 2, test_owners=np.array([0.5, 1, 2]))


def test_natural_partition_returns_each_clients_own_samples() -> None:
    owners = np.array([1, 0, 1, 2, 2, 2])
    parts = natural_partition(np.zeros(6), num_partitions=3, owners=owners)
    assert [p.tolist() for p in parts] == [[1], [0, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="num_clients=3"):
        natural_partition(np.zeros(6), num_partitions=4, owners=owners)
    with pytest.raises(ValueError, match="pooled"):
        natural_partition(np.zeros(6), num_partitions=3, owners=None)


def test_the_pipeline_gives_every_client_its_generated_data() -> None:
    cfg = compose_config("+experiment=fedprox-synthetic dataset.loader.seed=2")
    data = load_synthetic(seed=2)
    train, _ = _per_client(data)
    assert partition_sizes(cfg, 30) == train.tolist()
    assert data.train_owners is not None
    client = client_partition(cfg, 7, 30)
    np.testing.assert_array_equal(client.y, data.train.y[data.train_owners == 7])
    with pytest.raises(ValueError, match="num_clients=30"):
        partition_sizes(
            compose_config("+experiment=fedprox-synthetic num_clients=20"), 20
        )
    with pytest.raises(ValueError, match="pooled"):
        partition_sizes(compose_config("partition=natural num_clients=4"), 4)


def test_the_preset_runs_and_records_the_training_loss(tmp_path: Path) -> None:
    """The paper's setting, cut to 2 rounds of 2 epochs: 10 of 30 clients a round,
    the global model's loss on every client's training data in central-train."""
    _, results = run_app(
        tmp_path,
        "+experiment=fedprox-synthetic strategy.mu=1 num_rounds=2"
        " train.local_epochs=2 strategy.drop_percent=0.5",
        num_nodes=30,
    )
    assert results["dataset"] == "synthetic" and results["num-clients"] == 30
    assert len(results["partition-sizes"]) == 30
    rounds = results["rounds"]
    assert rounds[1]["train"]["replies-valid"] == 10
    losses = [r["central-train"]["loss"] for r in rounds]
    assert losses[2] < losses[0]  # the loss over all 30 clients' training data
    assert rounds[2]["central"]["num-examples"] == len(load_synthetic().test)

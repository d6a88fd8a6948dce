"""FedProx against mathematics: hand-computed steps, closed-form prox, FedAvg limit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from torch.utils.data import DataLoader, TensorDataset

from flwr_prox_strategies import (
    FedAvg,
    FedAvgClient,
    FedProx,
    FedProxClient,
    to_client_app,
)
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid
from flwr_prox_strategies.ops.proximal import ProximalTerm

from .helpers import model_arrays, record, sampling_grid


def half_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()


def least_squares(seed: int = 0, n: int = 40, d: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = x @ rng.normal(size=d) + 0.3 * rng.normal(size=n)
    return x, y


def quad_client(x, y, w0, *, epochs, lr, gamma=None) -> FedProxClient:
    model = torch.nn.Linear(x.shape[1], 1, bias=False).double()
    data = TensorDataset(torch.tensor(x), torch.tensor(y))
    loader = DataLoader(data, batch_size=len(y), shuffle=False)  # full batch: exact GD
    return FedProxClient(
        model,
        loader,
        local_epochs=epochs,
        learning_rate=lr,
        loss_fn=half_mse,
        gamma=gamma,
    )


def test_proximal_term_is_the_gradient_of_the_squared_penalty() -> None:
    torch.manual_seed(0)
    p = torch.randn(5, requires_grad=True)
    anchor = torch.randn(5)
    mu = 0.7
    (0.5 * mu * ((p - anchor) ** 2).sum()).backward()
    expected = p.grad.clone()
    p.grad = torch.zeros_like(p)
    ProximalTerm(mu, [anchor]).add_([p])
    torch.testing.assert_close(p.grad, expected)
    # Sign: a step along -grad moves toward the anchor.
    assert torch.dot(p.grad, (p - anchor).detach()) > 0


def test_proximal_term_keeps_copies_unless_told_not_to() -> None:
    p = torch.zeros(3, requires_grad=True)
    anchor, shift = torch.ones(3), torch.full((3,), 0.5)
    copied = ProximalTerm(1.0, [anchor], [shift])
    kept = ProximalTerm(1.0, [anchor], [shift], copy=False)
    assert copied.anchor[0].data_ptr() != anchor.data_ptr()
    assert copied.shift is not None and copied.shift[0].data_ptr() != shift.data_ptr()
    assert kept.anchor[0].data_ptr() == anchor.data_ptr()
    assert kept.shift is not None and kept.shift[0].data_ptr() == shift.data_ptr()
    anchor.fill_(3.0)  # the caller breaks its promise: only the kept term sees it
    copied.add_([p])
    torch.testing.assert_close(p.grad, torch.full((3,), -0.5))
    p.grad = None
    kept.add_([p])
    torch.testing.assert_close(p.grad, torch.full((3,), -2.5))


def test_two_hand_computed_steps() -> None:
    x, y = least_squares()
    w_t = np.array([0.5, -1.0, 2.0])
    mu, lr = 0.3, 0.05
    client = quad_client(x, y, w_t, epochs=2, lr=lr)
    out, n, _ = client.fit([w_t[None, :]], {"proximal-mu": mu})

    def grad_f(w):
        return x.T @ (x @ w - y) / len(y)

    w1 = w_t - lr * grad_f(w_t)  # prox gradient is 0 at the anchor
    w2 = w1 - lr * (grad_f(w1) + mu * (w1 - w_t))
    np.testing.assert_allclose(out[0][0], w2, rtol=0, atol=1e-14)
    assert n == len(y)


@pytest.mark.parametrize("mu", [0.01, 0.5, 3.0])
def test_local_solve_reaches_the_closed_form_prox(mu: float) -> None:
    x, y = least_squares(seed=1)
    a = x.T @ x / len(y)
    b = x.T @ y / len(y)
    w_t = np.array([1.0, 2.0, -3.0])
    prox = np.linalg.solve(a + mu * np.eye(3), b + mu * w_t)
    client = quad_client(x, y, w_t, epochs=3000, lr=0.2)
    out, _, _ = client.fit([w_t[None, :]], {"proximal-mu": mu})
    np.testing.assert_allclose(out[0][0], prox, atol=1e-9)
    # And it is not the unregularised minimiser.
    assert np.linalg.norm(prox - np.linalg.solve(a, b)) > 1e-3


def test_gamma_inexact_rule_stops_where_it_should() -> None:
    x, y = least_squares(seed=2)
    w_t = np.array([3.0, -2.0, 1.0])
    mu, lr, gamma, cap = 0.5, 0.05, 0.3, 200

    def grad_h(w):
        return x.T @ (x @ w - y) / len(y) + mu * (w - w_t)

    initial = np.linalg.norm(grad_h(w_t))
    w, expected = w_t.copy(), None
    for epoch in range(1, cap + 1):
        w = w - lr * grad_h(w)
        if np.linalg.norm(grad_h(w)) <= gamma * initial:
            expected = epoch
            break
    assert expected is not None and 1 < expected < cap

    client = quad_client(x, y, w_t, epochs=cap, lr=lr, gamma=gamma)
    out, _, metrics = client.fit([w_t[None, :]], {"proximal-mu": mu})
    assert metrics["local-epochs-run"] == expected
    np.testing.assert_allclose(out[0][0], w, atol=1e-12)
    assert metrics["inexactness"] <= gamma
    # gamma = 0 never stops early: the cap rules.
    strict = quad_client(x, y, w_t, epochs=7, lr=lr, gamma=0.0)
    assert strict.fit([w_t[None, :]], {"proximal-mu": mu})[2]["local-epochs-run"] == 7


def classification_client_fn(client_cls, **kwargs):
    torch.manual_seed(0)
    features = torch.randn(300, 6)
    labels = (features @ torch.randn(6, 3)).argmax(1)

    def client_fn(context):
        pid = int(context.node_config["partition-id"])
        n = int(context.node_config["num-partitions"])
        idx = torch.arange(pid, len(labels), n)
        loader = DataLoader(
            TensorDataset(features[idx], labels[idx]), batch_size=8, shuffle=True
        )
        model = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        )
        return client_cls(
            model, loader, local_epochs=2, learning_rate=0.1, seed=pid, **kwargs
        )

    return client_fn


def run(strategy, client_fn, rounds=3, nodes=4) -> dict[str, np.ndarray]:
    torch.manual_seed(123)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    grid = InProcessGrid(to_client_app(client_fn), num_nodes=nodes)
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds
    )
    return {k: v.numpy() for k, v in result.arrays.items()}


def test_mu_zero_equals_fedavg_bit_for_bit() -> None:
    prox = run(
        FedProx(mu=0.0, min_available_nodes=4, fraction_train=0.75, min_train_nodes=2),
        classification_client_fn(FedProxClient),
    )
    avg = run(
        FedAvg(min_available_nodes=4, fraction_train=0.75, min_train_nodes=2),
        classification_client_fn(FedAvgClient),
    )
    assert prox.keys() == avg.keys()
    for key in prox:
        assert prox[key].tobytes() == avg[key].tobytes()
    # And mu > 0 really changes the result.
    other = run(
        FedProx(mu=1.0, min_available_nodes=4), classification_client_fn(FedProxClient)
    )
    assert any(not np.array_equal(other[k], avg[k]) for k in avg)


def test_stragglers_same_draws_fedavg_drops_fedprox_keeps_partial_work() -> None:
    arrays = record(model_arrays())
    avg = FedAvg(min_available_nodes=10, local_epochs=5, drop_percent=0.3, seed=4)
    prox = FedProx(
        mu=0.1, min_available_nodes=10, local_epochs=5, drop_percent=0.3, seed=4
    )
    grid = sampling_grid(10)
    for rnd in (1, 2, 3):
        sent_avg = list(avg.configure_train(rnd, arrays, ConfigRecord(), grid))
        sent_prox = list(prox.configure_train(rnd, arrays, ConfigRecord(), grid))
        epochs = {
            m.metadata.dst_node_id: m.content["config"]["local-epochs"]
            for m in sent_prox
        }
        stragglers = {node for node, e in epochs.items() if e < 5}
        assert len(sent_prox) == 10 and len(stragglers) == 3
        assert all(1 <= e <= 4 for e in epochs.values() if e < 5)
        assert {m.metadata.dst_node_id for m in sent_avg} == set(epochs) - stragglers


def test_uniform_weighting_is_the_plain_mean() -> None:
    strategy = FedProx(mu=0.1, min_available_nodes=3, weighting="uniform")
    grid = sampling_grid(3)
    messages = list(
        strategy.configure_train(1, record(model_arrays()), ConfigRecord(), grid)
    )
    from .helpers import reply

    values = [model_arrays(seed=s) for s in (1, 2, 3)]
    replies = [
        reply(m, v, num_examples=n)
        for m, v, n in zip(messages, values, (1, 50, 1000), strict=True)
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    expected = np.mean([v["w"] for v in values], axis=0)
    np.testing.assert_allclose(arrays["w"].numpy(), expected, rtol=1e-6)


def test_dissimilarity_is_one_for_identical_clients() -> None:
    strategy = FedProx(mu=0.1, min_available_nodes=3, monitor_dissimilarity=True)
    grid = sampling_grid(3)
    messages = list(
        strategy.configure_train(1, record(model_arrays()), ConfigRecord(), grid)
    )
    from .helpers import reply

    g = model_arrays(seed=5)
    replies = [
        reply(m, model_arrays(), extra_records={"gradient": record(g)})
        for m in messages
    ]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["dissimilarity-b"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"mu": -1.0}, "mu"),
        ({"mu": float("nan")}, "mu"),
        ({"fraction_train": 1.5}, "fraction_train"),
        ({"weighting": "median"}, "weighting"),
        ({"drop_percent": 0.5}, "drop_percent"),
        ({"drop_percent": 2.0}, "drop_percent"),
        ({"min_available_nodes": -1}, "min_available_nodes"),
        ({"seed": -3}, "seed"),
    ],
)
def test_invalid_hyperparameters_fail_at_construction(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        FedProx(**kwargs)


def test_client_rejects_invalid_gamma() -> None:
    x, y = least_squares()
    with pytest.raises(ValueError, match="gamma"):
        quad_client(x, y, None, epochs=1, lr=0.1, gamma=1.5)


def test_checkpoint_and_resume_is_bit_identical() -> None:
    def strategy():
        return FedProx(
            mu=0.1, min_available_nodes=4, fraction_train=0.5, min_train_nodes=2, seed=3
        )

    client_fn = classification_client_fn(FedProxClient)
    torch.manual_seed(123)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    initial = ArrayRecord(model.state_dict())

    straight = strategy().start(
        grid=InProcessGrid(to_client_app(client_fn), num_nodes=4),
        initial_arrays=initial,
        num_rounds=4,
    )
    first = strategy()
    half = first.start(
        grid=InProcessGrid(to_client_app(client_fn), num_nodes=4),
        initial_arrays=initial,
        num_rounds=2,
    )
    checkpoint = first.state_dict()
    resumed_strategy = strategy()
    resumed_strategy.load_state_dict(checkpoint)
    resumed = resumed_strategy.start(
        grid=InProcessGrid(to_client_app(client_fn), num_nodes=4),
        initial_arrays=half.arrays,
        num_rounds=2,
    )
    assert resumed_strategy.rounds_completed == 4
    for key, value in straight.arrays.items():
        assert value.numpy().tobytes() == resumed.arrays[key].numpy().tobytes()

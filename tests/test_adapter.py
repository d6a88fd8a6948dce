"""The NumPyClient -> ClientApp adapter, against the pack's and Flower's strategies."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
)
from flwr.client import NumPyClient
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from flwr_prox_strategies import FedAvg, FedProxClient, to_client_app
from flwr_prox_strategies.core.client.adapter import ErrorLog, handle_train
from flwr_prox_strategies.core.transport.flower import MOD_FAILED_PRECONDITION
from flwr_prox_strategies.core.transport.inprocess import InProcessGrid

from .helpers import context, model_arrays, record, train_message


class DocsClient(NumPyClient):
    """A NumPyClient written as in Flower's docs: least squares on local data."""

    def __init__(self, partition_id: int) -> None:
        rng = np.random.default_rng(partition_id)
        self.x = rng.normal(size=(20 + 5 * partition_id, 3))
        self.y = self.x @ np.array([1.0, -2.0, 0.5])

    def get_parameters(self, config):
        return [np.zeros(3)]

    def fit(self, parameters, config):
        w = parameters[0]
        for _ in range(5):
            w = w - 0.1 * self.x.T @ (self.x @ w - self.y) / len(self.y)
        return (
            [w],
            len(self.y),
            {"train-loss": float(np.mean((self.x @ w - self.y) ** 2))},
        )

    def evaluate(self, parameters, config):
        loss = float(np.mean((self.x @ parameters[0] - self.y) ** 2))
        return loss, len(self.y), {"mse": loss}


def docs_client_fn(context: Context) -> NumPyClient:
    return DocsClient(int(context.node_config["partition-id"]))


@pytest.mark.parametrize("strategy_cls", [FedAvg, FlowerFedAvg])
def test_docs_numpy_client_runs_unchanged(strategy_cls) -> None:
    grid = InProcessGrid(to_client_app(docs_client_fn), num_nodes=3)
    strategy = strategy_cls(min_available_nodes=3)
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord([np.zeros(3)]), num_rounds=30
    )
    w = result.arrays.to_numpy_ndarrays()[0]
    np.testing.assert_allclose(w, [1.0, -2.0, 0.5], atol=1e-3)
    assert result.evaluate_metrics_clientapp[30]["mse"] < 1e-5


def test_pack_and_flower_fedavg_agree() -> None:
    finals = []
    for strategy in (
        FedAvg(min_available_nodes=3),
        FlowerFedAvg(min_available_nodes=3),
    ):
        grid = InProcessGrid(to_client_app(docs_client_fn), num_nodes=3)
        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord([np.zeros(3)]), num_rounds=3
        )
        finals.append(result.arrays.to_numpy_ndarrays()[0])
    np.testing.assert_allclose(finals[0], finals[1], rtol=1e-12)


class EchoClient(NumPyClient):
    def fit(self, parameters, config):
        state = self.context.state  # the adapter hands over the node's Context
        count = state["counter"]["n"] + 1 if "counter" in state else 1
        state["counter"] = ConfigRecord({"n": count})
        return (
            [p * 2 for p in parameters],
            7,
            {"seen": count, "note": "strings stay local"},
        )


def test_keys_order_context_and_metrics() -> None:
    arrays = record({"z": np.ones(2, np.float32), "a": np.arange(3, dtype=np.float32)})
    ctx = context()
    for expected in (1, 2):
        out = handle_train(lambda c: EchoClient(), train_message(arrays, {}), ctx)
        assert not out.has_error()
        assert list(out.content["arrays"].keys()) == ["z", "a"]
        np.testing.assert_array_equal(out.content["arrays"]["a"].numpy(), [0, 2, 4])
        metrics = out.content["metrics"]
        assert metrics["num-examples"] == 7 and metrics["seen"] == expected
        assert "note" not in metrics


class Crashing(NumPyClient):
    def fit(self, parameters, config):
        raise RuntimeError("disk on fire")


def test_client_exception_becomes_an_error_reply() -> None:
    out = handle_train(
        lambda c: Crashing(), train_message(record(model_arrays()), {}), context()
    )
    assert out.has_error()
    assert out.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "disk on fire" in out.error.reason


def test_protocol_mismatch_names_the_strategy() -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    def client_fn(c):
        model = torch.nn.Linear(3, 4)
        data = TensorDataset(torch.randn(8, 3), torch.randint(0, 4, (8,)))
        return FedProxClient(model, DataLoader(data, batch_size=4))

    model = torch.nn.Linear(3, 4)
    message = train_message(ArrayRecord(model.state_dict()), {"server-round": 1})
    out = handle_train(client_fn, message, context())
    assert out.has_error()
    assert out.error.code == MOD_FAILED_PRECONDITION
    assert "proximal-mu" in out.error.reason and "FedProx" in out.error.reason


def test_a_repeated_client_error_logs_its_traceback_once(caplog) -> None:
    """A refused setting fails every message alike: one traceback, then one line each."""
    errors = ErrorLog()
    message = train_message(record(model_arrays()), {})
    with caplog.at_level("ERROR", logger="flwr"):
        replies = [
            handle_train(lambda c: Crashing(), message, context(), errors)
            for _ in range(3)
        ]
    assert all(r.has_error() and "disk on fire" in r.error.reason for r in replies)
    logged = [
        r.getMessage() for r in caplog.records if "disk on fire" in r.getMessage()
    ]
    assert len(logged) == 3
    assert sum("Traceback" in line for line in logged) == 1
    assert sum("again; its traceback was logged" in line for line in logged) == 2

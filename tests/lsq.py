"""A least-squares federation with a known global minimiser (tests' shared problem)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch.utils.data import DataLoader, TensorDataset

from flwr_prox_strategies import to_client_app
from flwr_prox_strategies.core.inprocess import InProcessGrid


def half_sse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f_k = 1/2 ||A_k theta - b_k||^2 for a full batch."""
    return 0.5 * ((out.squeeze(-1) - y) ** 2).sum()


class LeastSquares:
    """K clients, f_k(theta) = 1/2 ||A_k theta - b_k||^2, strongly heterogeneous."""

    def __init__(
        self, num_clients: int = 4, dim: int = 5, rows: int = 20, seed: int = 0
    ):
        rng = np.random.default_rng(seed)
        self.dim = dim
        self.a, self.b = [], []
        for k in range(num_clients):
            scale = 0.5 + 1.5 * k / max(num_clients - 1, 1)  # curvature differs
            a = rng.normal(size=(rows, dim)) * scale / np.sqrt(rows)
            target = rng.normal(size=dim) * 3.0 + 2.0 * k  # optima differ
            self.a.append(a.astype(np.float32))
            self.b.append((a @ target + 0.1 * rng.normal(size=rows)).astype(np.float32))
        gram = sum(a.astype(np.float64).T @ a for a in self.a)
        rhs = sum(
            a.astype(np.float64).T @ b for a, b in zip(self.a, self.b, strict=True)
        )
        self.optimum = np.linalg.solve(gram, rhs)

    def loader(self, k: int) -> DataLoader:
        data = TensorDataset(torch.from_numpy(self.a[k]), torch.from_numpy(self.b[k]))
        return DataLoader(data, batch_size=len(data), shuffle=False)

    def client_fn(self, client_cls, **kwargs) -> Callable:
        def client_fn(context):
            k = int(context.node_config["partition-id"])
            model = torch.nn.Linear(self.dim, 1, bias=False)
            return client_cls(model, self.loader(k), loss_fn=half_sse, **kwargs)

        return client_fn

    def initial(self) -> ArrayRecord:
        return ArrayRecord([np.zeros((1, self.dim), np.float32)])

    def run(self, strategy, client_cls, rounds: int, **client_kwargs) -> np.ndarray:
        grid = InProcessGrid(
            to_client_app(self.client_fn(client_cls, **client_kwargs)),
            num_nodes=len(self.a),
        )
        result = strategy.start(
            grid=grid, initial_arrays=self.initial(), num_rounds=rounds
        )
        return result.arrays.to_numpy_ndarrays()[0][0]

    def relative_error(self, theta: np.ndarray) -> float:
        return float(
            np.linalg.norm(theta - self.optimum) / np.linalg.norm(self.optimum)
        )

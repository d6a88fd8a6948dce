r"""A least-squares federation with a known global minimiser, run in process.

Client :math:`k` holds :math:`f_k(\theta) = \frac12\lVert A_k\theta -
b_k\rVert^2`, with curvatures and optima that differ between clients, so an
algorithm that drifts shows it; the minimiser of :math:`\sum_k f_k` is solved
in float64 (:attr:`LeastSquares.optimum`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from torch.utils.data import DataLoader, TensorDataset

from ..core.client.adapter import to_client_app
from ..core.transport.inprocess import InProcessGrid


def half_sse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r"""Return :math:`\frac12\lVert \hat y - y\rVert^2` summed over the batch.

    Parameters
    ----------
    out : torch.Tensor
        Predictions, shape ``(n, 1)`` or ``(n,)``.
    y : torch.Tensor
        Targets, shape ``(n,)``.

    Returns
    -------
    torch.Tensor
        The scalar loss; on a full batch it is :math:`f_k`.
    """
    return 0.5 * ((out.squeeze(-1) - y) ** 2).sum()


class LeastSquares:
    r"""N clients, :math:`f_k(\theta) = \frac12\lVert A_k\theta - b_k\rVert^2`.

    Parameters
    ----------
    num_clients : int (default: 4)
        N; client ``k`` is the node whose ``partition-id`` is ``k``.
    dim : int (default: 5)
        The dimension of :math:`\theta` (a ``Linear(dim, 1, bias=False)``).
    rows : int (default: 20)
        Rows of each :math:`A_k`.
    seed : int (default: 0)
        Seeds the problem.

    Attributes
    ----------
    a, b : list[numpy.ndarray]
        Each client's :math:`A_k` and :math:`b_k` (float32).
    optimum : numpy.ndarray
        The minimiser of :math:`\sum_k f_k` (float64).
    """

    def __init__(
        self, num_clients: int = 4, dim: int = 5, rows: int = 20, seed: int = 0
    ) -> None:
        rng = np.random.default_rng(seed)
        self.dim = dim
        self.a: list[np.ndarray] = []
        self.b: list[np.ndarray] = []
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
        """Return client ``k``'s data as one full batch ``(A_k, b_k)``.

        Parameters
        ----------
        k : int
            The client.

        Returns
        -------
        DataLoader
            One batch holding every row, not shuffled.
        """
        data = TensorDataset(torch.from_numpy(self.a[k]), torch.from_numpy(self.b[k]))
        return DataLoader(data, batch_size=len(data), shuffle=False)

    def model(self) -> torch.nn.Module:
        r"""Return a fresh linear model :math:`\theta \mapsto A\theta`.

        Returns
        -------
        torch.nn.Module
            ``Linear(dim, 1, bias=False)``.
        """
        return torch.nn.Linear(self.dim, 1, bias=False)

    def client_fn(self, client_cls: type, **kwargs: Any) -> Callable[[Context], Any]:
        """Return a ``client_fn`` building ``client_cls`` on each node's data.

        Parameters
        ----------
        client_cls : type
            A ``NumPyClient`` class taking ``(model, train_loader, ...)``, as
            the pack's clients do.
        **kwargs
            More keyword arguments of ``client_cls`` (``loss_fn`` defaults to
            :func:`half_sse`).

        Returns
        -------
        Callable[[Context], Any]
            What :func:`~flwr_prox_strategies.to_client_app` takes.
        """
        options = {"loss_fn": half_sse, **kwargs}

        def client_fn(context: Context) -> Any:
            k = int(context.node_config["partition-id"])
            return client_cls(self.model(), self.loader(k), **options)

        return client_fn

    def initial(self) -> ArrayRecord:
        r"""Return :math:`\theta^0 = 0` as the model's ``ArrayRecord``.

        Returns
        -------
        ArrayRecord
            One array of shape ``(1, dim)``.
        """
        return ArrayRecord([np.zeros((1, self.dim), np.float32)])

    def run(
        self, strategy: Any, client_cls: type, rounds: int, **client_kwargs: Any
    ) -> np.ndarray:
        r"""Run ``strategy.start`` over an :class:`InProcessGrid` of the N clients.

        Parameters
        ----------
        strategy : Strategy
            Any strategy with Flower's ``start``.
        client_cls : type
            The clients' ``NumPyClient`` class.
        rounds : int
            Number of rounds.
        **client_kwargs
            Keyword arguments of ``client_cls``.

        Returns
        -------
        numpy.ndarray
            The final :math:`\theta`, shape ``(dim,)``.
        """
        grid = InProcessGrid(
            to_client_app(self.client_fn(client_cls, **client_kwargs)),
            num_nodes=len(self.a),
        )
        result = strategy.start(
            grid=grid, initial_arrays=self.initial(), num_rounds=rounds
        )
        return result.arrays.to_numpy_ndarrays()[0][0]

    def relative_error(self, theta: np.ndarray) -> float:
        r"""Return :math:`\lVert\theta - \theta^\star\rVert/\lVert\theta^\star\rVert`.

        Parameters
        ----------
        theta : numpy.ndarray
            A model, shape ``(dim,)``.

        Returns
        -------
        float
            Its distance to :attr:`optimum`, relative.
        """
        return float(
            np.linalg.norm(theta - self.optimum) / np.linalg.norm(self.optimum)
        )

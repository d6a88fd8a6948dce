r"""FedEPM's maths: the elastic-net centre, the clients' steps, the official setup.

The coordinate-wise elastic-net centre of the uploads, exact by sorting (its
derivation, weighted too: ``docs/algorithms/fedepm.md``); the server's table of
uploads (:func:`with_rows`, :func:`table_center`), the clients' closed-form
prox-linear steps (:func:`prox_linear_steps`), the paper's default :math:`\eta`,
model (:class:`PaperLogistic`) and the official code's partition and stopping
rules (:func:`official_partition`, :func:`official_stop`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from .checks import check_int

ArrayT = TypeVar("ArrayT", bound=Any)


def elastic_net_center(
    uploads: NDArray[np.floating], lam: float, eta: float
) -> NDArray[np.float64]:
    r"""Minimise :math:`\sum_j \lambda|v - z_j| + \frac{\eta}{2}(v - z_j)^2`.

    Per entry of the uploads (coordinate-wise).

    Parameters
    ----------
    uploads : ndarray, shape (m, ...)
        The m uploads :math:`z_j` stacked on the first axis.
    lam : float
        :math:`\lambda \ge 0`.
    eta : float
        :math:`\eta \ge 0`; at least one of ``lam`` and ``eta`` must be > 0.

    Returns
    -------
    ndarray, shape uploads.shape[1:], float64
        The minimiser for every coordinate.
    """
    if not (np.isfinite(lam) and lam >= 0 and np.isfinite(eta) and eta >= 0):
        raise ValueError(f"need lam >= 0 and eta >= 0, got lam={lam}, eta={eta}")
    if lam == 0 and eta == 0:
        raise ValueError("lam and eta cannot both be 0 (every v is a minimiser)")
    z = np.asarray(uploads, dtype=np.float64)
    if z.ndim == 0 or z.shape[0] == 0:
        raise ValueError("need at least one upload")
    m = z.shape[0]
    flat = np.sort(z.reshape(m, -1), axis=0)
    if eta == 0:
        return flat[(m - 1) // 2].reshape(z.shape[1:])
    # A non-finite upload gives a non-finite centre (callers reject it), quietly.
    with np.errstate(invalid="ignore", over="ignore"):
        total = flat.sum(axis=0)
        q = np.arange(1, m + 1, dtype=np.float64)[:, None]
        right_derivative = lam * (2 * q - m) + eta * (m * flat - total)
        first = np.argmax(right_derivative >= 0, axis=0)  # q* - 1 (0-based)
        interior = (total - (lam / eta) * (2 * first - m)) / m
    kink = flat[first, np.arange(flat.shape[1])]
    return np.minimum(interior, kink).reshape(z.shape[1:])


def weighted_elastic_net_center(
    uploads: NDArray[np.floating],
    weights: NDArray[np.integer] | list[int],
    lam: float,
    eta: float,
    block: int = 1 << 14,
) -> NDArray[np.float64]:
    r""":func:`elastic_net_center` of ``uploads[j]`` repeated ``weights[j]`` times.

    Without building the repeated table: memory is :math:`O(r \cdot` ``block``
    :math:`)` beyond the ``r`` rows given, coordinates taken ``block`` at a time.

    Parameters
    ----------
    uploads : ndarray, shape (r, ...)
        The distinct uploads stacked on the first axis.
    weights : sequence of int, length r
        How many uploads each row stands for, each >= 1.
    lam, eta : float
        As :func:`elastic_net_center`.
    block : int (default: 16384)
        Coordinates processed at once.

    Returns
    -------
    ndarray, shape uploads.shape[1:], float64
        The minimiser for every coordinate; equal to
        ``elastic_net_center(np.repeat(uploads, weights, axis=0), lam, eta)`` up
        to the order of float additions.
    """
    if not (np.isfinite(lam) and lam >= 0 and np.isfinite(eta) and eta >= 0):
        raise ValueError(f"need lam >= 0 and eta >= 0, got lam={lam}, eta={eta}")
    if lam == 0 and eta == 0:
        raise ValueError("lam and eta cannot both be 0 (every v is a minimiser)")
    z = np.asarray(uploads)
    w = np.asarray(weights)
    if z.ndim == 0 or z.shape[0] == 0:
        raise ValueError("need at least one upload")
    if w.shape != (z.shape[0],) or not np.issubdtype(w.dtype, np.integer):
        raise ValueError(f"need one integer weight per row, got {w!r}")
    if np.any(w < 1):
        raise ValueError(f"weights must be >= 1, got {w.min()}")
    r, total_weight = z.shape[0], int(w.sum())
    flat = z.reshape(r, -1)
    out = np.empty(flat.shape[1], dtype=np.float64)
    weight = w.astype(np.float64)
    for start in range(0, flat.shape[1], block):
        cols = np.asarray(flat[:, start : start + block], dtype=np.float64)
        order = np.argsort(cols, axis=0, kind="stable")
        ordered = np.take_along_axis(cols, order, axis=0)
        cumulative = np.cumsum(weight[order], axis=0)  # W_q
        columns = np.arange(cols.shape[1])
        if eta == 0:  # the lower median: position (M - 1) // 2 of the repeated table
            first = np.argmax(cumulative >= (total_weight - 1) // 2 + 1, axis=0)
            out[start : start + block] = ordered[first, columns]
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            total = weight @ cols
            right_derivative = lam * (2 * cumulative - total_weight) + eta * (
                total_weight * ordered - total
            )
            first = np.argmax(right_derivative >= 0, axis=0)
            # W_{q*-1}: the weight sorted before the kink
            before = cumulative[first, columns] - weight[order[first, columns]]
            interior = (
                total - (lam / eta) * (2 * before - total_weight)
            ) / total_weight
        out[start : start + block] = np.minimum(interior, ordered[first, columns])
    return out.reshape(z.shape[1:])


def elastic_net_objective(
    uploads: NDArray[np.floating], v: NDArray[np.floating], lam: float, eta: float
) -> NDArray[np.float64]:
    r"""Return the objective :math:`\sum_j \lambda|v-z_j| + \frac{\eta}{2}(v-z_j)^2`."""
    diff = np.asarray(v, dtype=np.float64)[None] - np.asarray(uploads, np.float64)
    return (lam * np.abs(diff) + 0.5 * eta * diff**2).sum(axis=0)


def soft_threshold(x: ArrayT, threshold: float) -> ArrayT:
    r"""Return :math:`\mathrm{sign}(x)\max(|x| - \tau, 0)`: the prox of :math:`\tau|x|`.

    Written as :math:`x - \mathrm{clip}(x, -\tau, \tau)`, so it works on numpy
    arrays and torch tensors alike.
    """
    return x - x.clip(-threshold, threshold)


def prox_linear_steps(
    x: Sequence[Any],
    local: Sequence[Any],
    grads: Sequence[Any],
    iterations: Iterable[int],
    *,
    lam: float,
    eta: float,
    r0: float,
    growth: float,
    size: int,
) -> tuple[list[Any], float]:
    r"""Run FedEPM's client iterations from the server point ``x``; return (x_i, mu_i).

    At iteration :math:`k`, :math:`\mu_i = r_0(1 + 10^{-8}\lVert x_i -
    x\rVert^2)\,growth^{k+1}`, :math:`\tilde\mu_i = \mu_i/d_i` (``size``) and
    :math:`x_i \gets x + S_\lambda(\tilde\mu_i(x_i - x) - g_i)/(\tilde\mu_i +
    \eta)`, the gradient ``grads`` fixed at ``x``. ``mu`` is ``r0`` when no
    iteration runs.
    """
    mu = r0
    for iteration in iterations:
        distance = sum(
            float(((a - b) ** 2).sum()) for a, b in zip(local, x, strict=True)
        )
        mu = r0 * (1 + 1e-8 * distance) * growth ** (iteration + 1)
        scaled = mu / size
        local = [
            xv + soft_threshold(scaled * (lv - xv) - g, lam) / (scaled + eta)
            for xv, lv, g in zip(x, local, grads, strict=True)
        ]
    return list(local), mu


def official_partition(
    labels: NDArray, *, num_partitions: int, seed: int = 0
) -> list[NDArray]:
    r"""Split rows as the official ``FedEPM.m``: contiguous blocks of random sizes.

    :math:`m - 1` distinct cut points drawn uniformly from :math:`2..d-1`, drawn
    again until every client holds more than 1% of :math:`d/m` rows; rows are
    taken in order (the loader shuffles them first). The experiment preset
    ``+experiment=fedepm-adult`` uses it as its ``partition`` (a Hydra partial
    with ``labels``, ``num_partitions`` and ``seed``), so that the app runs
    the benchmark's clients: with ``seed`` = the benchmark's split (and the
    loader's seed), the blocks are ``benchmarks/fedepm_adult.py``'s.

    Parameters
    ----------
    labels : NDArray
        One label per row (only the count :math:`d` is used).
    num_partitions : int
        :math:`m`.
    seed : int (default: 0)
        Seeds the cut points.

    Returns
    -------
    list[NDArray]
        Row indices of each client, in order.
    """
    d, m = len(labels), int(num_partitions)
    check_int("num_partitions", m, 1)
    if d < 2 * m + 2:
        raise ValueError(f"official_partition: {d} rows cannot make {m} clients")
    rng = np.random.default_rng(seed)
    while True:
        cuts = np.sort(np.append(rng.choice(np.arange(2, d), m - 1, replace=False), d))
        sizes = np.diff(np.concatenate([[0], cuts]))
        if sizes.min() > 0.01 * d / m:
            break
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [np.arange(bounds[i], bounds[i + 1]) for i in range(m)]


def default_eta(num_clients: int, rho: float) -> float:
    r"""Return the paper's :math:`\eta = (0.02m + 1)(\rho + 0.1)10^{-5}`."""
    return (0.02 * num_clients + 1) * (rho + 0.1) * 1e-5


def official_stop(
    objectives: Sequence[float], errors: Sequence[float], tol: float
) -> int:
    r"""Return which official stopping rule fires after the last round (0: none).

    ``objectives[s]`` is :math:`F(x)` and ``errors[s]`` is
    :math:`\lVert\frac{1}{m}\sum_i\nabla f_i(x)\rVert^2` at the model of
    communication :math:`s`. Rules (the official ``FedEPM.m``): 1, the sample
    variance of the last 4 objectives is below :math:`tol/(1 + F)`; 2, both the
    objective and the error exceed their maxima over the 3 previous rounds;
    3, the error is below ``tol`` (``tol`` is :math:`10^{-9} n` there).
    """
    s = len(objectives)
    if s == 0:
        return 0
    value, error = objectives[-1], errors[-1]
    if s > 3 and float(np.var(objectives[-4:], ddof=1)) < tol / (1 + value):
        return 1
    if s > 3 and value > max(objectives[-4:-1]) and error > max(errors[-4:-1]):
        return 2
    if error < tol:
        return 3
    return 0


def with_rows(
    table: NDArray, size: int, rows: Sequence[int], values: Sequence[NDArray]
) -> NDArray:
    """Return a copy of ``table`` with ``size`` rows and ``values`` at ``rows``.

    Rows added (FedEPM's "seen" table: one per new client) start as row 0, the
    initial model, until written.
    """
    new_rows = size - len(table)
    if new_rows > 0:
        table = np.concatenate([table, np.repeat(table[:1], new_rows, 0)])
    else:
        table = table.copy()
    for row, value in zip(rows, values, strict=True):
        table[row] = value
    return table


def table_center(table: NDArray, lam: float, eta: float, unseen: int | None) -> NDArray:
    """Return the elastic-net centre of a table of uploads, one row per client.

    ``unseen`` None: every row is a client's ("dense"); else row 0 is the
    initial model, standing for the ``unseen`` clients that still hold it
    ("seen"), and weighs as many.
    """
    if unseen is None:
        return elastic_net_center(table, lam, eta)
    if unseen > 0:
        weights = np.ones(len(table), dtype=np.int64)
        weights[0] = unseen
        return weighted_elastic_net_center(table, weights, lam, eta)
    return elastic_net_center(table[1:], lam, eta)


class PaperLogistic(nn.Module):
    r"""The FedEPM paper's model: binary logistic regression without an intercept.

    One weight vector :math:`x \in \mathbb{R}^n`, no bias, started at 0 (the
    official code's :math:`x^0`). The forward pass returns the two logits
    :math:`(0, \langle a, x\rangle)`, so the pack's cross-entropy is exactly the
    paper's loss :math:`\ln(1 + e^{\langle a, x\rangle}) - b\langle a,
    x\rangle` and the argmax is its sign rule.

    Why not ``model=logreg``
    (:class:`~flwr_prox_strategies.task.models.LogisticRegression`) for FedEPM
    on Adult: FedEPM's default :math:`\eta` (about :math:`10^{-5}`) and
    :math:`r_0` make a local step :math:`1/(\mu_i/d_i + \eta)` of order
    :math:`10^4`-:math:`10^5` on the mean loss, tuned for these unit-length
    feature columns, whose curvature is of order :math:`1/d`. The intercept's
    feature is the constant 1 (curvature about 0.2, thousands of times more), so
    the bias jumps by thousands and the model is a constant predictor flipping
    sign every round. Without the bias, the two-logit softmax still
    doubles the step on the logit difference (and its noise by :math:`2\sqrt2`),
    which alone makes the iterates oscillate.

    Parameters
    ----------
    in_features : int
        :math:`n` (14 on Adult).
    num_classes : int (default: 2)
        Must be 2 (accepted so that the ``model=logreg`` keys compose).
    """

    def __init__(self, *, in_features: int, num_classes: int = 2) -> None:
        super().__init__()
        check_int("in_features", in_features, 1)
        if num_classes != 2:
            raise ValueError(
                f"PaperLogistic is a binary classifier: num_classes must be 2, "
                f"got {num_classes!r}"
            )
        self.in_features = int(in_features)
        self.weight = nn.Parameter(torch.zeros(1, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r"""Return the logits :math:`(0, \langle a, x\rangle)`, shape ``(N, 2)``."""
        z = x.flatten(1) @ self.weight.T
        return torch.cat([torch.zeros_like(z), z], dim=1)

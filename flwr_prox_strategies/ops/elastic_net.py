r"""FedEPM's server step: the coordinate-wise elastic-net centre of the uploads.

.. math::
    x = \arg\min_v \sum_{j=1}^{m} \lambda\lvert v - z_j\rvert
    + \frac{\eta}{2}(v - z_j)^2 \qquad\text{(per coordinate)}

is a blend of the mean (:math:`\lambda = 0`) and the median
(:math:`\lambda/\eta \to \infty`; Flower's ``FedMedian`` is that limit). The
objective is convex and piecewise quadratic with kinks at the sorted uploads
:math:`z_{(1)} \le \dots \le z_{(m)}`. Its right derivative at :math:`z_{(q)}`
(counting position :math:`q` in the sorted order) is

.. math::
    D_q = \lambda(2q - m) + \eta(m z_{(q)} - \textstyle\sum_j z_j),

non-decreasing in :math:`q`, and :math:`D_m \ge 0`. With :math:`q^*` the first
:math:`q` where :math:`D_q \ge 0`, the minimiser lies in
:math:`(z_{(q^*-1)}, z_{(q^*)}]`, where the derivative is
:math:`\lambda(2(q^*-1) - m) + \eta(m v - \sum_j z_j)`; so

.. math::
    x = \min\Big(\frac{1}{m}\big(\textstyle\sum_j z_j
        - \frac{\lambda}{\eta}(2(q^* - 1) - m)\big),\; z_{(q^*)}\Big),

exact (ties included), vectorised over coordinates, :math:`O(nm\log m)` for the
sort. ``eta = 0`` (pure :math:`\ell_1`) returns the lower median.

With integer multiplicities :math:`w_j` (:func:`weighted_elastic_net_center`:
upload :math:`z_j` stands for :math:`w_j` identical uploads, :math:`M = \sum_j w_j`)
the same derivation holds with :math:`q` replaced by the cumulative weight
:math:`W_q` of the first :math:`q` sorted uploads, :math:`m` by :math:`M` and
:math:`\sum_j z_j` by :math:`\sum_j w_j z_j`. FedEPM's clients that never
uploaded all hold the initial model: one row of weight ``m - seen`` replaces
them (``FedEPM(table="seen")``).
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

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

r"""FedEPM's maths: the elastic-net centre, the clients' steps, the official setup.

The coordinate-wise elastic-net centre of the uploads, exact by sorting (its
derivation, weighted too: ``docs/algorithms/fedepm.md``); the server's table of
uploads (:func:`with_rows`, :func:`table_center`), the clients' closed-form
prox-linear steps (:func:`prox_linear_steps`), the paper's default :math:`\eta`
and the official code's partition and stopping rules (:func:`official_partition`,
:func:`official_stop`). The paper's model is
:class:`~flwr_prox_strategies.task.models.PaperLogistic`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from .checks import check_int

ArrayT = TypeVar("ArrayT", bound=Any)


def _check_penalties(lam: float, eta: float) -> None:
    """Refuse a negative or non-finite penalty, and lam = eta = 0.

    Parameters
    ----------
    lam, eta : float
        As :func:`elastic_net_center`.

    Raises
    ------
    ValueError
        If either is negative or not finite, or both are 0.
    """
    if not (np.isfinite(lam) and lam >= 0 and np.isfinite(eta) and eta >= 0):
        raise ValueError(f"need lam >= 0 and eta >= 0, got lam={lam}, eta={eta}")
    if lam == 0 and eta == 0:
        raise ValueError("lam and eta cannot both be 0 (every v is a minimiser)")


def _sorted_center(z: NDArray[np.float64], lam: float, eta: float) -> NDArray:
    """Return the centre of each column of ``z`` by sorting it: the reference.

    Parameters
    ----------
    z : ndarray, shape (m, n), float64
        The uploads of ``n`` coordinates.
    lam, eta : float
        As :func:`elastic_net_center`.

    Returns
    -------
    ndarray, shape (n,), float64
        The centre, the uploads' total summed in sorted order.
    """
    m = z.shape[0]
    flat = np.sort(z, axis=0)
    if eta == 0:
        return flat[(m - 1) // 2]
    # A non-finite upload gives a non-finite centre (callers reject it), quietly.
    with np.errstate(invalid="ignore", over="ignore"):
        total = flat.sum(axis=0)
        q = np.arange(1, m + 1, dtype=np.float64)[:, None]
        right_derivative = lam * (2 * q - m) + eta * (m * flat - total)
        first = np.argmax(right_derivative >= 0, axis=0)  # q* - 1 (0-based)
        interior = (total - (lam / eta) * (2 * first - m)) / m
    kink = flat[first, np.arange(flat.shape[1])]
    return np.minimum(interior, kink)


def _sorted_weighted_center(
    cols: NDArray[np.float64],
    weight: NDArray[np.float64],
    total: NDArray[np.float64] | None,
    lam: float,
    eta: float,
) -> NDArray[np.float64]:
    """Return the weighted centre of each column of ``cols`` by sorting: the reference.

    Parameters
    ----------
    cols : ndarray, shape (r, n), float64
        The uploads of ``n`` coordinates.
    weight : ndarray, shape (r,), float64
        Integer weights, each >= 1.
    total : ndarray, shape (n,), float64, or None
        ``weight @ cols`` (None when ``eta`` is 0), computed by the caller so
        that the sorted and the certified columns share it bit for bit.
    lam, eta : float
        As :func:`elastic_net_center`.

    Returns
    -------
    ndarray, shape (n,), float64
        The centre.
    """
    total_weight = int(weight.sum())
    order = np.argsort(cols, axis=0, kind="stable")
    ordered = np.take_along_axis(cols, order, axis=0)
    cumulative = np.cumsum(weight[order], axis=0)  # W_q
    columns = np.arange(cols.shape[1])
    if eta == 0 or total is None:  # the lower median: position (M - 1) // 2
        first = np.argmax(cumulative >= (total_weight - 1) // 2 + 1, axis=0)
        return ordered[first, columns]
    with np.errstate(invalid="ignore", over="ignore"):
        right_derivative = lam * (2 * cumulative - total_weight) + eta * (
            total_weight * ordered - total
        )
        first = np.argmax(right_derivative >= 0, axis=0)
        # W_{q*-1}: the weight sorted before the kink
        before = cumulative[first, columns] - weight[order[first, columns]]
        interior = (total - (lam / eta) * (2 * before - total_weight)) / total_weight
    return np.minimum(interior, ordered[first, columns])


def _masked_weight(
    mask: NDArray[np.bool_], weight: NDArray[np.float64], unit_tail: bool
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    """Return the weight and the number of the rows ``mask`` holds, per column.

    Parameters
    ----------
    mask : ndarray, shape (r, n), bool
        Which uploads count.
    weight : ndarray, shape (r,), float64
        The rows' weights.
    unit_tail : bool
        Every row but row 0 weighs 1 (the count then gives the weight).

    Returns
    -------
    tuple[ndarray, ndarray]
        The weight (float64) and the number of rows (int64) of each column.
    """
    # Summing the bytes as integers is 2-5x faster than numpy's sum of bools.
    count = np.add.reduce(mask.view(np.uint8), axis=0, dtype=np.int64)
    if unit_tail:  # only row 0 weighs more than 1 (FedEPM's "seen" table)
        return count + (weight[0] - 1) * mask[0], count
    return weight @ mask, count


def _right_derivative(
    through: NDArray, at: NDArray, total: NDArray, lam: float, eta: float, w: int
) -> NDArray[np.float64]:
    r"""Return the sorted solvers' right derivative, rounding for rounding.

    Nondecreasing in ``through`` and in ``at`` (every rounding is monotone), which
    is what lets a certificate at two positions stand for the whole sorted order.

    Parameters
    ----------
    through : ndarray
        The cumulative weight up to and including the position (:math:`W_q`).
    at : ndarray
        The upload at the position (:math:`z_{(q)}`).
    total : ndarray
        The weighted sum of the uploads.
    lam, eta : float
        As :func:`elastic_net_center`.
    w : int
        The total weight :math:`M`.

    Returns
    -------
    ndarray, float64
        :math:`\lambda(2W_q - M) + \eta(M z_{(q)} - \sum_j w_j z_j)`.
    """
    through = np.asarray(through, dtype=np.float64)
    return lam * (2 * through - w) + eta * (w * np.asarray(at, np.float64) - total)


def _certified_center(
    cols: NDArray[np.floating],
    weight: NDArray[np.float64],
    total: NDArray[np.float64] | None,
    lam: float,
    eta: float,
    hint: NDArray[np.floating],
    tries: int = 3,
) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
    """Certify from the hint, then again from each failure's next guess.

    A coordinate whose optimum moved past an upload (the mean-like regime,
    small ``lam``) is usually certified by a second guess: the stationary point
    of the piece the first one pointed to.

    Parameters
    ----------
    cols, weight, total, lam, eta, hint
        As :func:`_certify`.
    tries : int (default: 3)
        Extra guesses at most, each on the columns still failing only.

    Returns
    -------
    tuple[ndarray, ndarray]
        The centre (float64; meaningless where not certified) and the mask of
        the certified columns.
    """
    out, ok, guess = _certify(cols, weight, total, lam, eta, hint)
    if total is None:  # eta 0: the median's group, no stationary point to try
        return out, ok
    for _ in range(tries):
        again = np.flatnonzero(~ok & np.isfinite(guess))
        if not again.size:
            break
        out[again], ok[again], guess[again] = _certify(
            cols[:, again], weight, total[again], lam, eta, guess[again]
        )
    return out, ok


def _certify(
    cols: NDArray[np.floating],
    weight: NDArray[np.float64],
    total: NDArray[np.float64] | None,
    lam: float,
    eta: float,
    hint: NDArray[np.floating],
) -> tuple[NDArray[np.float64], NDArray[np.bool_], NDArray[np.float64]]:
    r"""Solve the columns whose sorted solution the hint locates; say which.

    The sorted solvers pick the first position :math:`q` of the sorted column
    whose right derivative is :math:`\ge 0` (for ``eta`` 0, whose cumulative
    weight reaches the median's); the answer depends only on that position's
    value, and on the weight sorted before it. The hint names a group of equal
    values, the smallest at or above it, with the weight ``L`` strictly below
    it and ``E`` in it; two comparisons of the table with the hint give both.
    The position is in that group exactly when the test fails at the group's
    start and holds at its end (the test is monotone along the sorted order,
    even rounded); inside a group of ties the sorted order is the rows' order,
    so with unit weights after row 0 the position is one integer, solved for
    and checked. The answer is then the sorted solvers' formula on the same
    numbers, hence the same bits. Columns not certified (the optimum moved
    past another upload, weights of ties other than 1, a non-finite value) are
    the caller's to sort. O(rows) per column, no sort.

    Parameters
    ----------
    cols : ndarray, shape (r, n)
        The uploads of ``n`` coordinates, in the table's dtype.
    weight : ndarray, shape (r,), float64
        Integer weights, each >= 1.
    total : ndarray, shape (n,), float64, or None
        ``weight @ cols`` in float64, as the sorted solver computes it; None when
        ``eta`` is 0.
    lam, eta : float
        As :func:`elastic_net_center`.
    hint : ndarray, shape (n,)
        A guess of the centre (the previous round's).

    Returns
    -------
    tuple[ndarray, ndarray, ndarray]
        The centre (float64; meaningless where not certified), the mask of
        the certified columns and, where not certified, a better guess.
    """
    w = int(weight.sum())
    unit_tail = bool(np.all(weight[1:] == 1))
    # Compare in the table's dtype (exact): the hint is only a guess, so rounding
    # it to the table's values costs nothing but, at worst, a sorted column.
    h = np.asarray(hint).astype(cols.dtype)
    below = cols < h
    low, _ = _masked_weight(below, weight, unit_tail)  # L
    equal = cols == h
    tied, count = _masked_weight(equal, weight, unit_tail)  # E, their rows
    top = h.astype(np.float64)  # the group's value: the smallest upload >= hint
    moved = np.flatnonzero(count == 0)  # the hint is no upload: find the next one
    if moved.size:
        sub = cols[:, moved]
        above = np.min(sub, axis=0, where=sub >= h[moved], initial=np.inf)
        top[moved] = above
        again = sub == above.astype(cols.dtype)
        tied[moved], count[moved] = _masked_weight(again, weight, unit_tail)
        equal[0, moved] = again[0]  # row 0 in the group, for the ties below
    # A NaN guess compares false with everything: it locates nothing.
    ok = (count > 0) & ~np.isnan(h)
    if eta == 0 or total is None:  # the lower median's position
        need = (w - 1) // 2 + 1
        return top, ok & (low < need) & (need <= low + tied), top
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ok &= np.isfinite(total)
        # the test fails at the group's start: on (max below, top), or at the hint
        start = _right_derivative(low, h, total, lam, eta, w) < 0
        check = np.flatnonzero(ok & ~start & (low > 0))
        if check.size:
            sub = cols[:, check]
            under = np.max(sub, axis=0, where=sub < h[check], initial=-np.inf)
            start[check] = (
                _right_derivative(low[check], under, total[check], lam, eta, w) < 0
            )
        start |= low == 0
        end = _right_derivative(low + tied, top, total, lam, eta, w) >= 0
        ok &= start & end
        before = low.copy()  # the group's first row sorted first: W_{q*-1} = L
        ties = np.flatnonzero(ok & (count > 1))
        if ties.size:
            if not unit_tail:
                ok[ties] = False
            else:
                ok[ties], before[ties] = _position_in_ties(
                    low[ties],
                    np.where(equal[0, ties], weight[0], 1.0),
                    count[ties],
                    top[ties],
                    total[ties],
                    lam,
                    eta,
                    w,
                )
        interior = (total - (lam / eta) * (2 * before - w)) / w
        # Not certified: the stationary point of the piece just below the group
        # (the optimum is below it) or just above (above it).
        guess = np.where(
            start, (total - (lam / eta) * (2 * (low + tied) - w)) / w, interior
        )
    return np.minimum(interior, top), ok, guess


def _position_in_ties(
    low: NDArray[np.float64],
    first_weight: NDArray[np.float64],
    count: NDArray[np.int64],
    value: NDArray[np.float64],
    total: NDArray[np.float64],
    lam: float,
    eta: float,
    w: int,
) -> tuple[NDArray[np.bool_], NDArray[np.float64]]:
    """Find where in a group of ties the sorted test first holds; check it.

    The group's k-th row sorted ends at weight ``low + first_weight + k - 1``
    (the rest weigh 1): ``k`` is solved from the test's linear form, then the
    test itself (:func:`_right_derivative`) is evaluated at ``k`` and ``k - 1``.

    Parameters
    ----------
    low : ndarray, float64
        The weight below the group (``L``), per column.
    first_weight : ndarray, float64
        The weight of the group's first row (row 0's when it is tied, else 1).
    count : ndarray, int64
        The group's rows.
    value : ndarray, float64
        The group's value.
    total : ndarray, float64
        The weighted sum of the uploads.
    lam, eta : float
        As :func:`elastic_net_center`; ``eta`` > 0.
    w : int
        The total weight.

    Returns
    -------
    tuple[ndarray, ndarray]
        Whether the solved ``k`` passes the test and its predecessor fails it,
        and the weight sorted before the k-th row (:math:`W_{q^*-1}`).
    """
    offset = low + first_weight - 1  # the k-th row ends at offset + k
    if lam == 0:
        k = np.ones(len(low))
    else:
        at = eta * (w * value - total)
        k = np.ceil((w - at / lam) / 2 - offset)
    k = np.clip(np.nan_to_num(k, nan=1.0), 1, count)
    holds = _right_derivative(offset + k, value, total, lam, eta, w) >= 0
    fails = _right_derivative(offset + k - 1, value, total, lam, eta, w) < 0
    first = k == 1
    return holds & (first | fails), np.where(first, low, offset + k - 1)


def elastic_net_center(
    uploads: NDArray[np.floating],
    lam: float,
    eta: float,
    *,
    hint: NDArray[np.floating] | None = None,
    block: int = 1 << 14,
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
    hint : ndarray, shape uploads.shape[1:], optional
        A guess of the centre (the previous round's, when few uploads changed).
        None: sort every coordinate's uploads. Given: the coordinates where the
        guess locates the solution are solved without sorting (see
        :func:`weighted_elastic_net_center`), the others sorted. The result
        does not depend on the guess; it differs from the unhinted one by the
        order of one float sum only (the uploads' total, summed in row order
        instead of sorted order).
    block : int (default: 16384)
        Coordinates processed at once when ``hint`` is given.

    Returns
    -------
    ndarray, shape uploads.shape[1:], float64
        The minimiser for every coordinate.
    """
    _check_penalties(lam, eta)
    z = np.asarray(uploads)
    if z.ndim == 0 or z.shape[0] == 0:
        raise ValueError("need at least one upload")
    m = z.shape[0]
    if hint is None or not np.issubdtype(z.dtype, np.floating):
        flat = np.asarray(z, dtype=np.float64).reshape(m, -1)
        return _sorted_center(flat, lam, eta).reshape(z.shape[1:])
    flat = z.reshape(m, -1)
    guess = np.broadcast_to(np.asarray(hint), z.shape[1:]).reshape(-1)
    out = np.empty(flat.shape[1], dtype=np.float64)
    weight = np.ones(m)
    for start in range(0, flat.shape[1], block):
        cols = flat[:, start : start + block]
        with np.errstate(invalid="ignore", over="ignore"):
            total = None if eta == 0 else cols.sum(axis=0, dtype=np.float64)
        got, ok = _certified_center(
            cols, weight, total, lam, eta, guess[start : start + block]
        )
        sort = np.flatnonzero(~ok)
        if sort.size:
            # With the row-order total too: the result depends on the table only.
            got[sort] = _sorted_weighted_center(
                np.asarray(cols[:, sort], dtype=np.float64),
                weight,
                None if total is None else total[sort],
                lam,
                eta,
            )
        out[start : start + block] = got
    return out.reshape(z.shape[1:])


def weighted_elastic_net_center(
    uploads: NDArray[np.floating],
    weights: NDArray[np.integer] | list[int],
    lam: float,
    eta: float,
    block: int = 1 << 14,
    *,
    hint: NDArray[np.floating] | None = None,
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
    hint : ndarray, shape uploads.shape[1:], optional
        A guess of the centre (the previous round's). None: sort every
        coordinate's uploads. Given: a coordinate is solved without sorting
        when the guess locates its solution (two comparisons of the table with
        the guess certify it, ties included), and sorted otherwise; the result
        is the same bits either way, only faster when the solution has not
        moved past another upload (FedEPM's table between rounds).

    Returns
    -------
    ndarray, shape uploads.shape[1:], float64
        The minimiser for every coordinate; equal to
        ``elastic_net_center(np.repeat(uploads, weights, axis=0), lam, eta)`` up
        to the order of float additions.
    """
    _check_penalties(lam, eta)
    z = np.asarray(uploads)
    w = np.asarray(weights)
    if z.ndim == 0 or z.shape[0] == 0:
        raise ValueError("need at least one upload")
    if w.shape != (z.shape[0],) or not np.issubdtype(w.dtype, np.integer):
        raise ValueError(f"need one integer weight per row, got {w!r}")
    if np.any(w < 1):
        raise ValueError(f"weights must be >= 1, got {w.min()}")
    r = z.shape[0]
    flat = z.reshape(r, -1)
    out = np.empty(flat.shape[1], dtype=np.float64)
    weight = w.astype(np.float64)
    guess = None
    if hint is not None and np.issubdtype(z.dtype, np.floating):
        guess = np.broadcast_to(np.asarray(hint), z.shape[1:]).reshape(-1)
    for start in range(0, flat.shape[1], block):
        cols = np.asarray(flat[:, start : start + block], dtype=np.float64)
        total = None
        if eta != 0:
            with np.errstate(invalid="ignore", over="ignore"):
                total = weight @ cols
        if guess is None:
            out[start : start + block] = _sorted_weighted_center(
                cols, weight, total, lam, eta
            )
            continue
        got, ok = _certified_center(
            flat[:, start : start + block],
            weight,
            total,
            lam,
            eta,
            guess[start : start + block],
        )
        sort = np.flatnonzero(~ok)
        if sort.size:
            got[sort] = _sorted_weighted_center(
                cols[:, sort],
                weight,
                None if total is None else total[sort],
                lam,
                eta,
            )
        out[start : start + block] = got
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


def table_center(
    table: NDArray,
    lam: float,
    eta: float,
    unseen: int | None,
    hint: NDArray | None = None,
) -> NDArray:
    """Return the elastic-net centre of a table of uploads, one row per client.

    Parameters
    ----------
    table : ndarray, shape (rows, ...)
        The uploads, one row per slot.
    lam, eta : float
        As :func:`elastic_net_center`.
    unseen : int | None
        None: every row is a client's ("dense"); else row 0 is the initial
        model, standing for the ``unseen`` clients that still hold it ("seen"),
        and weighs as many.
    hint : ndarray, shape table.shape[1:], optional
        A guess of the centre (the current model), which spares sorting the
        coordinates it locates; the result does not depend on it (see
        :func:`weighted_elastic_net_center`).

    Returns
    -------
    ndarray, shape table.shape[1:], float64
        The centre.
    """
    if unseen is None:
        return elastic_net_center(table, lam, eta, hint=hint)
    if unseen > 0:
        weights = np.ones(len(table), dtype=np.int64)
        weights[0] = unseen
        return weighted_elastic_net_center(table, weights, lam, eta, hint=hint)
    return elastic_net_center(table[1:], lam, eta, hint=hint)

"""Weighted averaging of model arrays, in place into one accumulator.

Pure numpy: nothing here knows Flower. The strategies validate replies first and
then fold the replies' arrays into :class:`WeightedMean`, which holds exactly
one accumulator the size of the model. No per-reply copy is kept, so memory is
independent of the number of clients. Replies arrive one at a time
(:meth:`WeightedMean.add`) or all at once, as zero-copy views
(:meth:`WeightedMean.add_all`, what the strategies use): then the accumulator is
swept block by block, each block taking every reply's contribution while it is
in cache, with the same sum, element by element, as reply after reply.

Overflow. When the total weight is known in advance (``total=``, as the
strategies know it), every contribution is added as ``(w / total) * x``: the
accumulator then holds a convex combination, never larger in magnitude than the
largest input, so finite inputs cannot overflow it (one client's finite 3e38 in
float32 gives the true mean, as Flower's ``FedAvg``, which also normalises the
weights first). Without ``total``, weights are applied as given and the sum is
divided once at the end. ``accumulate_in=np.float64`` accumulates narrower
floats in float64 and rounds once at the end (the strategies' exact fallback).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numpy.typing import DTypeLike, NDArray

from .cpus import available_cpus

# Blocks of this many elements bound the scaled temporary to 1-2 MB, so
# `acc += w * x` needs no model-sized temporary; smaller blocks cost Python
# overhead, larger ones gain nothing (benchmarks/aggregate.py).
_BLOCK = 1 << 18
# Bytes of one accumulator block in add_all: the block and its scratch (twice
# this) stay in a core's L2 (1-2 MB) while every reply is added to them, so the
# accumulator is read and written once per round instead of once per reply;
# smaller blocks pay two numpy calls per reply and block in Python
# (benchmarks/aggregate.py).
_SWEEP_BYTES = 1 << 18
# The fewest accumulator blocks a sweep thread takes: a thread is worth its
# start (~0.1 ms) only over a few blocks.
_SPAN_BLOCKS = 4


class ZeroTotalWeightError(ValueError):
    """Raised when every contribution to a weighted mean has zero weight."""


def add_scaled_(acc: NDArray, x: NDArray, weight: float) -> None:
    """Accumulate ``acc += weight * x`` in place, block by block.

    Parameters
    ----------
    acc : NDArray
        Accumulator, modified in place. Must be contiguous.
    x : NDArray
        Same shape as ``acc``; any dtype castable to ``acc.dtype``.
    weight : float
        Scalar weight.
    """
    if acc.shape != x.shape:
        raise ValueError(f"shape mismatch: accumulator {acc.shape} vs array {x.shape}")
    flat_acc = acc.reshape(-1)
    flat_x = x.reshape(-1)
    w = acc.dtype.type(weight)
    n = flat_acc.size
    if n <= _BLOCK:
        flat_acc += w * flat_x
        return
    scratch = np.empty(_BLOCK, dtype=acc.dtype)
    for start in range(0, n, _BLOCK):
        stop = min(start + _BLOCK, n)
        part = scratch[: stop - start]
        np.multiply(flat_x[start:stop], w, out=part, casting="unsafe")
        flat_acc[start:stop] += part


def sweep_threads() -> int:
    """Return the threads a sweep may use: the run's CPU share, at most 4.

    ``OMP_NUM_THREADS`` when set (what the pack's runs, Ray's actors and
    Hydra's parallel sweeps set to a run's share of the CPUs; numpy's BLAS
    reads it too), else the CPUs this process may run on. At most 4: a
    sweep reads every reply once, and a few cores already draw what memory
    can give.
    """
    share = os.environ.get("OMP_NUM_THREADS", "")
    cpus = int(share) if share.isdigit() else available_cpus()
    return max(1, min(cpus, 4))


def sweep_scaled_(
    acc: NDArray,
    arrays: Sequence[NDArray],
    weights: Sequence[float],
    *,
    overwrite: bool,
    threads: int = 1,
) -> None:
    """Accumulate ``acc += sum_i weights[i] * arrays[i]`` in place, block-outer.

    Each element gets exactly the roundings of :func:`add_scaled_` called on
    each array in turn: ``weights[i] * arrays[i]`` rounded to ``acc.dtype``,
    then added, in the order of ``arrays``. Only the loops are swapped (blocks
    outside, arrays inside), so a block of ``acc`` stays in cache while every
    array is added to it. With ``threads > 1`` a large accumulator is cut into
    that many spans, swept at once (numpy releases the GIL): each element is
    still summed by one thread in the same order, so the result is the same
    bit for bit.

    Parameters
    ----------
    acc : NDArray
        Accumulator, modified in place. Must be contiguous.
    arrays : Sequence[NDArray]
        Arrays of ``acc``'s shape; any dtypes castable to ``acc.dtype``.
    weights : Sequence[float]
        One scalar weight per array.
    overwrite : bool
        True: ``acc``'s contents are ignored, its value becomes
        ``weights[0] * arrays[0]`` (rounded to ``acc.dtype``) plus the rest.
    threads : int (default: 1)
        Threads at most; fewer when the accumulator is too small to share
        (:func:`sweep_threads` gives the run's CPU share).
    """
    flat_acc = acc.reshape(-1)
    flats = [x.reshape(-1) for x in arrays]
    # Scalars of the accumulator's dtype, as add_scaled_: the products are
    # computed in the same precision, hence rounded the same.
    ws = [acc.dtype.type(weight) for weight in weights]
    n = flat_acc.size
    block = max(1, _SWEEP_BYTES // acc.dtype.itemsize)
    spans = max(1, min(threads, n // (_SPAN_BLOCKS * block)))
    if spans == 1 or len(flats) < 2:
        _sweep_span(flat_acc, flats, ws, 0, n, block, overwrite)
        return
    cuts = [n * i // spans // block * block for i in range(spans)] + [n]
    with ThreadPoolExecutor(spans) as pool:
        jobs = [
            pool.submit(_sweep_span, flat_acc, flats, ws, a, b, block, overwrite)
            for a, b in itertools.pairwise(cuts)
        ]
    for job in jobs:
        job.result()  # re-raises a thread's exception here


def _sweep_span(
    flat_acc: NDArray,
    flats: Sequence[NDArray],
    ws: Sequence[Any],
    begin: int,
    end: int,
    block: int,
    overwrite: bool,
) -> None:
    """Sweep ``flat_acc[begin:end]``: see :func:`sweep_scaled_`."""
    scratch = np.empty(min(block, end - begin), dtype=flat_acc.dtype)
    # NaN, inf and overflow propagate to the result, which callers check
    # (numpy's error state is per thread: set here, not by the caller).
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(begin, end, block):
            stop = min(start + block, end)
            part = flat_acc[start:stop]
            term = scratch[: stop - start]
            pairs = zip(flats, ws, strict=True)
            if overwrite:
                x, w = next(pairs)
                np.multiply(x[start:stop], w, out=part, casting="unsafe")
            for x, w in pairs:
                np.multiply(x[start:stop], w, out=term, casting="unsafe")
                np.add(part, term, out=part)


class WeightedMean:
    """Streaming weighted mean of lists (or dicts) of arrays.

    ``add(arrays, w)`` folds one contribution into the accumulator;
    ``result()`` divides by the total weight. Float arrays are accumulated in
    their own dtype (as Flower's ``FedAvg`` does) unless ``accumulate_in`` says
    otherwise; integer arrays in float64 and rounded back, so integer buffers
    (e.g. counters) keep their dtype.

    Parameters
    ----------
    total : float | None (default: None)
        The sum of the weights that will be added, when known. Each
        contribution is then scaled by ``w / total`` as it is added, so the
        accumulator never exceeds the largest input in magnitude (no overflow
        while the inputs are finite). ``result()`` divides by the share of
        ``total`` actually added (1 when every promised weight came).
    accumulate_in : numpy dtype | None (default: None)
        Dtype of the accumulator of float arrays (e.g. ``np.float64``: the mean
        of float32 arrays rounded once, at the end); None: each array's own.
    threads : int | None (default: None)
        Threads :meth:`add_all` may sweep a large array with (the result is
        the same bit for bit); None: the run's CPU share,
        :func:`sweep_threads`.

    Examples
    --------
    >>> m = WeightedMean()
    >>> m.add([np.array([1.0, 2.0])], 1.0)
    >>> m.add([np.array([3.0, 4.0])], 3.0)
    >>> m.result()[0]
    array([2.5, 3.5])
    """

    def __init__(
        self,
        *,
        total: float | None = None,
        accumulate_in: DTypeLike | None = None,
        threads: int | None = None,
    ) -> None:
        if total is not None and (not np.isfinite(total) or total < 0):
            raise ValueError(f"total must be finite and >= 0, got {total!r}")
        if threads is not None and (type(threads) is not int or threads < 1):
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.threads = sweep_threads() if threads is None else threads
        self._acc: dict[str, NDArray] | None = None
        self._dtypes: dict[str, np.dtype] = {}
        # Weights are divided by this as they are added (1: as given).
        self._scale = float(total) if total else 1.0
        self._accumulate_in = None if accumulate_in is None else np.dtype(accumulate_in)
        self.total_weight = 0.0
        self.count = 0

    def _acc_dtype(self, dtype: np.dtype) -> np.dtype:
        if not np.issubdtype(dtype, np.floating):
            return np.dtype(np.float64)
        wide = self._accumulate_in
        if wide is not None and np.finfo(wide).bits > np.finfo(dtype).bits:
            return wide
        return dtype

    def add(
        self, arrays: Mapping[str, NDArray] | Sequence[NDArray], weight: float
    ) -> None:
        """Fold ``weight * arrays`` into the accumulator."""
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
        items = _as_items(arrays)
        scaled = float(weight) / self._scale
        # NaN, inf and overflow propagate to the result, which callers check.
        with np.errstate(over="ignore", invalid="ignore"):
            self._fold(items, scaled)
        self.total_weight += float(weight)
        self.count += 1

    def add_all(
        self,
        contributions: Sequence[Mapping[str, NDArray] | Sequence[NDArray]],
        weights: Sequence[float],
    ) -> None:
        """Fold every ``weights[i] * contributions[i]`` into the accumulator.

        The result is bit for bit that of calling :meth:`add` on each in turn
        (the same roundings, in the same order, element by element), but the
        accumulator is swept once, block by block, each block taking every
        contribution while it is in cache: memory traffic is one read of each
        contribution, where :meth:`add` also reads and writes the accumulator
        once per contribution. Everything is checked before anything is added.

        Parameters
        ----------
        contributions : Sequence[Mapping[str, NDArray] | Sequence[NDArray]]
            The arrays of each contribution, all in memory (views are enough),
            with the same keys in the same order and the same shapes.
        weights : Sequence[float]
            One finite weight >= 0 per contribution.

        Raises
        ------
        ValueError
            On a bad weight, a contribution whose keys or shapes differ from
            the first one's, or not as many weights as contributions.
        """
        if len(contributions) != len(weights):
            raise ValueError(
                f"{len(contributions)} contributions for {len(weights)} weights"
            )
        values = [float(weight) for weight in weights]
        for weight, value in zip(weights, values, strict=True):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
        if not contributions:
            return
        columns = self._columns([_as_items(arrays) for arrays in contributions])
        scaled = [value / self._scale for value in values]
        first = self._acc is None
        if self._acc is None:
            self._acc = {}
            for key, arrays in columns.items():
                self._dtypes[key] = arrays[0].dtype
                acc_dtype = self._acc_dtype(arrays[0].dtype)
                self._acc[key] = np.empty(arrays[0].shape, dtype=acc_dtype)
        # NaN, inf and overflow propagate to the result, which callers check.
        with np.errstate(over="ignore", invalid="ignore"):
            for key, arrays in columns.items():
                sweep_scaled_(
                    self._acc[key],
                    arrays,
                    scaled,
                    overwrite=first,
                    threads=self.threads,
                )
        for value in values:  # one at a time, as add: the same rounded total
            self.total_weight += value
        self.count += len(values)

    def _columns(
        self, rows: list[list[tuple[str, NDArray]]]
    ) -> dict[str, list[NDArray]]:
        """Return key -> every contribution's array, after checking keys and shapes."""
        keys = [key for key, _ in rows[0]] if self._acc is None else list(self._acc)
        shapes = (
            {key: x.shape for key, x in rows[0]}
            if self._acc is None
            else {key: acc.shape for key, acc in self._acc.items()}
        )
        columns: dict[str, list[NDArray]] = {key: [] for key in keys}
        for row in rows:
            if [key for key, _ in row] != keys:
                raise ValueError("contribution keys differ from the first contribution")
            for key, x in row:
                if x.shape != shapes[key]:
                    raise ValueError(
                        f"shape mismatch: accumulator {shapes[key]} vs array {x.shape}"
                    )
                columns[key].append(x)
        return columns

    def _fold(self, items: list[tuple[str, NDArray]], scaled: float) -> None:
        if self._acc is None:
            self._acc = {}
            for key, x in items:
                acc_dtype = self._acc_dtype(x.dtype)
                self._dtypes[key] = x.dtype
                acc = np.empty(x.shape, dtype=acc_dtype)
                np.multiply(x, acc_dtype.type(scaled), out=acc, casting="unsafe")
                self._acc[key] = acc
        else:
            if [k for k, _ in items] != list(self._acc):
                raise ValueError("contribution keys differ from the first contribution")
            for key, x in items:
                add_scaled_(self._acc[key], x, scaled)

    def result(self) -> dict[str, NDArray]:
        """Return the weighted mean, keyed as the contributions were.

        Raises
        ------
        ZeroTotalWeightError
            If nothing was added or all weights were zero.
        """
        if self._acc is None or self.total_weight <= 0.0:
            raise ZeroTotalWeightError(
                f"weighted mean of {self.count} contribution(s) with total weight "
                f"{self.total_weight}: nothing to average"
            )
        share = self.total_weight / self._scale
        out: dict[str, NDArray] = {}
        for key, acc in self._acc.items():
            if share != 1.0:
                acc /= acc.dtype.type(share)
            dtype = self._dtypes[key]
            if acc.dtype == dtype:
                out[key] = acc
            elif np.issubdtype(dtype, np.floating):
                with np.errstate(over="ignore"):  # not representable: inf, checked
                    out[key] = acc.astype(dtype)
            else:
                out[key] = np.rint(acc).astype(dtype)
        return out


def _as_items(
    arrays: Mapping[str, NDArray] | Sequence[NDArray],
) -> list[tuple[str, NDArray]]:
    if isinstance(arrays, Mapping):
        return [(str(k), np.asarray(v)) for k, v in arrays.items()]
    return [(str(i), np.asarray(v)) for i, v in enumerate(arrays)]


def weighted_average(
    contributions: Iterable[Sequence[NDArray]], weights: Iterable[float]
) -> list[NDArray]:
    """Weighted mean of several lists of arrays (convenience over WeightedMean).

    Parameters
    ----------
    contributions : Iterable[Sequence[NDArray]]
        One list of arrays per contributor, all with the same shapes.
    weights : Iterable[float]
        One non-negative weight per contributor.

    Returns
    -------
    list[NDArray]
        ``sum_i w_i x_i / sum_i w_i``.
    """
    weights = [float(w) for w in weights]
    mean = WeightedMean(total=sum(weights))
    for arrays, weight in zip(contributions, weights, strict=True):
        mean.add(list(arrays), weight)
    return list(mean.result().values())


def divided_like(
    model: Mapping[str, NDArray], sums: Mapping[str, NDArray], total: float
) -> dict[str, NDArray]:
    """Return ``model`` with each array of ``sums`` divided by ``total``, in its dtype.

    A weighted sum kept in float64 becomes a model of the global one's dtypes;
    the arrays ``sums`` lacks stay ``model``'s.
    """
    new = dict(model)
    for key, value in sums.items():
        new[key] = (value / total).astype(model[key].dtype)
    return new


#: The metrics that add up over servers (counts); every other one is averaged.
SUMMED_METRICS = frozenset(
    {
        "replies-valid",
        "replies-failed",
        "replies-rejected",
        "replies-absent",
        "replies-capped",
        "bytes-sent",
        "bytes-received",
        "num-examples",
    }
)


def merge_metric_values(
    records: Iterable[Mapping[str, Any]], summed: Collection[str]
) -> dict[str, Any]:
    """Merge several sets of metrics into one.

    Keys in ``summed`` add up (integers but ``num-examples``), ``*-max`` takes
    the max, ``*-min`` / ``*-worst`` the min, and every other metric is
    averaged weighted by each set's ``num-examples`` (1 when absent). Lists and
    booleans are skipped.
    """
    merged: dict[str, Any] = {}
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    extremes: dict[str, float] = {}
    for record in records:
        weight = float(record.get("num-examples", 1.0))
        for key, value in record.items():
            if isinstance(value, (list, bool)):
                continue
            if key.endswith("-max"):
                extremes[key] = max(extremes.get(key, -math.inf), float(value))
            elif key.endswith(("-min", "-worst")):
                extremes[key] = min(extremes.get(key, math.inf), float(value))
            elif key in summed:
                sums[key] = sums.get(key, 0.0) + float(value)
                weights[key] = 1.0
            else:
                sums[key] = sums.get(key, 0.0) + weight * float(value)
                weights[key] = weights.get(key, 0.0) + weight
    for key, total in sums.items():
        value = total if key in summed else total / weights[key]
        merged[key] = int(value) if key in summed and key != "num-examples" else value
    merged.update(extremes)
    return merged

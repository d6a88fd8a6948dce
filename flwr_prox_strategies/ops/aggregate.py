"""Weighted averaging of model arrays, in place into one accumulator.

Pure numpy: nothing here knows Flower. The strategies validate replies first and
then stream each reply's arrays into :class:`WeightedMean`, which holds exactly
one accumulator the size of the model. No per-reply copy is kept, so memory is
independent of the number of clients.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

# Blocks of this many elements bound the scaled temporary to 1-2 MB, so
# `acc += w * x` needs no model-sized temporary; smaller blocks cost Python
# overhead, larger ones gain nothing (benchmarks/aggregate.py).
_BLOCK = 1 << 18


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


class WeightedMean:
    """Streaming weighted mean of lists (or dicts) of arrays.

    ``add(arrays, w)`` folds one contribution into the accumulator;
    ``result()`` divides by the total weight. Float arrays are accumulated in
    their own dtype (as Flower's ``FedAvg`` does); integer arrays in float64 and
    rounded back, so integer buffers (e.g. counters) keep their dtype.

    Examples
    --------
    >>> m = WeightedMean()
    >>> m.add([np.array([1.0, 2.0])], 1.0)
    >>> m.add([np.array([3.0, 4.0])], 3.0)
    >>> m.result()[0]
    array([2.5, 3.5])
    """

    def __init__(self) -> None:
        self._acc: dict[str, NDArray] | None = None
        self._dtypes: dict[str, np.dtype] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(
        self, arrays: Mapping[str, NDArray] | Sequence[NDArray], weight: float
    ) -> None:
        """Fold ``weight * arrays`` into the accumulator."""
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"weight must be finite and >= 0, got {weight!r}")
        items = _as_items(arrays)
        if self._acc is None:
            self._acc = {}
            for key, x in items:
                floating = np.issubdtype(x.dtype, np.floating)
                acc_dtype = x.dtype if floating else np.dtype(np.float64)
                self._dtypes[key] = x.dtype
                acc = np.empty(x.shape, dtype=acc_dtype)
                np.multiply(x, acc_dtype.type(weight), out=acc, casting="unsafe")
                self._acc[key] = acc
        else:
            if [k for k, _ in items] != list(self._acc):
                raise ValueError("contribution keys differ from the first contribution")
            for key, x in items:
                add_scaled_(self._acc[key], x, weight)
        self.total_weight += float(weight)
        self.count += 1

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
        out: dict[str, NDArray] = {}
        for key, acc in self._acc.items():
            acc /= acc.dtype.type(self.total_weight)
            dtype = self._dtypes[key]
            out[key] = acc if acc.dtype == dtype else np.rint(acc).astype(dtype)
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
    mean = WeightedMean()
    for arrays, weight in zip(contributions, weights, strict=True):
        mean.add(list(arrays), weight)
    return list(mean.result().values())

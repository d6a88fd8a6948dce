r"""The server control variate of SCAFFOLD (option II) and of FedDC's official form.

:math:`c`, the mean over **all** :math:`N` clients of their control variates, its
update and its rescaling when :math:`N` grows: ``docs/algorithms/scaffold.md``. Pure
numpy on name -> array mappings: :math:`c` holds every array of the model (zeros for
integer buffers, which clients ignore), and only the floating ones are updated. Every
function returns new arrays and leaves its inputs untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import overload

import numpy as np
from numpy.typing import NDArray


def _floating(arrays: Mapping[str, NDArray]) -> list[str]:
    return [k for k, v in arrays.items() if np.issubdtype(v.dtype, np.floating)]


def zeros_like(model: Mapping[str, NDArray]) -> dict[str, NDArray]:
    """Return :math:`c = 0`, shaped and typed like every array of ``model``."""
    return {key: np.zeros_like(value) for key, value in model.items()}


def control_update(
    c: Mapping[str, NDArray],
    deltas: Iterable[Mapping[str, NDArray]],
    num_clients: int,
    scale: Sequence[float] | None = None,
) -> dict[str, NDArray]:
    r"""Return :math:`c + \frac{1}{N}\sum_i s_i\,\Delta c_i` (new arrays).

    Parameters
    ----------
    c : Mapping[str, NDArray]
        The current control variate.
    deltas : Iterable[Mapping[str, NDArray]]
        The participants' :math:`\Delta c_i`, keyed as ``c``.
    num_clients : int
        :math:`N`, the number of all clients (not of the participants).
    scale : Sequence[float] | None (default: None)
        A weight :math:`s_i` per delta, in the order of ``deltas``; None: 1 each.

    Returns
    -------
    dict[str, NDArray]
        The new :math:`c`, in the dtypes of ``c``; non-floating arrays copied.
    """
    new = {key: value.copy() for key, value in c.items()}
    keys = _floating(new)
    deltas = list(deltas)
    weights = [1.0] * len(deltas) if scale is None else list(scale)
    if len(weights) != len(deltas):
        raise ValueError(f"{len(weights)} scale weight(s) for {len(deltas)} deltas")
    for delta, weight in zip(deltas, weights, strict=True):
        for key in keys:
            new[key] += (weight / num_clients) * delta[key]
    return new


@overload
def rescaled(c: None, factor: float) -> None: ...
@overload
def rescaled(c: Mapping[str, NDArray], factor: float) -> dict[str, NDArray]: ...
def rescaled(
    c: Mapping[str, NDArray] | None, factor: float
) -> dict[str, NDArray] | None:
    """Return ``c * factor`` on the floating arrays (dtypes kept), others copied.

    None (no round configured yet) stays None.
    """
    if c is None:
        return None
    keys = set(_floating(c))
    return {
        key: (value * factor).astype(value.dtype) if key in keys else value.copy()
        for key, value in c.items()
    }

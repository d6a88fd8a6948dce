r"""The drift sum FedDyn and FedDC keep, and the model it corrects.

Both algorithms keep, instead of one drift per client, the running sum over
**all** clients :math:`\Lambda = \sum_k \lambda_k`, advanced by the round's
participants: :math:`\Lambda^{t+1} = \Lambda^t + \sum_{k\in S_t}(\theta_k -
\theta^t)` (a client outside :math:`S_t` keeps its drift, so the sum keeps
it too), and send :math:`\mathrm{mean}_{S_t}\theta_k + \Lambda^{t+1}/N`.
Pure numpy on name -> array mappings; only the floating arrays take part.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from numpy.typing import NDArray


def drift_sum(
    previous: Mapping[str, NDArray] | None,
    theta_t: Mapping[str, NDArray],
    models: Iterable[Mapping[str, NDArray]],
) -> dict[str, NDArray]:
    r"""Return :math:`\Lambda + \sum_k(\theta_k - \theta^t)` (new arrays).

    ``previous=None`` (or empty) starts from zero. An overflow gives inf, which
    the caller's finiteness check rejects, so it is not warned about here.
    """
    keys = [k for k, v in theta_t.items() if np.issubdtype(v.dtype, np.floating)]
    if previous:
        total = {k: np.array(v, copy=True) for k, v in previous.items()}
    else:
        total = {k: np.zeros_like(theta_t[k]) for k in keys}
    with np.errstate(over="ignore", invalid="ignore"):
        for model in models:
            for key in keys:
                total[key] += model[key] - theta_t[key]
    return total


def drift_corrected(
    average: Mapping[str, NDArray], drift: Mapping[str, NDArray], num_clients: int
) -> dict[str, NDArray]:
    r"""Return :math:`\bar\theta + \Lambda/N`, in the dtypes of ``average``."""
    model = dict(average)
    for key, value in drift.items():
        model[key] = model[key] + (value / num_clients).astype(model[key].dtype)
    return model


def summed(
    start: Mapping[str, NDArray], changes: Iterable[Mapping[str, NDArray]]
) -> dict[str, NDArray]:
    """Return ``start + sum(changes)`` over the keys of ``start`` (new arrays)."""
    total = {k: np.array(v, copy=True) for k, v in start.items()}
    for change in changes:
        for key in total:
            total[key] += change[key]
    return total


def norm(arrays: Mapping[str, NDArray]) -> float:
    """Return the Euclidean norm of all arrays taken as one vector."""
    return float(np.sqrt(sum(float(np.sum(v**2)) for v in arrays.values())))

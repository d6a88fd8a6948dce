r"""APFL's weighted averages (Deng et al., 2020): the weights and the server's sum.

The weights :math:`p_t = (t + a)^2` of the averaged models and the server's
running sum of :math:`p`-weighted means, in numpy: the server half of APFL's
maths, apart from the clients' torch maths (:mod:`.apfl`) so that a ServerApp
never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray


def averaging_weight(step: int, a: float) -> float:
    r"""Return :math:`p_t = (t + a)^2`, the weight of step :math:`t` (from 1)."""
    return (step + a) ** 2


def averaging_weight_sum(first: int, last: int, a: float) -> float:
    r"""Return :math:`\sum_{t=first}^{last}(t + a)^2` (0 when ``last < first``)."""
    if last < first:
        return 0.0
    if first < 1:
        raise ValueError(f"steps are counted from 1, got first={first}")

    def squares(n: int) -> int:  # 1^2 + ... + n^2, exact in integers
        return n * (n + 1) * (2 * n + 1) // 6

    def naturals(n: int) -> int:
        return n * (n + 1) // 2

    count = last - first + 1
    return float(
        squares(last)
        - squares(first - 1)
        + 2 * a * (naturals(last) - naturals(first - 1))
        + count * a * a
    )


def average_offset(condition_number: float, sync_gap: int) -> float:
    r"""Return :math:`a = \max(128\kappa, \tau)`, the offset in :math:`\eta_t, p_t`."""
    return max(128.0 * condition_number, float(sync_gap))


def add_weighted(
    total: Mapping[str, NDArray] | None, mean: Mapping[str, NDArray], weight: float
) -> dict[str, NDArray]:
    r"""Return ``total + weight * mean`` in float64 (``total=None``: from zero).

    The server's :math:`\sum_t p_t\,\mathrm{mean}_S\theta_k^t`, one round's
    :math:`p`-weighted mean (``mean``, weighted by the round's
    :math:`\sum p_t`) at a time.
    """
    if total is None:
        new = {key: np.zeros(value.shape, np.float64) for key, value in mean.items()}
    else:
        new = {key: np.array(value, copy=True) for key, value in total.items()}
    for key, value in mean.items():
        new[key] += weight * value
    return new

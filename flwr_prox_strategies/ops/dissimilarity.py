"""The FedProx paper's bounded-dissimilarity measure B(theta).

``B(theta) = E_k ||grad f_k(theta)||^2 / ||grad f(theta)||^2`` with
``grad f = E_k grad f_k`` and the expectation over clients weighted by their
share of the data (the paper's B-local dissimilarity, Section 4: T. Li et al.,
"Federated Optimization in Heterogeneous Networks", MLSys 2020). B = 1 when
all clients agree; it grows with heterogeneity.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray


def sq_norm(arrays: Sequence[NDArray]) -> float:
    """Squared Euclidean norm of a list of arrays seen as one vector (float64)."""
    total = 0.0
    for a in arrays:
        flat = np.asarray(a, dtype=np.float64).reshape(-1)
        total += float(np.dot(flat, flat))
    return total


def dissimilarity(
    mean_of_sq_norms: float, sq_norm_of_mean: float, *, eps: float = 1e-30
) -> float:
    """Return ``B = E||g_k||^2 / ||E g_k||^2`` (inf when the mean gradient is 0)."""
    if mean_of_sq_norms < 0 or sq_norm_of_mean < 0:
        raise ValueError("squared norms must be >= 0")
    if sq_norm_of_mean <= eps:
        return float("inf")
    return mean_of_sq_norms / sq_norm_of_mean

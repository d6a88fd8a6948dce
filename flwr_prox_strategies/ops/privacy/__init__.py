r"""Noise for privacy: Laplace on uploads here; distributed DP's integer pieces beside.

An upload :math:`u` whose L1 sensitivity (the largest change of :math:`u`, in
the L1 norm, when one sample of the client's data changes) is :math:`\Delta`
is :math:`\varepsilon`-differentially private once every coordinate gets
independent :math:`\mathrm{Laplace}(0, b)` noise with :math:`b = \Delta /
\varepsilon` (Dwork & Roth, Thm. 3.6). Uploads compose: a client that uploads
:math:`T` times spends at most :math:`\sum_t \varepsilon_t` (basic composition).

Distributed DP under secure aggregation (Kairouz, Liu & Steinke, ICML 2021;
Agarwal, Kairouz & Liu, NeurIPS 2021) needs integer uploads: each client clips
its update, rotates, scales and rounds it (:mod:`.quantise`), adds integer noise
(:mod:`.noise`) and wraps it into :math:`\mathbb{Z}_{2^b}`; the server unwraps
the modular sum and undoes the scaling and the rotation; :mod:`.encoding` does
both for a whole upload (every summed record at once). :mod:`.accounting` gives
the privacy of the noisy sum (Renyi DP per round, composition, epsilon).
:class:`~flwr_prox_strategies.DistributedDP` puts them to work under SecAgg+.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray


def laplace_scale(sensitivity: float, epsilon: float) -> float:
    r"""Return the scale :math:`b = \Delta/\varepsilon` giving pure epsilon-DP."""
    if not (np.isfinite(sensitivity) and sensitivity >= 0):
        raise ValueError(f"sensitivity must be finite and >= 0, got {sensitivity!r}")
    if not (np.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon!r}")
    return float(sensitivity) / float(epsilon)


def add_laplace_noise(
    arrays: Sequence[NDArray[np.floating]], scale: float, rng: np.random.Generator
) -> list[NDArray[np.floating]]:
    """Return copies of ``arrays`` with i.i.d. ``Laplace(0, scale)`` noise added.

    The noise is drawn in float64 and the result cast back to each array's
    dtype; ``scale = 0`` returns exact copies.
    """
    if not (np.isfinite(scale) and scale >= 0):
        raise ValueError(f"scale must be finite and >= 0, got {scale!r}")
    noisy = []
    for array in arrays:
        value = np.asarray(array)
        if scale == 0 or not np.issubdtype(value.dtype, np.floating):
            noisy.append(value.copy())
            continue
        noise = rng.laplace(0.0, scale, size=value.shape)
        noisy.append((value.astype(np.float64) + noise).astype(value.dtype))
    return noisy

r"""Privacy accounting for distributed DP: Renyi DP of the noisy sum, then epsilon.

Each of :math:`n` clients adds integer noise to its rounded upload and secure
aggregation reveals only the sum, so the sum carries the noise of every
contributor. The bounds here give the Renyi DP (RDP) of that sum for one round:

* :func:`ddg_rdp`: the distributed discrete Gaussian (every client adds
  :math:`N_\mathbb{Z}(0, \sigma^2)` per coordinate; Kairouz, Liu & Steinke,
  "The Distributed Discrete Gaussian Mechanism for Federated Learning with
  Secure Aggregation", ICML 2021, arXiv:2102.06387);
* :func:`skellam_rdp`: the Skellam mechanism (the sum of Skellam noise is
  Skellam with the summed variance :math:`\mu`; Agarwal, Kairouz & Liu, "The
  Skellam Mechanism for Differentially Private Federated Learning", NeurIPS
  2021, arXiv:2110.04995).

RDP composes by addition (Mironov, "Renyi Differential Privacy", CSF 2017): a
client that takes part in :math:`T` rounds spends :func:`compose` ``(rdp, T)``.
:func:`rdp_to_epsilon` turns the total into :math:`(\varepsilon, \delta)`-DP.

Scope. The neighbouring relation is adding or removing one client (its whole
upload); the sensitivities are those of one client's integer upload after
scaling and rounding (:func:`.quantise.rounding_norm_bound` gives
:math:`\Delta_2`; :func:`integer_l1_bound` a matching :math:`\Delta_1`). There is
no amplification by sampling: a client is charged every round it takes part in,
as if participation were fixed. With dropouts the caller passes the smallest
number of clients whose noise a revealed sum can hold
(:func:`smallest_contributors`), never the number sampled.

Orders. The bounds are charged at integer orders (the setting in which the
authors evaluate them); a fractional order :math:`\alpha` is charged the bound
at :math:`\lceil\alpha\rceil`, which is valid because Renyi divergence does not
decrease with its order (van Erven & Harremoës, IEEE Trans. Inf. Theory 2014).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from ..checks import (
    check_int,
    check_non_negative,
    check_positive,
    check_probability,
)

#: The RDP orders used when none are given: fine steps near 1, the integers to 63
#: and a few large orders (the grid dp-accounting's RdpAccountant uses by default).
DEFAULT_ORDERS: tuple[float, ...] = (
    *(1 + x / 10 for x in range(1, 100)),
    *(float(a) for a in range(11, 64)),
    128.0,
    256.0,
    512.0,
    1024.0,
)


def _orders(orders: ArrayLike) -> NDArray[np.float64]:
    """Return the orders as a 1-D float array, all finite and > 1, else raise."""
    try:
        values = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    except (TypeError, ValueError) as error:
        raise ValueError(f"orders must be numbers > 1, got {orders!r}") from error
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"orders must be a non-empty 1-D sequence, got {orders!r}")
    if not (np.all(np.isfinite(values)) and np.all(values > 1)):
        raise ValueError(f"orders must be finite and > 1, got {orders!r}")
    return values


def _rdp(rdp: ArrayLike) -> NDArray[np.float64]:
    """Return the RDP values as a 1-D float array, none NaN or negative, else raise."""
    values = np.atleast_1d(np.asarray(rdp, dtype=np.float64))
    if np.any(np.isnan(values)) or np.any(values < 0):
        raise ValueError(f"rdp must be >= 0, got {rdp!r}")
    return values


def ddg_tau(sigma2: float, num_clients: int) -> float:
    r"""Return :math:`\tau`, how far a sum of discrete Gaussians is from one.

    The sum of :math:`n` independent :math:`N_\mathbb{Z}(0, \sigma^2)` is not a
    discrete Gaussian; Kairouz, Liu & Steinke (ICML 2021) bound its distance from
    :math:`N_\mathbb{Z}(0, n\sigma^2)` through

    .. math::

        \tau = 10 \sum_{k=1}^{n-1}
        \exp\left(-2\pi^2\sigma^2 \frac{k}{k+1}\right),

    which is 0 for one client and negligible once :math:`\sigma^2 \gtrsim 1`.

    Parameters
    ----------
    sigma2 : float
        Each client's discrete Gaussian parameter :math:`\sigma^2 > 0` (in the
        integer domain, after scaling).
    num_clients : int
        :math:`n \geq 1`, the number of noise shares in the sum.

    Returns
    -------
    float
        :math:`\tau \geq 0`.

    Raises
    ------
    ValueError
        ``sigma2`` not > 0, ``num_clients`` not an int >= 1.
    """
    s2 = check_positive("sigma2", sigma2)
    n = check_int("num_clients", num_clients, 1)
    k = np.arange(1, n, dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * s2 * k / (k + 1.0))))


def integer_l1_bound(l2_sensitivity: float, dim: int) -> float:
    r"""Return an L1 bound for an integer vector of L2 norm :math:`\Delta_2`.

    :math:`\|x\|_1 \leq \sqrt d \|x\|_2` for every :math:`x \in \mathbb{R}^d`
    (Cauchy-Schwarz), and :math:`\|x\|_1 = \sum_i |x_i| \leq \sum_i x_i^2 =
    \|x\|_2^2` when every coordinate is an integer, so
    :math:`\Delta_1 = \Delta_2 \min(\sqrt d, \Delta_2)`.

    Parameters
    ----------
    l2_sensitivity : float
        :math:`\Delta_2 \geq 0`, the L2 bound of one client's integer upload.
    dim : int
        The dimension :math:`d \geq 1`.

    Returns
    -------
    float
        :math:`\Delta_1`.

    Raises
    ------
    ValueError
        ``l2_sensitivity`` negative or not finite, ``dim`` not an int >= 1.
    """
    l2 = check_non_negative("l2_sensitivity", l2_sensitivity)
    d = check_int("dim", dim, 1)
    return l2 * min(math.sqrt(d), l2)


def ddg_rdp(
    orders: ArrayLike = DEFAULT_ORDERS,
    *,
    l2_sensitivity: float,
    l1_sensitivity: float,
    sigma2: float,
    num_clients: int,
    dim: int,
) -> NDArray[np.float64]:
    r"""Return the RDP of one round of the distributed discrete Gaussian.

    Each of :math:`n` clients adds :math:`N_\mathbb{Z}(0, \sigma^2)` to every one
    of the :math:`d` coordinates of its integer upload; the server sees only the
    sum. With :math:`\tau` from :func:`ddg_tau`, :math:`s = \sqrt{n}\sigma` and
    one client's sensitivities :math:`\Delta_2`, :math:`\Delta_1`, the sum is
    :math:`(\alpha, \varepsilon(\alpha))`-RDP with (Kairouz, Liu & Steinke,
    ICML 2021, arXiv:2102.06387: the RDP bound for sums of discrete Gaussians
    that their accounting code evaluates, the refinement of their main theorem's
    concentrated-DP guarantee)

    .. math::

        \varepsilon(\alpha) = \min\left\{
        \frac{\alpha\Delta_2^2}{2 s^2} + \tau d,\;
        \frac{\alpha}{2}\left(\frac{\Delta_2^2}{s^2}
        + \frac{2\Delta_1\tau}{s} + \tau^2 d\right),\;
        \frac{\alpha}{2}\left(\frac{\Delta_2}{s} + \tau\sqrt d\right)^2
        \right\}.

    With :math:`\tau = 0` (one client, or :math:`\sigma^2` large) every term is
    the continuous Gaussian's :math:`\alpha\Delta_2^2 / (2 n\sigma^2)`; the
    discrete Gaussian's own bound (Canonne, Kamath & Steinke, NeurIPS 2020) is
    the case :math:`n = 1`. The bound never falls below the Gaussian's.

    Parameters
    ----------
    orders : array_like of float (default: :data:`DEFAULT_ORDERS`)
        RDP orders :math:`\alpha > 1`; a fractional order is charged at
        :math:`\lceil\alpha\rceil` (the module's note on orders).
    l2_sensitivity : float
        :math:`\Delta_2 \geq 0`, the L2 bound of one client's integer upload
        (e.g. :func:`.quantise.rounding_norm_bound`).
    l1_sensitivity : float
        :math:`\Delta_1 \geq 0`, its L1 bound (e.g. :func:`integer_l1_bound`).
    sigma2 : float
        Each client's :math:`\sigma^2 > 0`, in the integer domain.
    num_clients : int
        :math:`n \geq 1`, the fewest clients whose noise the revealed sum holds
        (:func:`smallest_contributors`).
    dim : int
        The dimension :math:`d \geq 1` of the upload (after padding).

    Returns
    -------
    numpy.ndarray
        :math:`\varepsilon(\alpha)` for each order, one round.

    Raises
    ------
    ValueError
        An order not finite and > 1, a sensitivity negative, ``sigma2`` not
        > 0, ``num_clients`` or ``dim`` not an int >= 1.
    """
    alphas = np.ceil(_orders(orders))
    l2 = check_non_negative("l2_sensitivity", l2_sensitivity)
    l1 = check_non_negative("l1_sensitivity", l1_sensitivity)
    tau = ddg_tau(sigma2, num_clients)
    d = check_int("dim", dim, 1)
    scale = math.sqrt(num_clients * float(sigma2))
    l2_scale, l1_scale = l2 / scale, l1 / scale
    first = alphas * l2_scale**2 / 2 + tau * d
    second = alphas / 2 * (l2_scale**2 + 2 * l1_scale * tau + tau**2 * d)
    third = alphas / 2 * (l2_scale + math.sqrt(d) * tau) ** 2
    return np.minimum(np.minimum(first, second), third)


def skellam_rdp(
    orders: ArrayLike = DEFAULT_ORDERS,
    *,
    l2_sensitivity: float,
    l1_sensitivity: float,
    mu: float,
) -> NDArray[np.float64]:
    r"""Return the RDP of one round of the (distributed) Skellam mechanism.

    The revealed sum carries :math:`\mathrm{Sk}(\mu)` noise on every coordinate
    (a sum of Skellam draws is Skellam with the summed variance: :math:`n`
    clients that each add :math:`\mu_0` give :math:`\mu = n\mu_0`). For one
    client's sensitivities :math:`\Delta_2`, :math:`\Delta_1` and an integer
    order :math:`\alpha > 1` the sum is :math:`(\alpha, \varepsilon(\alpha))`-RDP
    with (Agarwal, Kairouz & Liu, NeurIPS 2021, arXiv:2110.04995: their bound
    on the Renyi divergence between shifted multi-dimensional Skellam
    distributions)

    .. math::

        \varepsilon(\alpha) = \frac{\alpha\Delta_2^2}{2\mu}
        + \min\left\{\frac{(2\alpha - 1)\Delta_2^2 + 6\Delta_1}{4\mu^2},\;
        \frac{3\Delta_1}{2\mu}\right\}.

    The first term is the continuous Gaussian's RDP at variance :math:`\mu`; the
    correction vanishes as :math:`\mu` grows and is never negative.

    Parameters
    ----------
    orders : array_like of float (default: :data:`DEFAULT_ORDERS`)
        RDP orders :math:`\alpha > 1`; a fractional order is charged at
        :math:`\lceil\alpha\rceil` (the module's note on orders).
    l2_sensitivity : float
        :math:`\Delta_2 \geq 0`, the L2 bound of one client's integer upload.
    l1_sensitivity : float
        :math:`\Delta_1 \geq 0`, its L1 bound (e.g. :func:`integer_l1_bound`).
    mu : float
        :math:`\mu > 0`, the total variance per coordinate of the revealed sum's
        noise: the per-client :math:`\mu_0` times the fewest contributors
        (:func:`smallest_contributors`).

    Returns
    -------
    numpy.ndarray
        :math:`\varepsilon(\alpha)` for each order, one round.

    Raises
    ------
    ValueError
        An order not finite and > 1, a sensitivity negative, ``mu`` not > 0.
    """
    alphas = np.ceil(_orders(orders))
    l2 = check_non_negative("l2_sensitivity", l2_sensitivity)
    l1 = check_non_negative("l1_sensitivity", l1_sensitivity)
    m = check_positive("mu", mu)
    gaussian = alphas * l2**2 / (2 * m)
    correction = np.minimum(
        ((2 * alphas - 1) * l2**2 + 6 * l1) / (4 * m**2), 3 * l1 / (2 * m)
    )
    return gaussian + correction


def compose(rdp: ArrayLike, rounds: int) -> NDArray[np.float64]:
    r"""Return the RDP of ``rounds`` adaptive rounds: :math:`T\,\varepsilon(\alpha)`.

    RDP at a fixed order adds up under adaptive composition (Mironov, CSF 2017).

    Parameters
    ----------
    rdp : array_like of float
        One round's :math:`\varepsilon(\alpha)` (each >= 0).
    rounds : int
        :math:`T \geq 0`, the rounds a client takes part in (without sampling
        amplification: every round it may take part in).

    Returns
    -------
    numpy.ndarray
        :math:`T\,\varepsilon(\alpha)` for each order.

    Raises
    ------
    ValueError
        ``rdp`` negative or NaN, ``rounds`` not an int >= 0.
    """
    return _rdp(rdp) * check_int("rounds", rounds, 0)


def rdp_to_epsilon(orders: ArrayLike, rdp: ArrayLike, delta: float) -> float:
    r"""Return the smallest :math:`\varepsilon` the RDP curve gives at :math:`\delta`.

    For each order, an :math:`(\alpha, r)`-RDP mechanism is
    :math:`(\varepsilon, \delta)`-DP with (Canonne, Kamath & Steinke, "The
    Discrete Gaussian for Differential Privacy", NeurIPS 2020, arXiv:2004.00010,
    the improved conversion; also Asoodeh et al. 2021)

    .. math::

        \varepsilon = r + \log\left(1 - \frac1\alpha\right)
        - \frac{\log\delta + \log\alpha}{\alpha - 1},

    tighter than the classic :math:`r + \log(1/\delta)/(\alpha - 1)` (Mironov,
    CSF 2017) by :math:`\log(\alpha/(\alpha-1)) + \log(\alpha)/(\alpha-1) > 0`.
    When :math:`\delta^2 \geq 1 - e^{-r}` the result is 0: total variation is at
    most :math:`\sqrt{1 - e^{-\mathrm{KL}}}` (Bretagnolle & Huber 1979) and
    :math:`\mathrm{KL} \leq D_\alpha`. The best order wins; the result is >= 0.
    This is the conversion dp-accounting's ``RdpAccountant`` makes.

    Parameters
    ----------
    orders : array_like of float
        The orders :math:`\alpha > 1`.
    rdp : array_like of float
        :math:`r(\alpha) \geq 0` for each order (``inf`` allowed), already
        composed over the rounds (:func:`compose`).
    delta : float
        :math:`\delta \in (0, 1)`.

    Returns
    -------
    float
        :math:`\varepsilon \geq 0` (``inf`` if every order is ``inf``).

    Raises
    ------
    ValueError
        An order not finite and > 1, ``rdp`` not one value >= 0 per order,
        ``delta`` outside ``(0, 1)``.
    """
    alphas = _orders(orders)
    values = _rdp(rdp)
    if values.shape != alphas.shape:
        raise ValueError(
            f"rdp must have one value per order ({alphas.size}), got {values.size}"
        )
    d = check_probability("delta", delta)
    best = math.inf
    for alpha, r in zip(alphas.tolist(), values.tolist(), strict=True):
        if math.isinf(r):
            continue
        if d * d + math.expm1(-r) > 0:  # delta >= TV bound from KL <= D_alpha
            return 0.0
        epsilon = (
            r + math.log1p(-1 / alpha) - (math.log(d) + math.log(alpha)) / (alpha - 1)
        )
        best = min(best, epsilon)
    return max(0.0, best)


def smallest_contributors(num_clients: int, threshold: int, colluding: int = 0) -> int:
    r"""Return the fewest clients whose noise a revealed secure-aggregation sum holds.

    A client that drops out after masking adds no noise, but secure aggregation
    (Bonawitz et al., CCS 2017; Bell et al., CCS 2020) reveals the sum only when
    at least ``threshold`` clients' inputs are in it, so a revealed sum holds at
    least ``threshold`` noise shares. Clients colluding with the server know
    their own noise and can subtract it: ``threshold - colluding`` shares stay
    unknown. Account with this number as ``num_clients`` of :func:`ddg_rdp`
    (or :math:`\mu = ` it times the per-client :math:`\mu_0` in
    :func:`skellam_rdp`), never with the number sampled.

    Parameters
    ----------
    num_clients : int
        :math:`n \geq 1`, the clients sampled for the round.
    threshold : int
        :math:`t`, secure aggregation's reconstruction threshold,
        :math:`1 \leq t \leq n`.
    colluding : int (default: 0)
        How many of the clients may share their noise with the server,
        :math:`0 \leq k < t`.

    Returns
    -------
    int
        :math:`t - k \geq 1`.

    Raises
    ------
    ValueError
        ``num_clients`` not an int >= 1, ``threshold`` outside ``[1, n]``,
        ``colluding`` outside ``[0, t)``.
    """
    n = check_int("num_clients", num_clients, 1)
    t = check_int("threshold", threshold, 1)
    if t > n:
        raise ValueError(f"threshold must be <= num_clients ({n}), got {threshold!r}")
    k = check_int("colluding", colluding, 0)
    if k >= t:
        raise ValueError(f"colluding must be < threshold ({t}), got {colluding!r}")
    return t - k


def epsilon_after(
    rdp: ArrayLike,
    *,
    rounds: int,
    delta: float,
    orders: Sequence[float] | ArrayLike = DEFAULT_ORDERS,
) -> float:
    r"""Return :math:`\varepsilon` after ``rounds`` rounds of a one-round RDP curve.

    :func:`compose` then :func:`rdp_to_epsilon`.

    Parameters
    ----------
    rdp : array_like of float
        One round's :math:`\varepsilon(\alpha)` at ``orders``.
    rounds : int
        :math:`T \geq 0`.
    delta : float
        :math:`\delta \in (0, 1)`.
    orders : array_like of float (default: :data:`DEFAULT_ORDERS`)
        The orders ``rdp`` was computed at.

    Returns
    -------
    float
        :math:`\varepsilon \geq 0`.

    Raises
    ------
    ValueError
        As :func:`compose` and :func:`rdp_to_epsilon`.
    """
    return rdp_to_epsilon(orders, compose(rdp, rounds), delta)

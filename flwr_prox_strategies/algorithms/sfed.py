r"""SFedAvg and SFedProx: the FedEPM paper's secured baselines (Section VII).

S. Zhou and G. Y. Li, "Exact Penalty Method for Federated Learning", 2022
(arXiv:2208.11231), Section VII; official code: github.com/ShenglongZhou/FedEPM.
Wire keys: FedEPM's plus ``sfed-inner-steps`` and ``sfed-mu``. The update, the
step size and the noise scale: the pack's FedEPM page (``docs/algorithms/fedepm.md``).
"""

from __future__ import annotations

import math
from typing import Any

from ..core.contract.validation import resolve_alias
from ..core.server.strategy import ValidatedFedAvg
from ..ops.checks import check_int, check_non_negative, check_positive, check_unset
from .fedepm import (
    GROWTH_KEY,
    ITERATION_KEY,
    K0_KEY,
    NOISE_KEY,
    R0_KEY,
    SAMPLING_KEYWORDS,
)

#: The train-config key of :math:`\ell`, gradient steps per iteration.
INNER_STEPS_KEY = "sfed-inner-steps"
#: The train-config key of SFedProx's :math:`\mu` (0 for SFedAvg).
PROX_MU_KEY = "sfed-mu"
#: Reported by clients that apply SFedAvg's / SFedProx's rule.
SFEDAVG_APPLIED_KEY = "sfedavg-applied"
SFEDPROX_APPLIED_KEY = "sfedprox-applied"


def step_size(num_examples: int, iteration: int, k0: int) -> float:
    r"""Return :math:`\gamma_i^k = 2 d_i / \sqrt{2k_0 + \lceil k/k_0\rceil}`."""
    return 2 * num_examples / math.sqrt(2 * k0 + math.ceil(iteration / k0))


class SFedAvg(ValidatedFedAvg):
    r"""SFedAvg: k0 full-gradient local steps, noisy uploads, mean of the sampled.

    The FedEPM paper's secured FedAvg baseline (Zhou and Li, 2022, Section
    VII): the :math:`\lceil\rho m\rceil` sampled clients take :math:`k_0`
    full-gradient steps of size
    :math:`\gamma_i^k = 2 d_i/\sqrt{2k_0 + \lceil k/k_0\rceil}` from the server
    model, upload it with Laplace noise, and the server takes the plain mean.
    The paper does not give the noise's scale: every method gets FedEPM's
    mechanism, so the comparison isolates the optimiser. Its clients are
    :class:`SFedAvgClient` or your own code with :class:`SFedRule`.

    Parameters
    ----------
    num_clients : int | None (default: None)
        :math:`m` (sampling takes :math:`\lceil\rho m\rceil`; checked each round).
        None: the number of nodes connected at the first round (logged).
    rho : float (default: 0.5)
        Fraction of clients sampled per communication.
    k0 : int (default: 10)
        Local iterations between communications.
    noise : float (default: 0.1)
        :math:`\varepsilon` per upload; 0 turns the noise off.
    r0 : float (default: 0.05)
        Calibrates the noise as FedEPM's :math:`r_0` (:math:`> 0`).
    growth : float (default: 1.001)
        Calibrates the noise as FedEPM's growth (:math:`\ge 1`): the noise
        scale is :math:`2\lVert g_i\rVert_1/(r_0\,\mathrm{growth}^{k+1}
        \varepsilon)` at the round's last iteration :math:`k`.
    **kwargs
        Keyword arguments of :class:`FedAvg`, except ``fraction_train``,
        ``min_train_nodes``, ``local_epochs`` and ``local_steps`` (set by
        ``rho`` and ``k0``). Here ``weighting`` defaults to ``"uniform"`` (the
        paper's plain mean over the sampled clients).

    Raises
    ------
    ValueError
        If a parameter is out of range, naming it: ``num_clients`` or ``k0``
        not an integer >= 1, ``rho`` outside ``(0, 1]``, ``noise`` negative,
        ``r0`` not > 0, ``growth`` below 1; or if a keyword it sets itself is
        given.
    TypeError
        If a keyword is unknown.

    Notes
    -----
    Clients report ``sfedavg-applied`` (``sfedprox-applied`` for SFedProx),
    value 1; replies without it are named in a warning once per run (rejected
    with ``strict=True``).

    References
    ----------
    S. Zhou and G. Y. Li, "Exact Penalty Method for Federated Learning", 2022.
    https://arxiv.org/abs/2208.11231
    """

    inner_steps = 1
    default_mu = 0.0
    requires_num_clients = True
    default_weighting = "uniform"
    ledger_clients = True  # SFedRule spends epsilon as FedEPMRule does
    rule_metric = SFEDAVG_APPLIED_KEY
    rule_pieces = ("SFedAvgClient", "SFedRule")
    rule_name = "SFedAvg's full-gradient local steps and noisy upload"
    settings = ("num_clients", "rho", "k0", "inner_steps", "mu", "noise")
    #: The clients' iteration counter is ``(round - 1) * k0``: a resume needs
    #: the same ``k0``.
    resume_settings = ("k0",)

    def __init__(
        self,
        *,
        num_clients: int | None = None,
        rho: float = 0.5,
        k0: int = 10,
        noise: float = 0.1,
        r0: float = 0.05,
        growth: float = 1.001,
        **kwargs: Any,
    ) -> None:
        if num_clients is not None:
            check_int("num_clients", num_clients, 1)
        if not (isinstance(rho, (int, float)) and 0.0 < rho <= 1.0):
            raise ValueError(f"rho must be in (0, 1], got {rho!r}")
        check_int("k0", k0, 1)
        check_non_negative("noise", noise)
        check_positive("r0", r0)
        if not (isinstance(growth, (int, float)) and growth >= 1.0):
            raise ValueError(f"growth must be >= 1, got {growth!r}")
        check_unset(type(self).__name__, kwargs, SAMPLING_KEYWORDS, "rho, k0")
        super().__init__(
            num_clients=num_clients,
            fraction_train=float(rho),
            min_train_nodes=math.ceil(rho * (num_clients or 1)),
            **kwargs,
        )
        self.rho = float(rho)
        self.k0 = k0
        self.noise = float(noise)
        self.r0 = float(r0)
        self.growth = float(growth)
        self.mu = self.default_mu

    def learn_num_clients(self, num_clients: int) -> None:
        """Set m and the sample size it gives, ceil(rho * m)."""
        super().learn_num_clients(num_clients)
        self.min_train_nodes = math.ceil(self.rho * num_clients)

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send the iteration counter, the inner loop and the noise level."""
        return {
            ITERATION_KEY: (server_round - 1) * self.k0,
            K0_KEY: self.k0,
            INNER_STEPS_KEY: self.inner_steps,
            PROX_MU_KEY: self.mu,
            R0_KEY: self.r0,
            GROWTH_KEY: self.growth,
            NOISE_KEY: self.noise,
        }


class SFedProx(SFedAvg):
    r"""SFedProx: the FedEPM paper's Algorithm 4 (:math:`\ell` prox-gradient steps).

    As :class:`SFedAvg`, with :math:`\ell` steps per iteration on the local
    loss plus the proximal term
    :math:`\frac{\mu}{2}\lVert v - w^\tau\rVert^2` (Zhou and Li, 2022,
    Section VII). Its clients are :class:`SFedProxClient` (the same class as
    :class:`SFedAvgClient`) or your own code with :class:`SFedRule`.

    Parameters
    ----------
    mu : float | None (default: None)
        Proximal weight :math:`\mu \ge 0`; None: :math:`10^{-5}`.
    proximal_mu : float | None (default: None)
        Flower's name for ``mu``; give one of the two.
    inner_steps : int (default: 3)
        :math:`\ell`, gradient steps per iteration.
    **kwargs
        Keyword arguments of :class:`SFedAvg` (``num_clients``, ``rho``,
        ``k0``, ``noise``, ...).

    Raises
    ------
    ValueError
        If ``mu`` is negative, ``inner_steps`` is not an integer >= 1, or a
        keyword argument of :class:`SFedAvg` is out of range.
    TypeError
        If both ``mu`` and ``proximal_mu`` are given, or a keyword is unknown.
    """

    rule_metric = SFEDPROX_APPLIED_KEY
    rule_pieces = ("SFedProxClient", "SFedRule")
    rule_name = "SFedProx's proximal local steps and noisy upload"

    def __init__(
        self,
        *,
        mu: float | None = None,
        proximal_mu: float | None = None,
        inner_steps: int = 3,
        **kwargs: Any,
    ) -> None:
        mu = resolve_alias(
            type(self).__name__, "mu", mu, "proximal_mu", proximal_mu, 1e-5
        )
        check_non_negative("mu", mu)
        check_int("inner_steps", inner_steps, 1)
        super().__init__(**kwargs)
        self.mu = float(mu)
        self.inner_steps = inner_steps  # type: ignore[misc]


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes.
SFEDAVG_CASES = {"default": lambda n: SFedAvg(num_clients=n, rho=1.0)}
#: As :data:`SFEDAVG_CASES`, for SFedProx.
SFEDPROX_CASES = {"default": lambda n: SFedProx(num_clients=n, rho=1.0)}

r"""SFedAvg and SFedProx: the FedEPM paper's secured baselines (seed 002, Sec. VII).

Both run :math:`k_0` local iterations between communications on the sampled
clients (:math:`\lceil\rho m\rceil`, resampled each communication), starting
from the server model :math:`w^\tau`; iteration :math:`k` is :math:`\ell` full
local gradient steps

.. math::
    v \gets v - \gamma_i^k\big(\nabla f_i(v) + \mu(v - w^\tau)\big),\qquad
    \gamma_i^k = \frac{2 d_i}{\sqrt{2k_0 + \lceil k/k_0\rceil}},

(the seed's :math:`\lfloor t\rfloor`, "the largest integer smaller than
:math:`t + 1`", is :math:`\lceil t\rceil`). **SFedAvg** is :math:`\ell = 1`,
:math:`\mu = 0` (full-batch SFedAvg, as the paper runs it); **SFedProx** is the
seed's Algorithm 4, :math:`\ell = 3`, :math:`\mu = 10^{-5}`. The sampled clients
upload :math:`w_i + \epsilon_i` and the server averages them (plain mean over
the sampled clients, the seed's Eq. for these methods).

Noise. The paper adds noise to these uploads without giving its scale; here
every method gets the same mechanism as FedEPM, Laplace with scale
:math:`2\lVert g_i\rVert_1/(\mu^\circ_k\varepsilon)`, :math:`g_i` the gradient at
the received model and :math:`\mu^\circ_k = r_0\,1.001^{k+1}` at the round's last
iteration (FedEPM's :math:`\mu_i` without its tiny distance term), so all three
spend the same :math:`\varepsilon` per upload under the same accounting and the
comparison isolates the optimisation method.

Wire keys: those of FedEPM (iteration, :math:`k_0`, :math:`r_0`, growth, noise),
plus ``sfed-inner-steps`` and ``sfed-mu``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..core.strategy import ValidatedFedAvg
from ..core.training import TrainReport
from ..core.validation import (
    check_int,
    check_non_negative,
    check_positive,
    resolve_alias,
)
from .fedepm import (
    GROWTH_KEY,
    ITERATION_KEY,
    K0_KEY,
    NOISE_KEY,
    R0_KEY,
    FedEPMClient,
    FedEPMRule,
    Objective,
)

INNER_STEPS_KEY = "sfed-inner-steps"
PROX_MU_KEY = "sfed-mu"
# Reported by clients that apply SFedAvg's / SFedProx's rule.
SFEDAVG_APPLIED_KEY = "sfedavg-applied"
SFEDPROX_APPLIED_KEY = "sfedprox-applied"


def step_size(num_examples: int, iteration: int, k0: int) -> float:
    r"""Return :math:`\gamma_i^k = 2 d_i / \sqrt{2k_0 + \lceil k/k_0\rceil}`."""
    return 2 * num_examples / math.sqrt(2 * k0 + math.ceil(iteration / k0))


class SFedAvg(ValidatedFedAvg):
    r"""SFedAvg: k0 full-gradient local steps, noisy uploads, mean of the sampled.

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
    r0, growth : float (default: 0.05, 1.001)
        Calibrate the noise as FedEPM's (module docstring).
    weighting : str (default: "uniform")
        The seed's plain mean over the sampled clients.
    **kwargs
        Keyword arguments of
        :class:`~flwr_prox_strategies.core.strategy.ValidatedFedAvg`.

    Notes
    -----
    Clients report ``sfedavg-applied`` (``sfedprox-applied`` for SFedProx),
    value 1; replies without it are named in a warning once per run (rejected
    with ``strict=True``).
    """

    inner_steps = 1
    default_mu = 0.0
    requires_num_clients = True
    default_weighting = "uniform"
    rule_metric = SFEDAVG_APPLIED_KEY
    rule_pieces = ("SFedAvgClient", "SFedRule")
    rule_name = "SFedAvg's full-gradient local steps and noisy upload"
    settings = ("num_clients", "rho", "k0", "inner_steps", "mu", "noise")
    # The clients' iteration counter is (round - 1) * k0: a resume needs the same k0.
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
        for name in (
            "fraction_train",
            "min_train_nodes",
            "local_epochs",
            "local_steps",
        ):
            if name in kwargs:
                raise ValueError(
                    f"{type(self).__name__} sets {name} itself (rho, k0); "
                    f"got {name}={kwargs[name]!r}"
                )
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
    r"""SFedProx: the seed's Algorithm 4 (:math:`\ell` prox-gradient steps).

    Parameters
    ----------
    mu : float | None (default: None, i.e. 1e-5)
        Proximal weight :math:`\mu \ge 0`.
    proximal_mu : float | None (default: None)
        Flower's name for ``mu``; give one of the two.
    inner_steps : int (default: 3)
        :math:`\ell`, gradient steps per iteration.
    **kwargs
        As :class:`SFedAvg`.
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


class SFedRule(FedEPMRule):
    r"""The client rule of SFedAvg and SFedProx: k0 x l full-gradient steps.

    Each step :math:`x \leftarrow x - \gamma(\nabla f_i(x) + \mu(x - x_t))`
    (:math:`\mu = 0` for SFedAvg), then FedEPM's Laplace upload. :meth:`solve`
    takes your objective (value and full gradient at the model's current
    point); ``gradient`` (the gradient alone, cheaper) serves the later steps
    when given. It reports both strategies' ``-applied`` metrics: one client
    serves both.
    """

    protocol = "SFedAvg/SFedProx"
    applied_metric = SFEDAVG_APPLIED_KEY
    stateful = False

    def setup(self) -> None:
        """Read the iteration counter, k0, l, mu and the noise settings."""
        super().setup()
        self.inner = int(self.required(INNER_STEPS_KEY))
        self.mu = float(self.required(PROX_MU_KEY))

    def metrics(self) -> dict[str, Any]:
        """Say that both SFedAvg's and SFedProx's rule were applied."""
        return {**super().metrics(), SFEDPROX_APPLIED_KEY: 1}

    def solve(
        self,
        objective: Objective,
        gradient: Callable[[], list[torch.Tensor]] | None = None,
    ) -> TrainReport:
        """Run k0 iterations of l full-gradient steps from the server model."""
        gradient = gradient or (lambda: objective()[1])
        d = self.num_examples
        value, received_grads = objective()
        grads = received_grads
        for iteration in range(self.first, self.first + self.k0):
            gamma = step_size(d, iteration, self.k0)
            for step in range(self.inner):
                if not (iteration == self.first and step == 0):
                    grads = gradient()
                with torch.no_grad():
                    for p, g, a in zip(self.params, grads, self.anchor, strict=True):
                        p.sub_(gamma * (g + self.mu * (p - a)))
        noise_mu = self.r0 * self.growth ** (self.first + self.k0)
        self.round_metrics = self.noisy_upload(value, received_grads, noise_mu)
        self.steps = self.k0 * self.inner
        return TrainReport(epochs=0, steps=self.steps, examples_seen=d, mean_loss=value)


class SFedClient(FedEPMClient):
    r"""Client of SFedAvg and SFedProx: :class:`SFedRule` on this client's data.

    Parameters
    ----------
    ridge : float (default: 0.0)
        As :class:`~flwr_prox_strategies.algorithms.fedepm.FedEPMClient`.
    *args, **kwargs
        As :class:`~flwr_prox_strategies.core.client.TorchClient`.
    """

    protocol = "SFedAvg/SFedProx"
    rule_class = SFedRule

    def local_solve(
        self, config: dict[str, Any], *, epochs: int, steps: int | None
    ) -> TrainReport:
        """Run the rule's k0 x l steps on this client's objective."""
        rule = self.make_rule(config)
        assert isinstance(rule, SFedRule)
        return rule.solve(
            self.objective_and_gradient,
            lambda: self.objective_and_gradient(with_value=False)[1],
        )


SFedAvgClient = SFedClient
SFedProxClient = SFedClient

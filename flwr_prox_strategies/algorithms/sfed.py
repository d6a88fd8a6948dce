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
from logging import INFO
from typing import Any

import torch
from flwr.common.logger import log

from ..core.strategy import ValidatedFedAvg
from ..core.training import TrainReport, trainable
from ..core.validation import check_int, check_non_negative, check_positive
from .fedepm import (
    GROWTH_KEY,
    ITERATION_KEY,
    K0_KEY,
    NOISE_KEY,
    R0_KEY,
    FedEPMClient,
)

INNER_STEPS_KEY = "sfed-inner-steps"
PROX_MU_KEY = "sfed-mu"


def step_size(num_examples: int, iteration: int, k0: int) -> float:
    r"""Return :math:`\gamma_i^k = 2 d_i / \sqrt{2k_0 + \lceil k/k_0\rceil}`."""
    return 2 * num_examples / math.sqrt(2 * k0 + math.ceil(iteration / k0))


class SFedAvg(ValidatedFedAvg):
    r"""SFedAvg: k0 full-gradient local steps, noisy uploads, mean of the sampled.

    Parameters
    ----------
    num_clients : int
        :math:`m` (sampling takes :math:`\lceil\rho m\rceil`; checked each round).
    rho : float (default: 0.5)
        Fraction of clients sampled per communication.
    k0 : int (default: 10)
        Local iterations between communications.
    noise : float (default: 0.1)
        :math:`\varepsilon` per upload; 0 turns the noise off.
    r0, growth : float (default: 0.05, 1.001)
        Calibrate the noise as FedEPM's (module docstring).
    **kwargs
        Keyword arguments of
        :class:`~flwr_prox_strategies.core.strategy.ValidatedFedAvg`.
    """

    inner_steps = 1
    default_mu = 0.0

    def __init__(
        self,
        *,
        num_clients: int,
        rho: float = 0.5,
        k0: int = 10,
        noise: float = 0.1,
        r0: float = 0.05,
        growth: float = 1.001,
        weighting: str = "uniform",
        **kwargs: Any,
    ) -> None:
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
            min_train_nodes=math.ceil(rho * num_clients),
            weighting=weighting,
            **kwargs,
        )
        self.rho = float(rho)
        self.k0 = k0
        self.noise = float(noise)
        self.r0 = float(r0)
        self.growth = float(growth)
        self.mu = self.default_mu

    def __repr__(self) -> str:
        """Return the class name and its main settings."""
        return (
            f"{type(self).__name__}(num_clients={self.num_clients}, rho={self.rho}, "
            f"k0={self.k0}, inner_steps={self.inner_steps}, mu={self.mu}, "
            f"noise={self.noise})"
        )

    def summary(self) -> None:
        """Log the settings, then the base's."""
        log(INFO, "\t├──> %r", self)
        super().summary()

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
    mu : float (default: 1e-5)
        Proximal weight :math:`\mu \ge 0`.
    inner_steps : int (default: 3)
        :math:`\ell`, gradient steps per iteration.
    **kwargs
        As :class:`SFedAvg`.
    """

    def __init__(
        self, *, mu: float = 1e-5, inner_steps: int = 3, **kwargs: Any
    ) -> None:
        check_non_negative("mu", mu)
        check_int("inner_steps", inner_steps, 1)
        super().__init__(**kwargs)
        self.mu = float(mu)
        self.inner_steps = inner_steps  # type: ignore[misc]


class SFedClient(FedEPMClient):
    r"""Client of SFedAvg and SFedProx: full-gradient (prox) steps, noisy upload.

    Parameters
    ----------
    ridge : float (default: 0.0)
        As :class:`~flwr_prox_strategies.algorithms.fedepm.FedEPMClient`.
    *args, **kwargs
        As :class:`~flwr_prox_strategies.core.client.TorchClient`.
    """

    protocol = "SFedAvg/SFedProx"

    stateful = False

    def local_solve(
        self, config: dict[str, Any], *, epochs: int, steps: int | None
    ) -> TrainReport:
        """Run k0 iterations of l full-gradient steps from the server model."""
        first = int(self.required(config, ITERATION_KEY))
        k0 = int(self.required(config, K0_KEY))
        inner = int(self.required(config, INNER_STEPS_KEY))
        mu = float(self.required(config, PROX_MU_KEY))
        r0 = float(self.required(config, R0_KEY))
        growth = float(self.required(config, GROWTH_KEY))
        epsilon = float(self.required(config, NOISE_KEY))
        d = self.num_train_examples()
        params = trainable(self.model)
        anchor = [p.detach().clone() for p in params]
        value, received_grads = self.objective_and_gradient()
        grads = received_grads
        for iteration in range(first, first + k0):
            gamma = step_size(d, iteration, k0)
            for step in range(inner):
                if not (iteration == first and step == 0):
                    _, grads = self.objective_and_gradient(with_value=False)
                with torch.no_grad():
                    for p, g, a in zip(params, grads, anchor, strict=True):
                        p.sub_(gamma * (g + mu * (p - a)))
        noise_mu = r0 * growth ** (first + k0)
        self._round_metrics = self.noisy_upload(
            value, received_grads, noise_mu, epsilon
        )
        return TrainReport(epochs=0, steps=k0 * inner, examples_seen=d, mean_loss=value)


SFedAvgClient = SFedClient
SFedProxClient = SFedClient

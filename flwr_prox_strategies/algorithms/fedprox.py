r"""FedProx (Li et al., MLSys 2020), as seed 000 specifies it.

Client :math:`k` finds a :math:`\gamma`-inexact minimiser of

.. math::
    h_k(\theta; \theta_t) = f_k(\theta)
    + \frac{\mu}{2} \lVert \theta - \theta_t \rVert^2
    \qquad \text{(seed 000, Eq. (1))}

by local SGD: each step follows :math:`\nabla f_k(\theta) + \mu(\theta - \theta_t)`.
The penalty is **squared** (its gradient vanishes at :math:`\theta_t`), and is
added with a plus sign.

:math:`\gamma`-inexactness (the seed's pseudo-code garbles it; this is the
paper's Definition 1): :math:`\lVert \nabla h_k(\theta; \theta_t) \rVert \le
\gamma \lVert \nabla h_k(\theta_t; \theta_t) \rVert`. With ``gamma`` set, the
client checks it on its full local gradient after every epoch and stops early;
``local_epochs`` caps the solve.

Server: the seed's pseudo-code averages uniformly over :math:`S_t`
(``weighting="uniform"``); the official code (litian96/FedProx) weights by
sample counts, which is the default here (``weighting="num-examples"``).

Systems heterogeneity (the paper's Section 5.2): with ``drop_percent`` a
fraction of the sampled clients become stragglers running a random
``1 .. E-1`` epochs (``np.random.randint(1, E)`` in the official code). FedProx
keeps their partial work; :class:`~flwr_prox_strategies.algorithms.fedavg.FedAvg`
drops them, with the same seeded draws.

The dissimilarity :math:`B(\theta)` of Eq. (6) is logged per round with
``monitor_dissimilarity=True``.

With ``mu = 0`` and no stragglers, FedProx equals FedAvg bit for bit.

Wire keys: the strategy sends ``proximal-mu`` (``PROXIMAL_MU_KEY``, the same key
as Flower's own ``FedProx``) in every train ``ConfigRecord``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..core.client import TorchClient
from ..core.rule import ClientRule
from ..core.strategy import ValidatedFedAvg
from ..core.training import GradientTerm, full_gradient, grad_norm
from ..core.validation import check_non_negative, resolve_alias
from ..ops.proximal import ProximalTerm

PROXIMAL_MU_KEY = "proximal-mu"
# Reported by clients that add the proximal term (FedProxRule).
PROXIMAL_MU_APPLIED_KEY = "proximal-mu-applied"


class FedProx(ValidatedFedAvg):
    r"""FedProx strategy: FedAvg's server plus ``proximal-mu`` for the clients.

    Parameters
    ----------
    mu : float | None (default: None, i.e. 0.01)
        Proximal penalty constant :math:`\mu \ge 0`. 0 gives FedAvg.
    proximal_mu : float | None (default: None)
        Flower's name for ``mu`` (``flwr.serverapp.strategy.FedProx``); give
        one of the two.
    **kwargs
        Keyword arguments of
        :class:`~flwr_prox_strategies.core.strategy.ValidatedFedAvg`
        (``fraction_train``, ``weighting``, ``local_epochs``, ``drop_percent``,
        ``seed``, ``monitor_dissimilarity``, ...).

    Notes
    -----
    The client side of the contract (:class:`FedProxClient` implements it)::

        mu = config["proximal-mu"]
        loss.backward()
        for p, p_global in zip(params, global_params):
            p.grad += mu * (p - p_global)     # gradient of (mu/2)||w - w_t||^2
        optimizer.step()

    and reports ``proximal-mu-applied`` (value 1) in its reply's metrics: replies
    without it are named in a warning (once per run), or rejected with
    ``strict=True``.
    """

    straggler_policy = "keep-partial"
    rule_metric = PROXIMAL_MU_APPLIED_KEY
    rule_name = "FedProx's proximal term"
    settings = ("mu", "weighting", "seed")

    def __init__(
        self,
        *,
        mu: float | None = None,
        proximal_mu: float | None = None,
        **kwargs: Any,
    ) -> None:
        mu = resolve_alias(
            type(self).__name__, "mu", mu, "proximal_mu", proximal_mu, 0.01
        )
        check_non_negative("mu", mu)
        super().__init__(**kwargs)
        self.mu = float(mu)

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send ``proximal-mu`` every round."""
        return {PROXIMAL_MU_KEY: self.mu}


class FedProxRule(ClientRule):
    r"""FedProx's client rule: add :math:`\mu(\theta - \theta_t)` at every step.

    Works with any optimiser (momentum, Adam, ...): the term is part of the
    gradient of :math:`h_k`, whatever follows it. In your own ClientApp::

        rule = FedProxRule.from_message(msg, context, model)
        rule.attach(optimizer)           # or rule.add_gradient() before step()
        ...                              # your training loop
        return rule.reply(num_examples=n, metrics={"train_loss": loss})
    """

    protocol = "FedProx"
    applied_metric = PROXIMAL_MU_APPLIED_KEY

    def setup(self) -> GradientTerm:
        """Read ``proximal-mu``; anchor the term at the model just received."""
        mu = float(self.required(PROXIMAL_MU_KEY))
        if not math.isfinite(mu) or mu < 0:
            raise ValueError(f"received proximal-mu={mu!r}; it must be finite and >= 0")
        self.mu = mu
        return ProximalTerm(mu, self.anchor)


class FedProxClient(TorchClient):
    r"""FedProx client: local SGD on :math:`h_k(\theta; \theta_t)` (module docstring).

    With ``dp``, the proximal gradient :math:`\mu(\theta - \theta_t)` reads no data
    and is added after DP-SGD's per-example clipping and noise: neither clipped
    nor noised.

    Parameters
    ----------
    model, train_loader, test_loader
        As :class:`~flwr_prox_strategies.core.client.TorchClient`.
    gamma : float | None (default: None)
        Inexactness :math:`\gamma \in [0, 1]`. When set, the solve stops after the
        first epoch whose full local gradient satisfies
        :math:`\lVert\nabla h_k(\theta)\rVert
        \le \gamma \lVert\nabla f_k(\theta_t)\rVert`
        (one extra pass over the local data per epoch). None: run every epoch.
    **kwargs
        ``local_epochs`` (the cap), ``learning_rate``, ``momentum``,
        ``weight_decay``, ``loss_fn``, ``seed``, ``device``.
    """

    protocol = "FedProx"
    rule_class = FedProxRule

    def __init__(self, *args: Any, gamma: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if gamma is not None and not (
            isinstance(gamma, (int, float)) and 0.0 <= gamma <= 1.0
        ):
            raise ValueError(f"gamma must be None or a number in [0, 1], got {gamma!r}")
        if gamma is not None and self.dp is not None:
            raise ValueError(
                "gamma: the gamma-inexact test reads the exact local gradient, which "
                "DP-SGD does not release; use a fixed number of epochs with dp"
            )
        self.gamma = None if gamma is None else float(gamma)
        self.last_inexactness = math.nan

    def stop_rule(
        self, config: dict[str, Any], term: GradientTerm | None
    ) -> Callable[[int], bool] | None:
        """Return the gamma-inexact stopping test (None when ``gamma`` is unset)."""
        self.last_inexactness = math.nan
        if self.gamma is None:
            return None
        # The proximal gradient is zero at theta_t: grad h_k = grad f_k there.
        initial = grad_norm(
            full_gradient(
                self.model, self.train_loader, self.loss_fn, device=self.device
            )
        )
        gamma = self.gamma

        def stop_after_epoch(epoch: int) -> bool:
            current = grad_norm(
                full_gradient(
                    self.model,
                    self.train_loader,
                    self.loss_fn,
                    term=term,
                    device=self.device,
                )
            )
            self.last_inexactness = current / initial if initial > 0 else 0.0
            return current <= gamma * initial

        return stop_after_epoch

    def after_training(self, config: dict[str, Any], report: Any) -> dict[str, Any]:
        """Finish the rule (its metrics), and report the inexactness if measured."""
        metrics = super().after_training(config, report)
        if math.isfinite(self.last_inexactness):
            metrics["inexactness"] = self.last_inexactness
        return metrics


__all__ = [
    "PROXIMAL_MU_APPLIED_KEY",
    "PROXIMAL_MU_KEY",
    "FedProx",
    "FedProxClient",
    "FedProxRule",
]

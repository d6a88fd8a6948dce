"""FedProx: the client side, the rule and the ``NumPyClient``.

The strategy, the wire keys and the docs of the algorithm are in
:mod:`..fedprox`; this half imports torch, which a ServerApp never needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ...core.client.client import TorchClient
from ...core.client.rule import ClientRule
from ...core.client.training import GradientTerm, full_gradient, grad_norm
from ...core.docstrings import inherit_parameters
from ...ops.proximal import ProximalTerm
from ..fedprox import (
    PROXIMAL_MU_APPLIED_KEY,
    PROXIMAL_MU_KEY,
)


@inherit_parameters(ClientRule)
class FedProxRule(ClientRule):
    r"""FedProx's client rule: add :math:`\mu(\theta - \theta_t)` at every step.

    Runs under any optimiser (momentum, Adam, ...): the term is part of the
    gradient of :math:`h_k`, whatever follows it; under Adam the same
    :math:`\mu` pulls harder (the FedProx page measures it). It reads ``proximal-mu``
    (:data:`PROXIMAL_MU_KEY`) from the train config and reports
    ``proximal-mu-applied``. In your own ClientApp::

        rule = FedProxRule.from_message(msg, context, model)
        rule.attach(optimizer)           # or rule.add_gradient() before step()
        ...                              # your training loop
        return rule.reply(num_examples=n, metrics={"train_loss": loss})

    Build it with :meth:`ClientRule.from_message`, which loads the received
    model and passes the parameters below.
    """

    protocol = "FedProx"
    applied_metric = PROXIMAL_MU_APPLIED_KEY

    def setup(self) -> GradientTerm:
        """Read ``proximal-mu``; anchor the term at the model just received.

        Raises
        ------
        ProtocolError
            If the train config has no ``proximal-mu`` (the server is not
            running FedProx).
        ValueError
            If the received ``proximal-mu`` is negative or not finite.
        """
        mu = float(self.required(PROXIMAL_MU_KEY))
        if not math.isfinite(mu) or mu < 0:
            raise ValueError(f"received proximal-mu={mu!r}; it must be finite and >= 0")
        self.mu = mu
        return ProximalTerm(mu, self.anchor, copy=False)


class FedProxClient(TorchClient):
    r"""FedProx client: local SGD on :math:`h_k(\theta; \theta_t)`.

    Runs :class:`FedProxRule` in the pack's training loop: each step adds
    :math:`\mu(\theta - \theta_t)` to the data gradient. With ``dp``, the
    proximal gradient reads no data and is added after DP-SGD's per-example
    clipping and noise: neither clipped nor noised.

    Parameters
    ----------
    *args
        ``model``, ``train_loader``, ``test_loader``, as :class:`FedAvgClient`.
    gamma : float | None (default: None)
        Inexactness :math:`\gamma \in [0, 1]` (the paper's Definition 1). When
        set, the solve stops after the first epoch whose full local gradient
        satisfies :math:`\lVert\nabla h_k(\theta)\rVert
        \le \gamma \lVert\nabla f_k(\theta_t)\rVert`
        (one extra pass over the local data per epoch); ``local_epochs`` caps
        it. None: run every epoch.
    **kwargs
        Keyword arguments of :class:`FedAvgClient` (``local_epochs``,
        ``learning_rate``, ``momentum``, ``weight_decay``, ``loss_fn``,
        ``seed``, ``dp``, ``device``, ...).

    Raises
    ------
    ValueError
        If ``gamma`` is not None or a number in ``[0, 1]``, if ``gamma`` is set
        together with ``dp`` (DP-SGD does not release the exact local gradient
        the test reads), or a keyword argument of :class:`FedAvgClient` is
        invalid.
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


__all__ = ["FedProxClient", "FedProxRule"]

r"""FedNova's client half: local (proximal) SGD that reports its tau_i and a_i.

The strategy and the wire keys are in :mod:`flwr_fednova.fednova`, which the
ServerApp imports without torch; the registry names these classes by their
dotted paths, so that only a client process loads this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from numpy.typing import NDArray

from flwr_prox_strategies.extend import ClientRule, TorchClient

from .fednova import (
    FEDNOVA_A_METRIC,
    FEDNOVA_APPLIED_KEY,
    FEDNOVA_MU_KEY,
    FEDNOVA_TAU_METRIC,
    normaliser,
)


class _ProximalGradient:
    r"""Adds :math:`\mu(\theta - x)` to each parameter's gradient."""

    def __init__(self, mu: float, anchor: Sequence[torch.Tensor]) -> None:
        self.mu = mu
        self.anchor = [t.detach().clone() for t in anchor]

    def add_(self, params: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, x in zip(params, self.anchor, strict=True):
                if p.grad is not None:
                    p.grad.add_(p.detach() - x, alpha=self.mu)


class FedNovaRule(ClientRule):
    r"""FedNova's client rule: local (proximal) SGD, then report tau_i and a_i.

    Reads ``fednova-mu``; with :math:`\mu > 0` it adds :math:`\mu(\theta - x)`
    at every step (FedProx's local solver). After training it reports
    ``fednova-tau`` (the steps taken) and ``fednova-a`` (:func:`normaliser`
    of them at this round's step size). The normaliser assumes plain SGD
    steps: :meth:`~flwr_prox_strategies.extend.ClientRule.attach` refuses
    momentum and other optimisers. In your own ClientApp:
    ``rule = FedNovaRule.from_message(msg, context, model)``,
    ``rule.attach(optimizer)``, your loop, then ``rule.reply(num_examples=n)``.

    Parameters
    ----------
    *args, **kwargs
        As :class:`~flwr_prox_strategies.extend.ClientRule`.

    Raises
    ------
    ProtocolError
        If the train config has no ``fednova-mu`` (the server is not running
        FedNova).
    ValueError
        If the received ``fednova-mu`` is negative or not finite.
    """

    protocol = "FedNova"
    applied_metric = FEDNOVA_APPLIED_KEY
    plain_sgd = True

    def setup(self) -> _ProximalGradient | None:
        """Read ``fednova-mu``; anchor the proximal term at the received model."""
        mu = float(self.required(FEDNOVA_MU_KEY))
        if not math.isfinite(mu) or mu < 0:
            raise ValueError(f"received fednova-mu={mu!r}; it must be finite and >= 0")
        self.mu = mu
        # Only the proximal normaliser divides by the step size.
        self.needs_lr = mu > 0
        return _ProximalGradient(mu, self.anchor) if mu > 0 else None

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        r"""Return ``fednova-tau`` and ``fednova-a`` for ``steps`` steps of ``lr``."""
        a = normaliser(steps, lr * self.mu if self.mu > 0 else 0.0)
        return {}, {FEDNOVA_TAU_METRIC: int(steps), FEDNOVA_A_METRIC: a}


class FedNovaClient(TorchClient):
    r"""FedNova client: :class:`FedNovaRule` in the pack's training loop.

    Plain SGD (with FedProx's proximal term when the server's ``mu`` > 0),
    however many steps its epochs or the server's ``local-steps`` give it;
    it reports them with their normaliser. Weight decay is part of the local
    objective and leaves :math:`a_i` unchanged; momentum would change it.

    Parameters
    ----------
    *args, **kwargs
        As :class:`~flwr_prox_strategies.extend.TorchClient`; ``momentum``
        must be 0.

    Raises
    ------
    ValueError
        If ``momentum`` is not 0, or a keyword argument of the base is out of
        range.
    """

    protocol = "FedNova"
    rule_class = FedNovaRule

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.momentum != 0.0:
            raise ValueError(
                "momentum must be 0: FedNova's normaliser a_i here assumes plain "
                "(proximal) SGD steps"
            )


__all__ = ["FedNovaClient", "FedNovaRule"]

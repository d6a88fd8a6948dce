"""FedDyn: the client side, the rule and the ``NumPyClient``.

The strategy, the wire keys and the docs of the algorithm are in
:mod:`..feddyn`; this half imports torch, which a ServerApp never needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ...core.client.client import TorchClient
from ...core.client.rule import ClientRule, arrays_from_params
from ...core.client.training import GradientTerm
from ...ops.proximal import ProximalTerm
from ..feddyn import (
    DRIFT_STATE,
    FEDDYN_ALPHA_KEY,
    FEDDYN_APPLIED_KEY,
    INITIAL_MODEL_RECORD,
    LATEST_STATE,
    MODEL_DELTA_RECORD,
    TRACK_LATEST_KEY,
)


class FedDynRule(ClientRule):
    r"""FedDyn's client rule: add :math:`\alpha_k(\theta - \theta^t + \lambda_k)`.

    Keeps :math:`\lambda_k = -g_k/\alpha` in the client's state (one model),
    advanced by :math:`\theta_k - \theta^t` once the server confirms the reply.
    :math:`\alpha_k = \alpha` divided by ``relative_size`` (1 by default).
    Any optimiser runs it (under Adam, alpha acts differently: the FedDyn
    page measures it). It reads ``feddyn-alpha`` and reports
    ``feddyn-applied``.

    Parameters
    ----------
    *args, **kwargs
        As :class:`ClientRule` (``model``, ``config``, ``received``, ``state``,
        ``client_key``, ``relative_size``, ``base_lr``); build the rule with
        :meth:`ClientRule.from_message`, which passes them.
    decoupled : bool (default: False)
        Leave out the :math:`\alpha\theta` part of the term, for an optimiser
        whose weight decay carries it (the official code).

    Raises
    ------
    ProtocolError
        If the train config has no ``feddyn-alpha`` (the server is not
        running FedDyn).
    ValueError
        If the received ``feddyn-alpha`` is not > 0, or ``relative_size`` not
        > 0.
    """

    protocol = "FedDyn"
    applied_metric = FEDDYN_APPLIED_KEY
    stateful = True
    state_names = (DRIFT_STATE, LATEST_STATE)

    def __init__(self, *args: Any, decoupled: bool = False, **kwargs: Any) -> None:
        self.decoupled = bool(decoupled)
        super().__init__(*args, **kwargs)

    def setup(self) -> GradientTerm:
        r"""Read ``feddyn-alpha`` and :math:`\lambda_k`."""
        alpha = float(self.required(FEDDYN_ALPHA_KEY))
        if not (np.isfinite(alpha) and alpha > 0):
            raise ValueError(f"received feddyn-alpha={alpha!r}; it must be > 0")
        self.alpha = alpha / self.relative_size
        self.drift = self.state.get_tensors(DRIFT_STATE, self.anchor)
        shift = [self.alpha * d for d in self.drift]
        return ProximalTerm(
            self.alpha, self.anchor, shift, decoupled=self.decoupled, copy=False
        )

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        r"""Set :math:`\lambda_k + \theta_k - \theta^t` pending."""
        updated = [
            d + (p.detach() - a)
            for d, p, a in zip(self.drift, self.params, self.anchor, strict=True)
        ]
        self.state.set_pending(DRIFT_STATE, updated, self.server_round)
        if not self.config.get(TRACK_LATEST_KEY, False):
            return {}, {}
        latest = self.state.get(LATEST_STATE)
        if latest is not None:
            previous = [torch.as_tensor(v) for v in latest]
        elif INITIAL_MODEL_RECORD in self.received:
            previous = self.received_params(INITIAL_MODEL_RECORD)
        else:  # round 1: the received model is theta^0
            previous = self.anchor
        now = [p.detach().clone() for p in self.params]
        change = [n - q.to(n.dtype) for n, q in zip(now, previous, strict=True)]
        self.state.set_pending(LATEST_STATE, now, self.server_round)
        return {MODEL_DELTA_RECORD: arrays_from_params(self.model, change)}, {}


class FedDynClient(TorchClient):
    r"""FedDyn client: local SGD on the dynamically regularised objective.

    Runs :class:`FedDynRule` in the pack's training loop. With ``dp``, the
    regulariser's gradient reads no data and is added after DP-SGD's clipping
    and noise; :math:`\lambda_k` is built from the private iterates.

    Parameters
    ----------
    *args, **kwargs
        As :class:`FedAvgClient` (``relative_size`` divides :math:`\alpha`, as
        the official code does).
    decoupled_alpha : bool (default: False)
        Carry the :math:`\alpha\theta` part of the gradient by the optimiser's
        weight decay (the official code), which keeps it out of clipping.

    Raises
    ------
    ValueError
        If a keyword argument of :class:`FedAvgClient` is out of range.
    """

    protocol = "FedDyn"
    rule_class = FedDynRule

    def __init__(
        self, *args: Any, decoupled_alpha: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.decoupled_alpha = decoupled_alpha

    def rule_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """Pass ``decoupled_alpha`` to the rule."""
        return {"decoupled": self.decoupled_alpha}

    def make_optimizer(self) -> Any:
        """SGD; with ``decoupled_alpha`` its weight decay also carries alpha."""
        optimizer = super().make_optimizer()
        if self.decoupled_alpha:
            assert isinstance(self.rule, FedDynRule)  # built by gradient_term
            for group in optimizer.param_groups:
                group["weight_decay"] = self.weight_decay + self.rule.alpha
        return optimizer

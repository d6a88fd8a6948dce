"""FedDC: the client side, the rule and the ``NumPyClient``.

The strategy, the wire keys and the docs of the algorithm are in
:mod:`..feddc`; this half imports torch, which a ServerApp never needs.
"""

from __future__ import annotations

from typing import Any

import torch
from numpy.typing import NDArray

from ...core.client.client import TorchClient
from ...core.client.rule import ClientRule, ProtocolError, arrays_from_params
from ...core.client.training import GradientTerm
from ...core.transport.keys import LOCAL_EPOCHS_KEY
from ...ops.proximal import ProximalTerm
from ..feddc import (
    CONTROL_STATE,
    CORRECTIONS,
    DRIFT_STATE,
    FEDDC_ALPHA_KEY,
    FEDDC_APPLIED_KEY,
    FEDDC_CORRECTION_KEY,
    GLOBAL_UPDATE_RECORD,
    LOCAL_UPDATE_RECORD,
    UPDATE_STATE,
)
from ..scaffold import CONTROL_DELTA_RECORD, CONTROL_RECORD


class FedDCRule(ClientRule):
    r"""FedDC's client rule: drift penalty plus gradient correction, both semantics.

    Adds :math:`\alpha_i(\theta + h_i - w)` and the correction to every step;
    after the round, :math:`h_i \mathrel{+}= \theta - w` (Eq. (11)) and the
    correction state (pending until the server confirms the reply). Plain SGD
    steps (:meth:`ClientRule.attach` refuses momentum). It reads
    ``feddc-alpha`` and ``feddc-correction`` and reports ``feddc-applied``.

    Parameters
    ----------
    *args, **kwargs
        As :class:`ClientRule` (``model``, ``config``, ``received``, ``state``,
        ``client_key``, ``relative_size``, ``base_lr``); build the rule with
        :meth:`ClientRule.from_message`, which passes them.
    planned_steps : int | None (default: None)
        The round's planned optimiser steps :math:`K`. The paper's correction
        divides by it before training: needed for ``correction="paper"``.
    lr : float | None (default: None)
        The round's step size, likewise needed for ``correction="paper"``.

    Raises
    ------
    ProtocolError
        If the train config lacks FedDC's keys or records (the server is not
        running FedDC), names an unknown correction, or the paper's form is
        asked without ``planned_steps`` and ``lr``.
    """

    protocol = "FedDC"
    applied_metric = FEDDC_APPLIED_KEY
    stateful = True
    state_names = (DRIFT_STATE, CONTROL_STATE, UPDATE_STATE)
    plain_sgd = True
    path_estimate = True
    needs_lr = True

    def __init__(
        self,
        *args: Any,
        planned_steps: int | None = None,
        lr: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.planned_steps = planned_steps
        self.planned_lr = lr
        super().__init__(*args, **kwargs)

    def setup(self) -> GradientTerm:
        r"""Return :math:`\alpha_i(\theta + h_i - w)` plus the correction."""
        alpha = float(self.required(FEDDC_ALPHA_KEY))
        self.mode = str(self.required(FEDDC_CORRECTION_KEY))
        if self.mode not in CORRECTIONS:
            raise ProtocolError(f"unknown feddc-correction {self.mode!r}")
        self.h = self.state.get_tensors(DRIFT_STATE, self.anchor)
        anchor = [w - h for w, h in zip(self.anchor, self.h, strict=True)]
        rho = self.relative_size
        if self.mode == "official":
            self.c = self.received_params(CONTROL_RECORD)
            self.ci = self.state.get_tensors(CONTROL_STATE, self.anchor)
            shift = [c / rho - ci for c, ci in zip(self.c, self.ci, strict=True)]
            return ProximalTerm(alpha / rho, anchor, shift, copy=False)
        if self.planned_steps is None or self.planned_lr is None:
            raise ProtocolError(
                "FedDC's paper form needs the round's planned steps and step "
                "size before training (planned_steps=, lr=; the pack's client "
                "takes them from len(train_loader))"
            )
        g = self.received_params(GLOBAL_UPDATE_RECORD)
        g_i = self.state.get_tensors(UPDATE_STATE, self.anchor)
        scale = 1.0 / (self.planned_steps * self.planned_lr)
        shift = [(gi - gg) * scale for gi, gg in zip(g_i, g, strict=True)]
        return ProximalTerm(alpha, anchor, shift, copy=False)

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        """Update :math:`h_i` (11) and the correction state; prepare the upload."""
        # The drift is measured from the global model w; the correction's
        # gradient estimate from where training started (w, unless the user
        # restored part of the model after from_message).
        drift = [
            h + p.detach() - w
            for h, p, w in zip(self.h, self.params, self.anchor, strict=True)
        ]
        update = [p.detach() - s for p, s in zip(self.params, self.start, strict=True)]
        self.state.set_pending(DRIFT_STATE, drift, self.server_round)
        if self.mode == "official":
            rho = self.relative_size
            beta = 1.0 / (max(steps, 1) * self.undecayed_lr(lr))
            new_ci = [
                ci - c / rho - beta * u
                for ci, c, u in zip(self.ci, self.c, update, strict=True)
            ]
            delta = [(n - ci) * rho for n, ci in zip(new_ci, self.ci, strict=True)]
            self.state.set_pending(CONTROL_STATE, new_ci, self.server_round)
            return {CONTROL_DELTA_RECORD: arrays_from_params(self.model, delta)}, {}
        self.state.set_pending(UPDATE_STATE, update, self.server_round)
        with torch.no_grad():  # the paper's form uploads theta^+ + h_i^{t+1}
            for p, h in zip(self.params, drift, strict=True):
                p.add_(h)
        return {LOCAL_UPDATE_RECORD: arrays_from_params(self.model, update)}, {}


class FedDCClient(TorchClient):
    r"""FedDC client: :class:`FedDCRule` in the pack's training loop.

    Keeps :math:`h_i` and :math:`c_i` (official) or :math:`g_i` (paper) in
    ``context.state``. With ``dp``, the drift penalty and the gradient correction
    read no data and are added after DP-SGD's clipping and noise.

    Parameters
    ----------
    *args, **kwargs
        As :class:`FedAvgClient` (``relative_size`` is the official code's
        :math:`\rho_i = n_i/\bar n`); ``momentum`` must be 0.

    Raises
    ------
    ValueError
        If ``momentum`` is not 0 (FedDC's correction assumes plain SGD), or a
        keyword argument of :class:`FedAvgClient` is out of range.
    """

    protocol = "FedDC"
    rule_class = FedDCRule

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.momentum != 0.0:
            raise ValueError("momentum must be 0: FedDC's correction assumes plain SGD")

    def rule_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """Give the paper's form its planned steps (``epochs * len(train_loader)``)."""
        if config.get(FEDDC_CORRECTION_KEY) != "paper":
            return {}
        epochs = int(config.get(LOCAL_EPOCHS_KEY, self.local_epochs))
        try:
            planned = epochs * len(self.train_loader)
        except TypeError as err:
            raise ProtocolError(
                "FedDC's paper form needs len(train_loader) to know K in advance"
            ) from err
        return {"planned_steps": planned, "lr": self.round_lr}

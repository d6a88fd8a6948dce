r"""FedDC (Gao et al., CVPR 2022): local drift decoupling and correction.

L. Gao, H. Fu, L. Li, Y. Chen, M. Xu and C.-Z. Xu, "FedDC: Federated Learning
with Non-IID Data via Local Drift Decoupling and Correction", CVPR 2022
(arXiv:2203.11751); official code: github.com/gaoliang13/FedDC. The update as
implemented, its two semantics (``correction``), the state, the wire keys and the
deviations: the pack's FedDC page (``docs/algorithms/feddc.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from numpy.typing import NDArray

from ..core.client.client import TorchClient
from ..core.client.rule import ClientRule, ProtocolError, arrays_from_params
from ..core.client.training import GradientTerm
from ..core.contract.fields import RoundUpdate
from ..core.contract.validation import ValidReply
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.keys import LOCAL_EPOCHS_KEY
from ..core.transport.records import RecordSpec, dict_to_record, record_to_dict
from ..ops.checks import check_choice, check_positive
from ..ops.control import control_update, rescaled, zeros_like
from ..ops.drift import drift_corrected, drift_sum
from ..ops.proximal import ProximalTerm
from .scaffold import CONTROL_DELTA_RECORD, CONTROL_RECORD

#: The train-config key of :math:`\alpha`.
FEDDC_ALPHA_KEY = "feddc-alpha"
#: The train-config key of the semantics (``"official"`` or ``"paper"``).
FEDDC_CORRECTION_KEY = "feddc-correction"
#: Reported by clients that apply FedDC's rule (FedDCRule).
FEDDC_APPLIED_KEY = "feddc-applied"
GLOBAL_UPDATE_RECORD = "feddc-g"
LOCAL_UPDATE_RECORD = "feddc-update"
CORRECTIONS = ("official", "paper")

DRIFT_STATE = "feddc-drift"
CONTROL_STATE = "feddc-control"
UPDATE_STATE = "feddc-last-update"


class FedDC(ValidatedFedAvg):
    r"""FedDC strategy: local drift decoupling and correction.

    Each sampled client :math:`i` keeps a local drift :math:`h_i` and
    minimises :math:`L_i(\theta_i) + \frac{\alpha}{2}\lVert\theta_i + h_i -
    w\rVert^2` plus a gradient correction (Gao et al., 2022, Eqs. (9)-(12)).
    Two semantics (``correction``): ``"official"`` (gaoliang13/FedDC's code,
    which partial participation needs: the server model is the participants'
    mean plus the mean drift of **all** clients, and the correction is
    SCAFFOLD's option-II control variate with :math:`\beta = 1/(K\eta_0)`), or
    ``"paper"`` (Eq. (10) as written, with the last round's updates). Under
    full participation they coincide for two rounds, then differ. The server
    keeps at most two model-sized sums, not :math:`N` models. Its clients are
    :class:`FedDCClient` or your own loop with :class:`FedDCRule` (plain SGD).

    Parameters
    ----------
    alpha : float (default: 0.1)
        Weight :math:`\alpha > 0` of the drift penalty.
    num_clients : int | None (default: None)
        :math:`N`, the number of all clients, checked every round. None: the
        number of nodes connected at the first round (logged).
    correction : str (default: "official")
        ``"official"`` (official code, partial participation) or ``"paper"``
        (Eq. (10) of the paper as written). ``"seed"`` is the deprecated name
        of ``"paper"``, accepted with a ``FutureWarning``.
    weighting : str | None (default: None)
        Average over participants: None means ``"uniform"`` for ``official``
        (``np.mean`` in the official code) and ``"num-examples"`` for
        ``paper`` (Eq. (12)); or give Flower's ``weighted_by_key``.
    **kwargs
        Keyword arguments of :class:`FedAvg`.

    Raises
    ------
    ValueError
        If ``alpha`` is not a finite number > 0, ``correction`` is not
        ``"official"`` or ``"paper"``, ``num_clients`` is not None or an
        integer >= 1, or a keyword argument of :class:`FedAvg` is out of range
        (naming it).
    TypeError
        If a keyword is unknown, or both ``weighting`` and
        ``weighted_by_key`` are given.

    Notes
    -----
    Clients report ``feddc-applied`` (their steps that held the rule's term)
    beside ``local-steps``; replies without it are named in a warning once per
    run (rejected with ``strict=True``). Train config keys: ``feddc-alpha``,
    ``feddc-correction``; records ``control`` / ``control-delta`` (official) or
    ``feddc-g`` / ``feddc-update`` (paper).

    References
    ----------
    L. Gao, H. Fu, L. Li, Y. Chen, M. Xu and C.-Z. Xu, "FedDC: Federated
    Learning with Non-IID Data via Local Drift Decoupling and Correction",
    CVPR 2022. https://arxiv.org/abs/2203.11751; official code:
    https://github.com/gaoliang13/FedDC
    """

    straggler_policy = "keep-partial"
    stateful_clients = True
    keeps_client_sums = True
    requires_num_clients = True
    rule_metric = FEDDC_APPLIED_KEY
    rule_name = "FedDC's drift penalty and gradient correction"
    #: The model is a positive combination of the replies' (NaN/inf reach it).
    model_linear_in_replies = True
    state_fields = ("drift_sum", "control", "global_update")
    resume_settings = ("correction",)
    settings = ("alpha", "num_clients", "correction")
    #: What the server keeps from un-noised aggregates (central DP's noise misses it).
    central_dp_caveat = (
        "FedDC's clients upload their drift and the server keeps the un- "
        "noised mean of it in the next model: neither is clipped nor noised "
        "by the wrapper"
    )

    def __init__(
        self,
        *,
        alpha: float = 0.1,
        num_clients: int | None = None,
        correction: str = "official",
        weighting: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_positive("alpha", alpha)
        if correction == "seed":
            warnings.warn(
                "FedDC(correction='seed') is now correction='paper' (Eq. (10) of "
                "the FedDC paper); 'seed' will be refused in a later release",
                FutureWarning,
                stacklevel=2,
            )
            correction = "paper"
        check_choice("correction", correction, CORRECTIONS)
        if weighting is None and kwargs.get("weighted_by_key") is None:
            weighting = "uniform" if correction == "official" else "num-examples"
        super().__init__(num_clients=num_clients, weighting=weighting, **kwargs)
        self.alpha = float(alpha)
        self.correction = correction
        self.drift_sum: dict[str, NDArray] | None = None  # H (official)
        self.control: dict[str, NDArray] | None = None  # c (official)
        self.global_update: dict[str, NDArray] | None = None  # g (paper)

    # ----------------------------------------------------------- messages
    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send alpha and the semantics."""
        return {FEDDC_ALPHA_KEY: self.alpha, FEDDC_CORRECTION_KEY: self.correction}

    def train_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Send :math:`c` (official) or :math:`g` (paper), zeros at first."""
        assert self.global_arrays is not None
        if self.correction == "official":
            if self.control is None:
                self.control = zeros_like(record_to_dict(self.global_arrays))
            return {CONTROL_RECORD: dict_to_record(self.control)}
        if self.global_update is None:
            model = record_to_dict(self.global_arrays)
            self.global_update = {k: np.zeros_like(v) for k, v in model.items()}
        return {GLOBAL_UPDATE_RECORD: dict_to_record(self.global_update)}

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        r"""Expect the model and :math:`\Delta c_i` (official) or :math:`g_i`."""
        expected = super().expected_train_arrays(server_round)
        extra = (
            CONTROL_DELTA_RECORD
            if self.correction == "official"
            else LOCAL_UPDATE_RECORD
        )
        expected[extra] = expected[self.arrayrecord_key]
        return expected

    def secure_sums(self) -> dict[str, tuple[str, ...]]:
        """Declare the model's mean and sum, the control sum (official), or means."""
        if self.correction == "paper":
            return {self.arrayrecord_key: ("mean",), LOCAL_UPDATE_RECORD: ("mean",)}
        return {self.arrayrecord_key: ("mean", "sum"), CONTROL_DELTA_RECORD: ("sum",)}

    # -------------------------------------------------------- aggregation
    def grown_state(
        self, state: Mapping[str, Any], old: int, new: int
    ) -> dict[str, Any]:
        """Keep c the mean over all N clients (the drift sum needs nothing)."""
        return {**state, "control": rescaled(state["control"], old / new)}

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        r"""Official: mean θ⁺ over S plus :math:`H^+/N`, new H and c; paper: new g.

        Official: :math:`H^+ = H + \sum_S(\theta_i^+ - w)` (the drift sum
        FedDyn keeps too), :math:`c^+ = c + \frac{1}{N}\sum_S\Delta c_i`.
        Paper: the weighted mean of the uploaded :math:`\theta^+ + h`, and
        :math:`g` the weighted mean of the uploaded :math:`g_i`.
        """
        average = self.weighted_mean(replies)
        if self.correction == "paper":
            update = self.weighted_mean(replies, LOCAL_UPDATE_RECORD)
            return RoundUpdate(dict_to_record(average), {"global_update": update})
        assert self.num_clients is not None and self.global_arrays is not None
        assert state["control"] is not None  # set when the round was configured
        theta_t = record_to_dict(self.global_arrays)
        models = [reply.arrays[self.arrayrecord_key] for reply in replies]
        drift = drift_sum(state["drift_sum"], theta_t, models)
        deltas = [reply.arrays[CONTROL_DELTA_RECORD] for reply in replies]
        return RoundUpdate(
            dict_to_record(drift_corrected(average, drift, self.num_clients)),
            {
                "drift_sum": drift,
                "control": control_update(state["control"], deltas, self.num_clients),
            },
        )


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
            return ProximalTerm(alpha / rho, anchor, shift)
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
        return ProximalTerm(alpha, anchor, shift)

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


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: FedDC(alpha=0.1, num_clients=n),
    "paper": lambda n: FedDC(alpha=0.1, num_clients=n, correction="paper"),
}

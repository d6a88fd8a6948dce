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
from flwr.app import ArrayRecord
from numpy.typing import NDArray

from ..core.contract.fields import RoundUpdate
from ..core.contract.validation import ValidReply
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.records import RecordSpec, dict_to_record, record_to_dict
from ..ops.checks import check_choice, check_positive
from ..ops.control import control_update, rescaled, zeros_like
from ..ops.drift import drift_corrected, drift_sum
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


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: FedDC(alpha=0.1, num_clients=n),
    "paper": lambda n: FedDC(alpha=0.1, num_clients=n, correction="paper"),
}

r"""SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates.

S. P. Karimireddy, S. Kale, M. Mohri, S. J. Reddi, S. U. Stich and A. T. Suresh,
"SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020
(arXiv:1910.06378), Algorithm 1 with option II. The update as implemented, the
state and the wire keys, ``control_lr`` and the deviations from the paper and the
official codes: the pack's SCAFFOLD page (``docs/algorithms/scaffold.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import ArrayRecord
from numpy.typing import NDArray

from ..core.contract.fields import RoundUpdate
from ..core.contract.validation import ValidReply
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.records import (
    RecordSpec,
    dict_to_record,
    float_keys,
    record_to_dict,
)
from ..ops.checks import check_choice, check_positive
from ..ops.control import control_update, rescaled, zeros_like
from ..ops.drift import norm

#: The ArrayRecord of the server control variate :math:`c`.
CONTROL_RECORD = "control"
#: The ArrayRecord of a client's :math:`\Delta c_i`, in its reply.
CONTROL_DELTA_RECORD = "control-delta"
CONTROL_STATE = "scaffold-control"
#: Reported by clients that apply SCAFFOLD's rule (ScaffoldRule).
SCAFFOLD_APPLIED_KEY = "scaffold-applied"
#: ``"round"`` or ``"base"``: the step size option II divides by.
CONTROL_LR_KEY = "scaffold-control-lr"
CONTROL_LRS = ("round", "base")


class Scaffold(ValidatedFedAvg):
    r"""SCAFFOLD strategy with option-II control variates.

    Each sampled client :math:`i` runs :math:`K` steps
    :math:`y \leftarrow y - \eta_l(\nabla f_i(y) - c_i + c)` and updates its
    control variate :math:`c_i^+ = c_i - c + \frac{x - y}{K\eta_l}`
    (option II); the server takes
    :math:`x \leftarrow x + \eta_g\,\mathrm{mean}_{S}\Delta y_i` and
    :math:`c \leftarrow c + \frac{1}{N}\sum_{S}\Delta c_i` over **all**
    :math:`N` clients (Karimireddy et al., 2020, Algorithm 1). The server
    keeps one model-sized :math:`c`; each client keeps its :math:`c_i` in
    ``context.state``. Its clients are :class:`ScaffoldClient` or your own
    loop with :class:`ScaffoldRule` (plain SGD).

    Parameters
    ----------
    num_clients : int | None (default: None)
        :math:`N`, the number of all clients, checked every round. None: the
        number of nodes connected at the first round (logged).
    server_learning_rate : float (default: 1.0)
        :math:`\eta_g > 0` (the name of Flower's ``FedAvgM``).
    control_lr : str (default: "round")
        The step size in option II's :math:`(x - y)/(K\eta_l)`. ``"round"``: the
        sizes of the steps taken this round (the paper; with ``lr_decay`` they
        shrink and the quotient stays a mean gradient). ``"base"``: the rate
        before the per-round decay, as the official FedDyn/FedDC codes do.
        Identical without ``lr_decay``.
    **kwargs
        Keyword arguments of :class:`FedAvg`. Here ``weighting`` defaults to
        ``"uniform"`` (the paper's plain mean of :math:`\Delta y_i`);
        ``"num-examples"`` weights it.

    Raises
    ------
    ValueError
        If ``server_learning_rate`` is not a finite number > 0,
        ``control_lr`` is not ``"round"`` or ``"base"``, ``num_clients`` is
        not None or an integer >= 1, or a keyword argument of :class:`FedAvg`
        is out of range (naming it).
    TypeError
        If a keyword is unknown.

    Notes
    -----
    Clients report ``scaffold-applied`` (their steps that held the rule's term)
    beside ``local-steps``; replies without it are named in a warning once per
    run (rejected with ``strict=True``). Records: the server sends :math:`c`
    (``control``), the client replies with :math:`\Delta c_i`
    (``control-delta``); config key ``scaffold-control-lr``.

    References
    ----------
    S. P. Karimireddy, S. Kale, M. Mohri, S. J. Reddi, S. U. Stich and A. T.
    Suresh, "SCAFFOLD: Stochastic Controlled Averaging for Federated
    Learning", ICML 2020. https://arxiv.org/abs/1910.06378
    """

    straggler_policy = "keep-partial"
    stateful_clients = True
    keeps_client_sums = True
    requires_num_clients = True
    default_weighting = "uniform"
    rule_metric = SCAFFOLD_APPLIED_KEY
    rule_name = "SCAFFOLD's control-variate correction"
    #: The model is a positive combination of the replies' (NaN/inf reach it).
    model_linear_in_replies = True
    state_fields = ("control",)
    settings = ("num_clients", "server_learning_rate", "control_lr")
    #: What the server keeps from un-noised aggregates (central DP's noise misses it).
    central_dp_caveat = (
        "SCAFFOLD's server control variate c is the un-noised mean of the "
        "clients' control-variate updates and is sent to every client: the "
        "wrapper's epsilon does not cover it"
    )

    def __init__(
        self,
        *,
        num_clients: int | None = None,
        server_learning_rate: float = 1.0,
        control_lr: str = "round",
        **kwargs: Any,
    ) -> None:
        check_positive("server_learning_rate", server_learning_rate)
        check_choice("control_lr", control_lr, CONTROL_LRS)
        super().__init__(num_clients=num_clients, **kwargs)
        self.server_learning_rate = float(server_learning_rate)
        self.control_lr = control_lr
        # c, the mean of all c_i: zeros at the first round.
        self.control: dict[str, NDArray] | None = None

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send the step size option II divides by."""
        return {CONTROL_LR_KEY: self.control_lr}

    def train_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Send :math:`c`."""
        assert self.global_arrays is not None
        if self.control is None:
            self.control = zeros_like(record_to_dict(self.global_arrays))
        assert self.control is not None
        return {CONTROL_RECORD: dict_to_record(self.control)}

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        r"""Expect the model :math:`y` and :math:`\Delta c_i`, both model-shaped."""
        expected = super().expected_train_arrays(server_round)
        expected[CONTROL_DELTA_RECORD] = expected[self.arrayrecord_key]
        return expected

    def secure_sums(self) -> dict[str, tuple[str, ...]]:
        r"""Declare the mean of the :math:`y_i`, the sum of the :math:`\Delta c_i`."""
        return {self.arrayrecord_key: ("mean",), CONTROL_DELTA_RECORD: ("sum",)}

    def grown_state(
        self, state: Mapping[str, Any], old: int, new: int
    ) -> dict[str, Any]:
        r"""Keep :math:`c` the mean over all N clients: new ones hold zero."""
        return {**state, "control": rescaled(state["control"], old / new)}

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        r"""Return :math:`x + \eta_g\,\mathrm{mean}_S(y_i - x)` and the new :math:`c`.

        :math:`c^+ = c + \frac{1}{N}\sum_S\Delta c_i`.
        """
        assert self.num_clients is not None and self.global_arrays is not None
        assert state["control"] is not None  # set when the round was configured
        model = self.weighted_mean(replies)
        if self.server_learning_rate != 1.0:  # else x + (mean y - x), exactly mean y
            x = record_to_dict(self.global_arrays)
            for key in float_keys(x):
                step = self.server_learning_rate * (model[key] - x[key])
                model[key] = (x[key] + step).astype(x[key].dtype)
        deltas = [reply.arrays[CONTROL_DELTA_RECORD] for reply in replies]
        control = control_update(state["control"], deltas, self.num_clients)
        return RoundUpdate(
            dict_to_record(model),
            {"control": control},
            {"control-norm": norm(control)},
        )


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: Scaffold(num_clients=n, server_learning_rate=0.5),
}

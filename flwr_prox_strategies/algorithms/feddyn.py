r"""FedDyn (Acar et al., ICLR 2021), as the paper's Algorithm 1 specifies it.

D. A. E. Acar, Y. Zhao, R. Matas Navarro, M. Mattina, P. N. Whatmough and
V. Saligrama, "Federated Learning Based on Dynamic Regularization", ICLR 2021
(arXiv:2111.04263); official code: github.com/alpemreacar/FedDyn. The update as
implemented, the state and the wire keys, the official code's options and the
deviations: the pack's FedDyn page (``docs/algorithms/feddyn.md``).
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
from ..ops.aggregate import divided_like
from ..ops.checks import check_positive
from ..ops.drift import drift_corrected, drift_sum, norm, summed

#: The train-config key of :math:`\alpha`.
FEDDYN_ALPHA_KEY = "feddyn-alpha"
#: Reported by clients that apply FedDyn's rule (FedDynRule).
FEDDYN_APPLIED_KEY = "feddyn-applied"
TRACK_LATEST_KEY = "feddyn-track-latest"
INITIAL_MODEL_RECORD = "initial-model"
MODEL_DELTA_RECORD = "model-delta"
DRIFT_STATE = "feddyn-drift"
LATEST_STATE = "feddyn-latest"


class FedDyn(ValidatedFedAvg):
    r"""FedDyn strategy: dynamic regularisation with a server-side drift sum.

    Each sampled client :math:`k` minimises
    :math:`f_k(\theta) - \langle g_k^t, \theta\rangle
    + \frac{\alpha}{2}\lVert\theta - \theta^t\rVert^2` and updates its
    :math:`g_k`; the server keeps
    :math:`h^{t+1} = h^t - \frac{\alpha}{K}\sum_{k\in S_t}(\theta_k^{t+1} -
    \theta^t)` over **all** :math:`N` clients and sends
    :math:`\theta^{t+1} = \frac{1}{|S_t|}\sum_{k\in S_t}\theta_k^{t+1}
    - \frac{1}{\alpha}h^{t+1}` (Acar et al., 2021, Algorithm 1). The server
    holds one model-sized drift sum, not N models; clients keep their own
    state in ``context.state`` (committed once the server confirms their reply
    was aggregated). Its clients are :class:`FedDynClient` or your own loop
    with :class:`FedDynRule`.

    Parameters
    ----------
    alpha : float (default: 0.01)
        The penalty :math:`\alpha > 0`.
    num_clients : int | None (default: None)
        :math:`N`, the number of all clients, checked every round. None: the
        number of nodes connected at the first round (logged).
    track_all_clients : bool (default: False)
        Keep the mean of all clients' latest models (the official code's second
        evaluated model, :meth:`all_clients_model`): the server keeps their
        running sum, each client uploads the change of its latest model.
    **kwargs
        Keyword arguments of :class:`FedAvg`. Here ``weighting`` defaults to
        ``"uniform"`` (the paper's and the official code's plain mean over
        :math:`S_t`); ``"num-examples"`` weights it by sample counts.

    Raises
    ------
    ValueError
        If ``alpha`` is not a finite number > 0, ``num_clients`` is not None
        or an integer >= 1, or a keyword argument of :class:`FedAvg` is out of
        range (naming it).
    TypeError
        If a keyword is unknown.

    Notes
    -----
    Clients report ``feddyn-applied`` (their steps that held the rule's term)
    beside ``local-steps``; replies without it are named in a warning once per
    run (rejected with ``strict=True``). Train config key: ``feddyn-alpha``.

    References
    ----------
    D. A. E. Acar, Y. Zhao, R. Matas Navarro, M. Mattina, P. N. Whatmough and
    V. Saligrama, "Federated Learning Based on Dynamic Regularization", ICLR
    2021. https://arxiv.org/abs/2111.04263; official code:
    https://github.com/alpemreacar/FedDyn
    """

    straggler_policy = "keep-partial"
    stateful_clients = True
    keeps_client_sums = True
    requires_num_clients = True
    default_weighting = "uniform"
    rule_metric = FEDDYN_APPLIED_KEY
    rule_name = "FedDyn's dynamic regulariser"
    #: The model is a positive combination of the replies' (NaN/inf reach it).
    model_linear_in_replies = True
    #: Sent again to each node after a restore (its client ignores it when it
    #: holds its own latest model).
    records_resent_after_restore = (INITIAL_MODEL_RECORD,)
    state_fields = ("drift_sum", "initial", "latest_sum")
    resume_settings = ("alpha",)
    settings = ("alpha", "num_clients", "track_all_clients")
    #: What the server keeps from un-noised aggregates (central DP's noise misses it).
    central_dp_caveat = (
        "FedDyn's server state h accumulates the un-noised mean of the "
        "clipped client models and every later global model carries "
        "h/alpha, so a client's contribution is released again each round: "
        "the wrapper's per-round epsilon understates FedDyn's"
    )

    def __init__(
        self,
        *,
        alpha: float = 0.01,
        num_clients: int | None = None,
        track_all_clients: bool = False,
        **kwargs: Any,
    ) -> None:
        check_positive("alpha", alpha)
        super().__init__(num_clients=num_clients, **kwargs)
        self.alpha = float(alpha)
        self.track_all_clients = bool(track_all_clients)
        # A client that lost its state computed its latest-model change from
        # the wrong baseline: with tracking, it restarts from theta^0 instead.
        self.accept_lost_state = not self.track_all_clients
        self.drift_sum: dict[str, NDArray] | None = None  # Lambda = sum_k lambda_k
        self.initial: dict[str, NDArray] | None = None  # theta^0 (tracking)
        self.latest_sum: dict[str, NDArray] | None = None  # sum_k latest theta_k

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send ``feddyn-alpha`` (and whether clients track their latest model)."""
        config: dict[str, Any] = {FEDDYN_ALPHA_KEY: self.alpha}
        if self.track_all_clients:
            config[TRACK_LATEST_KEY] = True
            if self.initial is None:  # the first round's model is theta^0
                assert self.global_arrays is not None and self.num_clients is not None
                self.initial = record_to_dict(self.global_arrays)
                self.latest_sum = {
                    k: v * self.num_clients
                    for k, v in self.initial.items()
                    if k in float_keys(self.initial)
                }
        return config

    def node_train_records(
        self, node_id: int, server_round: int
    ) -> dict[str, ArrayRecord]:
        """Send theta^0 to a node not yet identified in this run (tracking only)."""
        if not self.track_all_clients or node_id in self.book.node_keys:
            return {}
        assert self.initial is not None
        return {INITIAL_MODEL_RECORD: dict_to_record(self.initial)}

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        """Expect the model, plus the change of the latest model when tracking."""
        expected = super().expected_train_arrays(server_round)
        if self.track_all_clients:
            expected[MODEL_DELTA_RECORD] = expected[self.arrayrecord_key]
        return expected

    def secure_sums(self) -> dict[str, tuple[str, ...]]:
        r"""Declare the mean and the sum of the :math:`\theta_k`, the deltas' sum."""
        sums: dict[str, tuple[str, ...]] = {self.arrayrecord_key: ("mean", "sum")}
        if self.track_all_clients:
            sums[MODEL_DELTA_RECORD] = ("sum",)
        return sums

    def all_clients_model(self) -> ArrayRecord | None:
        r"""Return the mean of all clients' latest models.

        Returns
        -------
        ArrayRecord | None
            The mean over all :math:`N` clients (a client that never trained
            counts with :math:`\theta^0`); None unless ``track_all_clients``
            (or before the first round).
        """
        if self.latest_sum is None or self.global_arrays is None:
            return None
        model = record_to_dict(self.global_arrays)
        return dict_to_record(divided_like(model, self.latest_sum, self.num_clients))

    def central_models(self) -> dict[str, ArrayRecord]:
        """Evaluate the mean of all clients' latest models too, when tracked."""
        model = self.all_clients_model()
        return {} if model is None else {"central-all-clients": model}

    def grown_state(
        self, state: Mapping[str, Any], old: int, new: int
    ) -> dict[str, Any]:
        r"""Count the new clients' latest models, :math:`\theta^0`, when tracked."""
        latest = state["latest_sum"]
        if latest is None or self.initial is None:
            return dict(state)
        theta0 = [{k: (new - old) * self.initial[k] for k in latest}]
        return {**state, "latest_sum": summed(latest, theta0)}

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        r"""Return :math:`\mathrm{mean}_S\theta_k + \Lambda^{t+1}/N` and the new sums.

        :math:`\Lambda^{t+1} = \Lambda + \sum_S(\theta_k - \theta^t)`.
        """
        assert self.num_clients is not None and self.global_arrays is not None
        theta_t = record_to_dict(self.global_arrays)
        models = [reply.arrays[self.arrayrecord_key] for reply in replies]
        drift = drift_sum(state["drift_sum"], theta_t, models)
        model = drift_corrected(self.weighted_mean(replies), drift, self.num_clients)
        new_state: dict[str, Any] = {"drift_sum": drift}
        if self.track_all_clients:
            assert state["latest_sum"] is not None
            deltas = [reply.arrays[MODEL_DELTA_RECORD] for reply in replies]
            new_state["latest_sum"] = summed(state["latest_sum"], deltas)
        return RoundUpdate(
            dict_to_record(model),
            new_state,
            {"feddyn-drift-norm": norm(drift) / self.num_clients},
        )


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: FedDyn(alpha=0.1, num_clients=n),
    "track": lambda n: FedDyn(alpha=0.1, num_clients=n, track_all_clients=True),
}

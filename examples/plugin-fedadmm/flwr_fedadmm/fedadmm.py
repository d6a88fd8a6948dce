r"""FedADMM (Gong, Li and Freris, ICDE 2022): federated learning by the ADMM.

Y. Gong, Y. Li and N. M. Freris, "FedADMM: A Robust Federated Deep Learning
Framework with Adaptivity to System Heterogeneity", ICDE 2022
(arXiv:2204.03529).

The federation solves :math:`\min \sum_i f_i(w_i)` subject to the consensus
:math:`w_i = \theta` by the augmented Lagrangian, each of the :math:`N`
clients keeping its own dual variable :math:`\lambda_i`. This module
implements the following form of it. Every client :math:`i` holds
:math:`\lambda_i` (initially 0) and
:math:`u_i = w_i + \lambda_i/\rho` (initially :math:`\theta^0`, also for a
client never sampled). In round :math:`t` a sampled client receives
:math:`\theta^t`, starts from :math:`w = \theta^t` and runs its local steps on

.. math::
    f_i(w) + \langle \lambda_i, w - \theta^t\rangle
    + \frac{\rho}{2}\lVert w - \theta^t\rVert^2,

so that each step adds :math:`\lambda_i + \rho(w - \theta^t)` to the data
gradient; then

.. math::
    \lambda_i \leftarrow \lambda_i + \rho(w_i - \theta^t), \qquad
    u_i \leftarrow w_i + \lambda_i/\rho .

The server keeps :math:`S = \sum_{i=1}^N u_i`, over **all** clients, and
sends :math:`\theta^{t+1} = S/N`. It never sees :math:`u_i`, only its
change: each reply carries ``fedadmm-delta`` :math:`= u_i^{new} - u_i^{old}`.
A client knows no :math:`\theta^0`, so one without committed state sends
:math:`u_i^{new} - 0`; the server, which counted it at :math:`\theta^0`,
subtracts :math:`\theta^0` for it (it asks
:meth:`~flwr_prox_strategies.extend.ValidatedFedAvg.client_held_state`). A
client the server has never seen joins :math:`N` at :math:`\theta^0`
(:meth:`FedADMM.grown_state`).

Buffers (BatchNorm's running statistics and its ``num_batches_tracked``)
take part too: at a ``state_dict`` entry that is not a trainable parameter,
:math:`u_i` is the client's buffer after training, so :math:`S/N` there is the
mean of all clients' latest buffers (:math:`\theta^0`'s for a client never
sampled). Integer buffers are summed exactly and their mean rounded.

Wire: the strategy sends ``fedadmm-rho``; a client replies with its model,
the ArrayRecord ``fedadmm-delta`` (laid out as the model) and the metrics
``fedadmm-applied`` and ``state-round`` (the round of the state it trained
from, -1 for none). The client keeps :math:`\lambda_i` and :math:`u_i` in
``context.state``, committed in two phases.

This module is the server's half and imports no torch (a ServerApp without
central evaluation never loads it); the client's half is :mod:`flwr_fedadmm.client`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from flwr_prox_strategies.extend import (
    STATE_ROUND_METRIC,
    MetricSpec,
    RecordSpec,
    RoundUpdate,
    ValidatedFedAvg,
    ValidReply,
    check_positive,
    dict_to_record,
    record_to_dict,
)

#: The train-config key of the penalty :math:`\rho`.
FEDADMM_RHO_KEY = "fedadmm-rho"
#: The reply's ArrayRecord :math:`u_i^{new} - u_i^{old}` (the model's layout).
FEDADMM_DELTA_RECORD = "fedadmm-delta"
#: Reported by clients that apply FedADMM's rule (FedADMMRule).
FEDADMM_APPLIED_KEY = "fedadmm-applied"
#: Round metric: the replies whose client held no state (counted from zero).
FEDADMM_FRESH_METRIC = "fedadmm-fresh-replies"
#: The client's state records: its dual variable (one tensor per trainable
#: parameter) and its :math:`u_i` (the model's full layout, buffers included).
DUAL_STATE = "fedadmm-dual"
U_STATE = "fedadmm-u"


def wide(array: NDArray) -> NDArray:
    """Return ``array`` in the dtype FedADMM's sums are kept in.

    Parameters
    ----------
    array : NDArray
        A model entry (floating point, or an integer buffer).

    Returns
    -------
    NDArray
        A float64 copy of a floating-point array, an int64 copy of any other:
        a sum over many clients and rounds then loses nothing to rounding
        (integer counters stay exact).
    """
    if np.issubdtype(array.dtype, np.floating):
        return np.asarray(array, dtype=np.float64).copy()
    return np.asarray(array, dtype=np.int64).copy()


def mean_over(total: NDArray, count: int, dtype: np.dtype[Any]) -> NDArray:
    """Return ``total / count`` in ``dtype`` (an integer mean rounded half up).

    Parameters
    ----------
    total : NDArray
        A sum kept by :func:`wide` (float64 or int64).
    count : int
        The number of terms, >= 1.
    dtype : numpy.dtype
        The model entry's dtype.

    Returns
    -------
    NDArray
        The mean, in ``dtype``.
    """
    if np.issubdtype(total.dtype, np.floating):
        return (total / count).astype(dtype)
    # s = qN + r with 0 <= r < N: round(s / N) half up is q + (2r >= N), exact
    # for every int64 (no float, and 2r < 2K cannot overflow).
    quotient, remainder = np.divmod(total, count)
    return (quotient + (2 * remainder >= count)).astype(dtype)


def difference(new: NDArray, old: NDArray) -> NDArray:
    """Return ``new - old`` in ``new``'s dtype, computed without loss.

    Parameters
    ----------
    new, old : NDArray
        Two values of one model entry.

    Returns
    -------
    NDArray
        The difference; float entries go through float64 (rounded once),
        integer entries stay exact.
    """
    return (wide(new) - wide(old)).astype(new.dtype)


class FedADMM(ValidatedFedAvg):
    r"""FedADMM strategy: the mean of all clients' :math:`u_i = w_i + \lambda_i/\rho`.

    The server keeps :math:`S = \sum_{i=1}^N u_i` over all :math:`N`
    clients (a client never sampled counts at :math:`\theta^0`) and sends
    :math:`\theta^{t+1} = S/N`. Each valid reply's ``fedadmm-delta``,
    :math:`u_i^{new} - u_i^{old}`, is added to :math:`S`, less
    :math:`\theta^0` when its client held no state (it measured its change
    from zero). Its clients are :class:`~flwr_fedadmm.client.FedADMMClient`
    or your own loop with :class:`~flwr_fedadmm.client.FedADMMRule`; they
    keep :math:`\lambda_i` and :math:`u_i` in ``context.state``, committed
    once the server confirms their reply.

    Parameters
    ----------
    rho : float (default: 0.1)
        The penalty :math:`\rho > 0` of the augmented Lagrangian.
    num_clients : int | None (default: None)
        :math:`N`, the number of all clients, checked every round. None: the
        number of nodes connected at the first round (logged). It grows when
        a client not yet counted replies.
    **kwargs
        Keyword arguments of
        :class:`~flwr_prox_strategies.extend.ValidatedFedAvg`
        (``fraction_train``, ``local_epochs``, ``local_steps``,
        ``drop_percent``, ``seed``, ...). The model is :math:`S/N` whatever
        the ``weighting``, which weights the reported metrics only.

    Raises
    ------
    ValueError
        If ``rho`` is not a finite number > 0, ``num_clients`` is not None or
        an integer >= 1, or a keyword argument of the base is out of range
        (naming it).
    TypeError
        If a keyword is unknown.

    Notes
    -----
    The client side of the contract (:class:`~flwr_fedadmm.client.FedADMMRule`
    implements it)::

        rho = config["fedadmm-rho"]
        lam, u_old = state.get("dual", 0), state.get("u", 0)  # committed only
        for step in range(tau):             # tau may differ between clients
            loss.backward()
            for p, p_global, l in zip(params, global_params, lam):
                p.grad += l + rho * (p - p_global)
            optimizer.step()
        lam = lam + rho * (params - global_params)
        u = params + lam / rho              # buffers: the model's own values
        state.set_pending("dual", lam); state.set_pending("u", u)

    and replies with its model, the ArrayRecord ``fedadmm-delta``
    (``u - u_old``) and the metrics ``fedadmm-applied`` and ``state-round``
    (the round its committed state comes from, -1 for none). A reply
    without ``fedadmm-delta`` or ``state-round`` is rejected: the server could
    not tell what to add to :math:`S`.

    References
    ----------
    Y. Gong, Y. Li and N. M. Freris, "FedADMM: A Robust Federated Deep
    Learning Framework with Adaptivity to System Heterogeneity", ICDE 2022.
    https://arxiv.org/abs/2204.03529
    """

    # Variable local work is what FedADMM tolerates: stragglers are kept.
    straggler_policy = "keep-partial"
    stateful_clients = True
    keeps_client_sums = True
    requires_num_clients = True
    # theta = S/N: every client counts once, whatever its data size.
    default_weighting = "uniform"
    rule_metric = FEDADMM_APPLIED_KEY
    rule_name = "FedADMM's augmented Lagrangian"
    #: The model is built from the fedadmm-delta records and S, not as a
    #: combination of the replies' models: every reply is checked first.
    model_linear_in_replies = False
    state_fields = ("u_sum", "initial")
    resume_settings = ("rho",)
    settings = ("rho", "num_clients", "fraction_train", "seed")
    central_dp_caveat = (
        "FedADMM's model is S/N, S the server's sum of the clients' "
        "un-noised u_i built from their fedadmm-delta records: the noise added "
        "to one round's model never enters S, and every later model releases "
        "the sum again, so the wrapper's epsilon does not cover FedADMM's models"
    )
    secure_refusal = (
        "FedADMM's sum subtracts theta^0 for each reply whose client held no "
        "state, which it reads from that reply's state-round"
    )

    def __init__(
        self, *, rho: float = 0.1, num_clients: int | None = None, **kwargs: Any
    ) -> None:
        check_positive("rho", rho)
        super().__init__(num_clients=num_clients, **kwargs)
        self.rho = float(rho)
        self.u_sum: dict[str, NDArray] | None = None  # S = sum_i u_i, all N
        self.initial: dict[str, NDArray] | None = None  # theta^0

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send ``fedadmm-rho`` every round."""
        return {FEDADMM_RHO_KEY: self.rho}

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        """Expect the model and ``fedadmm-delta``, laid out as the model."""
        expected = super().expected_train_arrays(server_round)
        expected[FEDADMM_DELTA_RECORD] = expected[self.arrayrecord_key]
        return expected

    def expected_train_metrics(self, server_round: int) -> dict[str, MetricSpec]:
        """Expect ``state-round``: it says what the reply's delta is measured from."""
        expected = super().expected_train_metrics(server_round)
        # Without it a delta could be from u_old or from zero: S would drift by
        # theta^0 either way, so such a reply is rejected, not guessed at.
        expected[STATE_ROUND_METRIC] = MetricSpec(kind="int", minimum=-1)
        return expected

    def grown_state(
        self, state: Mapping[str, Any], old: int, new: int
    ) -> dict[str, Any]:
        r"""Count each of the ``new - old`` clients joining N at :math:`\theta^0`."""
        total, theta0 = state["u_sum"], state["initial"]
        if total is None:  # S is built at the first aggregated round, at that N
            return dict(state)
        grown = {
            key: value + (new - old) * wide(theta0[key]) for key, value in total.items()
        }
        return {**state, "u_sum": grown}

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        r"""Add the replies' deltas to :math:`S`; return :math:`S/N`."""
        assert self.num_clients is not None and self.global_arrays is not None
        k = self.num_clients
        new_state: dict[str, Any] = {}
        if state["u_sum"] is None:
            # No round aggregated yet, so the model sent is still theta^0 and
            # every client, sampled or not, counts at it.
            theta0 = record_to_dict(self.global_arrays)
            total = {key: k * wide(value) for key, value in theta0.items()}
            new_state["initial"] = theta0
        else:
            theta0 = dict(state["initial"])
            total = {key: wide(value) for key, value in state["u_sum"].items()}
        fresh = 0
        for reply in replies:
            delta = reply.arrays[FEDADMM_DELTA_RECORD]
            held = self.client_held_state(reply)
            fresh += not held
            for key in total:
                change = wide(delta[key])
                if not held:  # measured from zero; S counted the client at theta^0
                    change -= wide(theta0[key])
                total[key] += change
        new_state["u_sum"] = total
        model = {
            key: mean_over(value, k, theta0[key].dtype) for key, value in total.items()
        }
        return RoundUpdate(
            dict_to_record(model), new_state, {FEDADMM_FRESH_METRIC: fresh}
        )


__all__ = [
    "FEDADMM_APPLIED_KEY",
    "FEDADMM_DELTA_RECORD",
    "FEDADMM_FRESH_METRIC",
    "FEDADMM_RHO_KEY",
    "FedADMM",
]


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; each sets both state fields.
CASES = {
    "default": lambda n: FedADMM(rho=0.1, num_clients=n),
    # Stragglers run fewer epochs and are kept: FedADMM's unequal local work.
    "stragglers": lambda n: FedADMM(
        rho=1.0, num_clients=n, local_epochs=3, drop_percent=0.5, seed=1
    ),
    # N learned from the grid at round 1 (num_clients=None).
    "learned-k": lambda n: FedADMM(rho=1.0, min_available_nodes=n),
}

r"""FedNova (Wang et al., NeurIPS 2020): normalised averaging of local updates.

J. Wang, Q. Liu, H. Liang, G. Joshi and H. V. Poor, "Tackling the Objective
Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS 2020
(arXiv:2007.07481); official code: github.com/JYWa/FedNova.

Client :math:`i` starts from the global model :math:`x` and runs
:math:`\tau_i` local steps of size :math:`\eta`; :math:`\tau_i` may differ
between clients (data sizes, speeds, stragglers). It ends at :math:`y_i`, and
:math:`x - y_i = \eta \sum_k a_{i,k} g_{i,k}`: a combination of its stochastic
gradients whose weights depend on its local solver (the paper's Section 4).
Their sum is the normaliser :math:`a_i = \lVert \mathbf{a}_i \rVert_1`:

* plain SGD: :math:`\mathbf{a}_i = [1, \dots, 1]`, so :math:`a_i = \tau_i`;
* FedProx's proximal SGD (each step adds :math:`\mu(y - x)` to the
  gradient): :math:`\mathbf{a}_i = [(1-\eta\mu)^{\tau_i-1}, \dots,
  1-\eta\mu, 1]`, so

.. math::
    a_i = \sum_{k=0}^{\tau_i - 1} (1 - \eta\mu)^k
        = \frac{1 - (1 - \eta\mu)^{\tau_i}}{\eta\mu}.

FedAvg averages :math:`y_i`, which weights client :math:`i`'s gradients by
:math:`p_i a_i`: it minimises a surrogate objective biased towards the clients
that work more (the paper's Theorem 1). FedNova averages the *normalised*
updates :math:`d_i = (x - y_i) / a_i` with the weights :math:`p_i = n_i /
\sum_j n_j` and rescales by the effective number of steps (the paper's
Section 5):

.. math::
    x \leftarrow x - \tau_{\mathrm{eff}} \sum_i p_i\, d_i,
    \qquad \tau_{\mathrm{eff}} = \sum_i p_i\, a_i .

With equal :math:`\tau_i` it is FedAvg (or FedProx) bit for bit up to
rounding; with unequal ones its fixed point is a stationary point of the true
objective :math:`\sum_i p_i f_i`. The official code divides by the same
:math:`a_i` but takes :math:`\tau_{\mathrm{eff}} = \sum_i p_i \tau_i` when
:math:`\mu > 0`; here it is :math:`\sum_i p_i a_i` in both cases, the paper's
choice, so that FedNova equals FedProx when every client runs the same steps.

Wire: the strategy sends ``fednova-mu`` (:data:`FEDNOVA_MU_KEY`); a client
replies with :math:`y_i` (the usual model record) and the metrics
``fednova-tau`` (:math:`\tau_i`, an int >= 1) and ``fednova-a``
(:math:`a_i \in [1, \tau_i]`), from which the server computes :math:`d_i`. The
server keeps no state.

This module is the server's half and imports no torch (a ServerApp without
central evaluation never loads it); the client's half is :mod:`flwr_fednova.client`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from flwr_prox_strategies.extend import (
    MetricSpec,
    ReplyRejected,
    RoundUpdate,
    ValidatedFedAvg,
    ValidReply,
    check_non_negative,
    dict_to_record,
    record_to_dict,
)

#: The train-config key of the proximal constant :math:`\mu` (0: plain SGD).
FEDNOVA_MU_KEY = "fednova-mu"
#: Reply metric: :math:`\tau_i`, the local steps the client took.
FEDNOVA_TAU_METRIC = "fednova-tau"
#: Reply metric: :math:`a_i`, the normaliser of the client's update.
FEDNOVA_A_METRIC = "fednova-a"
#: Reported (value 1) by clients that apply FedNova's rule (FedNovaRule).
FEDNOVA_APPLIED_KEY = "fednova-applied"
#: Round metric: :math:`\tau_{\mathrm{eff}}` of the aggregated round.
FEDNOVA_TAU_EFF_METRIC = "fednova-tau-eff"


def normaliser(steps: int, eta_mu: float) -> float:
    r"""Return :math:`a_i = \sum_{k<\tau_i} (1 - \eta\mu)^k` for ``steps`` steps.

    Parameters
    ----------
    steps : int
        :math:`\tau_i`, the local steps taken (>= 0).
    eta_mu : float
        :math:`\eta\mu`, in ``[0, 1)``; 0 is plain SGD (:math:`a_i = \tau_i`).

    Returns
    -------
    float
        :math:`a_i`; :math:`(1 - (1 - \eta\mu)^{\tau_i}) / (\eta\mu)` when
        :math:`\eta\mu > 0`.

    Raises
    ------
    ValueError
        If ``eta_mu`` is not in ``[0, 1)``: at :math:`\eta\mu \ge 1` a proximal
        step overshoots the anchor and :math:`a_i` stops measuring progress.
    """
    if not 0.0 <= eta_mu < 1.0:
        raise ValueError(
            f"FedNova's proximal solver needs 0 <= lr * mu < 1, got {eta_mu!r}: "
            "lower the learning rate or mu"
        )
    if eta_mu == 0.0:
        return float(steps)
    # expm1/log1p keep a_i accurate when eta*mu is tiny (a_i -> tau_i).
    return -math.expm1(steps * math.log1p(-eta_mu)) / eta_mu


class FedNova(ValidatedFedAvg):
    r"""FedNova strategy: average the normalised updates, rescale by tau_eff.

    The server computes each client's normalised update
    :math:`d_i = (x - y_i)/a_i` from the model it sent (:math:`x`) and the
    one it received (:math:`y_i`), and takes
    :math:`x \leftarrow x - \tau_{\mathrm{eff}} \sum_i p_i d_i` with
    :math:`\tau_{\mathrm{eff}} = \sum_i p_i a_i` (Wang et al., 2020,
    Section 5). Clients report :math:`\tau_i` and :math:`a_i`
    (:class:`~flwr_fednova.client.FedNovaRule`). No server state.

    Parameters
    ----------
    mu : float (default: 0.0)
        The proximal constant :math:`\mu \ge 0` of the clients' local solver
        (FedProx's :math:`\frac{\mu}{2}\lVert y - x\rVert^2`); 0: plain SGD,
        the paper's vanilla FedNova.
    **kwargs
        Keyword arguments of
        :class:`~flwr_prox_strategies.extend.ValidatedFedAvg`
        (``weighting``: ``"num-examples"``, the paper's
        :math:`p_i = n_i / n`, or ``"uniform"``; ``local_epochs``,
        ``local_steps``, ``drop_percent``, ``seed``, ...).

    Raises
    ------
    ValueError
        If ``mu`` is negative or not finite, or a keyword argument of the base
        is out of range (naming it).
    TypeError
        If a keyword is unknown.

    Notes
    -----
    The client side of the contract (:class:`~flwr_fednova.client.FedNovaClient`
    implements it)::

        mu = config["fednova-mu"]
        for step in range(tau):             # tau may differ between clients
            loss.backward()
            for p, p_global in zip(params, global_params):
                p.grad += mu * (p - p_global)
            optimizer.step()                # plain SGD, step size lr
        a = tau if mu == 0 else (1 - (1 - lr * mu) ** tau) / (lr * mu)

    and replies with its model and the metrics ``fednova-tau`` (``tau``),
    ``fednova-a`` (``a``) and ``fednova-applied`` (1). A reply without
    ``fednova-tau`` or ``fednova-a``, or with :math:`a_i` outside
    :math:`[1, \tau_i]` (or :math:`\ne \tau_i` when :math:`\mu = 0`), is
    rejected: its update cannot be normalised.

    Float arrays of the model are combined as above (in float64); other
    arrays (integer buffers) are averaged with the weights :math:`p_i`.

    References
    ----------
    J. Wang, Q. Liu, H. Liang, G. Joshi and H. V. Poor, "Tackling the
    Objective Inconsistency Problem in Heterogeneous Federated Optimization",
    NeurIPS 2020. https://arxiv.org/abs/2007.07481; official code:
    https://github.com/JYWa/FedNova
    """

    # Partial work is what FedNova normalises: stragglers are kept.
    straggler_policy = "keep-partial"
    rule_metric = FEDNOVA_APPLIED_KEY
    rule_name = "FedNova's normalised update"
    settings = ("mu", "weighting", "seed")

    def __init__(self, *, mu: float = 0.0, **kwargs: Any) -> None:
        check_non_negative("mu", mu)
        super().__init__(**kwargs)
        self.mu = float(mu)

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send ``fednova-mu`` every round (also 0: it names the protocol)."""
        return {FEDNOVA_MU_KEY: self.mu}

    def expected_train_metrics(self, server_round: int) -> dict[str, MetricSpec]:
        r"""Expect :math:`\tau_i \ge 1` and :math:`a_i \ge 1` in every reply."""
        expected = super().expected_train_metrics(server_round)
        expected[FEDNOVA_TAU_METRIC] = MetricSpec(kind="int", minimum=1)
        # a_i >= 1 once a step is taken (its last weight is 1).
        expected[FEDNOVA_A_METRIC] = MetricSpec(kind="float", minimum=1.0)
        return expected

    def check_reply(self, reply: ValidReply) -> None:
        r"""Reject an :math:`a_i` no solver with :math:`\eta\mu < 1` can produce."""
        super().check_reply(reply)
        tau = int(reply.metrics[FEDNOVA_TAU_METRIC])  # type: ignore[arg-type]
        a = float(reply.metrics[FEDNOVA_A_METRIC])  # type: ignore[arg-type]
        # The weights (1 - eta mu)^k are at most 1: a_i <= tau_i (rounding aside).
        if a > tau * (1.0 + 1e-9):
            raise ReplyRejected(
                FEDNOVA_A_METRIC,
                f"'{FEDNOVA_A_METRIC}' = {a!r} exceeds '{FEDNOVA_TAU_METRIC}' = "
                f"{tau}: no local SGD of {tau} steps has that normaliser",
            )
        if self.mu == 0.0 and a != tau:
            raise ReplyRejected(
                FEDNOVA_A_METRIC,
                f"'{FEDNOVA_A_METRIC}' = {a!r} but '{FEDNOVA_TAU_METRIC}' = {tau} "
                "with mu = 0: plain SGD's normaliser is its number of steps",
            )

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        r"""Return :math:`x - \tau_{\mathrm{eff}} \sum_i p_i (x - y_i)/a_i`."""
        assert self.global_arrays is not None
        x = record_to_dict(self.global_arrays)
        weights = [self.reply_weight(reply) for reply in replies]
        total = sum(weights)
        p = [w / total for w in weights]
        a = [float(reply.metrics[FEDNOVA_A_METRIC]) for reply in replies]  # type: ignore[arg-type]
        tau_eff = sum(p_i * a_i for p_i, a_i in zip(p, a, strict=True))
        models = [reply.arrays[self.arrayrecord_key] for reply in replies]
        new: dict[str, NDArray] = {}
        mean: dict[str, NDArray] | None = None
        for key, x_key in x.items():
            if not np.issubdtype(x_key.dtype, np.floating):
                # Counters (BatchNorm's num_batches_tracked) are not SGD iterates.
                mean = mean if mean is not None else self.weighted_mean(replies)
                new[key] = mean[key]
                continue
            x64 = x_key.astype(np.float64)
            direction = np.zeros_like(x64)
            for p_i, a_i, model in zip(p, a, models, strict=True):
                direction += (p_i / a_i) * (x64 - model[key])
            new[key] = (x64 - tau_eff * direction).astype(x_key.dtype)
        return RoundUpdate(dict_to_record(new), {}, {FEDNOVA_TAU_EFF_METRIC: tau_eff})


__all__ = [
    "FEDNOVA_APPLIED_KEY",
    "FEDNOVA_A_METRIC",
    "FEDNOVA_MU_KEY",
    "FEDNOVA_TAU_EFF_METRIC",
    "FEDNOVA_TAU_METRIC",
    "FedNova",
    "normaliser",
]


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes.
CASES = {
    "default": lambda n: FedNova(min_available_nodes=n),
    "proximal": lambda n: FedNova(mu=0.1, min_available_nodes=n),
    "uniform": lambda n: FedNova(min_available_nodes=n, weighting="uniform"),
}

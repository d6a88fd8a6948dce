r"""FedEPM: the exact penalty method with noisy uploads (Zhou and Li, 2022).

S. Zhou and G. Y. Li, "Exact Penalty Method for Federated Learning", 2022
(arXiv:2208.11231); official code (MATLAB): github.com/ShenglongZhou/FedEPM.
The update as implemented, the defaults (the paper's experiments), the privacy
accounting, the state, the wire keys and the deviations from the official code
(:func:`official_stop` is its stopping rules): the pack's FedEPM page
(``docs/algorithms/fedepm.md``); validation and wire keys also in
:class:`FedEPM`'s Notes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from ..core.client.client import TorchClient
from ..core.client.rule import ClientRule
from ..core.client.training import TrainReport, evaluate_model, full_gradient, trainable
from ..core.contract.fields import RoundUpdate
from ..core.contract.ledger import (
    DELTA_METRIC,
    EPSILON_METRIC,
    EPSILON_TOTAL_METRIC,
    spend_epsilon,
)
from ..core.contract.validation import ReplyRejected, ValidReply
from ..core.server.strategy import ValidatedFedAvg
from ..core.transport.keys import CLIENT_KEY_METRIC
from ..core.transport.records import dict_to_record, float_keys, record_to_dict
from ..ops.checks import (
    check_choice,
    check_int,
    check_non_negative,
    check_positive,
    check_unset,
)
from ..ops.elastic_net import PaperLogistic as PaperLogistic
from ..ops.elastic_net import default_eta, prox_linear_steps, table_center, with_rows
from ..ops.elastic_net import official_partition as official_partition
from ..ops.elastic_net import official_stop as official_stop
from ..ops.privacy import add_laplace_noise

#: The train-config key of the round's first iteration :math:`(r-1)k_0`.
ITERATION_KEY = "fedepm-iteration"
K0_KEY = "fedepm-k0"
LAMBDA_KEY = "fedepm-lambda"
ETA_KEY = "fedepm-eta"
R0_KEY = "fedepm-r0"
GROWTH_KEY = "fedepm-growth"
NOISE_KEY = "fedepm-noise"
#: Reported by clients that apply FedEPM's rule (FedEPMRule).
FEDEPM_APPLIED_KEY = "fedepm-applied"
LOCAL_STATE = "fedepm-local"

#: What FedEPM and S-FedAvg derive from ``rho`` and ``k0``: not keywords of theirs.
SAMPLING_KEYWORDS = ("fraction_train", "min_train_nodes", "local_epochs", "local_steps")
#: ``f_i`` and its full gradient at the model's current point.
Objective = Callable[[], tuple[float, list[torch.Tensor]]]


class FedEPM(ValidatedFedAvg):
    r"""FedEPM strategy: elastic-net centre of every client's latest noisy upload.

    The exact penalty method (Zhou and Li, 2022) on model (III), consensus
    relaxed by an elastic-net penalty
    :math:`\sum_i \lambda\lVert x_i - x\rVert_1 + \frac{\eta}{2}\lVert x_i -
    x\rVert^2`. One Flower round is one communication: the server takes the
    coordinate-wise elastic-net centre of the latest uploads of **all**
    :math:`m` clients (stale ones for clients not sampled; exact, by sorting),
    and each of the :math:`\lceil\rho m\rceil` sampled clients computes one
    full gradient at the server point, takes :math:`k_0` closed-form
    prox-linear steps and uploads its model plus Laplace noise of scale
    :math:`2\lVert g_i\rVert_1/(\mu_i\varepsilon)` (the paper's data-dependent
    sensitivity bound, not a proven worst case: for a data-independent
    guarantee use :class:`LaplaceUploadMod`). Defaults are the paper's
    experiments. Its clients are :class:`FedEPMClient` or your own code with
    :class:`FedEPMRule`.

    Parameters
    ----------
    num_clients : int | None (default: None)
        :math:`m`, all clients (each keeps one upload slot), checked every
        round. None: the number of nodes connected at the first round (logged);
        the sampling and the default ``eta`` then follow from it.
    rho : float (default: 0.5)
        Fraction of clients sampled per communication (:math:`\lceil\rho m\rceil`).
    k0 : int (default: 10)
        Local iterations between communications.
    eta : float | None (default: None)
        :math:`\eta > 0`; None: the paper's
        :math:`\eta = (0.02m + 1)(\rho + 0.1)10^{-5}`.
    lam : float | None (default: None)
        :math:`\lambda \ge 0`; None: :math:`\eta/2`.
    r0 : float (default: 0.05)
        Base of the clients' proximal weight :math:`\mu_i`.
    growth : float (default: 1.001)
        Per-iteration growth of :math:`\mu_i`.
    noise : float (default: 0.1)
        :math:`\varepsilon` per upload; 0 turns the noise off.
    table : str (default: "dense")
        The server's table of every client's latest upload: ``"dense"``
        allocates all :math:`m` rows at the start, as the official code does
        (8 GB for 10,000 clients of a 0.8 MB model); ``"seen"`` keeps a row per
        client that has uploaded and one, weighted by their number, for the
        initial model the others hold: the same centre up to the order of
        float additions, in memory that grows with the clients seen.
    **kwargs
        Keyword arguments of :class:`FedAvg`, except ``fraction_train``,
        ``min_train_nodes``, ``local_epochs``, ``local_steps``, ``weighting``
        and ``weighted_by_key``, which FedEPM sets itself (``rho``, ``k0``;
        the centre weighs every slot alike).

    Raises
    ------
    ValueError
        If a parameter is out of range, naming it: ``num_clients`` or ``k0``
        not an integer >= 1, ``rho`` outside ``(0, 1]``, ``eta`` or ``r0`` not
        > 0, ``lam`` or ``noise`` negative, ``growth`` below 1, ``table`` not
        ``"dense"`` or ``"seen"``; or if a keyword FedEPM sets itself is given.
    TypeError
        If a keyword is unknown.

    Notes
    -----
    Clients report ``fedepm-applied`` (their steps whose update held the
    rule's term, measured) beside ``local-steps``; replies without it are
    named in a warning once per run (rejected with ``strict=True``). The centre is
    not linear in the uploads (an upload's :math:`+\infty` becomes the others'
    minimum), so every upload is checked for NaN and inf before it enters the
    table. Train config keys: ``fedepm-iteration``, ``fedepm-k0``,
    ``fedepm-lambda``, ``fedepm-eta``, ``fedepm-r0``, ``fedepm-growth``,
    ``fedepm-noise``.

    References
    ----------
    S. Zhou and G. Y. Li, "Exact Penalty Method for Federated Learning", 2022.
    https://arxiv.org/abs/2208.11231; official code:
    https://github.com/ShenglongZhou/FedEPM
    """

    stateful_clients = True
    requires_num_clients = True
    model_linear_in_replies = False  # see Notes
    rule_metric = FEDEPM_APPLIED_KEY
    rule_name = "FedEPM's local proximal iterations and noisy upload"
    state_fields = ("uploads", "slots")
    secure_refusal = (
        "its centre is an elastic-net problem over its table of every client's "
        "latest upload, which needs each upload, not their sum; FedEPM protects "
        "uploads with its own Laplace noise (epsilon per upload) instead"
    )
    #: The iteration counter sent to clients is ``(round - 1) * k0``.
    resume_settings = ("k0", "table")
    settings = ("num_clients", "rho", "k0", "eta", "lam", "r0", "growth", "noise")
    tables = ("dense", "seen")

    def __init__(
        self,
        *,
        num_clients: int | None = None,
        rho: float = 0.5,
        k0: int = 10,
        eta: float | None = None,
        lam: float | None = None,
        r0: float = 0.05,
        growth: float = 1.001,
        noise: float = 0.1,
        table: str = "dense",
        **kwargs: Any,
    ) -> None:
        check_choice("table", table, self.tables)
        if num_clients is not None:
            check_int("num_clients", num_clients, 1)
        if not (isinstance(rho, (int, float)) and 0.0 < rho <= 1.0):
            raise ValueError(f"rho must be in (0, 1], got {rho!r}")
        check_int("k0", k0, 1)
        if eta is not None:
            check_positive("eta", eta)
        if lam is not None:
            check_non_negative("lam", lam)
        check_positive("r0", r0)
        if not (isinstance(growth, (int, float)) and growth >= 1.0):
            raise ValueError(f"growth must be >= 1, got {growth!r}")
        check_non_negative("noise", noise)
        check_unset(
            "FedEPM",
            kwargs,
            (*SAMPLING_KEYWORDS, "weighting", "weighted_by_key"),
            "rho, k0; the elastic-net centre weighs every slot alike",
        )
        super().__init__(
            num_clients=num_clients,
            fraction_train=float(rho),
            min_train_nodes=1,  # ceil(rho * m), set with m (learn_num_clients)
            weighting="uniform",
            **kwargs,
        )
        self.rho = float(rho)
        self.k0 = k0
        self._eta_given, self._lam_given = eta, lam
        self.eta = math.nan  # set with m when not given
        self.lam = math.nan
        if num_clients is not None:
            self.learn_num_clients(num_clients)
        self.r0 = float(r0)
        self.growth = float(growth)
        self.noise = float(noise)
        self.table = table
        # key -> (rows, *shape): m rows ("dense"), or row 0 the initial model and
        # one row per client seen ("seen")
        self.uploads: dict[str, NDArray] | None = None
        self.slots: dict[int, int] = {}  # client key -> row of self.uploads

    def learn_num_clients(self, num_clients: int) -> None:
        """Set m, and what follows from it: the sample size, eta and lambda."""
        super().learn_num_clients(num_clients)
        self.min_train_nodes = math.ceil(self.rho * num_clients)
        eta = self._eta_given
        self.eta = float(default_eta(num_clients, self.rho) if eta is None else eta)
        check_positive("eta", self.eta)
        lam = self._lam_given
        self.lam = float(self.eta / 2 if lam is None else lam)
        check_non_negative("lam", self.lam)

    def train_config(self, server_round: int) -> dict[str, Any]:
        """Send the penalties, the iteration counter and the noise level."""
        if self.uploads is None:  # every slot starts at the initial model
            assert self.global_arrays is not None and self.num_clients is not None
            initial = record_to_dict(self.global_arrays)
            rows = self.num_clients if self.table == "dense" else 1
            self.uploads = {
                key: np.repeat(initial[key][None], rows, axis=0)
                for key in float_keys(initial)
            }
        return {
            ITERATION_KEY: (server_round - 1) * self.k0,
            K0_KEY: self.k0,
            LAMBDA_KEY: self.lam,
            ETA_KEY: self.eta,
            R0_KEY: self.r0,
            GROWTH_KEY: self.growth,
            NOISE_KEY: self.noise,
        }

    def check_reply(self, reply: ValidReply) -> None:
        """Also refuse a client beyond the ``num_clients`` upload slots."""
        super().check_reply(reply)
        key = int(reply.metrics[CLIENT_KEY_METRIC])  # type: ignore[arg-type]
        if key not in self.slots and len(self.slots) >= (self.num_clients or 0):
            raise ReplyRejected(
                "client-key",
                f"client {key} would be client number {len(self.slots) + 1}, but "
                f"num_clients={self.num_clients}",
            )

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        """Replace the repliers' uploads, then take the elastic-net centre.

        A client new to the table takes the next free slot. The new table and
        slots are the round's state; the clients' mean objective at the sent
        model (when they report it) is its metric.
        """
        assert state["uploads"] is not None and self.global_arrays is not None
        assert self.num_clients is not None
        slots = dict(state["slots"])
        first_row = 0 if self.table == "dense" else 1  # "seen": row 0 is x^0
        rows = []
        for reply in replies:
            key = int(reply.metrics[CLIENT_KEY_METRIC])  # type: ignore[arg-type]
            rows.append(slots.setdefault(key, first_row + len(slots)))
        uploads = {
            name: with_rows(
                table,
                len(slots) + first_row,
                rows,
                [reply.arrays[self.arrayrecord_key][name] for reply in replies],
            )
            for name, table in state["uploads"].items()
        }
        model = record_to_dict(self.global_arrays)
        # "seen": the clients still at x^0, weighing row 0; "dense": no such row
        unseen = None if self.table == "dense" else self.num_clients - len(slots)
        for name, table in uploads.items():
            # The current model, last round's centre, spares sorting the
            # coordinates whose optimum no new upload moved past (same centre).
            centre = table_center(table, self.lam, self.eta, unseen, model[name])
            model[name] = centre.astype(model[name].dtype)
        values = [
            float(v)
            for r in replies
            if isinstance(v := r.metrics.get("fedepm-objective"), (int, float))
        ]
        return RoundUpdate(
            dict_to_record(model),
            {"uploads": uploads, "slots": slots},
            {"fedepm-objective-mean": float(np.mean(values))} if values else {},
        )


class FedEPMRule(ClientRule):
    r"""FedEPM's client rule: k0 closed-form prox-linear steps, noisy upload.

    FedEPM takes no SGD steps, so it has no gradient term for a training loop:
    give :meth:`solve` your objective, a function returning :math:`f_i` and
    its full gradient at the model's current point (your loss, your data,
    any batch format), and it runs the round's iterations from the server
    point and the client's last local point (kept in the state), then adds
    the paper's Laplace noise to the upload::

        rule = FedEPMRule.from_message(msg, context, model, num_examples=n)
        rule.solve(lambda: my_loss_and_full_gradient(model))
        return rule.reply(num_examples=n)

    Parameters
    ----------
    num_examples : int
        :math:`d_i`, the local data size (the step scale :math:`\mu/d_i`).
    seed : int | None (default: None)
        Seeds the upload noise per (seed, client, round).
    *args, **kwargs
        As :class:`ClientRule` (``model``, ``config``, ``received``, ``state``,
        ``client_key``, ``relative_size``, ``base_lr``); build the rule with
        :meth:`ClientRule.from_message`, which passes them.

    Raises
    ------
    ValueError
        If ``num_examples`` is not an integer >= 1.
    ProtocolError
        If the train config lacks FedEPM's keys (the server is not running
        FedEPM).
    """

    protocol = "FedEPM"
    applied_metric = FEDEPM_APPLIED_KEY
    stateful = True
    keeps_privacy_ledger = True  # the Laplace release's epsilon, spent is spent
    state_names = (LOCAL_STATE,)

    def __init__(
        self, *args: Any, num_examples: int, seed: int | None = None, **kwargs: Any
    ) -> None:
        check_int("num_examples", num_examples, 1)
        self.num_examples = int(num_examples)
        self.seed = seed
        self.round_metrics: dict[str, Any] = {}
        super().__init__(*args, **kwargs)

    def setup(self) -> None:
        """Read the round's iteration counter, k0 and the penalty settings."""
        self.first = int(self.required(ITERATION_KEY))
        self.k0 = int(self.required(K0_KEY))
        self.r0 = float(self.required(R0_KEY))
        self.growth = float(self.required(GROWTH_KEY))
        self.epsilon = float(self.required(NOISE_KEY))
        return None

    def solve(self, objective: Objective) -> TrainReport:
        """Run the k0 closed-form iterations and build the noisy upload.

        Parameters
        ----------
        objective : callable
            ``objective() -> (f_i, gradient)``: the local objective's value and
            its full gradient (one tensor per trainable parameter) at the
            model's current point, which the rule sets to the server point.

        Returns
        -------
        TrainReport
            What the round did (``steps`` is ``k0``, ``mean_loss`` is
            :math:`f_i` at the server point); the model now holds the noisy
            upload.
        """
        lam = float(self.required(LAMBDA_KEY))
        eta = float(self.required(ETA_KEY))
        d = self.num_examples
        value, grads = objective()
        with torch.no_grad():
            x = [p.detach().clone() for p in self.params]
            local = self.state.get_tensors(LOCAL_STATE, self.params)
            if self.state.get(LOCAL_STATE) is None:
                local = [v.clone() for v in x]
            local, mu = prox_linear_steps(
                x,
                local,
                grads,
                range(self.first, self.first + self.k0),
                lam=lam,
                eta=eta,
                r0=self.r0,
                growth=self.growth,
                size=d,
            )
            self.state.set_pending(LOCAL_STATE, local, self.server_round)
            for p, value_now in zip(self.params, local, strict=True):
                p.copy_(value_now)
        self.round_metrics = {"fedepm-mu": mu, **self.noisy_upload(value, grads, mu)}
        self.took_steps(self.k0)
        return TrainReport(epochs=0, steps=self.k0, examples_seen=d, mean_loss=value)

    def noisy_upload(
        self, value: float, grads: list[torch.Tensor], mu: float
    ) -> dict[str, Any]:
        r"""Release the model, calibrated as the paper: :math:`\Delta = 2\|g\|_1/\mu`.

        ``grads`` is the gradient at the server point; returns the round's
        metrics (objective there, :math:`\|g\|_1`, and what :meth:`release` spent).
        """
        grad_l1 = sum(float(g.abs().sum()) for g in grads)
        return {
            "fedepm-objective": value,
            "fedepm-grad-l1": grad_l1,
            **self.release(2 * grad_l1 / mu, self.epsilon),
        }

    def release(self, sensitivity: float, epsilon: float) -> dict[str, Any]:
        r"""Add Laplace(:math:`\Delta/\varepsilon`) noise to the model, count epsilon.

        ``epsilon = 0`` releases the model as it is. Privacy is spent at release,
        whether or not the server then uses the upload.
        """
        if epsilon == 0:
            return {}
        scale = sensitivity / epsilon
        rng = np.random.default_rng(
            None
            if self.seed is None
            else [self.seed, self.client_key % (1 << 31), self.server_round]
        )
        noisy = add_laplace_noise(
            [p.detach().cpu().numpy() for p in self.params], scale, rng
        )
        with torch.no_grad():
            for p, upload in zip(self.params, noisy, strict=True):
                p.copy_(torch.as_tensor(upload))
        return {
            "laplace-scale": scale,
            EPSILON_METRIC: epsilon,
            EPSILON_TOTAL_METRIC: spend_epsilon(self.state.records, epsilon),
            DELTA_METRIC: 0.0,  # pure epsilon-DP
        }

    def finish(
        self, steps: int, lr: float
    ) -> tuple[dict[str, list[NDArray]], dict[str, Any]]:
        """Report f_i at the server point, the noise scale and epsilon spent."""
        return {}, dict(self.round_metrics)


class FedEPMClient(TorchClient):
    r"""FedEPM client: k0 closed-form prox-linear steps from one gradient, noisy upload.

    Runs :class:`FedEPMRule` on the client's objective :math:`f_i`: the mean
    loss of any torch model over the local data, plus the ridge term (the
    paper: logistic loss, :math:`\beta = 10^{-3}`).

    Parameters
    ----------
    *args, **kwargs
        As :class:`FedAvgClient` (``seed`` also seeds the noise per round; the
        learning rate is not used; ``dp`` is refused).
    ridge : float (default: 0.0)
        :math:`\beta \ge 0`: :math:`f_i` is the mean loss plus
        :math:`\beta/(2 d_i)\lVert x\rVert^2` (the paper uses :math:`10^{-3}`).

    Raises
    ------
    ValueError
        If ``dp`` is given (FedEPM privatises its upload with its own Laplace
        mechanism), ``ridge`` is negative, or a keyword argument of
        :class:`FedAvgClient` is out of range.
    """

    protocol = "FedEPM"
    rule_class = FedEPMRule

    def __init__(self, *args: Any, ridge: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.dp is not None:
            raise ValueError(
                f"dp: {type(self).__name__} takes full-gradient steps and privatises "
                "its upload with the paper's Laplace mechanism (the strategy's "
                "noise-epsilon, reported as dp-epsilon like DP-SGD's); DP-SGD does "
                "not apply to it"
            )
        check_non_negative("ridge", ridge)
        self.ridge = float(ridge)

    def objective_and_gradient(
        self, *, with_value: bool = True
    ) -> tuple[float, list[torch.Tensor]]:
        r"""Return :math:`f_i(x)` (NaN unless ``with_value``), :math:`\nabla f_i(x)`."""
        d = self.num_train_examples()
        params = trainable(self.model)
        loss = math.nan
        if with_value:
            loss, _, _ = evaluate_model(
                self.model, self.train_loader, self.loss_fn, device=self.device
            )
        grads = full_gradient(
            self.model, self.train_loader, self.loss_fn, device=self.device
        )
        with torch.no_grad():
            value = loss + self.ridge / (2 * d) * sum(
                float((p.double() ** 2).sum()) for p in params
            )
            grads = [
                g + (self.ridge / d) * p for g, p in zip(grads, params, strict=True)
            ]
        return value, grads

    def rule_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """Give the rule :math:`d_i` and the noise seed."""
        return {"num_examples": self.num_train_examples(), "seed": self.seed}

    def local_solve(
        self, config: dict[str, Any], *, epochs: int, steps: int | None
    ) -> TrainReport:
        """Run the rule's iterations on this client's objective."""
        rule = self.make_rule(config)
        assert isinstance(rule, FedEPMRule)
        return rule.solve(self.objective_and_gradient)


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: FedEPM(num_clients=n, rho=1.0),
    "l1-heavy": lambda n: FedEPM(num_clients=n, rho=1.0, lam=10.0),
}

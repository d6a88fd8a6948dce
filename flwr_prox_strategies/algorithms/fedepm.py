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
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..core.contract.fields import RoundUpdate
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
from ..ops.elastic_net import default_eta, table_center, with_rows
from ..ops.elastic_net import official_partition as official_partition
from ..ops.elastic_net import official_stop as official_stop

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
    ledger_clients = True
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


#: The configurations the conformance checks run (``flwr_prox_strategies.testing``),
#: name -> factory taking the number of nodes; together they set every state field.
CASES = {
    "default": lambda n: FedEPM(num_clients=n, rho=1.0),
    "l1-heavy": lambda n: FedEPM(num_clients=n, rho=1.0, lam=10.0),
}

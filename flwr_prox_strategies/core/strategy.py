"""The validated strategy base every strategy of the pack inherits.

It keeps Flower's ``FedAvg`` interface (so ``strategy.start(...)`` and Flower's DP
wrappers work unchanged) and runs a round; each job it delegates lives in a
module named for it:

* :mod:`.screening` (replies validated against what was sent, hostile claims and
  sizes bounded, a dead node's reply attributed to it) and :mod:`.finite` (the
  server rule re-run without replies holding NaN, inf or huge values);
* :mod:`.sampling` (seeded per round, bounded waits, stragglers) and
  :mod:`.messages` (one fresh message per node);
* :mod:`.commit` (the server's half of the two-phase commit of client state) and
  :mod:`.population` (K, the number of all clients: learned, grown, restored);
* :mod:`.fields` and :mod:`.resume` (declared state, from which ``state_dict``,
  ``load_state_dict``, ``repr`` and :mod:`.summary` follow);
* :mod:`.outcome`, :mod:`.metrics` and :mod:`.privacy` (a round without a valid
  reply keeps the model and says why; the round's metrics; the epsilon ledger).

An algorithm subclasses it, declares its state in class attributes and
overrides a few hooks (``flwr_prox_strategies.extend`` is the guide):
:meth:`~ValidatedFedAvg.server_update` (its server rule, pure), and when it
needs them :meth:`~ValidatedFedAvg.grown_state`, :meth:`~ValidatedFedAvg.train_config`,
:meth:`~ValidatedFedAvg.train_records` / :meth:`~ValidatedFedAvg.node_train_records`,
:meth:`~ValidatedFedAvg.expected_train_arrays`, :meth:`~ValidatedFedAvg.check_reply`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from numpy.typing import NDArray

from ..ops.aggregate import WeightedMean
from . import keys, metrics, population, sampling, screening
from .commit import ClientBook
from .fields import RoundUpdate, settings_text
from .finite import finite_update
from .messages import node_messages, payload_bytes
from .outcome import finish_run
from .privacy import record_privacy
from .records import RecordSpec, dict_to_record, spec_of
from .resume import restore_strategy, strategy_state
from .summary import log_summary
from .validation import (
    ReplyRejected,
    ValidReply,
    check_base_options,
    check_int,
    check_weight,
    init_keywords,
    reject_unknown_kwargs,
    resolve_weighting,
)

MetricsFn = Callable[[list[RecordDict], str], MetricRecord]


class ValidatedFedAvg(FedAvg):
    """Federated averaging with validated replies, seeded sampling and stragglers.

    This is the pack's FedAvg baseline and the base of every pack strategy.

    Parameters
    ----------
    fraction_train, fraction_evaluate : float (default: 1.0)
        Fraction of connected nodes sampled for training / federated evaluation.
    participation : str (default: "fixed")
        ``"fixed"``: exactly ``max(int(fraction_train * n), min_train_nodes)`` of
        the ``n`` connected nodes, uniformly without replacement (Flower's
        ``FedAvg``, the papers' "m clients per round"). ``"bernoulli"``: each
        node joins with probability ``fraction_train``, redrawn while fewer than
        ``max(min_train_nodes, 1)`` join (the official FedDyn/FedDC codes'
        ``act_prob``; 100 nodes at 0.1: 3 to 22 a round over 200 rounds).
    min_train_nodes, min_evaluate_nodes, min_available_nodes : int (default: 2)
        Least nodes sampled for training, for evaluation; connected to start.
    weighting : str | None (default: None)
        ``"num-examples"`` (each reply's sample count) or ``"uniform"`` (plain
        mean); None: the class's :attr:`default_weighting`.
    weighted_by_key : str | None (default: None)
        Flower's name for the weighting: the reply metric that weights the
        average (finite and > 0 in every reply, else it is rejected). Give
        ``weighting`` or ``weighted_by_key``, not both.
    local_epochs, local_steps : int | None (default: None)
        Sent as ``local-epochs`` / ``local-steps`` when set; otherwise clients
        use their own setting.
    drop_percent : float (default: 0.0)
        Fraction of the sampled nodes made stragglers (the FedProx paper's
        systems heterogeneity), each running a random number of epochs in
        ``1 .. local_epochs - 1`` (``np.random.randint(1, E)`` in the official
        code); the class's ``straggler_policy`` drops them (this baseline) or
        keeps their partial work. Needs ``local_epochs >= 2``.
    lr_decay : float (default: 1.0)
        Round ``t`` sends ``lr-scale = lr_decay ** (t - 1)``, which clients
        multiply into their step size (the official FedDyn/FedDC codes: 0.998).
    num_clients : int | None (default: None)
        ``K``, the federation's size, checked every round. Rules that divide by
        all clients (:attr:`requires_num_clients`) take None as "the nodes
        connected at the first round" (:mod:`.population`).
    seed : int (default: 0)
        Seeds node sampling and straggler draws, per round.
    monitor_dissimilarity : bool (default: False)
        Ask clients for their full local gradient at the global model and log
        the FedProx paper's ``B = E_k||grad f_k||^2 / ||grad f||^2`` over the
        round's valid replies (one extra pass, one model-sized upload).
    accept_failures : bool (default: True)
        When False, a round in which any reply failed or was rejected keeps the
        model, as in Flower's legacy strategies.
    node_wait_timeout : float (default: 120.0)
        Seconds to wait for the nodes a round needs before failing with the fix
        (Flower's ``FedAvg`` waits forever).
    min_round_nodes : int | None (default: None)
        Nodes that must be connected for a later round to start (None:
        ``min_available_nodes`` every round). A federation that loses nodes goes
        on with at least this many; stateful rules keep absent clients' state.
    max_num_examples : float | None (default: None)
        Absolute cap on a reply's claimed ``num-examples`` (lowered, logged).
    max_weight_ratio : float | None (default: 100.0)
        Cap on a claim relative to the round's median claim
        (:func:`.screening.cap_claims`, which says when the default binds). It
        bounds a liar in a large federation, not in a small one: there set
        ``max_num_examples`` or ``weighting="uniform"``. None: no cap.
    max_reply_bytes : int | None (default: None)
        Largest reply accepted (bytes of its ArrayRecords), checked before any
        array is decoded. None: twice an honest reply, plus 1 MiB.
    strict : bool (default: False)
        Reject train replies that do not report :attr:`rule_metric` (kind
        ``rule-not-applied``) instead of warning once per run.
    arrayrecord_key, configrecord_key : str
        Record names in the messages (Flower's defaults).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable | None
        Flower-style ``(list[RecordDict], str) -> MetricRecord``, called on the
        valid replies only, with ``weighted_by_key`` for training and
        ``num-examples`` for evaluation. Default: weighted mean of every metric.
    """

    # Stragglers: "drop" (never sent work) or "keep-partial" (their fewer epochs used).
    straggler_policy: ClassVar[str] = "drop"
    # Clients keep state the server sums over (FedDyn, FedDC, SCAFFOLD): the
    # two-phase commit of .commit runs, and replies need an integer client key.
    stateful_clients: ClassVar[bool] = False
    # The metric (value 1) a client reports when it applied this algorithm's
    # rule, what that rule is called and the pack's (client, rule) applying it
    # (None: <Class>Client, <Class>Rule); no rule_metric: any client will do.
    rule_metric: ClassVar[str | None] = None
    rule_name: ClassVar[str] = "client rule"
    rule_pieces: ClassVar[tuple[str, str] | None] = None
    # The rule divides by K, all clients: num_clients=None is learned (.population).
    requires_num_clients: ClassVar[bool] = False
    # Sums over all clients' states (a state lost on a client stays in them,
    # retired), and whether a lost state's zero-state reply is a new client's.
    keeps_client_sums: ClassVar[bool] = False
    accept_lost_state: bool = True
    default_weighting: ClassVar[str] = "num-examples"
    # The model is a positive linear combination of the replies': a NaN or inf
    # reaches it, so the replies' check waits for it (.finite). False for a
    # median-like rule (FedEPM), which can hide an inf: every reply is checked.
    linear_aggregate: ClassVar[bool] = True
    # Declared state (.fields): the rule's state, passed to server_update and
    # replaced by what it returns; the settings a checkpoint must match; the
    # settings repr() and summary() show. What central DP's noise leaves out.
    state_fields: ClassVar[tuple[str, ...]] = ()
    resume_settings: ClassVar[tuple[str, ...]] = ()
    settings: ClassVar[tuple[str, ...]] = (
        "fraction_train",
        "participation",
        "weighting",
        "seed",
    )
    central_dp_caveat: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        participation: str = "fixed",
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighting: str | None = None,
        weighted_by_key: str | None = None,
        local_epochs: int | None = None,
        local_steps: int | None = None,
        drop_percent: float = 0.0,
        lr_decay: float = 1.0,
        num_clients: int | None = None,
        seed: int = 0,
        monitor_dissimilarity: bool = False,
        accept_failures: bool = True,
        node_wait_timeout: float = 120.0,
        max_num_examples: float | None = None,
        max_weight_ratio: float | None = 100.0,
        max_reply_bytes: int | None = None,
        min_round_nodes: int | None = None,
        strict: bool = False,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_metrics_aggr_fn: MetricsFn | None = None,
        evaluate_metrics_aggr_fn: MetricsFn | None = None,
        **unknown: Any,
    ) -> None:
        reject_unknown_kwargs(type(self).__name__, unknown, self.accepted_kwargs())
        weighting, weight_key = resolve_weighting(
            type(self).__name__, weighting, weighted_by_key, self.default_weighting
        )
        check_base_options(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            participation=participation,
            participations=sampling.PARTICIPATION,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            local_epochs=local_epochs,
            local_steps=local_steps,
            drop_percent=drop_percent,
            lr_decay=lr_decay,
            num_clients=num_clients,
            seed=seed,
            node_wait_timeout=node_wait_timeout,
            max_num_examples=max_num_examples,
            max_weight_ratio=max_weight_ratio,
            max_reply_bytes=max_reply_bytes,
            min_round_nodes=min_round_nodes,
        )
        super().__init__(
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weight_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
        )
        self._custom_metrics = (train_metrics_aggr_fn, evaluate_metrics_aggr_fn)
        self.weighting = weighting
        self.participation = participation
        self.local_epochs = local_epochs
        self.local_steps = local_steps
        self.drop_percent = float(drop_percent)
        self.lr_decay = float(lr_decay)
        self.num_clients = num_clients
        self.num_clients_source = "given" if num_clients is not None else "not set"
        self.seed = seed
        self.monitor_dissimilarity = bool(monitor_dissimilarity)
        self.accept_failures = accept_failures
        self.node_wait_timeout = float(node_wait_timeout)
        self.min_round_nodes = min_round_nodes
        self.strict = bool(strict)
        self.max_num_examples = max_num_examples
        self.max_weight_ratio = max_weight_ratio
        self.max_reply_bytes = max_reply_bytes
        self.screen = screening.ReplyScreen()  # reply validation, and what was not used
        self.book = ClientBook()  # the two-phase commit of client state (state)
        # The round's model and sampled nodes: set by configure_*, read by aggregate_*.
        self.global_arrays: ArrayRecord | None = None
        self._global_spec: RecordSpec | None = None
        self.train_nodes: set[int] | None = None
        self.evaluate_nodes: set[int] | None = None
        # Rounds aggregated (state), and the offset a resumed run adds to
        # Strategy.start's round numbers so sampling and client seeds continue.
        self.rounds_completed = 0
        self.round_offset = 0
        # The epsilon ledger (client key or node id -> dp-epsilon-total reported)
        # and the nodes whose budget is spent, never sampled again (state).
        self.epsilon_totals: dict[int, float] = {}
        self.retired_nodes: set[int] = set()
        self._accumulate_in: type[np.floating] | None = None  # float64 on retry
        self._sampled_once = False
        self._rule_warned = False
        self._bytes_sent = 0

    rejections = property(lambda self: self.screen.rejections)
    run_tally = property(lambda self: self.screen.run_tally)
    round_tally = property(lambda self: self.screen.round_tally)

    @classmethod
    def accepted_kwargs(cls) -> set[str]:
        """Return the keyword arguments ``cls(...)`` accepts (its bases' included)."""
        return init_keywords(cls, ValidatedFedAvg)

    def __repr__(self) -> str:
        """Return the class name and its :attr:`settings`."""
        return f"{type(self).__name__}({settings_text(self, self.settings)})"

    def summary(self) -> None:
        """Log the algorithm's :attr:`settings`, the base's checks, then Flower's."""
        log_summary(self, ValidatedFedAvg.settings)
        super().summary()

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run Flower's ``Strategy.start``, then fail loudly if nothing was aggregated.

        ``Result.arrays`` is the last aggregated model, or ``initial_arrays``
        when no round was aggregated (Flower leaves it empty); then (with
        ``num_rounds > 0`` and ``fraction_train > 0``)
        :class:`NoRoundAggregatedError` is raised, with the counted reasons and
        the ``Result`` (``err.result``).
        """
        self.reset_run()
        result = super().start(
            grid=grid,
            initial_arrays=initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
        )
        return finish_run(
            type(self).__name__,
            result,
            initial_arrays,
            num_rounds,
            self.run_tally,
            trains=self.fraction_train > 0,
        )

    def reset_run(self) -> None:
        """Start a new run's diagnostics (reasons tally, the once-per-run warning)."""
        self.screen.reset_run()
        self._rule_warned = False

    def sample_nodes(
        self, grid: Grid, server_round: int, **draw: Any
    ) -> tuple[list[int], int]:
        """Sample nodes (:func:`.sampling.sample_nodes` with this strategy's seed).

        The quorum is ``min_available_nodes`` at the first sampling, then
        ``min_round_nodes`` when set.
        """
        quorum = self.min_available_nodes
        if self._sampled_once and self.min_round_nodes is not None:
            quorum = self.min_round_nodes
        self._sampled_once = True
        return sampling.sample_nodes(
            grid,
            server_round,
            seed=self.seed,
            quorum=quorum,
            timeout=self.node_wait_timeout,
            owner=type(self).__name__,
            **draw,
        )

    # ----------------------------------------------------------------- hooks
    def train_config(self, server_round: int) -> dict[str, Any]:
        """Return the algorithm's values for this round's train ConfigRecord."""
        return {}

    def train_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Return extra ArrayRecords sent to every sampled node with the model."""
        return {}

    def node_train_records(
        self, node_id: int, server_round: int
    ) -> dict[str, ArrayRecord]:
        """Return extra ArrayRecords for one node only."""
        return {}

    def evaluate_config(self, server_round: int) -> dict[str, Any]:
        """Return the algorithm's values for this round's evaluate ConfigRecord."""
        return {}

    def evaluate_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Return extra ArrayRecords sent with the model for evaluation."""
        return {}

    def central_models(self) -> dict[str, ArrayRecord]:
        """Return further server-side models to evaluate centrally (name -> model).

        The experiment layer evaluates each beside the global model under its
        name (FedDyn's mean of all clients' models, APFL's weighted average).
        """
        return {}

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        """Return the ArrayRecords (name -> spec) a train reply must carry.

        Before the first round the model's spec is not known: only the names are.
        """
        spec = {} if self._global_spec is None else self._global_spec
        expected = {self.arrayrecord_key: spec}
        if self.monitor_dissimilarity:
            expected[keys.GRADIENT_RECORD] = spec
        return expected

    def check_reply(self, reply: ValidReply) -> None:
        """Extra checks on a structurally valid reply; raise ``ReplyRejected``."""
        if self.strict and not screening.reports_rule(reply, self.rule_metric):
            raise ReplyRejected(
                "rule-not-applied",
                f"no '{self.rule_metric}' metric: the client is not applying "
                f"{self.rule_name} (strict=True)",
            )
        if self.weighting == "metric":
            check_weight(reply.metrics, self.weighted_by_key, kind="weight")
        if self.stateful_clients:
            key = reply.metrics.get(keys.CLIENT_KEY_METRIC)
            if isinstance(key, bool) or not isinstance(key, int):
                raise ReplyRejected(
                    "client-key",
                    f"no integer '{keys.CLIENT_KEY_METRIC}' metric: is the client a "
                    f"{type(self).__name__} client?",
                )

    def learn_num_clients(self, num_clients: int) -> None:
        """Adopt K learned from the grid, grown, or from a checkpoint.

        Subclasses that derive settings from it (FedEPM's sampling) extend this.
        """
        check_int("num_clients", num_clients, 1)
        self.num_clients = num_clients

    def reply_weight(self, reply: ValidReply) -> float:
        """Return the weight of a valid reply in the average."""
        if self.weighting == "metric":  # checked finite and > 0 in check_reply
            return float(reply.metrics[self.weighted_by_key])  # type: ignore[arg-type]
        return reply.num_examples if self.weighting == "num-examples" else 1.0

    def weighted_mean(
        self, replies: list[ValidReply], record: str | None = None
    ) -> dict[str, NDArray]:
        """Mean of one record (the model by default) over the replies, weighted.

        Weights are normalised before they are applied (as Flower's ``FedAvg``),
        so finite replies never overflow the accumulator.
        """
        weights = [self.reply_weight(reply) for reply in replies]
        mean = WeightedMean(total=sum(weights), accumulate_in=self._accumulate_in)
        for reply, weight in zip(replies, weights, strict=True):
            mean.add(reply.arrays[record or self.arrayrecord_key], weight)
        return mean.result()

    def server_update(
        self, server_round: int, state: dict[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        """Apply the algorithm's server rule: return the new model, state and metrics.

        ``state`` holds the current values of :attr:`state_fields` (as
        :meth:`grown_state` left them when K grows this round); it must not be
        mutated: return new values in ``RoundUpdate.state``, which the base
        commits only if the round is aggregated. It may be called more than once
        per round (a reply found non-finite is dropped and the rule re-run), so
        it must depend on its arguments only. Default: the weighted mean.
        """
        return RoundUpdate(dict_to_record(self.weighted_mean(replies)))

    def grown_state(self, state: dict[str, Any], old: int, new: int) -> dict[str, Any]:
        """Return ``state`` adjusted to K growing ``old`` -> ``new`` (not mutated).

        Sums over all clients need nothing (a new client holds zero state);
        a mean over K (SCAFFOLD's c) is rescaled.
        """
        return state

    def state_dict(self) -> dict[str, Any]:
        """Return the server state that resumes the run exactly (:mod:`.resume`)."""
        return strategy_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or refuse it naming why."""
        restore_strategy(self, state)

    # ------------------------------------------------------------- the round
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes and build one fresh message per node."""
        server_round += self.round_offset
        self.global_arrays = arrays
        self._global_spec = spec_of(arrays)
        if self.fraction_train == 0.0:
            self.train_nodes = set()
            return []
        population.learn_from_grid(self, grid, server_round)
        node_ids, stragglers = sampling.training_sample(
            self, grid, server_round, arrays
        )
        self.train_nodes = set(node_ids)
        shared = {**config, keys.SERVER_ROUND_KEY: server_round}
        if self.local_epochs is not None:
            shared[keys.LOCAL_EPOCHS_KEY] = self.local_epochs
        if self.local_steps is not None:
            shared[keys.LOCAL_STEPS_KEY] = self.local_steps
        if self.lr_decay != 1.0:
            shared[keys.LR_SCALE_KEY] = self.lr_decay ** (server_round - 1)
        if self.monitor_dissimilarity:
            shared[keys.REPORT_GRADIENT_KEY] = True
        shared.update(self.train_config(server_round))

        def node_config(node_id: int) -> dict[str, Any]:
            config: dict[str, Any] = {}
            if node_id in stragglers:
                config[keys.LOCAL_EPOCHS_KEY] = stragglers[node_id]
            if self.stateful_clients:  # what the node needs to resolve its state
                config.update(self.book.node_config(node_id))
            return config

        messages = node_messages(
            node_ids,
            MessageType.TRAIN,
            arrays=(self.arrayrecord_key, arrays),
            records=self.train_records(server_round),
            config=(self.configrecord_key, shared),
            node_records=lambda node_id: self.node_train_records(node_id, server_round),
            node_config=node_config,
        )
        self._bytes_sent = payload_bytes(messages)
        self.screen.remember("train", messages)
        return messages

    def collect_replies(
        self,
        server_round: int,
        replies: Iterable[Message],
        **screening: Any,
    ) -> tuple[list[ValidReply], int, int, int]:
        """Validate replies (:meth:`.screening.ReplyScreen.collect`).

        With this strategy's :meth:`check_reply`, size limit and retired nodes.
        """
        return self.screen.collect(
            server_round,
            replies,
            check=self.check_reply,
            max_bytes=self.reply_size_limit(screening["expected_arrays"]),
            retired=self.retired_nodes,
            **screening,
        )

    def reply_size_limit(self, expected_arrays: Mapping[str, RecordSpec]) -> int:
        """Return the largest reply accepted, in bytes (:attr:`max_reply_bytes`)."""
        return screening.reply_size_limit(self.max_reply_bytes, expected_arrays)

    def cap_claims(
        self, server_round: int, replies: list[ValidReply], phase: str
    ) -> int:
        """Lower claims above the caps (:func:`.screening.cap_claims`); count them."""
        return screening.cap_claims(
            server_round,
            replies,
            phase,
            max_num_examples=self.max_num_examples,
            max_weight_ratio=self.max_weight_ratio,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies, run the server rule on the valid ones, commit state."""
        server_round += self.round_offset
        self.rounds_completed = server_round
        if self._global_spec is None:
            raise RuntimeError(
                f"{type(self).__name__}.aggregate_train called before configure_train"
            )
        valid, failed, rejected, absent = self.collect_replies(
            server_round,
            replies,
            expected_arrays=self.expected_train_arrays(server_round),
            sampled=self.train_nodes,
            phase="aggregate_train",
            defer_finite=(self.arrayrecord_key,) if self.linear_aggregate else (),
        )
        # A fixed order (client key, else node id), not the arrival order: the
        # float sums depend on it, and a run should not.
        valid.sort(key=screening.reply_order)
        k_before = self.num_clients
        if self.stateful_clients:
            valid, unusable = self.book.reconcile(
                server_round,
                valid,
                keeps_client_sums=self.keeps_client_sums,
                accept_lost_state=self.accept_lost_state,
                count=lambda node, why: self.screen.count(node, why, "aggregate_train"),
            )
            rejected += unusable
        capped = self.cap_claims(server_round, valid, "aggregate_train")

        def rule(candidates: list[ValidReply], wide: bool) -> RoundUpdate:
            self._accumulate_in = np.float64 if wide else None
            try:
                state = population.state_for_round(self, k_before, candidates)
                return self.server_update(server_round, state, candidates)
            finally:
                self._accumulate_in = None

        update, keep = finite_update(
            server_round, valid, rule, screen=self.screen, record=self.arrayrecord_key
        )
        finite = [r for r in valid if r.finite]
        rejected += len(valid) - len(finite)
        valid = finite
        if keep is None and (failed or rejected) and not self.accept_failures:
            keep = "accept_failures=False and some replies failed or were rejected"
        if keep is None:
            self.run_tally.aggregated += 1
            self._warn_rule_not_applied(server_round, valid)
        counts = metrics.round_counts(
            valid,
            failed=failed,
            rejected=rejected,
            absent=absent,
            capped=capped,
            bytes_sent=self._bytes_sent,
        )
        # Privacy spent is spent, even in a round whose model is not kept.
        counts.update(record_privacy(self.epsilon_totals, valid, self.retired_nodes))
        if keep is not None or update is None:
            self.run_tally.kept[keep or "no model"] += 1
            self.num_clients = k_before  # as if the round's replies never came
            log(
                WARNING,
                "aggregate_train: round %d: %s; %s; keeping the previous model",
                server_round,
                keep,
                self.round_tally.describe(),
            )
            return None, MetricRecord(counts)
        if self.stateful_clients:
            self.book.commit(server_round, valid)
            population.commit_growth(self, k_before)
        if unknown := set(update.state) - set(self.state_fields):
            raise TypeError(
                f"{type(self).__name__}.server_update returned state {sorted(unknown)} "
                f"not declared in state_fields {self.state_fields}"
            )
        for name, value in update.state.items():
            setattr(self, name, value)
        record = metrics.reply_metrics(
            valid, self._custom_metrics[0], self.weighted_by_key
        )
        extra = dict(update.metrics)
        if self.monitor_dissimilarity:
            extra.update(metrics.dissimilarity_metrics(valid, self.reply_weight))
        for key, value in {**counts, **extra}.items():
            record[key] = value
        return update.arrays, record

    def _warn_rule_not_applied(
        self, server_round: int, replies: list[ValidReply]
    ) -> None:
        """Warn once per run, naming the nodes whose replies lack the rule metric."""
        if self._rule_warned or self.rule_metric is None:
            return
        name = type(self).__name__
        self._rule_warned = screening.warn_rule_not_applied(
            name,
            server_round,
            replies,
            self.rule_metric,
            self.rule_name,
            self.rule_pieces or (f"{name}Client", f"{name}Rule"),
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes for federated evaluation, one fresh message per node."""
        server_round += self.round_offset
        if self.fraction_evaluate == 0.0:
            self.evaluate_nodes = set()
            return []
        node_ids, num_connected = self.sample_nodes(
            grid,
            server_round,
            fraction=self.fraction_evaluate,
            minimum=self.min_evaluate_nodes,
            stream=2,
        )
        log(
            INFO,
            "configure_evaluate: sampled %d nodes (out of %d)",
            len(node_ids),
            num_connected,
        )
        self.evaluate_nodes = set(node_ids)
        shared = {**config, keys.SERVER_ROUND_KEY: server_round}
        shared.update(self.evaluate_config(server_round))
        messages = node_messages(
            node_ids,
            MessageType.EVALUATE,
            arrays=(self.arrayrecord_key, arrays),
            records=self.evaluate_records(server_round),
            config=(self.configrecord_key, shared),
        )
        self.screen.remember("evaluate", messages)
        return messages

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Validate evaluation replies and average their metrics."""
        server_round += self.round_offset
        valid, *_ = self.collect_replies(
            server_round,
            replies,
            expected_arrays={},
            sampled=self.evaluate_nodes,
            phase="aggregate_evaluate",
        )
        if not valid:
            return None
        self.cap_claims(server_round, valid, "aggregate_evaluate")
        return metrics.evaluation_metrics(server_round, valid, self._custom_metrics[1])

"""The validated strategy base every strategy of the pack inherits: Flower's hooks.

It keeps Flower's ``FedAvg`` interface and runs a round as calls into its
parts: :class:`.sampling.TrainSampling` (who trains), the
:class:`.screening.ReplyScreen` (replies checked, ordered, capped, the
non-finite re-run), the :class:`.commit.ClientBook` (the two-phase commit of
client state), the algorithm's rule (:class:`.hooks.AlgorithmHooks`),
:mod:`.metrics` and the :class:`.outcome.StallGuard`; evaluation is
:class:`.evaluation.EvaluationRound`, a run's start, end and checkpoint
:class:`.resume.RunState`. What each keyword means is in :mod:`.options`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from ..contract.fields import RoundUpdate, settings_text
from ..contract.frozen import FrozenState, call_rule
from ..contract.ledger import record_privacy
from ..contract.validation import ValidReply, init_keywords, reject_unknown_kwargs
from ..docstrings import with_class_attributes
from ..transport import keys
from ..transport.messages import payload_bytes
from ..transport.records import RecordSpec, spec_of
from ..wrapper import RunLifecycle
from . import metrics, screening
from .commit import ClientBook, saved_outside_commit
from .evaluation import Evaluation, EvaluationRound
from .hooks import AlgorithmHooks
from .options import (
    PARAMETERS,
    check_base_options,
    log_flower_summary,
    log_summary,
    resolve_weighting,
)
from .outcome import StallGuard
from .pieces import DissimilarityMonitor, LearningRateDecay, RoundPiece, round_pieces
from .population import Population
from .resume import RunState
from .rule_report import RuleNames
from .sampling import PARTICIPATION, Sampler, Stragglers, TrainSampling
from .screening import ScreenedRound

MetricsFn = Callable[[list[RecordDict], str], MetricRecord]


class ValidatedFedAvg(
    AlgorithmHooks, TrainSampling, RunState, EvaluationRound, RunLifecycle, FedAvg
):
    """Federated averaging with validated replies, seeded sampling and stragglers.

    The base of every strategy of the pack, and the pack's FedAvg baseline
    (:class:`flwr_prox_strategies.FedAvg` is this class, exported for users).
    It keeps the interface of Flower's ``FedAvg`` (so ``strategy.start(...)``
    and Flower's differential-privacy wrappers work unchanged) and adds what
    the pack guarantees: every reply is validated before it is aggregated (a
    bad one is logged with its node and dropped), node sampling and straggler
    draws are seeded per round, a round without a valid reply keeps the
    previous model, and the server state an algorithm declares
    (:attr:`state_fields`) is checkpointed by :meth:`state_dict`.
    """

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
        pieces: Sequence[RoundPiece] = (),
        accept_failures: bool = True,
        node_wait_timeout: float = 120.0,
        max_num_examples: float | None = None,
        max_weight_ratio: float | None = 100.0,
        max_reply_bytes: int | None = None,
        min_round_nodes: int | None = None,
        strict: bool = False,
        max_rounds_without_aggregation: int | None = 3,
        pack_metrics: bool = True,
        per_client_metrics: bool = False,
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
            participations=PARTICIPATION,
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
            max_rounds_without_aggregation=max_rounds_without_aggregation,
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
        name = type(self).__name__
        self._custom_metrics = (train_metrics_aggr_fn, evaluate_metrics_aggr_fn)
        self.weighting = weighting
        self.local_epochs = local_epochs
        self.local_steps = local_steps
        self.accept_failures = accept_failures
        self.node_wait_timeout = float(node_wait_timeout)
        self.min_round_nodes = min_round_nodes
        self.strict = bool(strict)
        self.max_rounds_without_aggregation = max_rounds_without_aggregation
        self.pack_metrics = bool(pack_metrics)
        self.per_client_metrics = bool(per_client_metrics)
        # The parts: each owns its state and is called by the round below.
        keep_partial = self.straggler_policy == "keep-partial"
        self.sampler = Sampler(
            seed, participation, Stragglers(float(drop_percent), keep_partial)
        )
        self.population = Population(
            num_clients,
            requires=self.requires_num_clients,
            owner=name,
            adopt=self.learn_num_clients,
        )
        self.pieces = round_pieces(
            lr_decay=float(lr_decay),
            monitor_dissimilarity=bool(monitor_dissimilarity),
            own=pieces,
        )
        # Reply validation and the caps, and what was not used.
        self.screen = screening.ReplyScreen(
            max_num_examples=max_num_examples,
            max_weight_ratio=max_weight_ratio,
            max_reply_bytes=max_reply_bytes,
        )
        self.book = ClientBook()  # the two-phase commit of client state (state)
        self.stall = StallGuard()
        # The round's model and sampled nodes: set by configure_*, read by aggregate_*.
        self.global_arrays: ArrayRecord | None = None
        self._global_spec: RecordSpec | None = None
        self.train_nodes: set[int] | None = None
        # Rounds aggregated (state), and the offset a resumed run adds to
        # Strategy.start's round numbers so sampling and client seeds continue.
        self.rounds_completed = 0
        self.round_offset = 0
        # The epsilon ledger (client key or node id -> dp-epsilon-total reported)
        # and the nodes whose budget is spent, never sampled again (state).
        self.epsilon_totals: dict[int, float] = {}
        self.retired_nodes: set[int] = set()
        self.evaluation = Evaluation()  # the nodes evaluating; off for the run
        self._bytes_sent = 0
        # The run's first model: what Result.arrays holds if nothing is aggregated.
        self._run_initial: ArrayRecord | None = None

    rejections = property(lambda self: self.screen.rejections)
    run_tally = property(lambda self: self.screen.run_tally)
    round_tally = property(lambda self: self.screen.round_tally)
    # The settings the parts own, read (N and the caps also set) as the strategy's own.
    seed = property(lambda self: self.sampler.seed)
    participation = property(lambda self: self.sampler.participation)
    drop_percent = property(lambda self: self.sampler.stragglers.drop_percent)
    max_num_examples = screening.screen_setting("max_num_examples")
    max_weight_ratio = screening.screen_setting("max_weight_ratio")
    max_reply_bytes = screening.screen_setting("max_reply_bytes")
    num_clients = property(
        lambda self: self.population.size,
        lambda self, k: setattr(self.population, "size", k),
    )
    num_clients_source = property(
        lambda self: self.population.source,
        lambda self, text: setattr(self.population, "source", text),
    )

    @property
    def lr_decay(self) -> float:
        """The per-round learning-rate decay sent as ``lr-scale`` (1.0: none)."""
        decays = [p for p in self.pieces if isinstance(p, LearningRateDecay)]
        return decays[0].decay if decays else 1.0

    @property
    def monitor_dissimilarity(self) -> bool:
        """Whether each round logs the FedProx paper's dissimilarity B."""
        return any(isinstance(p, DissimilarityMonitor) for p in self.pieces)

    @classmethod
    def accepted_kwargs(cls) -> set[str]:
        """Return the keyword arguments ``cls(...)`` accepts (its bases' included).

        Returns
        -------
        set[str]
            The names; any other keyword is a ``TypeError`` naming the closest.
        """
        return init_keywords(cls, ValidatedFedAvg)

    def __repr__(self) -> str:
        """Return the class name and its :attr:`settings`."""
        return f"{type(self).__name__}({settings_text(self, self.settings)})"

    def summary(self) -> None:
        """Log the algorithm's :attr:`settings`, the base's checks, Flower's lines."""
        log_summary(self, ValidatedFedAvg.settings)
        log_flower_summary(self)

    # ------------------------------------------------------------- the round
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes and build one fresh message per node."""
        server_round += self.round_offset
        self.global_arrays = arrays
        if self._run_initial is None:
            self._run_initial = arrays
        self._global_spec = spec_of(arrays)
        if self.fraction_train == 0.0:
            self.train_nodes = set()
            return []
        node_ids, stragglers = self.sample_train(grid, server_round, arrays)
        self.train_nodes = set(node_ids)
        shared = {**config, keys.SERVER_ROUND_KEY: server_round}
        if self.local_epochs is not None:
            shared[keys.LOCAL_EPOCHS_KEY] = self.local_epochs
        if self.local_steps is not None:
            shared[keys.LOCAL_STEPS_KEY] = self.local_steps
        for piece in self.pieces:
            shared.update(piece.train_config(server_round))
        shared.update(self.train_config(server_round))

        def node_config(node_id: int) -> dict[str, Any]:
            config: dict[str, Any] = {}
            if node_id in stragglers:
                config[keys.LOCAL_EPOCHS_KEY] = stragglers[node_id]
            if self.stateful_clients:  # what the node needs to resolve its state
                config.update(self.book.node_config(node_id))
            return config

        messages = self.round_messages(
            MessageType.TRAIN,
            node_ids,
            arrays,
            shared,
            self.train_records(server_round),
            node_records=lambda node_id: self.node_train_records(node_id, server_round),
            node_config=node_config,
        )
        self._bytes_sent = payload_bytes(messages)
        return messages

    def collect_replies(
        self,
        server_round: int,
        replies: Iterable[Message],
        **options: Any,
    ) -> tuple[list[ValidReply], int, int, int]:
        """Validate replies.

        With this strategy's :meth:`check_reply`, size limit and retired nodes
        (:meth:`.screening.ReplyScreen.collect`, whose keywords ``options`` are).
        """
        return self.screen.collect(
            server_round,
            replies,
            check=self.check_reply,
            retired=self.retired_nodes,
            rule=RuleNames.of(self),
            **options,
        )

    def reply_size_limit(self, expected_arrays: Mapping[str, RecordSpec]) -> int:
        """Return the largest reply accepted, in bytes (``max_reply_bytes``)."""
        return self.screen.reply_size_limit(expected_arrays)

    def cap_claims(
        self, server_round: int, replies: list[ValidReply], phase: str
    ) -> int:
        """Lower claims above the caps (``max_num_examples``, ``max_weight_ratio``)."""
        return self.screen.cap_claims(server_round, replies, phase)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies, run the server rule on the valid ones, commit state."""
        server_round += self.round_offset
        return self.aggregate_screened(
            server_round, self.screen_train(server_round, replies)
        )

    def screen_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> ScreenedRound:
        """Validate a round's train replies: the first half of :meth:`aggregate_train`.

        Replies are checked against what was sent, sorted, reconciled with the
        client states the server knows and their weights capped. Secure
        aggregation screens the replies' plain parts here before it unmasks
        their sum.

        Parameters
        ----------
        server_round : int
            The round, continuing after a resume (``round_offset`` added).
        replies : Iterable[Message]
            The round's train replies.

        Returns
        -------
        ScreenedRound
            The valid replies and the counts of the others.
        """
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
            expected_metrics=self.expected_train_metrics(server_round),
            defer_finite=(
                (self.arrayrecord_key,) if self.model_linear_in_replies else ()
            ),
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
                strict=self.strict,
            )
            rejected += unusable
        capped = self.cap_claims(server_round, valid, "aggregate_train")
        return ScreenedRound(valid, failed, rejected, absent, capped, k_before)

    def aggregate_screened(
        self, server_round: int, screened: ScreenedRound
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Run the rule on screened replies and commit: the rest of a round.

        Parameters
        ----------
        server_round : int
            The round, continuing after a resume (``round_offset`` added).
        screened : ScreenedRound
            What :meth:`screen_train` returned for the round.

        Returns
        -------
        tuple[ArrayRecord | None, MetricRecord | None]
            As :meth:`aggregate_train`.
        """
        valid, failed, rejected = screened.valid, screened.failed, screened.rejected
        absent, capped, k_before = screened.absent, screened.capped, screened.k_before

        def rule(candidates: list[ValidReply], wide: bool) -> RoundUpdate:
            self._accumulate_in = np.float64 if wide else None
            try:
                return call_rule(
                    lambda state: self.server_update(server_round, state, candidates),
                    self._round_state(k_before, candidates),
                    type(self).__name__,
                    self.state_fields,
                )
            finally:
                self._accumulate_in = None

        update, keep = self.screen.finite_update(
            server_round, valid, rule, self.arrayrecord_key
        )
        finite = [r for r in valid if r.finite]
        rejected += len(valid) - len(finite)
        valid = finite
        if keep is None and (failed or rejected) and not self.accept_failures:
            keep = "accept_failures=False and some replies failed or were rejected"
        lacking, short = self.screen.rule_not_applied(
            server_round, valid, aggregated=keep is None, rule=RuleNames.of(self)
        )
        counts = metrics.round_counts(
            valid,
            failed=failed,
            rejected=rejected,
            absent=absent,
            capped=capped,
            bytes_sent=self._bytes_sent,
            rule=(lacking, short) if self.rule_metric is not None else None,
            outside=(
                sum(saved_outside_commit(r) for r in valid)
                if self.stateful_clients
                else None
            ),
        )
        # Privacy spent is spent, even in a round whose model is not kept.
        counts.update(
            record_privacy(
                self.epsilon_totals,
                valid,
                self.retired_nodes,
                per_client=self.per_client_metrics,
            )
        )
        if not self.pack_metrics:
            counts = {}
        if keep is not None or update is None:
            self.keep_previous_model(server_round, keep or "no model", k_before)
            return None, MetricRecord(counts)
        self.commit_round(server_round, valid, update.state, k_before)
        record = metrics.reply_metrics(
            valid,
            self._custom_metrics[0],
            self.weighted_by_key,
            pack_metrics=self.pack_metrics,
        )
        extra = dict(update.metrics)
        for piece in self.pieces:
            extra.update(piece.metrics(valid, self.reply_weight))
        for key, value in {**counts, **extra}.items():
            record[key] = value
        return update.arrays, record

    def _round_state(
        self, k_base: int | None, replies: list[ValidReply]
    ) -> dict[str, Any]:
        """Return the declared state the round's rule starts from, N set for it.

        N counts every client seen, these repliers included; when that grows it,
        the state is the strategy's ``grown_state`` (not yet committed).
        """
        state = {name: getattr(self, name) for name in self.state_fields}
        if self.stateful_clients and self.requires_num_clients and k_base:
            k = self.population.grow_to(k_base, self.book.clients_needed(replies))
            if k != k_base:
                given = FrozenState(state, type(self).__name__, self.state_fields)
                grown = self.grown_state(given, k_base, k)
                state = {name: given.thaw(value) for name, value in grown.items()}
        return state


# What each keyword means is written beside its check (options.py); the class's
# documentation (help(), the API reference) is the whole.
ValidatedFedAvg.__doc__ = f"{ValidatedFedAvg.__doc__}{PARAMETERS}"
# help() lists what a subclass declares, from the comments in AlgorithmHooks.
with_class_attributes(AlgorithmHooks)(ValidatedFedAvg)

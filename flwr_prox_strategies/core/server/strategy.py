"""The validated strategy base every strategy of the pack inherits: one round.

It keeps Flower's ``FedAvg`` interface (so ``strategy.start(...)`` and Flower's DP
wrappers work unchanged) and runs a round, holding a part for each job:

* a :class:`.sampling.Sampler` (seeded per round, quorum-checked, its
  :class:`.sampling.Stragglers`), a :class:`.population.Population` (N: given,
  learned, grown, restored), a :class:`.commit.ClientBook` (the server's half of
  the two-phase commit of client state), a :class:`.screening.ReplyScreen`
  (replies checked against what was sent, claims capped, the once-per-run
  warnings about clients that did not apply the rule, in
  :mod:`.rule_report`'s words) and a :class:`.outcome.StallGuard` (rounds in a
  row not aggregated);
* the round's pieces (:mod:`.pieces`: a learning-rate decay, the dissimilarity
  monitor) and, per round, :func:`.finite.finite_update` (the rule re-run
  without replies holding NaN, inf or huge values), :mod:`.metrics`,
  :func:`..contract.ledger.record_privacy`, and :mod:`.resume` for checkpoints.

What an algorithm declares and overrides lives in :class:`.hooks.AlgorithmHooks`
(``flwr_prox_strategies.extend`` is the guide); what each keyword of the base
means, and how a bad value is refused, in :mod:`.options`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
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
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

from ...ops.checks import check_int
from ..contract.fields import (
    RoundUpdate,
    check_settings,
    load_fields,
    save_fields,
    settings_text,
)
from ..contract.frozen import FrozenState, call_rule
from ..contract.ledger import record_privacy
from ..contract.validation import ValidReply, init_keywords, reject_unknown_kwargs
from ..docstrings import with_class_attributes
from ..transport import keys
from ..transport.messages import node_messages, payload_bytes
from ..transport.records import RecordSpec, spec_of
from ..wrapper import RunLifecycle
from . import metrics, resume, screening
from .commit import ClientBook, saved_outside_commit
from .evaluation import Evaluation
from .hooks import AlgorithmHooks
from .options import (
    PARAMETERS,
    check_base_options,
    log_flower_summary,
    log_summary,
    resolve_weighting,
)
from .outcome import StallGuard, finish_run
from .pieces import (
    DissimilarityMonitor,
    LearningRateDecay,
    RoundPiece,
    round_pieces,
)
from .population import Population
from .rule_report import RuleNames
from .sampling import (
    PARTICIPATION,
    Sampler,
    Stragglers,
    connected_nodes,
    training_sample,
)

MetricsFn = Callable[[list[RecordDict], str], MetricRecord]


def _screen_setting(name: str) -> property:
    """Return a cap the reply screen owns as a setting of the strategy (read, set)."""
    return property(
        lambda self: getattr(self.screen, name),
        lambda self, value: setattr(self.screen, name, value),
    )


@dataclass
class ScreenedRound:
    """A round's train replies after screening: the valid ones, the others counted."""

    valid: list[ValidReply]
    failed: int
    rejected: int
    absent: int
    capped: int
    k_before: int | None


class ValidatedFedAvg(AlgorithmHooks, RunLifecycle, FedAvg):
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
    max_num_examples = _screen_setting("max_num_examples")
    max_weight_ratio = _screen_setting("max_weight_ratio")
    max_reply_bytes = _screen_setting("max_reply_bytes")
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

    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Start a run's diagnostics (:meth:`reset_run`); remember its initial model."""
        self.reset_run()
        self._run_initial = initial_arrays
        # A stall in the last round is left to end_run, which raises with
        # Flower's whole Result.
        self.stall.final_round = self.round_offset + num_rounds

    def end_run(
        self, result: Result, num_rounds: int, name: str | None = None
    ) -> Result:
        """Finish the run with :meth:`check_run`; ``name`` names the strategy."""
        return self.check_run(result, num_rounds=num_rounds, name=name)

    def check_run(
        self,
        result: Result | None = None,
        num_rounds: int | None = None,
        name: str | None = None,
    ) -> Result:
        """End a run: fail loudly if it aggregated nothing, say what it averaged in.

        The pack's ``start()`` ends with it; call it at the end of a
        ``start()`` of your own (after :meth:`reset_run` at its beginning).
        It repeats the warning about clients that did not apply the
        algorithm's rule, with the run's count, and, when the run trained
        (``num_rounds > 0`` and ``fraction_train > 0``) without aggregating a
        single round, raises :class:`~flwr_prox_strategies.NoRoundAggregatedError`
        with the counted reasons.

        Parameters
        ----------
        result : Result | None (default: None)
            The run's result; its ``arrays`` become the run's initial model
            when no round was aggregated (Flower leaves them empty). None: a
            new ``Result`` holding the last aggregated (or initial) model.
        num_rounds : int | None (default: None)
            The rounds the run was asked for; None: the rounds this strategy
            was called for since :meth:`reset_run`.
        name : str | None (default: None)
            How a failure names the strategy; None: its class name (a wrapper
            passes its own, e.g. ``SecAggPlus(FedAvg)``).

        Returns
        -------
        Result
            ``result``, its ``arrays`` set as above.

        Raises
        ------
        NoRoundAggregatedError
            If the run trained and aggregated no round.
        """
        tally = self.run_tally
        if result is None:
            result = Result(arrays=self.global_arrays or ArrayRecord())
        if tally.not_applied:
            log(WARNING, "%s: %s", type(self).__name__, tally.describe_not_applied())
        attempted = tally.aggregated + sum(tally.kept.values())
        return finish_run(
            name or type(self).__name__,
            result,
            self._run_initial if self._run_initial is not None else result.arrays,
            attempted if num_rounds is None else num_rounds,
            tally,
            trains=self.fraction_train > 0,
        )

    def reset_run(self) -> None:
        """Start a new run's diagnostics (reasons tally, the once-per-run warning)."""
        self.screen.reset_run()
        self.book.reset_run()
        self.stall.reset()
        self._run_initial = None
        self.evaluation.reset_run()

    def sample_nodes(
        self, grid: Grid, server_round: int, **draw: Any
    ) -> tuple[list[int], int]:
        """Sample nodes with this strategy's seed, waiting for a quorum.

        The quorum is ``min_available_nodes`` at the first sampling, then
        ``min_round_nodes`` when set.
        """
        return self.sampler.sample(
            grid,
            server_round,
            quorum=(self.min_available_nodes, self.min_round_nodes),
            timeout=self.node_wait_timeout,
            owner=type(self).__name__,
            **draw,
        )

    def learn_num_clients(self, num_clients: int) -> None:
        """Adopt N learned from the grid, grown, or from a checkpoint.

        Subclasses that derive settings from it (FedEPM's sampling) extend this.

        Parameters
        ----------
        num_clients : int
            The number of all clients, N.

        Raises
        ------
        ValueError
            If ``num_clients`` is not an integer >= 1.
        """
        check_int("num_clients", num_clients, 1)
        self.num_clients = num_clients

    def state_dict(self) -> dict[str, Any]:
        """Return the server state that resumes the run exactly.

        Returns
        -------
        dict[str, Any]
            The declared
            :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.state_fields`
            (kebab-case keys), the
            :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.resume_settings`,
            the rounds completed, N, ``seed``, the privacy ledger and the
            clients' commit bookkeeping: pass it to
            :meth:`load_state_dict` of a strategy built the same way.
        """
        return resume.checkpoint(
            strategy=type(self).__name__,
            seed=self.seed,
            rounds_completed=self.rounds_completed,
            population=self.population,
            epsilon_totals=self.epsilon_totals,
            retired_nodes=self.retired_nodes,
            book=self.book,
            fields={
                **save_fields(self, self.resume_settings),
                **save_fields(self, self.state_fields),
            },
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or refuse it naming why.

        Parameters
        ----------
        state : Mapping[str, Any]
            A :meth:`state_dict` of the same strategy class.

        Raises
        ------
        ValueError
            If the state was saved by another strategy class, or under other
            :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.resume_settings`,
            another seed or another N, naming the difference (the run would
            not resume identically).
        """
        restored = resume.restore(
            state,
            strategy=type(self).__name__,
            seed=self.seed,
            population=self.population,
            book=self.book,
            check_settings=lambda s: check_settings(self, self.resume_settings, s),
        )
        self.rounds_completed = restored.rounds_completed
        self.epsilon_totals = restored.epsilon_totals
        self.retired_nodes = restored.retired_nodes
        self.round_offset = self.rounds_completed
        load_fields(self, self.state_fields, state)

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
        self.population.learn_from_grid(
            lambda: len(
                connected_nodes(
                    grid,
                    self.min_available_nodes,
                    self.node_wait_timeout,
                    type(self).__name__,
                )
            ),
            server_round,
        )
        node_ids, stragglers = training_sample(
            lambda *args, **draw: self.sample_nodes(grid, *args, **draw),
            server_round,
            fraction=self.fraction_train,
            minimum=self.min_train_nodes,
            bernoulli=self.participation == "bernoulli",
            retired=self.retired_nodes,
            stragglers=self.sampler.stragglers,
            seed=self.seed,
            local_epochs=self.local_epochs,
            arrays=arrays,
            population_note=self.population.note,
            owner=type(self).__name__,
        )
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
        )
        if self.rule_metric is not None:
            counts["replies-rule-missing"] = lacking
            counts["replies-term-incomplete"] = short
        if self.stateful_clients:
            counts["replies-state-outside-commit"] = sum(
                saved_outside_commit(r) for r in valid
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
            self.run_tally.kept[keep or "no model"] += 1
            self.num_clients = k_before  # as if the round's replies never came
            log(
                WARNING,
                "aggregate_train: round %d: %s; %s; keeping the previous model",
                server_round,
                keep,
                self.round_tally.describe(),
            )
            if self.fraction_train > 0.0 and self.train_nodes:
                # (a round that sampled nobody for training is no failure)
                self.stall.kept(
                    server_round,
                    keep or "no model",
                    round_tally=self.round_tally,
                    never_aggregated=self.run_tally.aggregated == 0,
                    limit=self.max_rounds_without_aggregation,
                    owner=type(self).__name__,
                    model=lambda never: (
                        self._run_initial if never else self.global_arrays
                    ),
                )
            return None, MetricRecord(counts)
        self.run_tally.aggregated += 1
        self.stall.aggregated()
        if self.stateful_clients:
            self.book.commit(server_round, valid)
            self.population.commit_growth(
                k_before,
                f"{len(self.book.client_keys_seen)} client keys seen, "
                f"{self.book.retired_states} retired state(s)",
            )
        if unknown := set(update.state) - set(self.state_fields):
            raise TypeError(
                f"{type(self).__name__}.server_update returned state {sorted(unknown)} "
                f"not declared in state_fields {self.state_fields}"
            )
        for name, value in update.state.items():
            setattr(self, name, value)
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

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes for federated evaluation, one fresh message per node."""
        server_round += self.round_offset
        if self.evaluation.skipped(self.fraction_evaluate):
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
        self.evaluation.nodes = set(node_ids)
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
        replies = list(replies)
        self.evaluation.notice_missing_function(
            server_round,
            replies,
            owner=type(self).__name__,
            fraction=self.fraction_evaluate,
        )
        valid, *_ = self.collect_replies(
            server_round,
            replies,
            expected_arrays={},
            sampled=self.evaluation.nodes,
            phase="aggregate_evaluate",
        )
        if not valid:
            return None
        self.cap_claims(server_round, valid, "aggregate_evaluate")
        return metrics.evaluation_metrics(
            server_round,
            valid,
            self._custom_metrics[1],
            pack_metrics=self.pack_metrics,
            per_client=self.per_client_metrics,
        )


# What each keyword means is written beside its check (options.py); the class's
# documentation (help(), the API reference) is the whole.
ValidatedFedAvg.__doc__ = f"{ValidatedFedAvg.__doc__}{PARAMETERS}"
# help() lists what a subclass declares, from the comments in AlgorithmHooks.
with_class_attributes(AlgorithmHooks)(ValidatedFedAvg)

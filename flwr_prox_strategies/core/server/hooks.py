"""What an algorithm declares and overrides: the extension surface of the base.

:class:`AlgorithmHooks` holds the class attributes an algorithm sets (its state,
its client rule's metric, what a checkpoint must match) and the hooks it
overrides, each with the base's default: what a round sends
(:meth:`~AlgorithmHooks.train_config`, :meth:`~AlgorithmHooks.train_records`,
...), what a reply must carry (:meth:`~AlgorithmHooks.expected_train_metrics`),
the weights and the server rule (:meth:`~AlgorithmHooks.server_update`,
:meth:`~AlgorithmHooks.grown_state`). The round that calls them is
:class:`.strategy.ValidatedFedAvg`; ``flwr_prox_strategies.extend`` is the guide.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord
from numpy.typing import NDArray

from ...ops.aggregate import WeightedMean
from ..contract.fields import RoundUpdate
from ..contract.validation import MetricSpec, ReplyRejected, ValidReply, check_weight
from ..transport import keys
from ..transport.records import RecordSpec, dict_to_record
from .commit import held_state
from .pieces import RoundPiece
from .rule_report import (
    DeclaresRule,
    RuleNames,
    protocol_problem,
    reports_rule,
    shortfall_problem,
    term_shortfall,
)


class AlgorithmHooks(DeclaresRule):
    """The class attributes and hooks an algorithm of the pack sets and overrides.

    A mixin of :class:`~flwr_prox_strategies.extend.ValidatedFedAvg`: every
    default here is the base's (federated averaging); see
    ``flwr_prox_strategies.extend`` for which to override.
    """

    # Set by the base strategy (the round's settings, and float64 accumulators
    # while a non-finite result is retried).
    weighting: str
    weighted_by_key: str
    arrayrecord_key: str
    strict: bool
    pieces: tuple[RoundPiece, ...]
    _global_spec: RecordSpec | None
    _accumulate_in: type[np.floating] | None = None

    #: What happens to stragglers (``drop_percent``), ``"drop"`` (they are sent
    #: no work, as the FedProx paper's FedAvg) or ``"keep-partial"`` (their
    #: fewer epochs are used).
    straggler_policy: ClassVar[str] = "drop"
    #: Whether clients keep state the server sums over (FedDyn, FedDC,
    #: SCAFFOLD). Then the base runs the two-phase commit of client state (a
    #: client commits its pending state once told its reply was aggregated)
    #: and rejects replies without an integer ``client-key`` metric.
    stateful_clients: ClassVar[bool] = False
    #: Whether clients keep a privacy ledger in ``context.state`` (their
    #: rule's ``keeps_privacy_ledger``: FedEPM's and SFedAvg's noisy
    #: uploads, each spending epsilon). A checkpointed run then has its
    #: clients mirror their state, so that a resume finds the epsilon spent.
    ledger_clients: ClassVar[bool] = False
    #: The metric a client reports when it runs this algorithm's
    #: client rule (the rule's :attr:`ClientRule.applied_metric
    #: <flwr_prox_strategies.extend.ClientRule.applied_metric>`): the count
    #: of its steps whose update held the rule's term, beside
    #: ``local-steps``. Replies without it, or with fewer applied steps than
    #: local steps, are named in one warning per run (each kind), or
    #: rejected with ``strict=True``. None means any client will do.
    rule_metric: ClassVar[str | None] = None
    #: What the client rule is called, in that warning.
    rule_name: ClassVar[str] = "client rule"
    #: The pack's ``(client, rule)`` class names that apply the rule, in that
    #: warning; None means ``<Class>Client`` and ``<Class>Rule``.
    rule_pieces: ClassVar[tuple[str, str] | None] = None
    #: Whether the server rule divides by N, the number of all clients. Then
    #: ``num_clients=None`` means "learn N from the grid at the first round"
    #: (then checked every round, grown when a new client replies).
    requires_num_clients: ClassVar[bool] = False
    #: Whether the server keeps sums over all clients' states. Then a state
    #: lost on a client stays in them, retired, and the client goes on as a
    #: new one.
    keeps_client_sums: ClassVar[bool] = False
    #: Whether a client that lost its state may reply with a fresh state as a
    #: new client.
    accept_lost_state: bool = True
    #: The weighting used when neither ``weighting`` nor ``weighted_by_key`` is
    #: given.
    default_weighting: ClassVar[str] = "num-examples"
    #: Whether the server rule's model is a positive linear combination of
    #: the replies' model records (``arrays``): a NaN or inf in one then
    #: reaches the model, so the replies' value check waits for the result
    #: (one check instead of one per reply). False, the default for any class
    #: that overrides :meth:`server_update` without declaring it, checks every
    #: reply's model record before the rule runs: safe for a rule that builds
    #: its model from other records, or a median that can hide an inf.
    model_linear_in_replies: ClassVar[bool] = True
    #: ArrayRecords the strategy sends each node once more after a restore
    #: (FedDyn's :math:`\theta^0`), which the conformance kit allows.
    records_resent_after_restore: ClassVar[tuple[str, ...]] = ()
    #: Attribute names of the algorithm's server state, saved by
    #: :meth:`state_dict` (kebab-case keys), restored by
    #: :meth:`load_state_dict`, passed to :meth:`server_update` and replaced by
    #: the state it returns. No hand-written ``state_dict``, ``__repr__`` or
    #: ``summary``.
    state_fields: ClassVar[tuple[str, ...]] = ()
    #: Constructor settings a checkpoint must have been made with (compared
    #: on restore, so a run never resumes under another ``alpha``).
    resume_settings: ClassVar[tuple[str, ...]] = ()
    #: The settings ``repr()`` and the run's summary show.
    settings: ClassVar[tuple[str, ...]] = (
        "fraction_train",
        "participation",
        "weighting",
        "seed",
    )
    #: What Flower's central-DP wrappers leave uncovered when they wrap the
    #: strategy (server state built from un-noised aggregates), logged as a
    #: warning when one does. None means nothing beyond the records uploaded
    #: besides the model, which are named without it.
    central_dp_caveat: ClassVar[str | None] = None
    #: Why ``secure_sums()`` returns None (the rule needs individual
    #: replies), and what to use instead; said when secure aggregation is
    #: refused.
    secure_refusal: ClassVar[str] = (
        "its server_update was overridden without declaring secure_sums(), so "
        "nothing says it needs only sums of the replies"
    )
    # Set by secure aggregation while the rule runs: record -> the unmasked
    # weighted mean, which weighted_mean returns instead of averaging replies.
    _secure_means: dict[str, dict[str, NDArray]] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Make a rule of the subclass's own safe unless it declares otherwise.

        A class that overrides :meth:`server_update` without declaring
        :attr:`model_linear_in_replies` gets False: every reply's model record
        is checked for NaN and inf before its rule runs. The name this
        declaration had before, ``linear_aggregate``, still works, with a
        ``FutureWarning``.
        """
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if "linear_aggregate" in own:
            warnings.warn(
                f"{cls.__name__}.linear_aggregate is now called "
                "model_linear_in_replies; the old name goes in a later release",
                FutureWarning,
                stacklevel=2,
            )
            if "model_linear_in_replies" not in own:
                cls.model_linear_in_replies = bool(own["linear_aggregate"])
        elif "server_update" in own and "model_linear_in_replies" not in own:
            cls.model_linear_in_replies = False
        if "server_update" in own and "secure_sums" not in own:
            cls.secure_sums = _no_secure_sums  # type: ignore[method-assign]

    # ----------------------------------------------------------------- hooks
    def train_config(self, server_round: int) -> dict[str, Any]:
        """Return the algorithm's values for this round's train ConfigRecord.

        Parameters
        ----------
        server_round : int
            The round being configured (continuing after a resume).

        Returns
        -------
        dict[str, Any]
            Values added to every sampled node's train ``ConfigRecord``, under
            kebab-case keys defined beside the algorithm (``feddyn-alpha``).
            The base sends none.
        """
        return {}

    def train_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Return extra ArrayRecords sent to every sampled node with the model.

        Parameters
        ----------
        server_round : int
            The round being configured.

        Returns
        -------
        dict[str, ArrayRecord]
            Record name -> record, e.g. SCAFFOLD's server control variate. The
            base sends none.
        """
        return {}

    def node_train_records(
        self, node_id: int, server_round: int
    ) -> dict[str, ArrayRecord]:
        """Return extra ArrayRecords for one node only.

        Parameters
        ----------
        node_id : int
            The sampled node.
        server_round : int
            The round being configured.

        Returns
        -------
        dict[str, ArrayRecord]
            Record name -> record, sent to this node besides
            :meth:`train_records`. The base sends none.
        """
        return {}

    def evaluate_config(self, server_round: int) -> dict[str, Any]:
        """Return the values added to round ``server_round``'s evaluate configs.

        As :meth:`train_config`, for every evaluate ``ConfigRecord``; the base
        sends none.
        """
        return {}

    def evaluate_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Return extra ArrayRecords sent with the model for evaluation.

        As :meth:`train_records` (record name -> record), for round
        ``server_round``'s evaluate messages; the base sends none.
        """
        return {}

    def central_models(self) -> dict[str, ArrayRecord]:
        """Return further server-side models to evaluate centrally.

        The pack's app evaluates each beside the global model under its name
        (FedDyn's mean of all clients' models, APFL's weighted average).

        Returns
        -------
        dict[str, ArrayRecord]
            Name -> model; the base has none.
        """
        return {}

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        """Return the ArrayRecords a train reply must carry.

        Start from ``super()``'s (the model) and add yours: a reply missing a
        record, or with another key, shape or dtype, is rejected before
        :meth:`server_update` sees it. Before the first round the model's
        layout is not known: only the names are.

        Parameters
        ----------
        server_round : int
            The round whose replies are checked.

        Returns
        -------
        dict[str, RecordSpec]
            Record name -> expected keys, dtypes and shapes.
        """
        spec = {} if self._global_spec is None else self._global_spec
        expected = {self.arrayrecord_key: spec}
        for piece in self.pieces:
            expected.update(piece.expected_arrays(spec))
        return expected

    def check_reply(self, reply: ValidReply) -> None:
        """Check a structurally valid reply further; raise to drop it.

        Extend it with ``super().check_reply(reply)`` first. The base checks
        the rule metric (``strict=True``), a metric weight
        (``weighted_by_key``) and the client key (:attr:`stateful_clients`).

        Parameters
        ----------
        reply : ValidReply
            The reply, its arrays already checked against
            :meth:`expected_train_arrays`.

        Raises
        ------
        ReplyRejected
            To drop the reply; it is logged with its node and counted by
            ``kind``.
        """
        if self.strict and not reports_rule(reply, self.rule_metric):
            raise ReplyRejected(
                "rule-not-applied",
                f"no '{self.rule_metric}' metric, so nothing says the client "
                f"applies {self.rule_name} (strict=True): "
                f"{protocol_problem(RuleNames.of(self), reply)}",
            )
        if self.strict and term_shortfall(reply, self.rule_metric):
            raise ReplyRejected(
                "rule-not-applied",
                f"{shortfall_problem(RuleNames.of(self), reply)} (strict=True)",
            )
        if self.weighting == "metric":
            check_weight(reply.metrics, self.weighted_by_key, kind="weight")
        if self.stateful_clients:
            key = reply.metrics.get(keys.CLIENT_KEY_METRIC)
            if isinstance(key, bool) or not isinstance(key, int):
                names = RuleNames.of(self)
                raise ReplyRejected(
                    "client-key",
                    f"no integer '{keys.CLIENT_KEY_METRIC}' metric, which "
                    f"{names.server} needs to keep each client's state: "
                    f"{protocol_problem(names, reply)}",
                )
            for name in (keys.STATE_ROUND_METRIC, keys.STATE_OUTSIDE_COMMIT_METRIC):
                value = reply.metrics.get(name)
                if value is not None and (
                    isinstance(value, bool) or not isinstance(value, int) or value < -1
                ):
                    raise ReplyRejected(
                        name, f"'{name}' is {value!r}, not an integer >= -1"
                    )

    def expected_train_metrics(self, server_round: int) -> dict[str, MetricSpec]:
        """Return the metrics a train reply must carry, name -> :class:`MetricSpec`.

        Declare them as :meth:`expected_train_arrays` declares records (start
        from ``super()``'s): a reply without one, or with a value of another
        type or out of range, is rejected with a reason naming the metric
        before :meth:`check_reply` and :meth:`server_update` see it, and the
        conformance kit (:mod:`flwr_prox_strategies.testing`) builds valid
        replies from them. ``num-examples`` is always checked. For the replies
        of round ``server_round``; the base declares none.
        """
        return {}

    def reply_weight(self, reply: ValidReply) -> float:
        """Return the weight of a valid reply in the average.

        Parameters
        ----------
        reply : ValidReply
            A validated reply.

        Returns
        -------
        float
            Its ``num-examples`` (``weighting="num-examples"``), 1.0
            (``"uniform"``) or its ``weighted_by_key`` metric.
        """
        if self.weighting == "metric":  # checked finite and > 0 in check_reply
            return float(reply.metrics[self.weighted_by_key])  # type: ignore[arg-type]
        return reply.num_examples if self.weighting == "num-examples" else 1.0

    def client_held_state(self, reply: ValidReply) -> bool:
        r"""Return whether a reply's client trained from state the server committed.

        For a server rule over client states (``stateful_clients``): False
        when the client held none, so its state started at zero (its first
        round, a node restarted without a ``state_dir``, a client asked to
        start afresh). A sum over all clients that counts an unseen client
        at a value of its own (the model :math:`\theta^0`, say) then knows
        that the reply's difference is from zero, not from that value.

        Parameters
        ----------
        reply : ValidReply
            A reply of the round (reconciled: a client holding another round's
            state never reaches the rule).

        Returns
        -------
        bool
            True when the reply's ``state-round`` metric
            (:data:`~flwr_prox_strategies.extend.STATE_ROUND_METRIC`) names a
            committed round; False also when the reply carries none (a client
            that does not run the algorithm's rule): declare it in
            :meth:`expected_train_metrics` to reject such replies instead.
        """
        return held_state(reply)

    def weighted_mean(
        self, replies: list[ValidReply], record: str | None = None
    ) -> dict[str, NDArray]:
        """Return the weighted mean of one record over the replies.

        Weights (:meth:`reply_weight`) are normalised before they are applied
        (as Flower's ``FedAvg``), so finite replies never overflow the
        accumulator.

        Parameters
        ----------
        replies : list[ValidReply]
            The replies to average (non-empty).
        record : str | None (default: None)
            The ArrayRecord to average; None: the model.

        Returns
        -------
        dict[str, NDArray]
            Array key -> mean, in the replies' dtypes.
        """
        name = record or self.arrayrecord_key
        if self._secure_means is not None:  # secure aggregation unmasked it
            return {
                key: value.copy() for key, value in self._secure_means[name].items()
            }
        weights = [self.reply_weight(reply) for reply in replies]
        mean = WeightedMean(total=sum(weights), accumulate_in=self._accumulate_in)
        # The replies' arrays are views already in memory: fold them all at
        # once, block by block (the same sums as one reply after another).
        mean.add_all([reply.arrays[name] for reply in replies], weights)
        return mean.result()

    def server_update(
        self, server_round: int, state: Mapping[str, Any], replies: list[ValidReply]
    ) -> RoundUpdate:
        r"""Apply the algorithm's server rule: return the new model, state and metrics.

        It may be called more than once per round (a reply found non-finite is
        dropped and the rule re-run), so it must depend on its arguments only
        (and ``self.global_arrays``, the model this round sent,
        :math:`\theta^t`). The base returns the weighted mean.

        Parameters
        ----------
        server_round : int
            The round being aggregated.
        state : dict[str, Any]
            The current values of :attr:`state_fields` (as :meth:`grown_state`
            left them when N grows this round), read-only: writing into it
            (``x *= 0.9``, ``state["x"] = ...``) raises at once, and reading a
            field not declared names :attr:`state_fields`.
        replies : list[ValidReply]
            The round's valid replies, in a fixed order (client key, else node
            id): ``reply.arrays[record][key]`` are read-only arrays.

        Returns
        -------
        RoundUpdate
            The new model, the new state values (committed only if the round
            is aggregated) and extra metrics.
        """
        return RoundUpdate(dict_to_record(self.weighted_mean(replies)))

    def secure_sums(self) -> dict[str, tuple[str, ...]] | None:
        """Declare what the server rule reads of the replies, for secure aggregation.

        Under secure aggregation (:class:`~flwr_prox_strategies.SecAggPlus`)
        the server never sees a reply's arrays, only sums over the round's
        contributors; a rule that reads nothing else runs unchanged. Each
        record the rule reads is declared with how it reads it:

        * ``"mean"``: through :meth:`weighted_mean` (the clients mask their
          weight and the weighted record; :meth:`weighted_mean` returns the
          unmasked weighted mean);
        * ``"sum"``: as a sum over the replies (``sum(r.arrays[name] for r in
          replies)``, the drift and control sums); every reply the rule gets
          then holds the contributors' plain mean, so the sum over them is
          the unmasked sum.

        Parameters
        ----------
        None

        Returns
        -------
        dict[str, tuple[str, ...]] | None
            Record name -> the ways the rule reads it (``("mean",)``,
            ``("sum",)`` or both); None when the rule needs individual replies
            (a median, FedEPM's elastic-net centre): secure aggregation is
            then refused, with :attr:`secure_refusal`. The base (a weighted
            mean of the model) declares ``{model: ("mean",)}``; a class that
            overrides :meth:`server_update` without declaring it gets None.
        """
        return {self.arrayrecord_key: ("mean",)}

    def grown_state(
        self, state: Mapping[str, Any], old: int, new: int
    ) -> dict[str, Any]:
        """Return ``state`` adjusted to N growing from ``old`` to ``new``.

        Called before :meth:`server_update` in a round where N grows. Sums over
        all clients need nothing (a new client holds zero state); a mean over N
        (SCAFFOLD's c) is rescaled. The base returns ``state`` unchanged.

        Parameters
        ----------
        state : dict[str, Any]
            The current values of :attr:`state_fields`; do not mutate it.
        old, new : int
            N before and after this round.

        Returns
        -------
        dict[str, Any]
            The adjusted state.
        """
        return dict(state)


def _no_secure_sums(self: AlgorithmHooks) -> dict[str, tuple[str, ...]] | None:
    """Refuse secure aggregation: the rule was overridden without a declaration."""
    return None

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

import warnings
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

from ...ops.aggregate import WeightedMean
from ..contract.fields import RoundUpdate, settings_text
from ..contract.frozen import FrozenState, mutation_error
from ..contract.ledger import record_privacy
from ..contract.validation import (
    MetricSpec,
    ReplyRejected,
    ValidReply,
    check_base_options,
    check_int,
    check_metrics,
    check_weight,
    init_keywords,
    reject_unknown_kwargs,
    resolve_weighting,
)
from ..transport import keys
from ..transport.messages import node_messages, payload_bytes
from ..transport.records import RecordSpec, dict_to_record, spec_of
from . import metrics, population, sampling, screening
from .commit import ClientBook
from .finite import finite_update
from .outcome import (
    AggregationStalledError,
    NoRoundAggregatedError,
    ReplyTally,
    finish_run,
)
from .resume import restore_strategy, strategy_state
from .summary import log_flower_summary, log_summary

MetricsFn = Callable[[list[RecordDict], str], MetricRecord]


class ValidatedFedAvg(FedAvg):
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

    Parameters
    ----------
    fraction_train, fraction_evaluate : float (default: 1.0)
        Fraction of connected nodes sampled for training / federated
        evaluation, in ``[0, 1]``.
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
        mean); None: the class's
        :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.default_weighting`.
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
        code); the class's
        :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.straggler_policy`
        drops them (FedAvg) or keeps their partial work (FedProx). Needs
        ``local_epochs >= 2``.
    lr_decay : float (default: 1.0)
        Round ``t`` sends ``lr-scale = lr_decay ** (t - 1)``, which clients
        multiply into their step size (the official FedDyn/FedDC codes: 0.998).
    num_clients : int | None (default: None)
        ``K``, the federation's size, checked every round. Rules that divide by
        all clients
        (:attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.requires_num_clients`)
        take None as "the nodes connected at the first round"; K grows when a
        new client first replies.
    seed : int (default: 0)
        Seeds node sampling and straggler draws, per round.
    monitor_dissimilarity : bool (default: False)
        Ask clients for their full local gradient at the global model and log
        the FedProx paper's dissimilarity
        ``B = E_k||grad f_k||^2 / ||grad f||^2`` over the round's valid
        replies (one extra pass, one model-sized upload).
    accept_failures : bool (default: True)
        When False, a round in which any reply failed or was rejected keeps the
        model, as in Flower's legacy strategies.
    node_wait_timeout : float (default: 120.0)
        Seconds to wait for the nodes a round needs before failing with the fix
        (Flower's ``FedAvg`` waits forever).
    max_num_examples : float | None (default: None)
        Absolute cap on a reply's claimed ``num-examples`` (lowered, logged).
    max_weight_ratio : float | None (default: 100.0)
        Cap on a claim relative to the round's median claim (a capped claim is
        logged). It bounds a liar in a large federation, not in a small one:
        there set ``max_num_examples`` or ``weighting="uniform"``. None: no cap.
    max_reply_bytes : int | None (default: None)
        Largest reply accepted (bytes of its ArrayRecords), checked before any
        array is decoded. None: twice an honest reply, plus 1 MiB.
    min_round_nodes : int | None (default: None)
        Nodes that must be connected for a later round to start (None:
        ``min_available_nodes`` every round). A federation that loses nodes goes
        on with at least this many; stateful rules keep absent clients' state.
    strict : bool (default: False)
        Reject train replies that do not report
        :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.rule_metric`
        (kind ``rule-not-applied``) instead of averaging them in with a
        warning (given once per run, repeated at the run's end and counted
        each round in ``replies-rule-missing``).
    max_rounds_without_aggregation : int | None (default: 3)
        Rounds in a row that may end without aggregating (no valid reply, or
        ``accept_failures=False`` refusing the round) before
        ``aggregate_train`` raises
        :class:`~flwr_prox_strategies.AggregationStalledError`
        (:class:`~flwr_prox_strategies.NoRoundAggregatedError` when no round
        was ever aggregated), with the counted reasons. Raised inside the
        round, it stops any loop that calls the strategy, a ``start()`` of
        your own included; a round that aggregates resets the count. None:
        never (the pack's ``start()`` and
        :meth:`~flwr_prox_strategies.extend.ValidatedFedAvg.check_run` still
        fail a run that aggregated nothing).
    pack_metrics : bool (default: True)
        Add the pack's bookkeeping to each round's aggregated metrics (the
        counts of valid, failed, rejected, absent and capped replies, bytes
        sent and received, the privacy ledger's summary, the evaluation's
        spread over clients, and the rules' ``<algorithm>-applied`` flags and
        ``local-steps`` averaged from the replies). False: a round's metrics
        are only the aggregate of the clients' own metrics (and the
        algorithm's).
    per_client_metrics : bool (default: False)
        Add per-client lists to the aggregated metrics (``eval-client-keys``
        and ``<metric>-per-client`` of every accuracy, the privacy ledger's
        ``dp-epsilon-total-per-client``). The pack's experiment asks for them
        (its per-client table and plots); Flower's own metric handling
        expects scalars.
    arrayrecord_key : str (default: "arrays")
        The model's ArrayRecord name in the messages (Flower's default).
    configrecord_key : str (default: "config")
        The ConfigRecord's name in the messages (Flower's default).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable | None (default: None)
        Flower-style ``(list[RecordDict], str) -> MetricRecord``, called on the
        valid replies only, with ``weighted_by_key`` for training and
        ``num-examples`` for evaluation. None: the weighted mean of every
        metric.

    Raises
    ------
    ValueError
        If a parameter is out of range, naming it and the allowed range:
        ``fraction_train``, ``fraction_evaluate`` and ``drop_percent`` outside
        ``[0, 1]``; ``participation`` or ``weighting`` not one of the choices;
        a negative ``min_*_nodes``; ``local_epochs``, ``local_steps``,
        ``num_clients``, ``min_round_nodes`` or ``max_reply_bytes`` below 1;
        a negative ``seed``; ``lr_decay`` outside ``(0, 1]``; a negative
        ``node_wait_timeout``; ``max_num_examples`` not > 0;
        ``max_weight_ratio`` below 1; ``drop_percent > 0`` with
        ``local_steps`` or with ``local_epochs < 2``.
    TypeError
        If a keyword is unknown (naming the closest accepted one, or the
        Message-API name of a Flower legacy name such as ``fraction_fit``), or
        if both ``weighting`` and ``weighted_by_key`` are given.

    See Also
    --------
    flwr_prox_strategies.extend : the hooks a subclass overrides.
    """

    #: What happens to stragglers (``drop_percent``), ``"drop"`` (they are sent
    #: no work, as the FedProx paper's FedAvg) or ``"keep-partial"`` (their
    #: fewer epochs are used).
    straggler_policy: ClassVar[str] = "drop"
    #: Whether clients keep state the server sums over (FedDyn, FedDC,
    #: SCAFFOLD). Then the base runs the two-phase commit of client state (a
    #: client commits its pending state once told its reply was aggregated)
    #: and rejects replies without an integer ``client-key`` metric.
    stateful_clients: ClassVar[bool] = False
    #: The metric (value 1) a client reports when it applied this algorithm's
    #: client rule (the rule's :attr:`ClientRule.applied_metric
    #: <flwr_prox_strategies.extend.ClientRule.applied_metric>`). Replies
    #: without it are named in one warning per run, or rejected with
    #: ``strict=True``. None means any client will do.
    rule_metric: ClassVar[str | None] = None
    #: What the client rule is called, in that warning.
    rule_name: ClassVar[str] = "client rule"
    #: The pack's ``(client, rule)`` class names that apply the rule, in that
    #: warning; None means ``<Class>Client`` and ``<Class>Rule``.
    rule_pieces: ClassVar[tuple[str, str] | None] = None
    #: Whether the server rule divides by K, the number of all clients. Then
    #: ``num_clients=None`` means "learn K from the grid at the first round"
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
        self.max_rounds_without_aggregation = max_rounds_without_aggregation
        self.pack_metrics = bool(pack_metrics)
        self.per_client_metrics = bool(per_client_metrics)
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
        # The run's first model (what Result.arrays holds if nothing is
        # aggregated) and the rounds in a row not aggregated, with their reasons.
        self._run_initial: ArrayRecord | None = None
        self._final_round: int | None = None  # known in the pack's start() only
        self._stalled = 0
        self._stall_tally = ReplyTally()

    rejections = property(lambda self: self.screen.rejections)
    run_tally = property(lambda self: self.screen.run_tally)
    round_tally = property(lambda self: self.screen.round_tally)

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

        Parameters
        ----------
        grid : Grid
            The grid the ServerApp received.
        initial_arrays : ArrayRecord
            The initial global model.
        num_rounds : int (default: 3)
            Rounds of training (and evaluation) to run.
        timeout : float (default: 3600)
            Seconds to wait for a round's replies.
        train_config, evaluate_config : ConfigRecord | None (default: None)
            Sent with every train / evaluate message, besides the algorithm's
            own values.
        evaluate_fn : callable | None (default: None)
            ``evaluate_fn(server_round, arrays) -> MetricRecord | None``:
            central evaluation of the global model, each round.

        Returns
        -------
        Result
            Flower's ``Result``: ``Result.arrays`` is the last aggregated model,
            or ``initial_arrays`` when no round was aggregated (Flower leaves it
            empty).

        Raises
        ------
        NoRoundAggregatedError
            If no round was aggregated (with ``num_rounds > 0`` and
            ``fraction_train > 0``), with the counted reasons and the
            ``Result`` (``err.result``).
        AggregationStalledError
            From a round, when ``max_rounds_without_aggregation`` rounds in a
            row were not aggregated.
        """
        self.reset_run()
        self._run_initial = initial_arrays
        # A stall in the last round is left to check_run, which raises with
        # Flower's whole Result.
        self._final_round = self.round_offset + num_rounds
        result = super().start(
            grid=grid,
            initial_arrays=initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
        )
        return self.check_run(result, num_rounds=num_rounds)

    def check_run(
        self, result: Result | None = None, num_rounds: int | None = None
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
            type(self).__name__,
            result,
            self._run_initial if self._run_initial is not None else result.arrays,
            attempted if num_rounds is None else num_rounds,
            tally,
            trains=self.fraction_train > 0,
        )

    def reset_run(self) -> None:
        """Start a new run's diagnostics (reasons tally, the once-per-run warning)."""
        self.screen.reset_run()
        self._rule_warned = False
        self._run_initial = None
        self._final_round = None
        self._stalled = 0
        self._stall_tally = ReplyTally()

    def sample_nodes(
        self, grid: Grid, server_round: int, **draw: Any
    ) -> tuple[list[int], int]:
        """Sample nodes with this strategy's seed, waiting for a quorum.

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
        """Return the algorithm's values for this round's evaluate ConfigRecord.

        Parameters
        ----------
        server_round : int
            The round being configured.

        Returns
        -------
        dict[str, Any]
            Values added to every evaluate ``ConfigRecord``; the base sends none.
        """
        return {}

    def evaluate_records(self, server_round: int) -> dict[str, ArrayRecord]:
        """Return extra ArrayRecords sent with the model for evaluation.

        Parameters
        ----------
        server_round : int
            The round being configured.

        Returns
        -------
        dict[str, ArrayRecord]
            Record name -> record; the base sends none.
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
        if self.monitor_dissimilarity:
            expected[keys.GRADIENT_RECORD] = spec
        return expected

    def expected_train_metrics(self, server_round: int) -> dict[str, MetricSpec]:
        """Return the metrics a train reply must carry, name -> :class:`MetricSpec`.

        Declare them as :meth:`expected_train_arrays` declares records (start
        from ``super()``'s): a reply without one, or with a value of another
        type or out of range, is rejected with a reason naming the metric
        before :meth:`check_reply` and :meth:`server_update` see it, and the
        conformance kit (:mod:`flwr_prox_strategies.testing`) builds valid
        replies from them. ``num-examples`` is always checked.

        Parameters
        ----------
        server_round : int
            The round whose replies are checked.

        Returns
        -------
        dict[str, MetricSpec]
            Metric name -> its type and range; the base declares none.
        """
        return {}

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
        if self.strict and not screening.reports_rule(reply, self.rule_metric):
            raise ReplyRejected(
                "rule-not-applied",
                f"no '{self.rule_metric}' metric, so the client is not applying "
                f"{self.rule_name} (strict=True): "
                f"{screening.protocol_problem(self, reply)}",
            )
        if self.weighting == "metric":
            check_weight(reply.metrics, self.weighted_by_key, kind="weight")
        if self.stateful_clients:
            key = reply.metrics.get(keys.CLIENT_KEY_METRIC)
            if isinstance(key, bool) or not isinstance(key, int):
                raise ReplyRejected(
                    "client-key",
                    f"no integer '{keys.CLIENT_KEY_METRIC}' metric, which "
                    f"{screening.pack_class(type(self)).__name__} needs to keep "
                    f"each client's state: {screening.protocol_problem(self, reply)}",
                )

    def learn_num_clients(self, num_clients: int) -> None:
        """Adopt K learned from the grid, grown, or from a checkpoint.

        Subclasses that derive settings from it (FedEPM's sampling) extend this.

        Parameters
        ----------
        num_clients : int
            The number of all clients, K.

        Raises
        ------
        ValueError
            If ``num_clients`` is not an integer >= 1.
        """
        check_int("num_clients", num_clients, 1)
        self.num_clients = num_clients

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
        weights = [self.reply_weight(reply) for reply in replies]
        mean = WeightedMean(total=sum(weights), accumulate_in=self._accumulate_in)
        for reply, weight in zip(replies, weights, strict=True):
            mean.add(reply.arrays[record or self.arrayrecord_key], weight)
        return mean.result()

    def server_update(
        self,
        server_round: int,
        state: Mapping[str, Any],
        replies: list[ValidReply],
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
            left them when K grows this round). Do not mutate it.
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

    def grown_state(
        self, state: Mapping[str, Any], old: int, new: int
    ) -> dict[str, Any]:
        """Return ``state`` adjusted to K growing from ``old`` to ``new``.

        Called before :meth:`server_update` in a round where K grows. Sums over
        all clients need nothing (a new client holds zero state); a mean over K
        (SCAFFOLD's c) is rescaled. The base returns ``state`` unchanged.

        Parameters
        ----------
        state : dict[str, Any]
            The current values of :attr:`state_fields`; do not mutate it.
        old, new : int
            K before and after this round.

        Returns
        -------
        dict[str, Any]
            The adjusted state.
        """
        return dict(state)

    def state_dict(self) -> dict[str, Any]:
        """Return the server state that resumes the run exactly.

        Returns
        -------
        dict[str, Any]
            The declared
            :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.state_fields`
            (kebab-case keys), the
            :attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.resume_settings`,
            the rounds completed, K, ``seed``, the privacy ledger and the
            clients' commit bookkeeping: pass it to
            :meth:`load_state_dict` of a strategy built the same way.
        """
        return strategy_state(self)

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
            another seed or another K, naming the difference (the run would
            not resume identically).
        """
        restore_strategy(self, state)

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
        """Validate replies.

        With this strategy's :meth:`check_reply`, size limit and retired nodes.
        """
        expected_metrics = screening.pop("expected_metrics", None) or {}

        def check(reply: ValidReply) -> None:
            check_metrics(reply.metrics, expected_metrics)
            self.check_reply(reply)

        return self.screen.collect(
            server_round,
            replies,
            check=check,
            max_bytes=self.reply_size_limit(screening["expected_arrays"]),
            retired=self.retired_nodes,
            **screening,
        )

    def reply_size_limit(self, expected_arrays: Mapping[str, RecordSpec]) -> int:
        """Return the largest reply accepted, in bytes (``max_reply_bytes``)."""
        return screening.reply_size_limit(self.max_reply_bytes, expected_arrays)

    def cap_claims(
        self, server_round: int, replies: list[ValidReply], phase: str
    ) -> int:
        """Lower claims above the caps (``max_num_examples``, ``max_weight_ratio``)."""
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
            )
            rejected += unusable
        capped = self.cap_claims(server_round, valid, "aggregate_train")

        def rule(candidates: list[ValidReply], wide: bool) -> RoundUpdate:
            self._accumulate_in = np.float64 if wide else None
            try:
                state = FrozenState(
                    population.state_for_round(self, k_before, candidates),
                    type(self).__name__,
                    self.state_fields,
                )
                try:
                    update = self.server_update(server_round, state, candidates)
                except ValueError as err:  # numpy refusing a read-only array
                    mutation = mutation_error(type(self).__name__, err)
                    if mutation is None:
                        raise
                    raise mutation from err
                update.state = {k: state.thaw(v) for k, v in update.state.items()}
                return update
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
        lacking = self._count_rule_not_applied(server_round, valid, keep is None)
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
            self._count_stalled_round(server_round, keep or "no model")
            return None, MetricRecord(counts)
        self.run_tally.aggregated += 1
        self._stalled = 0
        self._stall_tally = ReplyTally()
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
            valid,
            self._custom_metrics[0],
            self.weighted_by_key,
            pack_metrics=self.pack_metrics,
        )
        extra = dict(update.metrics)
        if self.monitor_dissimilarity:
            extra.update(metrics.dissimilarity_metrics(valid, self.reply_weight))
        for key, value in {**counts, **extra}.items():
            record[key] = value
        return update.arrays, record

    def _count_rule_not_applied(
        self, server_round: int, replies: list[ValidReply], aggregated: bool
    ) -> int:
        """Count the valid replies that lack the rule metric; warn once per run."""
        if self.rule_metric is None:
            return 0
        lacking = [
            r for r in replies if not screening.reports_rule(r, self.rule_metric)
        ]
        if lacking and aggregated:
            self.run_tally.add_not_applied(
                lacking, screening.protocol_problem(self, lacking[0])
            )
            if not self._rule_warned:
                self._rule_warned = screening.warn_rule_not_applied(
                    self, server_round, lacking
                )
        return len(lacking)

    def _count_stalled_round(self, server_round: int, why: str) -> None:
        """Count a round not aggregated; raise after too many in a row."""
        if self.fraction_train == 0.0 or not self.train_nodes:
            return  # a round that sampled nobody for training is no failure
        self._stalled += 1
        self._stall_tally.update(self.round_tally)
        self._stall_tally.kept[why] += 1
        limit = self.max_rounds_without_aggregation
        if limit is None or self._stalled < limit or server_round == self._final_round:
            return
        name = type(self).__name__
        first = server_round - self._stalled + 1
        never = self.run_tally.aggregated == 0
        error = NoRoundAggregatedError if never else AggregationStalledError
        model = "the initial model" if never else "the last aggregated model"
        raise error(
            f"{name}: no round aggregated in {self._stalled} rounds in a row "
            f"(rounds {first}-{server_round}, max_rounds_without_aggregation="
            f"{limit}): {self._stall_tally.describe()}. The run stops here; "
            f"err.result.arrays holds {model}. Fix the cause above, or set "
            "max_rounds_without_aggregation=None to let such a run go on.",
            Result(
                arrays=(self._run_initial if never else self.global_arrays)
                or ArrayRecord()
            ),
            self._stall_tally,
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
        return metrics.evaluation_metrics(
            server_round,
            valid,
            self._custom_metrics[1],
            pack_metrics=self.pack_metrics,
            per_client=self.per_client_metrics,
        )

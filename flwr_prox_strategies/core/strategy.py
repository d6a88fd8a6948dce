"""The validated strategy base every strategy of the pack inherits.

It keeps Flower's ``FedAvg`` interface (so ``strategy.start(...)`` and Flower's DP
wrappers work unchanged) and holds the machinery a research user must be able
to trust, each job in its own module:

* :mod:`.screening`: every reply validated against what was sent; a bad one is
  logged, counted and otherwise ignored, as if it had never arrived; hostile
  claims and sizes bounded; a dead node's reply attributed to it;
* :mod:`.sampling`: seeded per round (a resumed run samples as an uninterrupted
  one), bounded waits for the quorum, stragglers;
* :mod:`.commit`: the server's half of the two-phase commit of client state;
* :mod:`.fields`: declared state, from which ``state_dict``, ``load_state_dict``,
  ``repr`` and ``summary`` follow;
* :mod:`.outcome`: a round without a valid reply keeps the model and says why; a
  run that aggregates nothing raises :class:`NoRoundAggregatedError`;
* :mod:`.metrics` and :func:`.privacy.record_privacy`: the round's metrics and
  the epsilon ledger.

An algorithm is a subclass that declares its state and overrides a few hooks:
:meth:`ValidatedFedAvg.server_update` (its server rule, pure), and when it
needs them :meth:`~ValidatedFedAvg.grown_state`, :meth:`~ValidatedFedAvg.train_config`,
:meth:`~ValidatedFedAvg.train_records`, :meth:`~ValidatedFedAvg.node_train_records`,
:meth:`~ValidatedFedAvg.expected_train_arrays`, :meth:`~ValidatedFedAvg.check_reply`;
class attributes say what it is (``state_fields``, ``resume_settings``,
``settings``, ``rule_metric``, ``stateful_clients``, ``requires_num_clients``).
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

from ..ops.aggregate import WeightedMean, ZeroTotalWeightError
from .commit import ClientBook
from .fields import (
    RoundUpdate,
    check_settings,
    load_fields,
    save_fields,
    settings_text,
)
from .keys import (
    CLIENT_KEY_METRIC,
    GRADIENT_RECORD,
    LOCAL_EPOCHS_KEY,
    LOCAL_STEPS_KEY,
    LR_SCALE_KEY,
    NUM_EXAMPLES_KEY,
    REPORT_GRADIENT_KEY,
    SERVER_ROUND_KEY,
)
from .metrics import dissimilarity_metrics, per_client_table, weighted_metric_mean
from .outcome import (
    EveryClientRetiredError,
    NoRoundAggregatedError,
    ReplyTally,
    finish_run,
    short_reason,
)
from .privacy import record_privacy
from .records import (
    RecordSpec,
    dict_to_record,
    record_is_finite,
    spec_of,
)
from .sampling import PARTICIPATION, connected_nodes, draw_stragglers, sample_nodes
from .screening import (
    ReplyScreen,
    cap_claims,
    reply_node,
    reply_order,
    reply_size_limit,
    reports_rule,
    warn_rule_not_applied,
)
from .validation import (
    NON_FINITE,
    OUT_OF_RANGE,
    ReplyRejected,
    ValidReply,
    check_choice,
    check_fraction,
    check_int,
    check_non_negative,
    check_positive,
    check_weight,
    init_keywords,
    reject_unknown_kwargs,
    resolve_weighting,
)

# The run outcome's names are re-exported: they were first defined here.
__all__ = [
    "EveryClientRetiredError",
    "NoRoundAggregatedError",
    "ReplyTally",
    "ValidatedFedAvg",
    "finish_run",
    "short_reason",
]

STRAGGLER_POLICIES = ("drop", "keep-partial")


class ValidatedFedAvg(FedAvg):
    """Federated averaging with validated replies, seeded sampling and stragglers.

    This is the pack's FedAvg baseline and the base of every pack strategy.

    Parameters
    ----------
    fraction_train : float (default: 1.0)
        Fraction of connected nodes sampled for training each round.
    participation : str (default: "fixed")
        How the training sample is drawn. ``"fixed"``: exactly
        ``max(int(fraction_train * n), min_train_nodes)`` of the ``n`` connected
        nodes, uniformly without replacement (Flower's ``FedAvg``, the papers'
        "m clients per round"). ``"bernoulli"``: each node joins independently
        with probability ``fraction_train``, so the count varies from round to
        round (100 nodes at 0.1: 3 to 22 over 200 rounds), redrawn while it is
        below ``max(min_train_nodes, 1)``; the official FedDyn/FedDC codes'
        ``act_prob`` rule.
    fraction_evaluate : float (default: 1.0)
        Fraction of connected nodes sampled for federated evaluation.
    min_train_nodes : int (default: 2)
        Minimum number of nodes sampled for training.
    min_evaluate_nodes : int (default: 2)
        Minimum number of nodes sampled for evaluation.
    min_available_nodes : int (default: 2)
        Nodes that must be connected before sampling.
    weighting : str | None (default: None)
        ``"num-examples"``: average weighted by each reply's sample count;
        ``"uniform"``: plain mean over the valid replies. None: the class's
        :attr:`default_weighting` (``"num-examples"`` here).
    weighted_by_key : str | None (default: None)
        Flower's name for the weighting: the reply metric whose value weights
        the average. ``"num-examples"`` is ``weighting="num-examples"``; any
        other key weights each reply by that metric, which must be a finite
        number > 0 in every reply (else the reply is rejected). Give
        ``weighting`` or ``weighted_by_key``, not both.
    local_epochs : int | None (default: None)
        Sent as ``local-epochs`` each round when set; otherwise clients use their
        own setting. Required when ``drop_percent > 0``.
    drop_percent : float (default: 0.0)
        Fraction of the sampled nodes made stragglers each round (the FedProx
        paper's systems heterogeneity). A straggler runs a random number of epochs
        in ``1 .. local_epochs - 1`` (as ``np.random.randint(1, E)`` in the
        official FedProx code). What happens to them is the class's
        ``straggler_policy``: this baseline drops them (never sends them work).
    lr_decay : float (default: 1.0)
        Per-round learning-rate decay: round ``t`` sends ``lr-scale =
        lr_decay ** (t - 1)``, which clients multiply into their step size (the
        official FedDyn/FedDC codes decay by 0.998 per round).
    num_clients : int | None (default: None)
        The federation's size ``K``. When set, every round checks that exactly
        this many nodes are connected. Algorithms whose update divides by the
        number of *all* clients (FedDyn, FedDC, SCAFFOLD, FedEPM, SFedAvg:
        :attr:`requires_num_clients`) take None as "the number of nodes the
        grid reports at the first round" (logged), checked in later rounds.
    seed : int (default: 0)
        Seeds node sampling and straggler draws, per round.
    monitor_dissimilarity : bool (default: False)
        Ask clients for their full local gradient at the global model and log
        the FedProx paper's dissimilarity ``B = E_k||grad f_k||^2 / ||grad f||^2``
        (weights as the average), estimated over the round's valid replies.
        Costs one extra pass over the local data and one model-sized upload.
    accept_failures : bool (default: True)
        When False, a round in which any reply failed or was rejected is not
        aggregated (the model is kept), as in Flower's legacy strategies.
    node_wait_timeout : float (default: 120.0)
        Seconds to wait for ``min_available_nodes`` before failing with an
        explanation (Flower's own ``FedAvg`` waits forever).
    min_round_nodes : int | None (default: None)
        The quorum after the first sampling: nodes that must be connected for
        a later round to start (None: ``min_available_nodes`` every round, as
        Flower's ``FedAvg``). A federation that loses nodes goes on with at
        least this many; the stateful algorithms keep absent clients' state in
        their sums, so K is unchanged.
    max_num_examples : float | None (default: None)
        Absolute cap on the ``num-examples`` a reply may claim; a larger claim
        is lowered to it (logged). None: no absolute cap.
    max_weight_ratio : float | None (default: 100.0)
        Cap on a claimed ``num-examples`` relative to the median claim of the
        round's valid replies (the lower middle one of an even number, so that
        one liar cannot raise it): a claim above ``max_weight_ratio x median`` is
        lowered to it, and the capped value is used everywhere (the weight, the
        metrics). Every capped reply is logged (node, client key, claimed,
        capped) and counted (``replies-capped``). The default never binds in
        an honest run of the pack's benchmarks (largest claim <= 15x a round's
        median) or configs' defaults (Adult under Dirichlet(0.3), all clients
        sampled: 27x); fewer clients sampled or stronger skew can need more
        (Adult, Dirichlet(0.3), half sampled: 65x; Dirichlet(0.1): 500x). It
        bounds a liar in a large federation, not in a small one: with 4
        clients even a 10x weight is most of the model, so set
        ``max_num_examples`` (or ``weighting="uniform"``) where the sizes are
        known. None: no cap.
    max_reply_bytes : int | None (default: None)
        Largest reply accepted, in bytes of its ArrayRecords (Flower's
        ``count_bytes``), checked before any array is decoded (kind
        ``too-large``). None: twice what an honest reply carries (the expected
        records, as sent) plus 1 MiB. This bounds what the ServerApp decodes,
        not what Flower carries: the reply has crossed the SuperLink by then.
    strict : bool (default: False)
        For strategies whose clients must apply a rule (:attr:`rule_metric`):
        reject train replies that do not report it (kind ``rule-not-applied``)
        instead of warning once per run.
    arrayrecord_key, configrecord_key : str
        Record names in the messages (Flower's defaults).
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn : callable | None
        Flower-style ``(list[RecordDict], str) -> MetricRecord``; called on the
        valid replies only. Default: weighted mean of every numeric metric.
    """

    straggler_policy: ClassVar[str] = "drop"
    # True for algorithms whose clients keep state that the server sums over
    # (FedDyn, FedDC, SCAFFOLD): the two-phase commit of .state is then used.
    stateful_clients: ClassVar[bool] = False
    # The metric a client reports (value 1) when it applied this algorithm's
    # client rule; None: any client will do (FedAvg).
    rule_metric: ClassVar[str | None] = None
    # What that rule is, for the warning ("FedProx's proximal term"), and the
    # pack's pieces that apply it: (client, rule); None: <Class>Client, <Class>Rule.
    rule_name: ClassVar[str] = "client rule"
    rule_pieces: ClassVar[tuple[str, str] | None] = None
    # The update divides by the number of all clients: num_clients=None means
    # "learn it from the grid at the first round".
    requires_num_clients: ClassVar[bool] = False
    # The server keeps sums over all clients' states (FedDyn, FedDC, SCAFFOLD):
    # a client state lost on the client stays in them, retired.
    keeps_client_sums: ClassVar[bool] = False
    # A reply computed from zero state by a client that lost its state is
    # usable as a new client's first reply.
    accept_lost_state: bool = True
    # The weighting when neither weighting nor weighted_by_key is given.
    default_weighting: ClassVar[str] = "num-examples"
    # The new model is a positive linear combination of the replies' models, so
    # a NaN or inf in one reaches the average: their check waits for it (one
    # pass instead of one per reply). False (FedEPM's elastic-net centre,
    # anything median-like, which can turn an inf into a finite value): every
    # reply is checked before it is used or stored.
    linear_aggregate: ClassVar[bool] = True
    # Declared state (see .fields): the algorithm's state, passed to
    # server_update and replaced by what it returns; the settings a checkpoint
    # must match; the settings repr() and summary() show.
    state_fields: ClassVar[tuple[str, ...]] = ()
    resume_settings: ClassVar[tuple[str, ...]] = ()
    settings: ClassVar[tuple[str, ...]] = (
        "fraction_train",
        "participation",
        "weighting",
        "seed",
    )

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
        train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
        | None = None,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
        | None = None,
        **unknown: Any,
    ) -> None:
        reject_unknown_kwargs(type(self).__name__, unknown, self.accepted_kwargs())
        weighting, weight_key = resolve_weighting(
            type(self).__name__, weighting, weighted_by_key, self.default_weighting
        )
        check_fraction("fraction_train", fraction_train)
        check_fraction("fraction_evaluate", fraction_evaluate)
        check_choice("participation", participation, PARTICIPATION)
        check_int("min_train_nodes", min_train_nodes, 0)
        check_int("min_evaluate_nodes", min_evaluate_nodes, 0)
        check_int("min_available_nodes", min_available_nodes, 0)
        if local_epochs is not None:
            check_int("local_epochs", local_epochs, 1)
        if local_steps is not None:
            check_int("local_steps", local_steps, 1)
        check_fraction("drop_percent", drop_percent)
        if drop_percent > 0 and local_steps is not None:
            raise ValueError(
                "drop_percent > 0 draws straggler epochs; it cannot be combined "
                f"with local_steps={local_steps!r}"
            )
        if drop_percent > 0 and (local_epochs is None or local_epochs < 2):
            raise ValueError(
                "drop_percent > 0 needs local_epochs >= 2 (stragglers run 1 .. "
                f"local_epochs - 1 epochs), got local_epochs={local_epochs!r}"
            )
        check_int("seed", seed, 0)
        if not (isinstance(lr_decay, (int, float)) and 0.0 < lr_decay <= 1.0):
            raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay!r}")
        if num_clients is not None:
            check_int("num_clients", num_clients, 1)
        check_non_negative("node_wait_timeout", node_wait_timeout)
        if max_num_examples is not None:
            check_positive("max_num_examples", max_num_examples)
        if max_weight_ratio is not None and (
            check_positive("max_weight_ratio", max_weight_ratio) < 1.0
        ):
            raise ValueError(
                f"max_weight_ratio must be >= 1 (a multiple of the round's median "
                f"claim), got {max_weight_ratio!r}"
            )
        if max_reply_bytes is not None:
            check_int("max_reply_bytes", max_reply_bytes, 1)
        if min_round_nodes is not None:
            check_int("min_round_nodes", min_round_nodes, 1)
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
        self._custom_train_metrics = train_metrics_aggr_fn
        self._custom_evaluate_metrics = evaluate_metrics_aggr_fn
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
        self._sampled_once = False
        self.strict = bool(strict)
        self.max_num_examples = max_num_examples
        self.max_weight_ratio = max_weight_ratio
        self.max_reply_bytes = max_reply_bytes
        # Reply validation, and the counts of what was not used and why.
        self.screen = ReplyScreen()
        # Set during the float64 retry of the average (_average_finite).
        self._accumulate_in: type[np.floating] | None = None
        # The missing-rule warning is given once per run.
        self._rule_warned = False
        # The round's model and sampled nodes: set by configure_*, read by aggregate_*.
        self.global_arrays: ArrayRecord | None = None
        self._global_spec: RecordSpec | None = None
        self.train_nodes: set[int] | None = None
        self.evaluate_nodes: set[int] | None = None
        # Rounds aggregated so far (state), and the offset a resumed run adds to
        # Strategy.start's round numbers so sampling and client seeds continue.
        self.rounds_completed = 0
        self.round_offset = 0
        self._bytes_sent = 0
        # The server's half of the two-phase commit of client state (state).
        self.book = ClientBook()
        # Privacy ledger: client key (or node id) -> epsilon spent so far, as the
        # clients report it (dp-epsilon-total); one report for every strategy.
        self.epsilon_totals: dict[int, float] = {}
        # Nodes whose privacy budget is spent (they said so): never sampled for
        # training again, like nodes that left.
        self.retired_nodes: set[int] = set()

    # Why replies and rounds were not used (diagnostics, never state).
    rejections = property(lambda self: self.screen.rejections)
    run_tally = property(lambda self: self.screen.run_tally)
    round_tally = property(lambda self: self.screen.round_tally)

    # ------------------------------------------------------------------ info
    @classmethod
    def accepted_kwargs(cls) -> set[str]:
        """Return the keyword arguments ``cls(...)`` accepts (its bases' included)."""
        return init_keywords(cls, ValidatedFedAvg)

    def _weighting_text(self) -> str:
        if self.weighting == "metric":
            return f"by metric '{self.weighted_by_key}'"
        return self.weighting

    def __repr__(self) -> str:
        """Return the class name and its :attr:`settings`."""
        return f"{type(self).__name__}({settings_text(self, self.settings)})"

    def summary(self) -> None:
        """Log the algorithm's :attr:`settings`, then the base's configuration."""
        if self.settings != ValidatedFedAvg.settings:
            log(INFO, "\t├──> %s settings:", type(self).__name__)
            for number, name in enumerate(self.settings, 1):
                branch = "└" if number == len(self.settings) else "├"
                log(INFO, "\t│\t%s── %s: %s", branch, name, getattr(self, name))
        log(INFO, "\t├──> Validation and sampling (flwr-prox-strategies):")
        log(INFO, "\t│\t├── Weighting: %s", self._weighting_text())
        if self.rule_metric is not None:
            log(
                INFO,
                "\t│\t├── Clients must report: '%s' (%s)",
                self.rule_metric,
                "replies without it rejected" if self.strict else "else warned",
            )
        log(INFO, "\t│\t├── Seed: %d", self.seed)
        log(INFO, "\t│\t├── Participation: %s", self.participation)
        log(
            INFO,
            "\t│\t├── num-examples cap: %s; largest reply: %s",
            " and ".join(
                text
                for text in (
                    f"{self.max_weight_ratio:g} x the round's median"
                    if self.max_weight_ratio is not None
                    else "",
                    f"{self.max_num_examples:g}"
                    if self.max_num_examples is not None
                    else "",
                )
                if text
            )
            or "none",
            f"{self.max_reply_bytes:,} bytes"
            if self.max_reply_bytes is not None
            else "2 x the expected records + 1 MiB",
        )
        log(INFO, "\t│\t├── Local epochs: %s", self.local_epochs or "client's own")
        if self.local_steps is not None:
            log(INFO, "\t│\t├── Local steps: %d", self.local_steps)
        log(
            INFO,
            "\t│\t└── Stragglers: %.0f%% (%s)",
            100 * self.drop_percent,
            self.straggler_policy,
        )
        super().summary()

    # ------------------------------------------------------------------- run
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
        when no round was aggregated (Flower leaves it empty); in that case
        (with ``num_rounds > 0`` and ``fraction_train > 0``)
        :class:`NoRoundAggregatedError` is raised, with the counted reasons
        and the ``Result`` (``err.result``).
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

    # -------------------------------------------------------------- sampling
    def sample_nodes(
        self,
        grid: Grid,
        server_round: int,
        *,
        fraction: float,
        minimum: int,
        stream: int,
        exclude: set[int] | frozenset[int] = frozenset(),
        bernoulli: bool = False,
    ) -> tuple[list[int], int]:
        """Sample nodes for ``server_round`` (:func:`.sampling.sample_nodes`).

        The quorum is ``min_available_nodes`` at the first sampling, then
        ``min_round_nodes`` when set.
        """
        quorum = self.min_available_nodes
        if self._sampled_once and self.min_round_nodes is not None:
            quorum = self.min_round_nodes
        self._sampled_once = True
        return sample_nodes(
            grid,
            server_round,
            seed=self.seed,
            stream=stream,
            fraction=fraction,
            minimum=minimum,
            quorum=quorum,
            timeout=self.node_wait_timeout,
            owner=type(self).__name__,
            exclude=exclude,
            bernoulli=bernoulli,
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

    def node_train_config(self, node_id: int, server_round: int) -> dict[str, Any]:
        """Return per-node additions to the train ConfigRecord.

        For stateful clients: what the node needs to resolve its pending state
        (:meth:`.commit.ClientBook.node_config`).
        """
        return self.book.node_config(node_id) if self.stateful_clients else {}

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

    def check_reply(self, reply: ValidReply) -> None:
        """Extra checks on a structurally valid reply; raise ``ReplyRejected``."""
        if self.strict and not reports_rule(reply, self.rule_metric):
            raise ReplyRejected(
                "rule-not-applied",
                f"no '{self.rule_metric}' metric: the client is not applying "
                f"{self.rule_name} (strict=True)",
            )
        if self.weighting == "metric":
            check_weight(reply.metrics, self.weighted_by_key, kind="weight")
        if self.stateful_clients:
            key = reply.metrics.get(CLIENT_KEY_METRIC)
            if isinstance(key, bool) or not isinstance(key, int):
                raise ReplyRejected(
                    "client-key",
                    f"no integer '{CLIENT_KEY_METRIC}' metric: is the client a "
                    f"{type(self).__name__} client?",
                )

    def _warn_rule_not_applied(
        self, server_round: int, replies: list[ValidReply]
    ) -> None:
        """Warn once per run, naming the nodes whose replies lack the rule metric."""
        if self._rule_warned or self.rule_metric is None:
            return
        name = type(self).__name__
        self._rule_warned = warn_rule_not_applied(
            name,
            server_round,
            replies,
            self.rule_metric,
            self.rule_name,
            self.rule_pieces or (f"{name}Client", f"{name}Rule"),
        )

    def grow_num_clients(self, old: int | None) -> None:
        """Commit K's growth from ``old`` once the round's replies are used.

        A client new to the server holds zero state, so the sums are unchanged;
        strategies that keep a *mean* over K rescale it in :meth:`grown_state`,
        which :meth:`server_update` already saw.
        """
        new = self.num_clients
        if old is None or new is None or new == old:
            return
        self.num_clients = old
        self.learn_num_clients(new)
        self.num_clients_source = (
            f"grown: {len(self.book.client_keys_seen)} client keys seen, "
            f"{self.book.retired_states} retired state(s)"
        )
        log(
            WARNING,
            "%s: K grows %d -> %d (%s)",
            type(self).__name__,
            old,
            new,
            self.num_clients_source,
        )

    def learn_num_clients(self, num_clients: int) -> None:
        """Adopt ``num_clients`` learned from the grid or a checkpoint.

        Subclasses that derive settings from it (FedEPM's sampling) extend this.
        """
        check_int("num_clients", num_clients, 1)
        self.num_clients = num_clients

    def expected_train_arrays(self, server_round: int) -> dict[str, RecordSpec]:
        """Return the ArrayRecords (name -> spec) a train reply must carry."""
        assert self._global_spec is not None
        expected = {self.arrayrecord_key: self._global_spec}
        if self.monitor_dissimilarity:
            expected[GRADIENT_RECORD] = self._global_spec
        return expected

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
        """Return the server state needed to resume a run exactly.

        Sampling is seeded per round, so the base holds no RNG state, only the
        number of rounds done; subclasses add their algorithm state (numpy
        arrays and scalars). After :meth:`load_state_dict`, ``start()`` round 1
        continues as round ``rounds-completed + 1``.
        """
        return {
            "strategy": type(self).__name__,
            "seed": self.seed,
            "rounds-completed": self.rounds_completed,
            "num-clients": self.num_clients,
            "epsilon-totals": dict(self.epsilon_totals),
            "retired-nodes": sorted(self.retired_nodes),
            "num-clients-source": self.num_clients_source,
            **self.book.state_dict(),
            **save_fields(self, self.resume_settings),
            **save_fields(self, self.state_fields),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state.get("strategy") != type(self).__name__:
            raise ValueError(
                f"checkpoint is for {state.get('strategy')!r}, "
                f"not {type(self).__name__}"
            )
        check_settings(self, self.resume_settings, state)
        saved_k = state.get("num-clients")
        grown = str(state.get("num-clients-source", "")).startswith("grown")
        if grown and self.num_clients is not None and saved_k is not None:
            # K grew during the run (new clients, retired states): adopt it.
            if int(saved_k) < self.num_clients:
                raise ValueError(
                    f"checkpoint has K={saved_k} after growth, below the "
                    f"strategy's num_clients={self.num_clients}"
                )
            self.learn_num_clients(int(saved_k))
            self.num_clients_source = str(state["num-clients-source"])
        if self.requires_num_clients and None in (saved_k, self.num_clients):
            # Learned from the grid: a checkpoint's K is adopted, and a strategy
            # built with K resumes a checkpoint made before K was learned.
            if saved_k is not None and self.num_clients is None:
                self.learn_num_clients(int(saved_k))
                self.num_clients_source = "from the checkpoint"
            saved_k = self.num_clients
        for key, mine, saved in (
            ("seed", self.seed, state.get("seed")),
            ("num-clients", self.num_clients, saved_k),
        ):
            if saved != mine:
                raise ValueError(
                    f"checkpoint was made with {key}={saved!r}, the strategy "
                    f"has {mine!r}: the run would not resume identically"
                )
        self.rounds_completed = int(state["rounds-completed"])
        self.epsilon_totals = {
            int(k): float(v) for k, v in state.get("epsilon-totals", {}).items()
        }
        self.retired_nodes = {int(n) for n in state.get("retired-nodes", [])}
        self.book.load_state_dict(state)
        self.round_offset = self.rounds_completed
        load_fields(self, self.state_fields, state)

    # -------------------------------------------------------------- training
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
        if self.num_clients is None and self.requires_num_clients:
            known = len(
                connected_nodes(
                    grid,
                    self.min_available_nodes,
                    self.node_wait_timeout,
                    type(self).__name__,
                )
            )
            self.learn_num_clients(known)
            self.num_clients_source = f"learned from the grid at round {server_round}"
            log(
                INFO,
                "%s: num_clients not given: using the %d nodes connected at round %d",
                type(self).__name__,
                known,
                server_round,
            )
        node_ids, num_connected = self.sample_nodes(
            grid,
            server_round,
            fraction=self.fraction_train,
            minimum=self.min_train_nodes,
            stream=0,
            exclude=self.retired_nodes,
            bernoulli=self.participation == "bernoulli",
        )
        if (
            self.requires_num_clients
            and self.num_clients is not None
            and num_connected != self.num_clients
        ):
            log(
                INFO,
                "configure_train: %d node(s) connected, K=%d clients (%s): absent "
                "clients keep their state in the sums; new ones join K when they "
                "first reply",
                num_connected,
                self.num_clients,
                self.num_clients_source,
            )
        if not node_ids and num_connected and self.retired_nodes:
            raise EveryClientRetiredError(
                f"{type(self).__name__}: round {server_round}: every one of the "
                f"{num_connected} connected node(s) has spent its privacy budget "
                f"(retired: {len(self.retired_nodes)}); training stops here instead "
                f"of idling through the remaining rounds. The model is the one "
                f"aggregated last (round {server_round - 1}). To train longer, "
                "raise the budget (privacy.dp.target_epsilon) or spend it more "
                "slowly (more noise, fewer local steps, fewer rounds).",
                Result(arrays=arrays),
                server_round,
            )
        stragglers = draw_stragglers(
            node_ids,
            server_round,
            seed=self.seed,
            drop_percent=self.drop_percent,
            local_epochs=self.local_epochs,
        )
        if stragglers and self.straggler_policy == "drop":
            node_ids = [n for n in node_ids if n not in stragglers]
            log(INFO, "configure_train: dropping %d straggler(s)", len(stragglers))
        if self.retired_nodes:
            log(
                INFO,
                "configure_train: %d node(s) retired (privacy budget spent)",
                len(self.retired_nodes),
            )
        log(
            INFO,
            "configure_train: sampled %d nodes (out of %d)%s",
            len(node_ids),
            num_connected,
            f", {len(stragglers)} straggler(s) keep partial work"
            if stragglers and self.straggler_policy == "keep-partial"
            else "",
        )
        self.train_nodes = set(node_ids)
        shared = dict(config)
        shared[SERVER_ROUND_KEY] = server_round
        if self.local_epochs is not None:
            shared[LOCAL_EPOCHS_KEY] = self.local_epochs
        if self.local_steps is not None:
            shared[LOCAL_STEPS_KEY] = self.local_steps
        if self.lr_decay != 1.0:
            shared[LR_SCALE_KEY] = self.lr_decay ** (server_round - 1)
        if self.monitor_dissimilarity:
            shared[REPORT_GRADIENT_KEY] = True
        shared.update(self.train_config(server_round))
        extra_records = self.train_records(server_round)
        messages = []
        for node_id in node_ids:
            node_config = dict(shared)
            if node_id in stragglers:
                node_config[LOCAL_EPOCHS_KEY] = stragglers[node_id]
            node_config.update(self.node_train_config(node_id, server_round))
            content = RecordDict(
                {
                    self.arrayrecord_key: self.node_train_arrays(node_id, arrays),
                    **extra_records,
                    **self.node_train_records(node_id, server_round),
                    self.configrecord_key: ConfigRecord(node_config),
                }
            )
            messages.append(
                Message(
                    content=content, message_type=MessageType.TRAIN, dst_node_id=node_id
                )
            )
        self._bytes_sent = sum(
            record.count_bytes()
            for message in messages
            for record in message.content.array_records.values()
        )
        self.screen.remember("train", messages)
        return messages

    def node_train_arrays(self, node_id: int, arrays: ArrayRecord) -> ArrayRecord:
        """Return the model sent to ``node_id`` (the global model by default)."""
        return arrays

    def sent_message_nodes(self, kind: str) -> dict[str, int]:
        """Map this round's ``kind`` message ids to their node (P-FedAvg reads it)."""
        return self.screen.sent_nodes(kind)

    reply_node = staticmethod(reply_node)

    def reply_size_limit(self, expected_arrays: Mapping[str, RecordSpec]) -> int:
        """Return the largest reply accepted, in bytes (:attr:`max_reply_bytes`)."""
        return reply_size_limit(self.max_reply_bytes, expected_arrays)

    def collect_replies(
        self,
        server_round: int,
        replies: Iterable[Message],
        *,
        expected_arrays: Mapping[str, RecordSpec],
        sampled: set[int] | None,
        phase: str,
        defer_finite: tuple[str, ...] = (),
        tally: ReplyTally | None = None,
    ) -> tuple[list[ValidReply], int, int, int]:
        """Validate replies (:meth:`.screening.ReplyScreen.collect`).

        With this strategy's :meth:`check_reply`, size limit and retired nodes.
        """
        return self.screen.collect(
            server_round,
            replies,
            expected_arrays=expected_arrays,
            sampled=sampled,
            phase=phase,
            check=self.check_reply,
            max_bytes=self.reply_size_limit(expected_arrays),
            retired=self.retired_nodes,
            defer_finite=defer_finite,
            tally=tally,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the replies, average the valid ones, update state."""
        server_round += self.round_offset
        self.rounds_completed = server_round
        if self._global_spec is None:
            raise RuntimeError(
                f"{type(self).__name__}.aggregate_train called before configure_train"
            )
        # The model record's NaN/inf check is deferred (linear_aggregate): NaN
        # and inf propagate through the weighted sum, so one check of the result
        # replaces one pass over every reply; only a non-finite result pays for
        # per-reply checks.
        valid, failed, rejected, absent = self.collect_replies(
            server_round,
            replies,
            expected_arrays=self.expected_train_arrays(server_round),
            sampled=self.train_nodes,
            phase="aggregate_train",
            defer_finite=(self.arrayrecord_key,) if self.linear_aggregate else (),
        )
        # Sum in a fixed order (by client key, else node id), not in the order
        # replies arrive: float sums depend on it, and a run should not.
        valid.sort(key=reply_order)
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
        capped = cap_claims(
            server_round,
            valid,
            "aggregate_train",
            max_num_examples=self.max_num_examples,
            max_weight_ratio=self.max_weight_ratio,
        )
        update, keep = self._average_finite(server_round, valid)
        arrays = None if update is None else update.arrays
        before = len(valid)
        valid = [r for r in valid if r.finite]
        rejected += before - len(valid)
        if keep is None and (failed or rejected) and not self.accept_failures:
            keep = "accept_failures=False and some replies failed or were rejected"
        if keep is None and arrays is not None:
            self.run_tally.aggregated += 1
            self._warn_rule_not_applied(server_round, valid)
        counts: dict[str, Any] = {
            "replies-valid": len(valid),
            "replies-failed": failed,
            "replies-rejected": rejected,
            "replies-absent": absent,
            "replies-capped": capped,
            # Array payload bytes of this round's messages (model, extra records).
            "bytes-sent": self._bytes_sent,
            "bytes-received": sum(
                record.count_bytes()
                for reply in valid
                if reply.message is not None
                for record in reply.message.content.array_records.values()
            ),
        }
        # Privacy spent is spent, even in a round whose model is not kept.
        counts.update(record_privacy(self.epsilon_totals, valid, self.retired_nodes))
        if keep is not None or arrays is None:
            self.run_tally.kept[keep or "no model"] += 1
            self.num_clients = k_before  # as if the round's replies never came
            log(
                WARNING,
                "aggregate_train: round %d: %s; %s; keeping the previous model",
                server_round,
                keep,
                self.round_tally.describe(),
            )
            return None, MetricRecord(dict(counts.items()))
        if self.stateful_clients:
            self.book.commit(server_round, valid)
            self.grow_num_clients(k_before)
        assert update is not None
        unknown = set(update.state) - set(self.state_fields)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.server_update returned state {sorted(unknown)} "
                f"not declared in state_fields {self.state_fields}"
            )
        for name, value in update.state.items():
            setattr(self, name, value)
        extra = dict(update.metrics)
        if self.monitor_dissimilarity:
            extra.update(dissimilarity_metrics(valid, self.reply_weight))
        metrics = self._aggregate_metrics(valid, self._custom_train_metrics)
        for key, value in {**counts, **extra}.items():
            metrics[key] = value
        return arrays, metrics

    def extra_reply_records(self) -> list[str]:
        """Name the ArrayRecords a train reply carries besides the model."""
        known = self._global_spec
        if known is None:  # before round 1: only the record names are needed
            self._global_spec = {}
        try:
            names = set(self.expected_train_arrays(1))
        finally:
            self._global_spec = known
        return sorted(names - {self.arrayrecord_key})

    def central_dp_caveats(self) -> list[str]:
        """Say what central DP's noise on the aggregated model does not cover.

        Flower's fixed-clipping wrappers clip each update and noise the
        aggregate; anything else a client uploads, or the server keeps from
        un-noised aggregates, is outside their epsilon.
        """
        extra = self.extra_reply_records()
        if not extra:
            return []
        return [
            f"replies also carry {extra}, which central DP neither clips as "
            "updates nor noises; its epsilon covers the model only"
        ]

    def _average_finite(
        self, server_round: int, valid: list[ValidReply]
    ) -> tuple[RoundUpdate | None, str | None]:
        """Run the server rule, rejecting replies whose model holds NaN or inf.

        Returns the round's update (or None) and, when None, why the model is kept.
        The average is first computed in the model's dtype, with normalised
        weights (finite replies cannot overflow it). When it is not finite,
        the replies are checked one by one: those holding NaN or inf get
        ``finite = False``, are logged, and the average is recomputed without
        them. When every reply is finite and the average still is not, it is
        recomputed once with float64 accumulators, rounded once at the end.
        If even that is not finite (the true value does not fit, or a sum
        kept in the model's dtype overflowed: FedDC's drift sum), the replies
        holding values beyond ``MAX_ABS_VALUE`` are rejected in turn, so one
        huge upload never costs the round of everyone else.
        """
        checked: set[str] = set()
        wide = False
        k_base = self.num_clients
        while True:
            candidates = [r for r in valid if r.finite]
            if not candidates:
                return None, "no valid reply"
            self._accumulate_in = np.float64 if wide else None
            state = {name: getattr(self, name) for name in self.state_fields}
            if self.stateful_clients and self.requires_num_clients and k_base:
                # K for this round's update: every client seen, these included.
                self.num_clients = max(k_base, self.book.clients_needed(candidates))
                if self.num_clients != k_base:
                    state = self.grown_state(state, k_base, self.num_clients)
            try:
                update = self.server_update(server_round, state, candidates)
            except ZeroTotalWeightError as err:
                return None, f"zero total weight ({err})"
            finally:
                self._accumulate_in = None
            if record_is_finite(update.arrays):
                return update, None
            if NON_FINITE not in checked:
                checked.add(NON_FINITE)
                if self.screen.reject_bad_values(
                    server_round, candidates, NON_FINITE, self.arrayrecord_key
                ):
                    continue
            if not wide:
                wide = True
                log(
                    WARNING,
                    "aggregate_train: round %d: the average of %d finite replies "
                    "overflowed the model's dtype; recomputing it in float64",
                    server_round,
                    len(candidates),
                )
                continue
            if OUT_OF_RANGE not in checked:
                checked.add(OUT_OF_RANGE)
                if self.screen.reject_bad_values(
                    server_round, candidates, OUT_OF_RANGE, self.arrayrecord_key
                ):
                    continue
            return None, (
                "the average is not finite although every reply is (its true "
                "value does not fit the model's dtype)"
            )

    # ------------------------------------------------------------ evaluation
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
        shared = dict(config)
        shared[SERVER_ROUND_KEY] = server_round
        shared.update(self.evaluate_config(server_round))
        extra_records = self.evaluate_records(server_round)
        messages = [
            Message(
                content=RecordDict(
                    {
                        self.arrayrecord_key: arrays,
                        **extra_records,
                        self.configrecord_key: ConfigRecord(dict(shared)),
                    }
                ),
                message_type=MessageType.EVALUATE,
                dst_node_id=node_id,
            )
            for node_id in node_ids
        ]
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
        cap_claims(
            server_round,
            valid,
            "aggregate_evaluate",
            max_num_examples=self.max_num_examples,
            max_weight_ratio=self.max_weight_ratio,
        )
        metrics = self._aggregate_metrics(valid, self._custom_evaluate_metrics)
        metrics["replies-valid"] = len(valid)
        if self._custom_evaluate_metrics is None:
            table = per_client_table(valid)
            for key, value in table.items():
                metrics[key] = value
            for name in ("accuracy", "personal-accuracy"):
                if f"{name}-worst" in table:
                    log(
                        INFO,
                        "aggregate_evaluate: round %d: %s over %d clients: "
                        "mean %.4f, std %.4f, worst %.4f",
                        server_round,
                        name,
                        len(valid),
                        table[f"{name}-clients-mean"],
                        table[f"{name}-std"],
                        table[f"{name}-worst"],
                    )
        return metrics

    def _aggregate_metrics(
        self,
        replies: list[ValidReply],
        custom: Callable[[list[RecordDict], str], MetricRecord] | None,
    ) -> MetricRecord:
        if custom is not None:
            contents = [r.message.content for r in replies if r.message is not None]
            key = self.weighted_by_key if custom is self._custom_train_metrics else None
            return custom(contents, key or NUM_EXAMPLES_KEY)
        return weighted_metric_mean(replies)

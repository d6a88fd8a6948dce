"""The base strategy's keywords: documented, checked and summarised in one place.

Every strategy of the pack takes the base's keywords (its own come first). Here is
what each means (:data:`PARAMETERS`, the numpydoc section the base's docstring
ends with), how a bad value is refused at construction, naming the keyword
(:func:`check_base_options`), the weighting resolved from the pack's and Flower's
names (:func:`resolve_weighting`), and the lines ``summary()`` logs at the start
of a run (:func:`log_summary`, :func:`log_flower_summary`; Flower's ``FedAvg``
lines are written here, not by Flower: its "Weighted by" line names
``weighted_by_key`` even when the pack weighs every reply alike, and a summary
must not contradict itself).
"""

from __future__ import annotations

from logging import INFO
from typing import Any

from flwr.common.logger import log

from ...ops.checks import (
    check_choice,
    check_fraction,
    check_int,
    check_non_negative,
    check_positive,
)
from ..transport.keys import NUM_EXAMPLES_KEY

# Any strategy of the pack: the summary reads its public settings only.
Summarised = Any

PARAMETERS = """
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
        ``N``, the federation's size, checked every round. Rules that divide by
        all clients
        (:attr:`~flwr_prox_strategies.extend.ValidatedFedAvg.requires_num_clients`)
        take None as "the nodes connected at the first round"; N grows when a
        new client first replies.
    seed : int (default: 0)
        Seeds node sampling and straggler draws, per round.
    monitor_dissimilarity : bool (default: False)
        Ask clients for their full local gradient at the global model and log
        the FedProx paper's dissimilarity
        ``B = E_k||grad f_k||^2 / ||grad f||^2`` over the round's valid
        replies (one extra pass, one model-sized upload).
    pieces : list[RoundPiece] (default: none)
        Further features of the round, your own
        (:class:`~flwr_prox_strategies.extend.RoundPiece`: values added to every
        train config, records every train reply must carry, metrics of the
        round's valid replies), applied after those that ``lr_decay`` and
        ``monitor_dissimilarity`` build, in order.
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
        Message-API name of a Flower legacy name such as ``fraction_fit``), if
        both ``weighting`` and ``weighted_by_key`` are given, or if ``pieces``
        holds anything but round pieces.

    See Also
    --------
    flwr_prox_strategies.extend : the hooks a subclass overrides.
"""


WEIGHTINGS = ("num-examples", "uniform")


def resolve_weighting(
    owner: str, weighting: str | None, weighted_by_key: str | None, default: str
) -> tuple[str, str]:
    """Return ``(weighting, metric key)`` from ours and Flower's names.

    ``weighting`` (``"num-examples"``, ``"uniform"``; None: ``default``) or
    Flower's ``weighted_by_key`` (a reply metric; ``"num-examples"`` is the
    same as ``weighting="num-examples"``), not both.
    """
    if weighting is not None and weighted_by_key is not None:
        raise TypeError(
            f"{owner}() got both weighting={weighting!r} and "
            f"weighted_by_key={weighted_by_key!r}; weighted_by_key is Flower's "
            "name for the weighting: give one"
        )
    if weighted_by_key is not None:
        if not isinstance(weighted_by_key, str) or not weighted_by_key:
            raise ValueError(
                "weighted_by_key must be a non-empty metric name, got "
                f"{weighted_by_key!r}"
            )
        if weighted_by_key == NUM_EXAMPLES_KEY:
            return "num-examples", NUM_EXAMPLES_KEY
        return "metric", weighted_by_key
    weighting = default if weighting is None else weighting
    if weighting not in WEIGHTINGS:
        raise ValueError(
            f"weighting must be one of {WEIGHTINGS}, got {weighting!r} (to "
            "weight by a metric of the replies, give weighted_by_key=<metric>)"
        )
    return weighting, NUM_EXAMPLES_KEY


def check_base_options(
    *,
    fraction_train: float,
    fraction_evaluate: float,
    participation: str,
    participations: tuple[str, ...],
    min_train_nodes: int,
    min_evaluate_nodes: int,
    min_available_nodes: int,
    local_epochs: int | None,
    local_steps: int | None,
    drop_percent: float,
    lr_decay: float,
    num_clients: int | None,
    seed: int,
    node_wait_timeout: float,
    max_num_examples: float | None,
    max_weight_ratio: float | None,
    max_reply_bytes: int | None,
    min_round_nodes: int | None,
    max_rounds_without_aggregation: int | None = None,
) -> None:
    """Check the base strategy's keywords; a ``ValueError`` names the bad one."""
    check_fraction("fraction_train", fraction_train)
    check_fraction("fraction_evaluate", fraction_evaluate)
    check_choice("participation", participation, participations)
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
    if max_rounds_without_aggregation is not None:
        check_int("max_rounds_without_aggregation", max_rounds_without_aggregation, 1)


def weighting_text(strategy: Summarised) -> str:
    """Return how replies are weighted, in words, and whether Flower's differs."""
    if strategy.weighting == "metric":
        return f"metric '{strategy.weighted_by_key}'"
    if strategy.weighting == "uniform":
        return "uniform (every valid reply weighs 1; Flower's FedAvg: 'num-examples')"
    return "'num-examples'"


def caps_text(strategy: Summarised) -> str:
    """Return the caps on a reply's claimed ``num-examples``, in words."""
    caps = []
    if strategy.max_weight_ratio is not None:
        caps.append(f"{strategy.max_weight_ratio:g} x the round's median")
    if strategy.max_num_examples is not None:
        caps.append(f"{strategy.max_num_examples:g}")
    return " and ".join(caps) or "none"


def log_summary(strategy: Summarised, base_settings: tuple[str, ...]) -> None:
    """Log the algorithm's settings (when it declares its own), then the base's."""
    settings = strategy.settings
    if settings != base_settings:
        log(INFO, "\t├──> %s settings:", type(strategy).__name__)
        for number, name in enumerate(settings, 1):
            branch = "└" if number == len(settings) else "├"
            log(INFO, "\t│\t%s── %s: %s", branch, name, getattr(strategy, name))
    log(INFO, "\t├──> Validation and sampling (flwr-prox-strategies):")
    if strategy.rule_metric is not None:
        log(
            INFO,
            "\t│\t├── Clients must report: '%s' (%s)",
            strategy.rule_metric,
            "replies without it rejected" if strategy.strict else "else warned",
        )
    log(INFO, "\t│\t├── Seed: %d", strategy.seed)
    log(INFO, "\t│\t├── Participation: %s", strategy.participation)
    log(
        INFO,
        "\t│\t├── num-examples cap: %s; largest reply: %s",
        caps_text(strategy),
        f"{strategy.max_reply_bytes:,} bytes"
        if strategy.max_reply_bytes is not None
        else "2 x the expected records + 1 MiB",
    )
    log(INFO, "\t│\t├── Local epochs: %s", strategy.local_epochs or "client's own")
    if strategy.local_steps is not None:
        log(INFO, "\t│\t├── Local steps: %d", strategy.local_steps)
    log(
        INFO,
        "\t│\t└── Stragglers: %.0f%% (%s)",
        100 * strategy.drop_percent,
        strategy.straggler_policy,
    )


def log_flower_summary(strategy: Summarised) -> None:
    """Log Flower's ``FedAvg.summary`` lines, with the weighting actually used."""
    log(INFO, "\t├──> Sampling:")
    log(
        INFO,
        "\t│\t├──Fraction: train (%.2f) | evaluate ( %.2f)",
        strategy.fraction_train,
        strategy.fraction_evaluate,
    )
    log(
        INFO,
        "\t│\t├──Minimum nodes: train (%d) | evaluate (%d)",
        strategy.min_train_nodes,
        strategy.min_evaluate_nodes,
    )
    log(INFO, "\t│\t└──Minimum available nodes: %d", strategy.min_available_nodes)
    log(INFO, "\t└──> Keys in records:")
    log(INFO, "\t\t├── Weighted by: %s", weighting_text(strategy))
    log(INFO, "\t\t├── ArrayRecord key: '%s'", strategy.arrayrecord_key)
    log(INFO, "\t\t└── ConfigRecord key: '%s'", strategy.configrecord_key)

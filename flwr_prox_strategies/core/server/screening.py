"""Reply screening: which replies a round may use, and why the others may not.

Every reply is validated against the layout of what was sent (:mod:`.validation`)
and the strategy's own check; a bad reply is logged with its node and reason,
counted (:class:`.outcome.ReplyTally`, :attr:`ReplyScreen.rejections`) and
otherwise ignored, exactly as if it had never arrived. Used by the base
strategy for training and evaluation, by the central-DP wrappers before
Flower's own aggregation (:func:`.central.screen_replies`) and, through its inner
strategies, by P-FedAvg.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message, Metadata
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import log

from ..client.rule import (
    LOCAL_STEPS_METRIC,
    TERM_LOST_METRIC,
    TERM_MISSING_METRIC,
    pack_rules,
)
from ..client.steps import shortfall_text
from ..contract.validation import (
    NON_FINITE,
    ReplyRejected,
    ValidReply,
    expected_bytes,
    validate_reply,
)
from ..transport.keys import CLIENT_KEY_METRIC
from ..transport.records import RecordSpec
from .outcome import ReplyTally


def reply_node(message: Message, sent_to: Mapping[str, int]) -> int:
    """Return the node a reply stands for.

    When a node dies mid-round, the SuperLink answers in its place with an
    error reply (``NODE_UNAVAILABLE``) whose source is the SuperLink's own node
    id (1); such a reply, and the grid's own error replies, are attributed to
    the node the answered message was sent to (``reply_to_message_id``). Any
    other reply is its source's.
    """
    node_id = message.metadata.src_node_id
    if node_id == SUPERLINK_NODE_ID and message.has_error():
        return sent_to.get(message.metadata.reply_to_message_id, node_id)
    return node_id


def reply_order(reply: ValidReply) -> tuple[int, int]:
    """Sort key of a reply: its client key when reported, else its node id."""
    key = reply.metrics.get(CLIENT_KEY_METRIC)
    if isinstance(key, (int, float)) and not isinstance(key, bool):
        return (0, int(key))
    return (1, reply.node_id)


def reply_size_limit(
    max_reply_bytes: int | None, expected_arrays: Mapping[str, RecordSpec]
) -> int:
    """Return the largest reply accepted, in bytes.

    ``max_reply_bytes`` when set; else twice the payload of the expected
    ArrayRecords, plus 1 MiB (``.npy`` headers and keys take a few hundred
    bytes per array).
    """
    if max_reply_bytes is not None:
        return max_reply_bytes
    return 2 * expected_bytes(expected_arrays) + (1 << 20)


def cap_claims(
    server_round: int,
    replies: list[ValidReply],
    phase: str,
    *,
    max_num_examples: float | None,
    max_weight_ratio: float | None,
) -> int:
    """Lower claimed ``num-examples`` above the caps; return how many were.

    The cap is the smaller of ``max_num_examples`` and ``max_weight_ratio``
    times the median claim of ``replies`` (of an even number of claims, the
    lower middle one: one inflated claim cannot raise it, even among two). A
    capped reply keeps its claim in ``capped_from`` and is logged with its
    node, client key, claim and cap.
    """
    caps: list[tuple[float, str]] = []
    if max_num_examples is not None:
        caps.append((max_num_examples, f"max_num_examples={max_num_examples:g}"))
    if max_weight_ratio is not None and replies:
        claims = sorted(r.num_examples for r in replies)
        median = claims[(len(claims) - 1) // 2]
        caps.append(
            (
                max_weight_ratio * median,
                f"max_weight_ratio={max_weight_ratio:g} x the round's "
                f"median claim {median:g}",
            )
        )
    if not caps:
        return 0
    limit, policy = min(caps, key=lambda cap: cap[0])
    capped = 0
    for reply in replies:
        if reply.num_examples <= limit:
            continue
        capped += 1
        reply.capped_from = reply.num_examples
        reply.num_examples = limit
        key = reply.metrics.get(CLIENT_KEY_METRIC)
        log(
            WARNING,
            "%s: round %d: node %d (client key %s) claims num-examples %g: "
            "capped to %g (%s)",
            phase,
            server_round,
            reply.node_id,
            key
            if isinstance(key, (int, float)) and not isinstance(key, bool)
            else "not reported",
            reply.capped_from,
            limit,
            policy,
        )
    return capped


class ReplyScreen:
    """One strategy's screening of replies, and its counts of what was not used.

    Attributes
    ----------
    rejections : Counter[str]
        ``"<phase>:<kind>"`` -> replies not used, over the strategy's life.
    run_tally, round_tally : ReplyTally
        Why replies were not used, this run and this (training) round.
    """

    def __init__(self) -> None:
        self.rejections: Counter[str] = Counter()
        self.run_tally = ReplyTally()
        self.round_tally = ReplyTally()
        # Metadata of this round's train and evaluate messages (ids are set by
        # the grid when it pushes them), to name the node of an error reply
        # the SuperLink sends in its place.
        self._sent: dict[str, list[Metadata]] = {}

    def reset_run(self) -> None:
        """Start a new run's tallies (the strategy's life-long counts stay)."""
        self.run_tally = ReplyTally()
        self.round_tally = ReplyTally()

    def remember(self, kind: str, messages: Sequence[Message]) -> None:
        """Keep the metadata of the ``kind`` messages about to be sent."""
        self._sent[kind] = [message.metadata for message in messages]

    def sent_nodes(self, kind: str) -> dict[str, int]:
        """Map the ids of this round's ``kind`` messages to their destination node.

        Flower's grids set ``metadata.message_id`` on the very ``Message``
        objects ``configure_train`` / ``configure_evaluate`` return when they
        push them; before that (messages never pushed), the map is empty.
        """
        return {
            metadata.message_id: metadata.dst_node_id
            for metadata in self._sent.get(kind, [])
            if metadata.message_id
        }

    def count(self, node_id: int, why: ReplyRejected, phase: str) -> None:
        """Count one training reply not used, in the round's and the run's tally."""
        self.rejections[f"{phase}:{why.kind}"] += 1
        self.round_tally.add(node_id, why)
        self.run_tally.add(node_id, why)

    def collect(
        self,
        server_round: int,
        replies: Iterable[Message],
        *,
        expected_arrays: Mapping[str, RecordSpec],
        sampled: set[int] | None,
        phase: str,
        check: Callable[[ValidReply], None],
        max_bytes: int,
        retired: set[int],
        defer_finite: tuple[str, ...] = (),
        tally: ReplyTally | None = None,
        explain_records: Callable[[Message], str] | None = None,
    ) -> tuple[list[ValidReply], int, int, int]:
        """Validate replies; return the valid ones, #failed, #rejected, #absent.

        Error replies count as failures; replies that arrive but fail a check
        (the layout, then ``check``) count as rejected. Both are counted by reason
        in a :class:`ReplyTally` (``tally``, or a new one; for training it
        becomes :attr:`round_tally`) and logged: one line per reply naming the
        node when some reply is valid, else one warning with the counted
        reasons (for ``aggregate_train``, the caller's). A client that says its
        privacy budget is spent is absent, not failed: in training it joins
        ``retired``. ``explain_records(message)`` adds the cause and the fix
        to a rejection for missing or unexpected records.
        """
        valid: list[ValidReply] = []
        seen: set[int] = set()
        failed = rejected = absent = 0
        training = phase != "aggregate_evaluate"
        tally = ReplyTally() if tally is None else tally
        if training:
            self.round_tally = tally
        unused: list[tuple[int, ReplyRejected]] = []
        sent_to = self.sent_nodes("train" if training else "evaluate")
        answered: set[int] = set()
        for message in replies:
            node_id = reply_node(message, sent_to)
            answered.add(node_id)
            try:
                if sampled is not None and node_id not in sampled:
                    raise ReplyRejected("unsampled", "node was not sampled this round")
                if node_id in seen:
                    raise ReplyRejected("duplicate", "second reply from this node")
                reply = validate_reply(
                    message,
                    expected_arrays=expected_arrays,
                    defer_finite=defer_finite,
                    max_bytes=max_bytes,
                )
                if expected_arrays:
                    check(reply)
            except ReplyRejected as err:
                hint = (
                    explain_records(message)
                    if err.kind == "records" and explain_records is not None
                    else ""
                )
                if hint:
                    err = ReplyRejected(err.kind, f"{err.reason}: {hint}")
                if err.kind == "budget-exhausted":
                    absent += 1
                    if training:
                        retired.add(node_id)
                    log(
                        INFO,
                        "%s: round %d: node %d retires: %s",
                        phase,
                        server_round,
                        node_id,
                        err.reason,
                    )
                    continue
                if err.kind == "error-reply":
                    failed += 1
                else:
                    rejected += 1
                self.rejections[f"{phase}:{err.kind}"] += 1
                tally.add(node_id, err)
                unused.append((node_id, err))
                continue
            seen.add(node_id)
            valid.append(reply)
        # Sampled nodes with no reply at all: Flower's round timeout passed
        # first (a slow or frozen node). Failed, and named.
        for node_id in sorted((sampled or set()) - answered):
            failed += 1
            why = ReplyRejected("no-reply", "no reply before the round timeout")
            self.rejections[f"{phase}:no-reply"] += 1
            tally.add(node_id, why)
            unused.append((node_id, why))
        if training:
            self.run_tally.update(tally)
        if valid:
            for node_id, why in unused:
                log(
                    WARNING,
                    "%s: round %d: reply from node %d not used (%s): %s",
                    phase,
                    server_round,
                    node_id,
                    why.kind,
                    why.reason,
                )
        elif phase != "aggregate_train" and (unused or tally.failed or sampled):
            # (aggregate_train says it with the model it keeps)
            log(
                WARNING,
                "%s: round %d: no valid reply: %s",
                phase,
                server_round,
                tally.describe(),
            )
        log(
            INFO,
            "%s: round %d: %d valid, %d failed, %d rejected%s",
            phase,
            server_round,
            len(valid),
            failed,
            rejected,
            f", {absent} out of privacy budget" if absent else "",
        )
        return valid, failed, rejected, absent

    def reject_bad_values(
        self, server_round: int, replies: list[ValidReply], problem: str, record: str
    ) -> int:
        """Mark, count and log the replies whose ``record`` has ``problem``.

        ``NON_FINITE`` (NaN or inf) or ``OUT_OF_RANGE`` (values beyond
        ``MAX_ABS_VALUE``): see :func:`.validation.value_problem`. A marked
        reply gets ``finite = False``.
        """
        kind = "non-finite" if problem == NON_FINITE else "out-of-range"
        found = 0
        for reply in replies:
            bad = [k for k, p in reply.bad_value_keys(record).items() if p == problem]
            if not bad:
                continue
            found += 1
            reply.finite = False
            what = f"{', '.join(bad)} hold {problem}"
            self.count(reply.node_id, ReplyRejected(kind, what), "aggregate_train")
            log(
                WARNING,
                "aggregate_train: round %d: reply from node %d not used (%s): %s",
                server_round,
                reply.node_id,
                kind,
                what,
            )
        return found


def _count(value: Any) -> int | float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def reports_rule(reply: ValidReply | Mapping[str, Any], metric: str | None) -> bool:
    """Return True when the reply (or its metrics) reports ``metric`` (or none is due).

    The metric is the count of steps whose update held the rule's term (0
    for a client that took no step); a reply without it comes from a client
    that did not run the rule's :meth:`~flwr_prox_strategies.ClientRule.reply`.
    """
    if metric is None:
        return True
    metrics = reply if isinstance(reply, Mapping) else reply.metrics
    value = _count(metrics.get(metric))
    return value is not None and value >= 0


def term_shortfall(reply: ValidReply, metric: str | None) -> tuple[int, int] | None:
    """Return ``(applied, steps)`` when the rule's term missed some of the steps.

    ``metric`` counts the steps whose update held the term, ``local-steps``
    all the client's steps; None when every step held it (or the reply does
    not say: an earlier client's flag of 1 without ``local-steps``).
    """
    if metric is None:
        return None
    applied = _count(reply.metrics.get(metric))
    steps = _count(reply.metrics.get(LOCAL_STEPS_METRIC))
    if applied is None or steps is None or applied >= steps:
        return None
    return int(applied), int(steps)


def shortfall_problem(strategy: Any, reply: ValidReply, *, counted: bool = True) -> str:
    """Say in how many steps a client's term reached the update, why not, the fix.

    ``counted=False`` leaves the numbers out (one line for many replies).
    """
    shortfall = term_shortfall(reply, strategy.rule_metric)
    assert shortfall is not None
    applied, steps = shortfall
    _, rule = rule_pieces_of(strategy)
    lost = int(_count(reply.metrics.get(TERM_LOST_METRIC)) or 0)
    missing = int(_count(reply.metrics.get(TERM_MISSING_METRIC)) or 0)
    if not (lost or missing):
        missing = steps - applied
    if not counted:
        return f"{strategy.rule_name} missed updates: " + shortfall_text(
            lost, missing, rule, counted=False
        )
    return (
        f"{strategy.rule_name} reached the update in {applied} of the client's "
        f"{steps} local steps: {shortfall_text(lost, missing, rule)}"
    )


def pack_class(cls: type) -> type:
    """Return the first class of ``cls``'s MRO that the pack defines.

    A user's subclass (``class CustomFedAvg(FedProx)``) is skipped, so messages
    name classes that exist (``FedProxRule``, not ``CustomFedAvgRule``). An
    algorithm built on the pack's base itself (a plugin's ``FedNova``) is its
    own: the base's name (``ValidatedFedAvgRule``) names nothing.
    """
    below_base = cls
    for klass in cls.__mro__:
        if klass.__module__.startswith("flwr_prox_strategies.algorithms."):
            return klass
        if klass.__module__.startswith("flwr_prox_strategies."):
            return below_base
        below_base = klass
    return cls


def rule_pieces_of(strategy: Any) -> tuple[str, str]:
    """Return the pack's ``(client, rule)`` class names that serve ``strategy``."""
    name = pack_class(type(strategy)).__name__
    return strategy.rule_pieces or (f"{name}Client", f"{name}Rule")


def rules_applied(metrics: Mapping[str, Any]) -> list[str]:
    """Return the pack's rules a reply's metrics say were run (their ``*-applied``)."""
    return sorted(
        {
            rule.__name__
            for rule in pack_rules()
            if rule.applied_metric is not None
            and reports_rule(metrics, rule.applied_metric)
        }
    )


def protocol_problem(strategy: Any, reply: ValidReply | Mapping[str, Any]) -> str:
    """Say what the client did instead of applying the strategy's rule, and the fix.

    Either it applied another algorithm's rule (naming both), or its reply
    carries none of the records :meth:`ClientRule.reply` adds (a ClientApp
    that builds its own reply, or Flower's own client). Takes a reply or its
    metrics.
    """
    client, rule = rule_pieces_of(strategy)
    server = pack_class(type(strategy)).__name__
    metrics = reply if isinstance(reply, Mapping) else reply.metrics
    others = [name for name in rules_applied(metrics) if name != rule]
    if others:
        return (
            f"the client applies {' and '.join(others)}, but this server runs "
            f"{server}, whose clients apply {rule}: build {rule} in your "
            f"@app.train instead (or use the pack's {client})"
        )
    return (
        f"the reply carries none of {rule}'s records (a reply built without "
        f"rule.reply, which says in how many steps the term was applied): in "
        f"your @app.train, build {rule}.from_message(msg, context, model) and "
        f"return rule.reply(...) instead of a reply of your own (or use the "
        f"pack's {client})"
    )


def records_problem(strategy: Any, message: Message) -> str:
    """Say why a train reply lacks the records the strategy expects, and the fix.

    Empty unless the strategy's clients run a rule and the reply does not
    report it (a reply of the user's own, or another algorithm's rule).
    """
    if strategy.rule_metric is None:
        return ""
    records = list(message.content.metric_records.values())
    metrics: Mapping[str, Any] = records[0] if len(records) == 1 else {}
    if reports_rule(metrics, strategy.rule_metric):
        return ""
    return protocol_problem(strategy, metrics)


def warn_term_shortfall(
    strategy: Any, server_round: int, short: list[ValidReply]
) -> bool:
    """Warn, naming the nodes of ``short``, replies whose term missed steps.

    Their clients ran the rule, but its term did not reach every update (a
    closure-based step wiped it, or the optimiser that stepped was not the
    one attached): the message says in how many steps, why, and the fix.
    Returns whether there were any.
    """
    if not short:
        return False
    log(
        WARNING,
        "%s: round %d: nodes %s: %s. Their updates are averaged in as they are; "
        "strict=True rejects such replies. (Given once per run, repeated at the "
        "run's end and counted in the 'replies-term-incomplete' metric.)",
        type(strategy).__name__,
        server_round,
        sorted(r.node_id for r in short),
        shortfall_problem(strategy, short[0]),
    )
    return True


def warn_rule_not_applied(
    strategy: Any, server_round: int, lacking: list[ValidReply]
) -> bool:
    """Warn, naming the nodes of ``lacking``, replies without the rule metric.

    Their clients are not applying the algorithm's rule: the message says what
    they do instead and what to change. Returns whether there were any.
    """
    if not lacking:
        return False
    metric = strategy.rule_metric
    log(
        WARNING,
        "%s: round %d: nodes %s do not report '%s', so nothing says their "
        "clients apply %s; their updates are averaged in as they are: %s. "
        "strict=True rejects such replies. (Given once per run, repeated at "
        "the run's end and counted in the 'replies-rule-missing' metric.)",
        type(strategy).__name__,
        server_round,
        sorted(r.node_id for r in lacking),
        metric,
        strategy.rule_name,
        protocol_problem(strategy, lacking[0]),
    )
    return True

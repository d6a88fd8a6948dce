"""Reply screening: which replies a round may use, and why the others may not.

:class:`ReplyScreen`'s steps in a round: ``docs/explanation/architecture.md``. Used
by the base strategy for training and evaluation, by the central-DP wrappers before
Flower's own aggregation (:func:`.central.screen_replies`) and, through its inner
strategies, by P-FedAvg.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING

from flwr.app import Message, Metadata
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.common.logger import log

from ...ops.aggregate import ZeroTotalWeightError
from ..contract.fields import RoundUpdate
from ..contract.validation import (
    NON_FINITE,
    OUT_OF_RANGE,
    MetricSpec,
    ReplyRejected,
    ValidReply,
    check_metrics,
    expected_bytes,
    validate_reply,
)
from ..transport.keys import CLIENT_KEY_METRIC
from ..transport.records import RecordSpec, record_is_finite
from .outcome import ReplyTally
from .rule_report import (
    RuleNames,
    protocol_problem,
    records_problem,
    reports_rule,
    shortfall_problem,
    term_shortfall,
    warn_rule_not_applied,
    warn_term_shortfall,
)


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


# The server rule on (candidate replies, wide): wide asks for float64 accumulators.
Rule = Callable[[list[ValidReply], bool], RoundUpdate]


def screen_setting(name: str) -> property:
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


class ReplyScreen:
    """One strategy's screening of replies, and its counts of what was not used.

    Parameters
    ----------
    max_num_examples : float | None (default: None)
        The largest ``num-examples`` a reply may claim; None: no such cap.
    max_weight_ratio : float | None (default: None)
        The largest claim, as a multiple of the round's median claim; None: no
        such cap.
    max_reply_bytes : int | None (default: None)
        The largest reply accepted, in bytes; None: twice the expected
        records' payload plus 1 MiB (:meth:`reply_size_limit`).

    Attributes
    ----------
    rejections : Counter[str]
        ``"<phase>:<kind>"`` -> replies not used, over the strategy's life.
    run_tally, round_tally : ReplyTally
        Why replies were not used, this run and this (training) round.
    """

    def __init__(
        self,
        *,
        max_num_examples: float | None = None,
        max_weight_ratio: float | None = None,
        max_reply_bytes: int | None = None,
    ) -> None:
        self.max_num_examples = max_num_examples
        self.max_weight_ratio = max_weight_ratio
        self.max_reply_bytes = max_reply_bytes
        self.rejections: Counter[str] = Counter()
        self.run_tally = ReplyTally()
        self.round_tally = ReplyTally()
        # Metadata of this round's train and evaluate messages (ids are set by
        # the grid when it pushes them), to name the node of an error reply
        # the SuperLink sends in its place.
        self._sent: dict[str, list[Metadata]] = {}
        # Whether this run has warned about replies without the rule metric,
        # and about replies whose term missed steps: once each per run.
        self._rule_warned = False
        self._shortfall_warned = False

    def reset_run(self) -> None:
        """Start a new run: new tallies, warnings re-armed (life-long counts stay)."""
        self.run_tally = ReplyTally()
        self.round_tally = ReplyTally()
        self._rule_warned = False
        self._shortfall_warned = False

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
        retired: set[int],
        rule: RuleNames,
        expected_metrics: Mapping[str, MetricSpec] | None = None,
        defer_finite: tuple[str, ...] = (),
        tally: ReplyTally | None = None,
    ) -> tuple[list[ValidReply], int, int, int]:
        """Validate replies; return the valid ones, #failed, #rejected, #absent.

        Error replies count as failures; replies that arrive but fail a check
        (the size and the layout, then the declared metrics and ``check``)
        count as rejected. Both are counted by reason in a :class:`ReplyTally`
        (``tally``, or a new one; for training it becomes :attr:`round_tally`)
        and logged: one line per reply naming the node when some reply is
        valid, else one warning with the counted reasons (for
        ``aggregate_train``, the caller's). A client that says its privacy
        budget is spent is absent, not failed: in training it joins
        ``retired``.

        Parameters
        ----------
        server_round : int
            The round, for the log lines.
        replies : Iterable[Message]
            The replies, in their arrival order.
        expected_arrays : Mapping[str, RecordSpec]
            Exactly the ArrayRecords a reply must carry, each with its layout;
            empty for evaluation replies (then only the error replies, the
            size and the ``num-examples`` are checked).
        sampled : set[int] | None
            The nodes sent a message this round: a reply from another is
            rejected, a node without a reply fails (``no-reply``). None: any
            node may reply, none has to.
        phase : str
            ``"aggregate_train"``, ``"aggregate_evaluate"`` or the caller's
            name for a training screen (``"screen_train"``): the log lines'
            prefix and the :attr:`rejections` keys' first part.
        check : Callable[[ValidReply], None]
            The strategy's own check of a reply with the expected records
            (its ``check_reply``); raises :class:`ReplyRejected` to drop it.
        retired : set[int]
            The nodes out of privacy budget, joined by those that say so in
            training.
        rule : RuleNames
            The strategy's client rule: a reply without the expected records
            is explained from it (:func:`.rule_report.records_problem`).
        expected_metrics : Mapping[str, MetricSpec] | None (default: None)
            Metrics a reply with the expected records must carry; None: none.
        defer_finite : tuple[str, ...] (default: ())
            Records whose NaN/inf check the caller does on the result.
        tally : ReplyTally | None (default: None)
            Where the replies not used are counted; None: a new tally.

        Returns
        -------
        tuple[list[ValidReply], int, int, int]
            The valid replies (arrival order), the number failed, rejected,
            and absent (out of privacy budget).
        """
        max_bytes = self.reply_size_limit(expected_arrays)
        expected_metrics = expected_metrics or {}
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
                    check_metrics(reply.metrics, expected_metrics)
                    check(reply)
            except ReplyRejected as err:
                hint = records_problem(rule, message) if err.kind == "records" else ""
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

    def reply_size_limit(self, expected_arrays: Mapping[str, RecordSpec]) -> int:
        """Return the largest reply accepted, in bytes.

        Parameters
        ----------
        expected_arrays : Mapping[str, RecordSpec]
            The ArrayRecords a reply must carry, each with its layout.

        Returns
        -------
        int
            ``max_reply_bytes`` when set; else twice the payload of the
            expected ArrayRecords, plus 1 MiB (``.npy`` headers and keys take a
            few hundred bytes per array).
        """
        if self.max_reply_bytes is not None:
            return self.max_reply_bytes
        return 2 * expected_bytes(expected_arrays) + (1 << 20)

    def cap_claims(
        self, server_round: int, replies: list[ValidReply], phase: str
    ) -> int:
        """Lower claimed ``num-examples`` above the caps; return how many were.

        The cap is the smaller of ``max_num_examples`` and ``max_weight_ratio``
        times the median claim of ``replies`` (of an even number of claims, the
        lower middle one: one inflated claim cannot raise it, even among two). A
        capped reply keeps its claim in ``capped_from`` and is logged with its
        node, client key, claim and cap.

        Parameters
        ----------
        server_round : int
            The round, for the log line.
        replies : list[ValidReply]
            The round's valid replies; their ``num_examples`` is lowered in place.
        phase : str
            The log line's prefix (``"aggregate_train"``, ``"aggregate_evaluate"``).

        Returns
        -------
        int
            How many claims were capped.
        """
        caps: list[tuple[float, str]] = []
        if self.max_num_examples is not None:
            caps.append(
                (self.max_num_examples, f"max_num_examples={self.max_num_examples:g}")
            )
        if self.max_weight_ratio is not None and replies:
            claims = sorted(r.num_examples for r in replies)
            median = claims[(len(claims) - 1) // 2]
            caps.append(
                (
                    self.max_weight_ratio * median,
                    f"max_weight_ratio={self.max_weight_ratio:g} x the round's "
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

    def finite_update(
        self, server_round: int, valid: list[ValidReply], rule: Rule, record: str
    ) -> tuple[RoundUpdate | None, str | None]:
        """Run the server ``rule`` until its model is finite; or say why not.

        The model record's NaN/inf check is deferred for linear rules (their
        model is a positive combination of the replies', so a NaN or inf in
        one reaches the result): one check of the result replaces one pass
        over every reply, and only a non-finite result pays for per-reply
        checks. In order: the rule in the model's dtype; not finite, the
        replies holding NaN or inf are rejected (:meth:`reject_bad_values`)
        and the rule re-run without them; every reply finite and the result
        still not, the rule re-run once with float64 accumulators; even that
        not finite (the true value does not fit, or a sum kept in the model's
        dtype overflowed: FedDC's drift sum), the replies holding values
        beyond ``MAX_ABS_VALUE`` are rejected in turn, so one huge upload
        never costs the round of everyone else.

        Returns
        -------
        tuple[RoundUpdate | None, str | None]
            The round's update, or None and why the model is kept. A reply
            found holding bad values gets ``finite = False``; the caller drops
            it from the round's replies.
        """
        checked: set[str] = set()
        wide = False
        while True:
            candidates = [r for r in valid if r.finite]
            if not candidates:
                return None, "no valid reply"
            try:
                update = rule(candidates, wide)
            except ZeroTotalWeightError as err:
                return None, f"zero total weight ({err})"
            if record_is_finite(update.arrays):
                return update, None
            if NON_FINITE not in checked:
                checked.add(NON_FINITE)
                if self.reject_bad_values(server_round, candidates, NON_FINITE, record):
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
                if self.reject_bad_values(
                    server_round, candidates, OUT_OF_RANGE, record
                ):
                    continue
            return None, (
                "the average is not finite although every reply is (its true "
                "value does not fit the model's dtype)"
            )

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

    def rule_not_applied(
        self,
        server_round: int,
        replies: list[ValidReply],
        *,
        aggregated: bool,
        rule: RuleNames,
    ) -> tuple[int, int]:
        """Count the valid replies without the rule, or whose term missed steps.

        In a round whose model is kept (``aggregated``), each such reply is
        counted in :attr:`run_tally` (repeated at the run's end) and each kind
        is warned about once per run, naming the nodes, the cause and the fix;
        :meth:`reset_run` re-arms both warnings.

        Parameters
        ----------
        server_round : int
            The round, for the warning.
        replies : list[ValidReply]
            The round's valid replies.
        aggregated : bool
            Whether the round's model is kept: replies of a round thrown away
            are counted in the round's metrics only.
        rule : RuleNames
            The strategy's client rule; ``rule.metric`` None: nothing is due.

        Returns
        -------
        tuple[int, int]
            ``(lacking, short)``: replies without the rule metric, and replies
            whose term reached fewer updates than the client's steps.
        """
        if rule.metric is None:
            return 0, 0
        lacking = [r for r in replies if not reports_rule(r, rule.metric)]
        short = [r for r in replies if term_shortfall(r, rule.metric) is not None]
        if lacking and aggregated:
            self.run_tally.add_not_applied(lacking, protocol_problem(rule, lacking[0]))
            if not self._rule_warned:
                self._rule_warned = warn_rule_not_applied(rule, server_round, lacking)
        if short and aggregated:
            for reply in short:
                self.run_tally.add_not_applied(
                    [reply], shortfall_problem(rule, reply, counted=False)
                )
            if not self._shortfall_warned:
                self._shortfall_warned = warn_term_shortfall(rule, server_round, short)
        return len(lacking), len(short)

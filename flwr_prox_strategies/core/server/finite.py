"""A server rule run until its model is finite, at the least cost to honest replies.

The model record's NaN/inf check is deferred for linear rules (their model is a
positive combination of the replies', so a NaN or inf in one reaches the
result): one check of the result replaces one pass over every reply, and only a
non-finite result pays for per-reply checks. In order:

1. the rule in the model's dtype, with normalised weights (finite replies
   cannot overflow it);
2. not finite: the replies holding NaN or inf are rejected (logged, counted)
   and the rule re-run without them;
3. every reply finite and the result still not: the rule re-run once with
   float64 accumulators, rounded once at the end;
4. even that not finite (the true value does not fit, or a sum kept in the
   model's dtype overflowed: FedDC's drift sum): the replies holding values
   beyond ``MAX_ABS_VALUE`` are rejected in turn, so one huge upload never costs
   the round of everyone else.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING

from flwr.common.logger import log

from ...ops.aggregate import ZeroTotalWeightError
from ..contract.fields import RoundUpdate
from ..contract.validation import NON_FINITE, OUT_OF_RANGE, ValidReply
from ..transport.records import record_is_finite
from .screening import ReplyScreen

# The rule on (candidate replies, wide): wide asks for float64 accumulators.
Rule = Callable[[list[ValidReply], bool], RoundUpdate]


def finite_update(
    server_round: int,
    valid: list[ValidReply],
    rule: Rule,
    *,
    screen: ReplyScreen,
    record: str,
) -> tuple[RoundUpdate | None, str | None]:
    """Return the round's update, or None and why the model is kept.

    A reply found holding NaN or inf (or beyond ``MAX_ABS_VALUE``) gets
    ``finite = False``; the caller drops it from the round's replies.
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
            if screen.reject_bad_values(server_round, candidates, NON_FINITE, record):
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
            if screen.reject_bad_values(server_round, candidates, OUT_OF_RANGE, record):
                continue
        return None, (
            "the average is not finite although every reply is (its true "
            "value does not fit the model's dtype)"
        )

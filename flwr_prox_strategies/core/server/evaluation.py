"""Federated evaluation: the nodes asked to evaluate, and a federation that cannot.

A part of the base strategy with its own state: the nodes sampled for this
round's evaluation (their replies are screened against them) and whether
evaluation is off for the run. A federation whose ClientApp has no evaluate
function answers every evaluation message with Flower's error; the part notices
it once, says what to change, and turns evaluation off for the rest of the run
instead of failing on every node every round.
"""

from __future__ import annotations

from collections.abc import Sequence
from logging import ERROR

from flwr.app import Message
from flwr.common.logger import log


class Evaluation:
    """The evaluation round's state: the nodes sampled, and whether it is off."""

    def __init__(self) -> None:
        self.nodes: set[int] | None = None
        self.off = False

    def reset_run(self) -> None:
        """Start a new run, evaluating again."""
        self.off = False

    def skipped(self, fraction: float) -> bool:
        """Return True (no node sampled) when nothing evaluates this round."""
        if fraction == 0.0 or self.off:
            self.nodes = set()
            return True
        return False

    def notice_missing_function(
        self,
        server_round: int,
        replies: Sequence[Message],
        *,
        owner: str,
        fraction: float,
    ) -> None:
        """Turn evaluation off for the run when no sampled node can evaluate."""
        if not replies or not all(map(_no_evaluate_function, replies)):
            return
        self.off = True
        log(
            ERROR,
            "aggregate_evaluate: round %d: the ClientApp of every node sampled "
            "for evaluation has no evaluate function (Flower: 'No evaluate "
            "function registered'), while %s evaluates (fraction_evaluate=%g). "
            "Build the strategy with fraction_evaluate=0.0, or register one "
            "with @app.evaluate(); federated evaluation is off for the rest "
            "of this run",
            server_round,
            owner,
            fraction,
        )


def _no_evaluate_function(reply: Message) -> bool:
    """Return True for the error reply of a ClientApp without an evaluate function."""
    return reply.has_error() and "No evaluate function registered" in str(
        reply.error.reason
    )


__all__ = ["Evaluation"]

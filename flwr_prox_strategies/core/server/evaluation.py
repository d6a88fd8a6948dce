"""Federated evaluation: the nodes asked to evaluate, and a federation that cannot.

A part of the base strategy with its own state: the nodes sampled for this
round's evaluation (their replies are screened against them) and whether
evaluation is off for the run. A federation whose ClientApp has no evaluate
function answers every evaluation message with Flower's error; the part notices
it once, says what to change, and turns evaluation off for the rest of the run
instead of failing on every node every round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from logging import ERROR, INFO
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..transport import keys
from ..transport.messages import node_messages
from . import metrics

if TYPE_CHECKING:
    from ..contract.validation import ValidReply
    from .screening import ReplyScreen


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


class EvaluationRound:
    """Flower's two evaluation hooks, for the base strategy: sample, then average.

    The base of :class:`~flwr_prox_strategies.extend.ValidatedFedAvg` for
    federated evaluation; its replies are screened as train replies are.
    """

    # Set by ValidatedFedAvg (its parts, settings and hooks).
    evaluation: Evaluation
    screen: ReplyScreen
    round_offset: int
    fraction_evaluate: float
    min_evaluate_nodes: int
    arrayrecord_key: str
    configrecord_key: str
    pack_metrics: bool
    per_client_metrics: bool
    _custom_metrics: tuple[Any, Any]
    sample_nodes: Callable[..., tuple[list[int], int]]
    evaluate_config: Callable[[int], dict[str, Any]]
    evaluate_records: Callable[[int], dict[str, ArrayRecord]]
    collect_replies: Callable[..., tuple[list[ValidReply], int, int, int]]
    cap_claims: Callable[[int, list[ValidReply], str], int]

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
        records = self.evaluate_records(server_round)
        return self.round_messages(
            MessageType.EVALUATE, node_ids, arrays, shared, records
        )

    def round_messages(
        self,
        kind: str,
        node_ids: Sequence[int],
        arrays: ArrayRecord,
        config: dict[str, Any],
        records: dict[str, ArrayRecord],
        **per_node: Any,
    ) -> list[Message]:
        """Build one fresh ``kind`` message per node; remember them for screening.

        Train and evaluate messages alike: the model under ``arrayrecord_key``,
        ``config`` under ``configrecord_key``, the extra ``records``, and what
        ``per_node`` (``node_messages``' per-node keywords) adds.
        """
        messages = node_messages(
            node_ids,
            kind,
            arrays=(self.arrayrecord_key, arrays),
            records=records,
            config=(self.configrecord_key, config),
            **per_node,
        )
        self.screen.remember(kind, messages)
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


def _no_evaluate_function(reply: Message) -> bool:
    """Return True for the error reply of a ClientApp without an evaluate function."""
    return reply.has_error() and "No evaluate function registered" in str(
        reply.error.reason
    )


__all__ = ["Evaluation", "EvaluationRound"]

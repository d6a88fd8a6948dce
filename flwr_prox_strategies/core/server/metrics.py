"""Per-round metrics of the replies: weighted means, per-client tables, B(theta).

Computed from validated replies only (:class:`.validation.ValidReply`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import MetricRecord, RecordDict
from flwr.common.logger import log

from ...ops.aggregate import WeightedMean
from ...ops.dissimilarity import dissimilarity, sq_norm
from ..contract.validation import ValidReply
from ..transport.keys import (
    CLIENT_KEY_METRIC,
    GRADIENT_RECORD,
    LOCAL_STEPS_METRIC,
    NUM_EXAMPLES_KEY,
    STATE_OUTSIDE_COMMIT_METRIC,
    STATE_ROUND_METRIC,
    TERM_LOST_METRIC,
    TERM_MISSING_METRIC,
    node_key,
)
from ..transport.messages import payload_bytes
from .rule_report import declared_rules


def rule_bookkeeping() -> set[str]:
    """Return the metrics the pack's rules add to a reply besides the user's own.

    Every rule's ``<algorithm>-applied`` count, ``term-lost-steps``,
    ``term-missing-steps`` and ``local-steps`` (``client-key`` and
    ``state-round`` are never averaged).
    """
    return set().union(*declared_rules().values()) | {
        LOCAL_STEPS_METRIC,
        TERM_LOST_METRIC,
        TERM_MISSING_METRIC,
    }


def weighted_metric_mean(
    replies: list[ValidReply], exclude: frozenset[str] | set[str] = frozenset()
) -> MetricRecord:
    """Sample-weighted mean of each numeric metric over the replies carrying it.

    ``num-examples`` is summed instead. Non-finite values and lists are skipped
    (a NaN loss from one client must not hide the others' values), and so are
    the names in ``exclude``.
    """
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    total = 0.0
    for reply in replies:
        total += reply.num_examples
        for key, value in reply.metrics.items():
            if (
                key
                in (
                    NUM_EXAMPLES_KEY,
                    CLIENT_KEY_METRIC,
                    STATE_ROUND_METRIC,
                    STATE_OUTSIDE_COMMIT_METRIC,
                )
                or key in exclude
                or isinstance(value, (list, bool))
            ):
                continue
            if not math.isfinite(value):
                continue
            sums[key] = sums.get(key, 0.0) + reply.num_examples * float(value)
            weights[key] = weights.get(key, 0.0) + reply.num_examples
    record = MetricRecord({key: sums[key] / weights[key] for key in sums})
    record[NUM_EXAMPLES_KEY] = total
    return record


def per_client_table(
    replies: list[ValidReply], per_client: bool = True
) -> dict[str, Any]:
    """Per-client accuracies of an evaluation round, and their spread.

    For every metric ending in ``accuracy`` (the global model's ``accuracy``,
    a personalised client's ``personal-accuracy``, ...): their unweighted mean
    over clients (``-clients-mean``), standard deviation (``-std``) and the
    worst client's value (``-worst``), and with ``per_client`` the value of
    each client (``<metric>-per-client``, in the order of the integer
    ``eval-client-keys``). A personalised method is judged by its worst client
    as much as by its mean.
    """
    rows = sorted(
        ((_client_key(reply), reply) for reply in replies), key=lambda row: row[0]
    )
    table: dict[str, Any] = {}
    if per_client:
        table["eval-client-keys"] = [key for key, _ in rows]
    names = sorted(
        {
            key
            for _, reply in rows
            for key, value in reply.metrics.items()
            if key.endswith("accuracy") and not isinstance(value, (list, bool))
        }
    )
    for name in names:
        values = [_number(reply.metrics.get(name, math.nan)) for _, reply in rows]
        finite = np.array([v for v in values if math.isfinite(v)])
        if finite.size == 0:
            continue
        if per_client:
            table[f"{name}-per-client"] = values
        table[f"{name}-clients-mean"] = float(finite.mean())
        table[f"{name}-std"] = float(finite.std())
        table[f"{name}-worst"] = float(finite.min())
    return table


def evaluation_metrics(
    server_round: int,
    replies: list[ValidReply],
    custom: Callable[[list[RecordDict], str], MetricRecord] | None,
    *,
    pack_metrics: bool = True,
    per_client: bool = False,
) -> MetricRecord:
    """Aggregate an evaluation round: the user's function, or ours and the table.

    Ours: the weighted means and the per-client table (:func:`per_client_table`,
    whose spread is logged). With ``pack_metrics``, ``replies-valid`` and the
    table's spread join the record; with ``per_client``, its lists.
    """
    record = reply_metrics(replies, custom, pack_metrics=pack_metrics)
    if pack_metrics:
        record["replies-valid"] = len(replies)
    if custom is None:
        table = per_client_table(replies, per_client)
        log_client_spread(server_round, replies, table)
        for key, value in table.items():
            if pack_metrics or isinstance(value, list):
                record[key] = value
    return record


def log_client_spread(
    server_round: int, replies: list[ValidReply], table: dict[str, Any]
) -> None:
    """Log the mean, spread and worst client of each accuracy in ``table``."""
    for name in ("accuracy", "personal-accuracy"):
        if f"{name}-worst" in table:
            log(
                INFO,
                "aggregate_evaluate: round %d: %s over %d clients: "
                "mean %.4f, std %.4f, worst %.4f",
                server_round,
                name,
                len(replies),
                table[f"{name}-clients-mean"],
                table[f"{name}-std"],
                table[f"{name}-worst"],
            )


def _client_key(reply: ValidReply) -> int:
    # The client's own key (its partition id), else its node id made exact.
    key = reply.metrics.get(CLIENT_KEY_METRIC)
    if isinstance(key, (int, float)) and not isinstance(key, bool):
        return int(key)
    return node_key(reply.node_id)


def _number(value: Any) -> float:
    # Metric values are numbers or lists; a list is no table entry.
    return float(value) if isinstance(value, (int, float)) else math.nan


def reply_metrics(
    replies: list[ValidReply],
    custom: Callable[[list[RecordDict], str], MetricRecord] | None,
    weight_key: str | None = None,
    *,
    pack_metrics: bool = True,
) -> MetricRecord:
    """Aggregate the replies' metrics: the user's Flower-style function, or ours.

    ``custom(contents, key)`` gets the valid replies' contents only, and
    ``weight_key`` (``num-examples`` when None) as Flower's strategies give it.
    Ours leaves the rules' bookkeeping (:func:`rule_bookkeeping`) out unless
    ``pack_metrics``.
    """
    if custom is not None:
        contents = [r.message.content for r in replies if r.message is not None]
        return custom(contents, weight_key or NUM_EXAMPLES_KEY)
    return weighted_metric_mean(
        replies, frozenset() if pack_metrics else rule_bookkeeping()
    )


def round_counts(
    valid: list[ValidReply],
    *,
    failed: int,
    rejected: int,
    absent: int,
    capped: int,
    bytes_sent: int,
    rule: tuple[int, int] | None = None,
    outside: int | None = None,
) -> dict[str, Any]:
    """Return a training round's counts of replies and its traffic in bytes.

    ``bytes-sent``/``bytes-received``: the ArrayRecords' payload of this
    round's messages (model and extra records) and of its valid replies;
    ``rule``: the replies without the rule and those whose term missed steps
    (:meth:`.screening.ReplyScreen.rule_not_applied`); ``outside``: the replies
    whose client saved state outside the two-phase commit.
    """
    counts = {
        "replies-valid": len(valid),
        "replies-failed": failed,
        "replies-rejected": rejected,
        "replies-absent": absent,
        "replies-capped": capped,
        "bytes-sent": bytes_sent,
        "bytes-received": payload_bytes(
            reply.message for reply in valid if reply.message is not None
        ),
    }
    if rule is not None:
        counts["replies-rule-missing"], counts["replies-term-incomplete"] = rule
    if outside is not None:
        counts["replies-state-outside-commit"] = outside
    return counts


def dissimilarity_metrics(
    replies: list[ValidReply], weight: Callable[[ValidReply], float]
) -> dict[str, float]:
    """Estimate the FedProx paper's B(theta_t) from the gradients replies carry.

    ``B = E_k||grad f_k||^2 / ||grad f||^2``, with the weights of the average.
    """
    weights = [weight(reply) for reply in replies]
    mean = WeightedMean(total=sum(weights))
    mean_sq = 0.0
    total = 0.0
    for reply, w in zip(replies, weights, strict=True):
        grads = list(reply.arrays[GRADIENT_RECORD].values())
        mean.add(grads, w)
        mean_sq += w * sq_norm(grads)
        total += w
    mean_sq /= total
    norm_of_mean = sq_norm(list(mean.result().values()))
    value = dissimilarity(mean_sq, norm_of_mean)
    log(INFO, "aggregate_train: dissimilarity B(theta) = %.4g", value)
    return {"dissimilarity-b": value, "grad-sq-norm-global": norm_of_mean}

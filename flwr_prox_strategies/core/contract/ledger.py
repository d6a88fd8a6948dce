"""The privacy ledger: what a reply reports of privacy, and the server's tally.

Every client that privatises what it uploads (DP-SGD, the Laplace mod) reports,
in its train metrics, ``dp-epsilon`` (what this upload spent) and
``dp-epsilon-total`` (what the client has spent so far, by basic composition;
kept in its own ``context.state`` because spending is irreversible, even for an
upload the server then rejects). Every strategy of the pack collects the totals
into one report per round (:func:`privacy_metrics`), so the privacy of different
strategies compares in one table.
"""

from __future__ import annotations

from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.logger import log

from ..transport.keys import CLIENT_KEY_METRIC, node_key
from .validation import ValidReply

EPSILON_METRIC = "dp-epsilon"
EPSILON_TOTAL_METRIC = "dp-epsilon-total"
# 0 for pure epsilon-DP (Laplace), the accountant's delta for DP-SGD.
DELTA_METRIC = "dp-delta"
_SPENT = "scalar:dp-epsilon-spent"


def spend_epsilon(state_records: Any, epsilon: float) -> float:
    """Add ``epsilon`` to the total kept in a ``RecordDict``; return the new total."""
    previous = 0.0
    if _SPENT in state_records.array_records:
        previous = float(state_records.array_records[_SPENT]["0"].numpy())
    total = previous + float(epsilon)
    state_records[_SPENT] = ArrayRecord({"0": Array(np.asarray(total, np.float64))})
    return total


# Above this many clients a round's metrics carry no per-client lists: a round
# row of 10,000 clients' epsilons is 440 KB, and Flower's Result keeps every
# round's. The whole ledger stays in the checkpoint (and the experiment writes
# it to privacy-ledger.json).
PER_CLIENT_LIMIT = 100


def privacy_metrics(
    totals: dict[int, float],
    per_client_limit: int = PER_CLIENT_LIMIT,
    per_client: bool = True,
) -> dict[str, Any]:
    """Summarise per-client epsilon totals: max, mean, and every client's.

    ``dp-epsilon-total-per-client`` lists the totals in the order of
    ``dp-epsilon-client-keys`` (sorted client keys, integers), so
    ``results.json`` holds every client's epsilon every round, while at most
    ``per_client_limit`` clients have reported; beyond that, or with
    ``per_client=False``, the median takes the lists' place.
    """
    if not totals:
        return {}
    keys = sorted(totals)
    values = [totals[k] for k in keys]
    metrics: dict[str, Any] = {
        "dp-epsilon-total-max": max(values),
        "dp-epsilon-total-mean": sum(values) / len(values),
        "dp-clients-reporting": len(values),
    }
    if not per_client:
        metrics["dp-epsilon-total-median"] = float(np.median(values))
    elif len(values) <= per_client_limit:
        metrics["dp-epsilon-total-per-client"] = values
        metrics["dp-epsilon-client-keys"] = keys
    else:
        metrics["dp-epsilon-total-median"] = float(np.median(values))
    return metrics


def record_privacy(
    totals: dict[int, float],
    replies: list[ValidReply],
    retired: set[int],
    *,
    per_client: bool = True,
) -> dict[str, Any]:
    """Update the epsilon ledger ``totals`` from replies; return the round's metrics.

    The ledger maps a client key (or, for a client that reports none, its node
    id) to the largest ``dp-epsilon-total`` it reported: one report for every
    strategy, whatever mechanism the client runs. ``retired``: the nodes whose
    budget is spent. ``per_client``: list every client's total (else the
    median), as :func:`privacy_metrics`.
    """
    for reply in replies:
        total = reply.metrics.get(EPSILON_TOTAL_METRIC)
        if isinstance(total, bool) or not isinstance(total, (int, float)):
            continue
        key = reply.metrics.get(CLIENT_KEY_METRIC, node_key(reply.node_id))
        key = int(key) if isinstance(key, (int, float)) else node_key(reply.node_id)
        totals[key] = max(totals.get(key, 0.0), total)
    metrics = privacy_metrics(totals, per_client=per_client)
    if metrics:
        metrics["dp-clients-retired"] = len(retired)
        largest = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
        log(
            INFO,
            "privacy: epsilon spent by %d client(s): max %.4g, mean %.4g; "
            "%d retired (budget spent); largest (client: epsilon): %s",
            metrics["dp-clients-reporting"],
            metrics["dp-epsilon-total-max"],
            metrics["dp-epsilon-total-mean"],
            len(retired),
            ", ".join(f"{key}: {value:.4g}" for key, value in largest),
        )
    return metrics

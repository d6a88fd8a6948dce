"""Privacy of uploads on the Flower side: the Laplace ClientApp mod and the ledger.

Every client that privatises what it uploads reports, in its train metrics,
``dp-epsilon`` (what this upload spent) and ``dp-epsilon-total`` (what the client
has spent so far, by basic composition; kept in its own ``context.state``
because spending is irreversible, even for an upload the server then rejects).
Every strategy of the pack collects the totals into one report per round
(:func:`privacy_metrics`), so the privacy of different strategies compares in
one table.

:class:`LaplaceUploadMod` is the pure-epsilon counterpart of Flower's
``LocalDpMod`` (which adds Gaussian noise): it clips the model update's L1 norm
and adds Laplace noise to the upload of *any* ClientApp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord
from flwr.common.logger import log

from ..ops.privacy import add_laplace_noise, laplace_scale
from .keys import CLIENT_KEY_METRIC
from .records import to_ndarrays
from .rule import node_key
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


def _l1_clip(update: list[np.ndarray], bound: float) -> tuple[list[np.ndarray], float]:
    norm = float(sum(np.abs(u.astype(np.float64)).sum() for u in update))
    factor = min(1.0, bound / norm) if norm > 0 else 1.0
    return [u * factor for u in update], norm


class LaplaceUploadMod:
    r"""ClientApp mod: clip the update's L1 norm to C, add Laplace noise, count epsilon.

    The update :math:`u = w_{sent} - w_{received}` is scaled to L1 norm at most
    :math:`C`; two such updates differ by at most :math:`2C` in L1, whatever the
    data, so adding :math:`\mathrm{Laplace}(2C/\varepsilon)` noise to every
    coordinate makes each upload :math:`\varepsilon`-DP with respect to the
    client's whole dataset. Uploads compose by addition, reported as
    ``dp-epsilon-total``.

    Parameters
    ----------
    clipping_norm : float
        :math:`C > 0`, the L1 bound of the update.
    epsilon : float
        :math:`\varepsilon > 0` spent per upload.
    seed : int | None (default: None)
        Seeds the noise per (seed, node, round) for reproducible runs.

    Raises
    ------
    ValueError
        If ``clipping_norm`` or ``epsilon`` is not a finite number > 0.

    Examples
    --------
    >>> mod = LaplaceUploadMod(clipping_norm=1.0, epsilon=0.5)
    >>> app = to_client_app(client_fn, mods=[mod])
    """

    def __init__(
        self, clipping_norm: float, epsilon: float, *, seed: int | None = None
    ) -> None:
        if not (math.isfinite(clipping_norm) and clipping_norm > 0):
            raise ValueError(f"clipping_norm must be > 0, got {clipping_norm!r}")
        laplace_scale(2 * clipping_norm, epsilon)  # validates epsilon
        self.clipping_norm = float(clipping_norm)
        self.epsilon = float(epsilon)
        self.seed = seed

    def __call__(
        self,
        message: Message,
        context: Context,
        call_next: Callable[[Message, Context], Message],
    ) -> Message:
        """Run the ClientApp, then privatise its train reply."""
        if message.metadata.message_type.split(".")[0] != "train":
            return call_next(message, context)
        received = message.content.array_records.get("arrays")
        reply = call_next(message, context)
        if reply.has_error() or received is None:
            return reply
        sent_record = reply.content.array_records.get("arrays")
        if sent_record is None:
            return reply
        keys = list(sent_record.keys())
        sent = to_ndarrays(sent_record)
        before = to_ndarrays(received)
        update, norm = _l1_clip(
            [s - b for s, b in zip(sent, before, strict=True)], self.clipping_norm
        )
        config = message.content.config_records.get("config")
        round_value = config.get("server-round", 0) if config is not None else 0
        server_round = int(round_value) if isinstance(round_value, int) else 0
        rng = np.random.default_rng(
            None
            if self.seed is None
            else [self.seed, int(context.node_id) % (1 << 31), server_round]
        )
        scale = laplace_scale(2 * self.clipping_norm, self.epsilon)
        noisy = add_laplace_noise(
            [b + u for b, u in zip(before, update, strict=True)], scale, rng
        )
        reply.content["arrays"] = ArrayRecord(
            {
                k: Array(np.asarray(v, dtype=s.dtype))
                for k, v, s in zip(keys, noisy, sent, strict=True)
            }
        )
        total = spend_epsilon(context.state, self.epsilon)
        metrics = next(iter(reply.content.metric_records.values()), None)
        if metrics is None:
            metrics = MetricRecord()
            reply.content["metrics"] = metrics
        metrics[EPSILON_METRIC] = self.epsilon
        metrics[EPSILON_TOTAL_METRIC] = total
        metrics[DELTA_METRIC] = 0.0
        log(
            INFO,
            "LaplaceUploadMod: update L1 norm %.4g clipped to %.4g, Laplace scale "
            "%.4g, epsilon %.4g (total %.4g)",
            norm,
            self.clipping_norm,
            scale,
            self.epsilon,
            total,
        )
        return reply

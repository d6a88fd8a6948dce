"""Privacy of uploads on the Flower side: the ClientApp mods.

It reports what it spends as every private client does (:mod:`..contract.ledger`).
:class:`LaplaceUploadMod` is the pure-epsilon counterpart of Flower's
``LocalDpMod`` (which adds Gaussian noise): it clips the model update's L1 norm
and adds Laplace noise to the upload of *any* ClientApp. :func:`clip_when_asked`
is the client half of central DP with clipping on the clients (:mod:`.central`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import INFO

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp.mod import fixedclipping_mod
from flwr.common.logger import log

from ...ops.privacy import add_laplace_noise, laplace_scale
from ..contract.ledger import (
    DELTA_METRIC,
    EPSILON_METRIC,
    EPSILON_TOTAL_METRIC,
    spend_epsilon,
)
from ..transport.flower import KEY_CLIPPING_NORM
from ..transport.records import to_ndarrays


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


def clip_when_asked(
    message: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    """ClientApp mod: Flower's ``fixedclipping_mod`` when the server asks for it.

    The client-side wrapper puts ``clipping_norm`` in the train config; messages
    without it (every run without central DP) pass through untouched, so one
    ClientApp serves both.
    """
    config = message.content.config_records.get("config")
    if message.metadata.message_type.split(".")[0] == "train" and (
        config is not None and KEY_CLIPPING_NORM in config
    ):
        return fixedclipping_mod(message, context, call_next)
    return call_next(message, context)

"""Shared helpers for building messages and replies by hand."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)

from flwr_prox_strategies.core.inprocess import InProcessGrid


def model_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(4, 3)).astype(np.float32),
        "b": rng.normal(size=(3,)).astype(np.float32),
    }


def record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    rec = ArrayRecord()
    for key, value in arrays.items():
        rec[key] = Array(np.array(value, order="C", copy=None))
    return rec


def unused_app(message: Message, context: Context) -> Message:  # pragma: no cover
    raise AssertionError("this grid only samples; replies are built by hand")


def sampling_grid(num_nodes: int) -> InProcessGrid:
    return InProcessGrid(unused_app, num_nodes=num_nodes)


def reply(
    to: Message,
    arrays: dict[str, np.ndarray] | None,
    num_examples: float | None = 10,
    *,
    extra_records: dict[str, ArrayRecord] | None = None,
    metrics: dict | None = None,
) -> Message:
    content = RecordDict()
    if arrays is not None:
        content["arrays"] = record(arrays)
    for name, rec in (extra_records or {}).items():
        content[name] = rec
    metric_values = dict(metrics or {"train-loss": 1.0})
    if num_examples is not None:
        metric_values["num-examples"] = num_examples
    content["metrics"] = MetricRecord(metric_values)
    return Message(content, reply_to=to)


def error_reply(to: Message, reason: str = "boom") -> Message:
    return Message(Error(code=2, reason=reason), reply_to=to)


def honest_replies(
    messages: list[Message], make: Callable[[int], dict[str, np.ndarray]]
) -> list[Message]:
    """One well-formed reply per message; node i returns make(i)."""
    return [reply(m, make(i), num_examples=10 + i) for i, m in enumerate(messages)]


def configure(strategy, arrays: dict[str, np.ndarray], grid, server_round: int = 1):
    return list(
        strategy.configure_train(server_round, record(arrays), ConfigRecord(), grid)
    )

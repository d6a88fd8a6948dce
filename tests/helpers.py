"""Shared helpers for building messages and replies by hand."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import ConfigRecord, Message

# The conformance kit's builders, under the names the tests have always used.
from flwr_prox_strategies.testing import (
    error_reply,
    model_arrays,
    record,
    reply,
    sampling_grid,
)

__all__ = [
    "configure",
    "error_reply",
    "honest_replies",
    "model_arrays",
    "record",
    "reply",
    "sampling_grid",
]


def honest_replies(
    messages: list[Message], make: Callable[[int], dict[str, np.ndarray]]
) -> list[Message]:
    """One well-formed reply per message; node i returns make(i)."""
    return [reply(m, make(i), num_examples=10 + i) for i, m in enumerate(messages)]


def configure(strategy, arrays: dict[str, np.ndarray], grid, server_round: int = 1):
    return list(
        strategy.configure_train(server_round, record(arrays), ConfigRecord(), grid)
    )

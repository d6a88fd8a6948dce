"""The Message API's two ends for a rule: read a train message, build its reply.

What the server sent (the model, the config, extra ArrayRecords, which round
of this client's it aggregated) is read here; what goes back (the model, the
rule's records, the metrics as Flower's ``MetricRecord`` holds them) is built
here. A message the client cannot work with raises :class:`ProtocolError`,
naming the strategy it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from numpy.typing import NDArray

from ..transport.keys import (
    ACCEPTED_KEYS_KEY,
    ACCEPTED_ROUND_KEY,
    ACCEPTED_ROUNDS_KEY,
    MISSING_MOD_HINT,
    RESET_KEYS_KEY,
    RESET_STATE_KEY,
    SECAGG_RECORD,
    node_key,
)
from ..transport.records import to_ndarrays


class ProtocolError(Exception):
    """The server sent something this client cannot work with.

    Raised by a client or a client rule when the train message lacks what its
    algorithm needs (a config key or an ArrayRecord its strategy sends: is the
    ServerApp running that strategy?), or carries arrays that do not fit the
    model. The message names the strategy needed and what was received.
    :func:`to_client_app` turns it into an error reply with code
    ``MOD_FAILED_PRECONDITION``, so the server logs a failed node with the
    reason instead of averaging in a meaningless model.
    """


def require(config: Mapping[str, Any], key: str, client: str, strategy: str) -> Any:
    """Return ``config[key]`` or raise a ProtocolError naming the strategy needed."""
    if key not in config:
        raise ProtocolError(
            f"{client} needs '{key}' in the train config, which {strategy} sends; "
            f"is the ServerApp running {strategy}? Received keys: {sorted(config)}"
        )
    return config[key]


def accepted_round(config: Mapping[str, Any], client_key: int) -> int | None:
    """Return the last round whose reply was aggregated (None: not said)."""
    if ACCEPTED_ROUND_KEY in config:
        return int(config[ACCEPTED_ROUND_KEY])
    if ACCEPTED_KEYS_KEY in config:
        table = dict(
            zip(config[ACCEPTED_KEYS_KEY], config[ACCEPTED_ROUNDS_KEY], strict=True)
        )
        return int(table.get(client_key, -1))
    return None


def must_reset(config: Mapping[str, Any], client_key: int) -> bool:
    """Return True when the server asks this client to start afresh."""
    if config.get(RESET_STATE_KEY, False):
        return True
    return client_key in list(config.get(RESET_KEYS_KEY, []))


def client_key_of(context: Context | None) -> int:
    """Stable integer id of a client: its partition id, else its node id."""
    if context is None:
        return 0
    partition = context.node_config.get("partition-id")
    if partition is not None:
        return int(partition)
    return node_key(context.node_id)


def server_hint(config: Mapping[str, Any], rule: type, rules: list[type]) -> str:
    """Name the rule to build when ``config`` holds another algorithm's keys.

    Another algorithm's strategy is recognised by its config keys, which start
    like its rule's applied metric ("feddyn-alpha", "feddyn-applied").
    """
    for other in rules:
        metric = getattr(other, "applied_metric", None)
        if metric is None or other is rule:
            continue
        prefix = metric.removesuffix("-applied") + "-"
        if any(str(key).startswith(prefix) for key in config):
            return (
                f". The server runs {getattr(other, 'protocol', '?')} (it sent its "
                f"'{prefix}*' keys): build {other.__name__} in your "
                f"@app.train instead of {rule.__name__}"
            )
    return ""


def _single(records: Mapping[str, Any], kind: str, preferred: str) -> Any:
    if preferred in records:
        return records[preferred]
    if len(records) == 1:
        return next(iter(records.values()))
    raise ProtocolError(
        f"message carries {len(records)} {kind}s, none named '{preferred}'"
    )


@dataclass
class Received:
    """What a train or evaluate message carries, in plain Python."""

    arrays: ArrayRecord  # the model
    config: dict[str, Any]  # the ConfigRecord as a dict
    extra: dict[str, list[NDArray]]  # every other ArrayRecord, name -> arrays


def read_message(message: Message) -> Received:
    """Split a message into the model, its config and the extra ArrayRecords."""
    content = message.content
    if SECAGG_RECORD in content.config_records:
        # Only a ClientApp without the mod lets a protocol message reach here.
        raise ProtocolError(
            "the server runs secure aggregation (SecAggPlus) and this ClientApp "
            f"does not answer it: {MISSING_MOD_HINT}"
        )
    arrays: ArrayRecord = _single(dict(content.array_records), "ArrayRecord", "arrays")
    config: ConfigRecord = (
        _single(dict(content.config_records), "ConfigRecord", "config")
        if content.config_records
        else ConfigRecord()
    )
    return Received(
        arrays=arrays,
        config={str(key): value for key, value in config.items()},
        extra={
            name: to_ndarrays(record)
            for name, record in content.array_records.items()
            if record is not arrays
        },
    )


def metric_record(metrics: Mapping[str, Any]) -> MetricRecord:
    """Return metrics as a ``MetricRecord`` (bools as ints, scalars as numbers)."""
    record = MetricRecord()
    for key, value in metrics.items():
        if isinstance(value, (bool, np.bool_)):
            value = int(value)
        elif isinstance(value, (np.generic, torch.Tensor)):
            value = value.item()  # MetricRecord holds Python numbers
        record[key] = value
    return record


__all__ = [
    "ProtocolError",
    "Received",
    "accepted_round",
    "client_key_of",
    "metric_record",
    "must_reset",
    "read_message",
    "require",
    "server_hint",
]

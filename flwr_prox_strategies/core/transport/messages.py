"""The messages a round sends: one fresh ``RecordDict`` per node.

Flower's ``FedAvg.configure_train`` gives every message one shared
``RecordDict``, so a per-node payload (a straggler's epochs, a client's
accepted round, FedDyn's theta^0 for one node) would reach every node. Here each
node's content is built anew; the model's ``ArrayRecord`` and the records
every node gets are shared, read-only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict


def node_messages(
    node_ids: Iterable[int],
    message_type: str,
    *,
    arrays: tuple[str, ArrayRecord],
    records: Mapping[str, ArrayRecord],
    config: tuple[str, Mapping[str, Any]],
    node_records: Callable[[int], Mapping[str, ArrayRecord]] | None = None,
    node_config: Callable[[int], Mapping[str, Any]] | None = None,
) -> list[Message]:
    """Return one message per node: the model, shared then per-node records, config.

    ``arrays`` and ``config`` are (record name, value); each node's config is
    the shared one updated with ``node_config(node_id)``.
    """
    (arrays_key, model), (config_key, shared) = arrays, config
    messages = []
    for node_id in node_ids:
        node_values = dict(shared)
        if node_config is not None:
            node_values.update(node_config(node_id))
        content = RecordDict(
            {
                arrays_key: model,
                **records,
                **(node_records(node_id) if node_records is not None else {}),
                config_key: ConfigRecord(node_values),
            }
        )
        messages.append(
            Message(content=content, message_type=message_type, dst_node_id=node_id)
        )
    return messages


def payload_bytes(messages: Iterable[Message]) -> int:
    """Return the bytes of the messages' ArrayRecords (Flower's ``count_bytes``)."""
    # Not ``content.array_records``: it builds a new synced dict per message.
    return sum(
        record.count_bytes()
        for message in messages
        for record in message.content.values()
        if isinstance(record, ArrayRecord)
    )

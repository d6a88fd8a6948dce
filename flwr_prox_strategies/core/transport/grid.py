"""A view of a Flower ``Grid`` that shows a strategy only its own group of nodes.

P-FedAvg runs one inner strategy per logical parameter server inside one
ServerApp. Each inner strategy samples through a :class:`GroupGrid`, which
reports only its group's node ids; every other call goes to the real grid, so
messages are created and sent exactly as Flower would. The outer strategy sends
all groups' messages in one ``send_and_receive`` per round. The groups come
from :func:`assign_groups`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from .flower import Run

SERVER_ID_KEY = "server-id"
PARTITION_ID_KEY = "partition-id"


class GroupGrid(Grid):
    """The ``parent`` grid restricted to the node ids in ``group``."""

    def __init__(self, parent: Grid, group: Iterable[int]) -> None:
        self.parent = parent
        self.group = frozenset(int(n) for n in group)

    def set_run(self, run: Run) -> None:  # noqa: D102
        self.parent.set_run(run)

    @property
    def run(self) -> Run:  # noqa: D102
        return self.parent.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # noqa: D102
        # Passed on as given: the view adds nothing to what the parent builds.
        return self.parent.create_message(*args, **kwargs)

    def get_node_ids(self) -> list[int]:
        """Return the connected nodes of this group (sorted)."""
        return sorted(n for n in self.parent.get_node_ids() if n in self.group)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.parent.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.parent.pull_messages(message_ids)

    def send_and_receive(  # noqa: D102
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.parent.send_and_receive(messages, timeout=timeout)


def query_node_configs(grid: Grid, nodes: list[int]) -> dict[int, dict[str, Any]]:
    """Ask ``nodes`` for their ``node_config`` (one Flower ``query`` message each).

    The pack's ClientApps answer it; a node that does not (an error, another
    app) is left out of the result.
    """
    messages = [
        Message(
            content=RecordDict({"config": ConfigRecord({"query": "node-config"})}),
            message_type=MessageType.QUERY,
            dst_node_id=node,
        )
        for node in nodes
    ]
    configs: dict[int, dict[str, Any]] = {}
    for reply in grid.send_and_receive(messages):
        if reply.has_error() or "node-config" not in reply.content.metric_records:
            continue
        configs[reply.metadata.src_node_id] = dict(
            reply.content.metric_records["node-config"]
        )
    return configs


def assign_groups(
    grid: Grid, servers: int, assignment: Mapping[int, int] | None
) -> list[list[int]]:
    """Split the connected nodes into ``servers`` groups, as P-FedAvg assigns them.

    A node goes to ``assignment[partition-id or node id]`` when ``assignment``
    is given, else to its ``server-id``, else to its ``partition-id`` modulo
    ``servers`` (from its ``node_config``, :func:`query_node_configs`); nodes
    that say neither are dealt out by sorted node id (logged: not reproducible
    across runs).

    Raises
    ------
    RuntimeError
        If a node's ``server-id`` is out of range, or a group is left empty.
    """
    nodes = sorted(grid.get_node_ids())
    explicit = assignment is not None and all(n in assignment for n in nodes)
    configs = {} if explicit else query_node_configs(grid, nodes)
    groups: list[list[int]] = [[] for _ in range(servers)]
    unanswered = []
    for node in nodes:
        server = _server_for(node, configs.get(node, {}), servers, assignment)
        if server is None:
            unanswered.append(node)
        else:
            groups[server].append(node)
    if unanswered:
        log(
            WARNING,
            "P-FedAvg: %d node(s) gave no server-id/partition-id; dealt out by "
            "node id (not reproducible across runs)",
            len(unanswered),
        )
        for i, node in enumerate(unanswered):
            groups[i % servers].append(node)
    for server, group in enumerate(groups):
        if not group:
            raise RuntimeError(
                f"P-FedAvg: server {server} has no node; {len(nodes)} nodes for "
                f"{servers} servers"
            )
    log(INFO, "P-FedAvg: group sizes %s", [len(g) for g in groups])
    return groups


def _server_for(
    node: int,
    config: Mapping[str, Any],
    servers: int,
    assignment: Mapping[int, int] | None,
) -> int | None:
    partition = config.get(PARTITION_ID_KEY)
    if assignment is not None:
        for key in (partition, node):
            if key is not None and int(key) in assignment:
                return assignment[int(key)]
        return None
    if SERVER_ID_KEY in config:
        server = int(config[SERVER_ID_KEY])
        if not 0 <= server < servers:
            raise RuntimeError(
                f"node {node} says server-id={server}, but there are {servers} servers"
            )
        return server
    if partition is not None:
        return int(partition) % servers
    return None

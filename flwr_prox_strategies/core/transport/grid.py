"""Views of a Flower ``Grid``: replies handed over as they arrive, a group's nodes.

:class:`PromptGrid` waits for replies by pulling them at a cadence that grows
with the wait, instead of the grid's fixed one.

P-FedAvg runs one inner strategy per logical parameter server inside one
ServerApp. Each inner strategy samples through a :class:`GroupGrid`, which
reports only its group's node ids; every other call goes to the real grid, so
messages are created and sent exactly as Flower would. The outer strategy sends
all groups' messages in one ``send_and_receive`` per round. The groups come
from :func:`assign_groups`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from .flower import Run

if TYPE_CHECKING:  # Flower 1.42's; 1.21 has no NodeInfo (nor Grid.get_nodes)
    from flwr.proto.node_pb2 import NodeInfo  # type: ignore[attr-defined]

#: PromptGrid's shortest wait between two pulls, in seconds.
FIRST_WAIT = 0.005
SERVER_ID_KEY = "server-id"
PARTITION_ID_KEY = "partition-id"


class GridView(Grid):
    """A Flower ``Grid`` that passes every call on to ``parent``.

    The views below subclass it and override only what they change.
    """

    def __init__(self, parent: Grid) -> None:
        self.parent = parent

    def set_run(self, run: Run) -> None:  # noqa: D102
        self.parent.set_run(run)

    @property
    def run(self) -> Run:  # noqa: D102
        return self.parent.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # noqa: D102
        return self.parent.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.parent.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.parent.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.parent.pull_messages(message_ids)

    def send_and_receive(  # noqa: D102
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.parent.send_and_receive(messages, timeout=timeout)


class PromptGrid(GridView):
    """``parent``, with replies handed over as soon as they arrive.

    Flower's grids pull replies at a fixed cadence: every 0.1 s in simulation
    (``InMemoryGrid``), so a round phase whose replies arrive in 50 ms lasts
    0.1 s, and every 3 s in a deployment (the ServerApp's ``HttpGrid``, whose
    SuperNodes poll every 3 s too and set the pace there). This view pushes
    the messages and pulls at once, then again after waits that grow with the
    time waited so far (``share`` of it, at least ``first_wait``), up to
    ``max_wait``: a phase ends at most about ``share`` later than its last
    reply arrives (and ``first_wait``), and a long one pulls as seldom as
    ``max_wait`` allows. Everything else goes to ``parent`` unchanged.

    Parameters
    ----------
    parent : Grid
        The grid the ServerApp received; its ``push_messages`` returns the
        ids the replies' ``reply_to_message_id`` name (as Flower's grids do).
    first_wait : float (default: 0.005)
        The shortest wait between two pulls, in seconds.
    share : float (default: 0.1)
        Each wait as a share of the time waited so far.
    max_wait : float (default: 3.0)
        The longest wait between two pulls (Flower's deployment cadence).
    clock : Callable[[], float] (default: time.monotonic)
        The clock the waits are measured on.
    sleep : Callable[[float], None] (default: time.sleep)
        How a wait is spent.

    Raises
    ------
    ValueError
        If a wait is not > 0, or ``share`` not in (0, 1].
    """

    def __init__(
        self,
        parent: Grid,
        *,
        first_wait: float = FIRST_WAIT,
        share: float = 0.1,
        max_wait: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not first_wait > 0:
            raise ValueError(f"first_wait must be > 0, got {first_wait!r}")
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        if not max_wait >= first_wait:
            raise ValueError(
                f"max_wait must be >= first_wait ({first_wait}), got {max_wait!r}"
            )
        super().__init__(parent)
        self.first_wait, self.share, self.max_wait = first_wait, share, max_wait
        self.clock, self.sleep = clock, sleep
        #: Pulls made by :meth:`send_and_receive` (what the cadence costs).
        self.pulls = 0

    def __getattr__(self, name: str) -> Any:
        # What this view does not change is the parent's (``get_nodes``, a
        # grid's own attributes).
        if name == "parent":  # not set yet (copy, unpickling): not the parent's
            raise AttributeError(name)
        return getattr(self.parent, name)

    def get_nodes(self) -> Iterable[NodeInfo]:  # noqa: D102
        return self.parent.get_nodes()

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages``; return the replies once all arrived or ``timeout`` passed.

        Parameters
        ----------
        messages : Iterable[Message]
            The messages to send.
        timeout : float | None (default: None)
            Seconds to wait for replies (None: until all arrived), as Flower's
            ``Grid.send_and_receive``.

        Returns
        -------
        Iterable[Message]
            The replies that arrived, in the order they were pulled.
        """
        waiting = set(self.parent.push_messages(messages))
        started = self.clock()
        deadline = None if timeout is None else started + timeout
        replies: list[Message] = []
        while waiting:
            arrived = list(self.parent.pull_messages(waiting))
            self.pulls += 1
            replies.extend(arrived)
            waiting.difference_update(m.metadata.reply_to_message_id for m in arrived)
            now = self.clock()
            if not waiting or (deadline is not None and now >= deadline):
                break
            wait = self.share * (now - started)
            wait = min(self.max_wait, max(self.first_wait, wait))
            self.sleep(wait if deadline is None else min(wait, deadline - now))
        return replies


class GroupGrid(GridView):
    """The ``parent`` grid restricted to the node ids in ``group``."""

    def __init__(self, parent: Grid, group: Iterable[int]) -> None:
        super().__init__(parent)
        self.group = frozenset(int(n) for n in group)

    def get_node_ids(self) -> list[int]:
        """Return the connected nodes of this group (sorted)."""
        return sorted(n for n in self.parent.get_node_ids() if n in self.group)


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

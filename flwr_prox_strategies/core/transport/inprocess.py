"""A Grid that runs a ``ClientApp`` in this process, one call per message.

It is the smallest faithful stand-in for Flower's engine: every message goes
through the real ``ClientApp`` (adapter included) with the node's own
``Context``, whose ``state`` persists across rounds, exactly as on a SuperNode.
It serves unit, contract and integration tests, and lets a user step through a
strategy in a debugger. Runs that must prove the engine use ``flwr run``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from .flower import Run, set_task_identity

NodeConfigFn = Callable[[int], dict[str, int | float | str | bool]]


def default_node_config(num_nodes: int) -> NodeConfigFn:
    """Node configs as Flower's simulation gives them: partition-id, num-partitions."""
    return lambda index: {"partition-id": index, "num-partitions": num_nodes}


def node_unavailable_reply(message: Message) -> Message:
    """Return what the SuperLink answers for a node that died: Flower's own reply.

    Built by Flower's ``create_message_error_unavailable_res_message``: an
    error reply (``NODE_UNAVAILABLE``) from the SuperLink's node id (1), whose
    ``reply_to_message_id`` is ``message``'s id (set here if the message was
    never pushed).
    """
    # Flower's SuperLink code, imported here: it takes a second or two.
    from flwr.server.superlink.linkstate.utils import (
        create_message_error_unavailable_res_message,
    )

    if not message.metadata.message_id:
        message.metadata.__dict__["_message_id"] = str(uuid4())
    return create_message_error_unavailable_res_message(
        message.metadata, "node_unavail"
    )


class InProcessGrid(Grid):
    """Deliver messages to a ``ClientApp`` in this process.

    Like Flower's grids, pushing a message sets its ``metadata.message_id``
    (the ``Message`` objects the strategy built carry it afterwards).

    Parameters
    ----------
    client_app : ClientApp | Callable[[Message, Context], Message]
        What each node runs.
    num_nodes : int
        Number of nodes; node ids are ``1001, 1002, ...`` (not 0..n-1, so code
        that confuses node ids with partition ids fails here too).
    node_config : Callable[[int], dict] | None
        Node index -> ``node_config``; Flower simulation's by default.
    run_config : dict | None
        The ``run_config`` every context sees.
    run_id : int
        Run id stamped on the messages.

    Attributes
    ----------
    dead_nodes : set[int]
        Nodes that died: they stay listed (as a node that died mid-round), and
        a message to one is answered as the SuperLink answers it, with
        Flower's own "node unavailable" error reply from the SuperLink's node
        id (1), replying to the message's id.
    """

    def __init__(
        self,
        client_app: ClientApp | Callable[[Message, Context], Message],
        *,
        num_nodes: int,
        node_config: NodeConfigFn | None = None,
        run_config: dict[str, int | float | str | bool] | None = None,
        run_id: int = 1,
    ) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        set_task_identity(run_id)
        self.client_app = client_app
        config_of = node_config or default_node_config(num_nodes)
        self.contexts: dict[int, Context] = {
            1001 + i: Context(
                run_id=run_id,
                node_id=1001 + i,
                node_config=config_of(i),
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i in range(num_nodes)
        }
        self._run = Run.create_empty(run_id)
        self._pending: dict[str, Message] = {}
        self.messages_sent = 0
        self.dead_nodes: set[int] = set()

    def set_run(self, run: Run) -> None:  # noqa: D102
        self._run = run

    @property
    def run(self) -> Run:  # noqa: D102
        return self._run

    def create_message(  # noqa: D102
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content=content,
            message_type=message_type,
            dst_node_id=dst_node_id,
            group_id=group_id,
            ttl=ttl,
        )

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return list(self.contexts)

    def _deliver(self, message: Message) -> Message:
        node_id = message.metadata.dst_node_id
        if node_id not in self.contexts:
            raise ValueError(f"no node {node_id} in this grid")
        # As Flower's InMemoryGrid, on the caller's Message object.
        message.metadata.__dict__["_message_id"] = str(uuid4())
        if node_id in self.dead_nodes:
            return node_unavailable_reply(message)
        self.messages_sent += 1
        try:
            return self.client_app(message, self.contexts[node_id])
        except Exception as err:  # as Flower's engine: an error reply, no crash
            reason = f"{type(err).__name__}: {err}"
            return Message(
                Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                reply_to=message,
            )

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        ids = []
        for message in messages:
            reply = self._deliver(message)
            # The id its reply answers, as Flower's grids return.
            message_id = reply.metadata.reply_to_message_id
            self._pending[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return [self._pending.pop(i) for i in message_ids if i in self._pending]

    def send_and_receive(  # noqa: D102
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return [self._deliver(message) for message in messages]

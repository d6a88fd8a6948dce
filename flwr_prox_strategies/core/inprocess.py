"""A Grid that runs a ``ClientApp`` in this process, one call per message.

It is the smallest faithful stand-in for Flower's engine: every message goes
through the real ``ClientApp`` (adapter included) with the node's own
``Context``, whose ``state`` persists across rounds, exactly as on a SuperNode.
It serves unit, contract and integration tests, and lets a user step through a
strategy in a debugger. Runs that must prove the engine use ``flwr run``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

NodeConfigFn = Callable[[int], dict[str, int | float | str | bool]]


def default_node_config(num_nodes: int) -> NodeConfigFn:
    """Node configs as Flower's simulation gives them: partition-id, num-partitions."""
    return lambda index: {"partition-id": index, "num-partitions": num_nodes}


class InProcessGrid(Grid):
    """Deliver messages to a ``ClientApp`` in this process.

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
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = 0
        TaskIdentity.task_id = 0
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
        self._ids = itertools.count(1)
        self.messages_sent = 0

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
            message_id = str(next(self._ids))
            self._pending[message_id] = self._deliver(message)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return [self._pending.pop(i) for i in message_ids if i in self._pending]

    def send_and_receive(  # noqa: D102
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return [self._deliver(message) for message in messages]

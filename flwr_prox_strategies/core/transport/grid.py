"""A view of a Flower ``Grid`` that shows a strategy only its own group of nodes.

P-FedAvg runs one inner strategy per logical parameter server inside one
ServerApp. Each inner strategy samples through a :class:`GroupGrid`, which
reports only its group's node ids; every other call goes to the real grid, so
messages are created and sent exactly as Flower would. The outer strategy sends
all groups' messages in one ``send_and_receive`` per round.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from .flower import Run


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

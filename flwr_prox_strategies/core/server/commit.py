"""The two-phase commit of client state, seen from the server.

A stateful client (FedDyn, FedDC, SCAFFOLD) saves its new state as *pending*
and keeps it only once the server confirms that its reply was aggregated
(:mod:`.state`). The server's half is here: which round of each client it
last aggregated (sent back each round as ``accepted-round``), which clients it
has seen, which states it retired (lost or stale on the client, still in the
server's sums, so N grows by one), and which clients must start afresh.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping
from logging import ERROR, WARNING
from typing import Any

from flwr.common.logger import log

from ..contract.validation import ReplyRejected, ValidReply
from ..transport.keys import (
    ACCEPTED_KEYS_KEY,
    ACCEPTED_ROUND_KEY,
    ACCEPTED_ROUNDS_KEY,
    CLIENT_KEY_METRIC,
    RESET_KEYS_KEY,
    RESET_STATE_KEY,
    RUN_TAG_KEY,
    STATE_OUTSIDE_COMMIT_METRIC,
    STATE_ROUND_METRIC,
)


def client_key(reply: ValidReply) -> int:
    """Return the client key of a reply (checked to be an int by the strategy)."""
    return int(reply.metrics[CLIENT_KEY_METRIC])  # type: ignore[arg-type]


def saved_outside_commit(reply: ValidReply) -> bool:
    """Return True when the reply's rule saved state outside the two-phase commit."""
    value = reply.metrics.get(STATE_OUTSIDE_COMMIT_METRIC)
    return isinstance(value, (int, float)) and value > 0


def held_state(reply: ValidReply) -> bool:
    """Return True when the reply's client trained from committed state.

    False for a client that held none (new to the run, restarted without a
    ``state_dir``, or asked to start afresh): its state started at zero.
    """
    value = reply.metrics.get(STATE_ROUND_METRIC)
    return isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


class ClientBook:
    """What the server knows of its stateful clients (saved with its state).

    Attributes
    ----------
    accepted : dict[int, int]
        Client key -> the last round one of its replies was aggregated.
    node_keys : dict[int, int]
        Node id -> client key, as identified in this run (not saved).
    client_keys_seen : set[int]
        Every client key whose reply was aggregated.
    retired_states : int
        Client states retired: lost or unusable on the client, still in the
        server's sums.
    reset_keys : set[int]
        Clients asked to start afresh.
    run_tag : str
        Names this run for the clients' saved state (a resume keeps it).
    """

    def __init__(self) -> None:
        self.accepted: dict[int, int] = {}
        self.node_keys: dict[int, int] = {}
        self.client_keys_seen: set[int] = set()
        self.retired_states = 0
        self.reset_keys: set[int] = set()
        self.run_tag = secrets.token_hex(8)
        self._outside_warned = False

    def reset_run(self) -> None:
        """Start a new run's diagnostics (the once-per-run error)."""
        self._outside_warned = False

    def node_config(self, node_id: int) -> dict[str, Any]:
        """Return what a node's train config must carry for its state.

        The run tag, and the last round in which this node's reply was
        aggregated; until the node is identified in this run (e.g. after a
        resume), the whole client-key -> round table.
        """
        key = self.node_keys.get(node_id)
        if key is not None:
            config: dict[str, Any] = {
                RUN_TAG_KEY: self.run_tag,
                ACCEPTED_ROUND_KEY: self.accepted.get(key, -1),
            }
            if key in self.reset_keys:
                config[RESET_STATE_KEY] = True
            return config
        config = {RUN_TAG_KEY: self.run_tag}
        if self.reset_keys:
            config[RESET_KEYS_KEY] = sorted(self.reset_keys)
        if not self.accepted:
            return {**config, ACCEPTED_ROUND_KEY: -1}
        return {
            **config,
            ACCEPTED_KEYS_KEY: list(self.accepted),
            ACCEPTED_ROUNDS_KEY: list(self.accepted.values()),
        }

    def reconcile(
        self,
        server_round: int,
        replies: list[ValidReply],
        *,
        keeps_client_sums: bool,
        accept_lost_state: bool,
        count: Callable[[int, ReplyRejected], None],
        strict: bool = False,
    ) -> tuple[list[ValidReply], int]:
        """Check each client's state against what the server committed.

        A stateful client reports the round its committed state comes from
        (``state-round``); the server knows the last round it aggregated that
        client's reply (:attr:`accepted`). When they differ:

        * the client holds **no** state (a restarted node, no ``state_dir``):
          its last committed state is *retired* (with ``keeps_client_sums``):
          it stays in the server's sums, as an absent client's does, and the
          client goes on as a new client from zero state, so N grows by one.
          Its reply, computed from zero state, is used (unless
          ``accept_lost_state`` is False);
        * the client holds **another** round's or run's state (a stale
          ``state_dir``): its reply is rejected (``count``), its last committed
          state (if any) is retired the same way, and it is asked to start
          afresh (``reset-state``).

        A client whose rule saved its state outside the two-phase commit
        (``state-outside-commit``) reports no committed round although it
        holds state: that is a mistake in its client code, not a lost state.
        One error per run says so; its state is not retired (N does not grow
        from it) and its reply is used, or rejected with ``strict``.

        Returns the usable replies and the number rejected.
        """
        kept: list[ValidReply] = []
        rejected = 0
        outside = [r for r in replies if saved_outside_commit(r)]
        if outside and not self._outside_warned:
            self._outside_warned = True
            log(
                ERROR,
                "aggregate_train: round %d: clients %s save their state outside the "
                "two-phase commit (their rule writes it with ClientState.set, which "
                "commits at once): the server cannot confirm their state and a "
                "rejected reply still changes it. Their client code must save it "
                "with self.state.set_pending(name, arrays, self.server_round); "
                "their replies are %s (N unchanged)",
                server_round,
                sorted(client_key(r) for r in outside),
                "rejected (strict=True)" if strict else "used",
            )
        for reply in replies:
            key = client_key(reply)
            if saved_outside_commit(reply):
                self.node_keys[reply.node_id] = key
                if strict:
                    why = ReplyRejected(
                        "state-outside-commit",
                        f"client {key} saved its state outside set_pending",
                    )
                    count(reply.node_id, why)
                    rejected += 1
                else:
                    kept.append(reply)
                continue
            held_value = reply.metrics.get(STATE_ROUND_METRIC)
            expected = self.accepted.get(key, -1)
            if not isinstance(held_value, (int, float)) or int(held_value) == expected:
                kept.append(reply)
                continue
            held = int(held_value)
            lost = held == -1
            if expected >= 0 and keeps_client_sums:
                self.retired_states += 1
            self.accepted.pop(key, None)
            self.node_keys[reply.node_id] = key
            usable = lost and accept_lost_state
            what = (
                "holds no state"
                if lost
                else f"holds the state of round {held} (a stale copy of its state)"
            )
            log(
                WARNING,
                "aggregate_train: round %d: client %d (node %d) %s, but the server "
                "last committed its round %s: %s%s",
                server_round,
                key,
                reply.node_id,
                what,
                expected if expected >= 0 else "(none)",
                "its committed state stays in the sums as a retired client's and "
                "it goes on as a new client (N + 1); "
                if expected >= 0 and keeps_client_sums
                else "",
                "reply used (computed from zero state)"
                if usable
                else "reply not used; the client is asked to start afresh",
            )
            if usable:
                kept.append(reply)
                continue
            self.reset_keys.add(key)
            if not accept_lost_state:  # e.g. FedDyn's baseline: send theta^0
                self.node_keys.pop(reply.node_id, None)
            why = ReplyRejected(
                "stale-state", f"client {key} state from round {held}, not {expected}"
            )
            count(reply.node_id, why)
            rejected += 1
        return kept, rejected

    def clients_needed(self, replies: list[ValidReply]) -> int:
        """Return the N that covers every client key seen and retired state."""
        keys = {client_key(r) for r in replies}
        return len(self.client_keys_seen | keys) + self.retired_states

    def commit(self, server_round: int, replies: list[ValidReply]) -> None:
        """Record that the replies of ``server_round`` were aggregated."""
        self.client_keys_seen |= {client_key(r) for r in replies}
        for reply in replies:
            key = client_key(reply)
            self.node_keys[reply.node_id] = key
            self.accepted[key] = server_round
            self.reset_keys.discard(key)

    def state_dict(self) -> dict[str, Any]:
        """Return the checkpoint entries (node ids are per run: not saved)."""
        return {
            "accepted": dict(self.accepted),
            "client-keys-seen": sorted(self.client_keys_seen),
            "retired-states": self.retired_states,
            "reset-keys": sorted(self.reset_keys),
            "run-tag": self.run_tag,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.accepted = {int(k): int(v) for k, v in state.get("accepted", {}).items()}
        self.client_keys_seen = {int(k) for k in state.get("client-keys-seen", [])}
        self.retired_states = int(state.get("retired-states", 0))
        self.reset_keys = {int(k) for k in state.get("reset-keys", [])}
        self.run_tag = str(state.get("run-tag", self.run_tag))

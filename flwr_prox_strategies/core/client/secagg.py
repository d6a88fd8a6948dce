"""The client half of SecAgg+: a ClientApp mod that masks what the server sums.

:class:`SecAggPlusMod` answers the protocol's stages and refuses every request that
could let the server rebuild one client's vector, as
``docs/explanation/secure-aggregation.md`` describes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import INFO
from pathlib import Path
from typing import Any, cast

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log

from ..transport import signing
from ..transport.ddp import NODE_MIN_NOISE, DDPRound
from ..transport.secagg import (
    CONSISTENCY_STAGE,
    ROUND_KEY,
    SECAGG_RECORD,
    Key,
    Stage,
    pairwise_seed,
    to_bytes,
)
from ..transport.secagg_node import (
    NODE_KEY_DIRECTORY,
    NODE_MIN_NEIGHBOURHOOD,
    NODE_REQUIRED,
    NODE_SIGNING_KEY,
    STATE_RECORD,
    SecureAggregationRefused,
    Settings,
    State,
    check_order,
    ddp_masked_vector,
    masked_vector,
    only_metrics,
    receive_shares,
    reveal_shares,
    send_shares,
    setup,
    sign_survivors,
)

# The key handling and the stage handlers live in transport/ (the server's
# half imports the same wire); their public names stay importable from here.
__all__ = [
    "NODE_KEY_DIRECTORY",
    "NODE_MIN_NEIGHBOURHOOD",
    "NODE_REQUIRED",
    "NODE_SIGNING_KEY",
    "STATE_RECORD",
    "CallNext",
    "SecAggPlusMod",
    "SecureAggregationRefused",
    "pairwise_seed",
]

CallNext = Callable[[Message, Context], Message]


class SecAggPlusMod:
    """ClientApp mod: the client's part of SecAgg+ for the pack's strategies.

    Add it to your ClientApp beside the rule (``ClientApp(mods=[SecAggPlusMod()])``,
    or in ``@app.train(mods=[...])``); the pack's own ClientApps have it. It
    answers the key-exchange stages itself and, when the server collects,
    masks every record the strategy sums (declared by the server in the
    message), weighted by the reply's weight metric, together with how many
    values it clipped (so the server learns only the round's total). It
    refuses (the reply becomes an error naming the reason, and the client's
    state is not committed) a reply with NaN or inf values, a missing or
    differently shaped record, or a weight not in ``(0, max_weight]``; every
    value is clipped to ``clipping_range`` before it is weighted.

    It also refuses every request that could isolate this client or a peer: a
    repeated or unknown node id in any list, a node both active and dead,
    fewer than ``t`` distinct contributors, a second request of a stage, sets
    that differ from what an earlier stage told it, and a threshold ``t`` at
    most half of its neighbourhood (a server could split its requests so that
    one half of the holders reveals a client's mask seed and the other half its
    key). A refusal ends its part in the round.

    Parameters
    ----------
    required : bool | Callable[[Context], bool] (default: False)
        Refuse a train message outside the protocol, so that no plaintext
        update ever leaves this node (a server that leaves out
        :class:`~flwr_prox_strategies.SecAggPlus` gets an error naming it).
        A callable decides per message. A SuperNode's operator can also set it
        with ``--node-config "secagg-required=true"``; either one is enough.
    allow_weak_threshold : bool (default: False)
        Accept a threshold at most half of the neighbourhood, and
        neighbourhoods below the automatic size. Only for tests and tiny
        federations you trust: a lying server can then rebuild a client's
        update.
    signing_key : str | Path | None (default: None)
        This node's private signing key (OpenSSH or PEM; its SuperNode
        authentication key will do). With it the node runs only in
        active-adversary mode (``SecAggPlus(..., active_adversary=True)``):
        it signs its public keys and the survivor set, and reveals shares
        only after verifying ``t`` signatures of its neighbours on the set it
        signed itself. Node config: ``secagg-signing-key``.
    key_directory : str | Path | None (default: None)
        The public signing keys this node trusts (a folder of ``*.pub`` or
        ``*.pem`` files, or one file with an OpenSSH key per line); required
        with ``signing_key``. Node config: ``secagg-key-directory``.
    min_noise_multiplier : float | None (default: None)
        Require distributed DP (:class:`~flwr_prox_strategies.DistributedDP`)
        at least this strong: the node then refuses a plain SecAgg+ round,
        and a round whose noise, summed over the fewest contributors the
        reconstruction threshold allows, is below this multiple of its own
        L2 sensitivity (computed by the node from the clip, granularity and
        rounding the server asks for). The floor is the node's, so a server
        that asks for less noise gets nothing. Node config:
        ``ddp-min-noise-multiplier``.
    min_neighbourhood : int | None (default: None)
        The fewest nodes (this one included) it shares its secrets with and
        masks against: a round whose declared neighbourhoods, or the one it
        is given at ``share_keys``, are smaller is refused before anything
        secret leaves. Whatever it is, the node also refuses neighbourhoods
        below what ``num_shares="auto"`` gives (at the pack's default
        assumptions) for the nodes the server says it sampled, and a
        threshold at most half of them, unless ``allow_weak_threshold``.
        Node config: ``secagg-min-neighbourhood`` (the larger floor wins).

    Raises
    ------
    ValueError
        A key file that cannot be read, or only one of ``signing_key`` and
        ``key_directory``.
    """

    def __init__(
        self,
        *,
        required: bool | Callable[[Context], bool] = False,
        allow_weak_threshold: bool = False,
        signing_key: str | Path | None = None,
        key_directory: str | Path | None = None,
        min_noise_multiplier: float | None = None,
        min_neighbourhood: int | None = None,
    ) -> None:
        if not (isinstance(required, bool) or callable(required)):
            raise ValueError(f"required must be a bool or a callable, got {required!r}")
        if not isinstance(allow_weak_threshold, bool):
            raise ValueError(
                f"allow_weak_threshold must be a bool, got {allow_weak_threshold!r}"
            )
        self.required = required
        self.allow_weak_threshold = allow_weak_threshold
        self._keys = signing.load_keys(signing_key, key_directory, "signing_key")
        self.min_noise_multiplier = _floor(min_noise_multiplier, "min_noise_multiplier")
        self.min_neighbourhood = _size_floor(min_neighbourhood, "min_neighbourhood")

    def __call__(
        self, message: Message, context: Context, call_next: CallNext
    ) -> Message:
        """Run one stage, or pass the message on when it carries no stage."""
        if message.metadata.message_type.split(".")[0] != "train":
            return call_next(message, context)
        config = message.content.config_records.get(SECAGG_RECORD)
        if config is None:
            if self._required(context):
                raise SecureAggregationRefused(
                    "secure aggregation is required on this node (SecAggPlusMod("
                    "required=...), node config secagg-required, or the run's "
                    "secure_aggregation setting): the server sent a plain train "
                    "message, so no update leaves; wrap the server's strategy in "
                    "SecAggPlus (or secure_aggregation=secaggplus)"
                )
            return call_next(message, context)
        settings = self._settings(context)
        stage = config.get(Key.STAGE)
        node_id = message.metadata.dst_node_id
        state = State.load(context)
        try:
            if stage == Stage.SETUP:
                state = State({})
            else:
                check_order(stage, config, state)
            if stage == Stage.COLLECT_MASKED_VECTORS:
                reply = self._collect(
                    message, context, call_next, config, state, settings
                )
            else:
                answer = _STAGES[cast(str, stage)](config, state, node_id, settings)
                reply = Message(
                    RecordDict({SECAGG_RECORD: ConfigRecord(answer)}),
                    reply_to=message,
                )
        except SecureAggregationRefused:
            # A refusal ends this node's part in the round: nothing more of its
            # secrets can be asked for, under any story.
            State({}).save(context)
            raise
        if reply.has_error():  # it trained and failed: it contributes nothing
            state = State({})
        state["stage"] = stage
        state["round"] = config.get(ROUND_KEY)
        state.save(context)
        return reply

    def _required(self, context: Context) -> bool:
        # Asked only of a plain train message: the node trains next anyway, so
        # a callable may load what it needs (the experiment's config).
        node = context.node_config.get(NODE_REQUIRED)
        if _flag(node, NODE_REQUIRED):
            return True
        return self.required(context) if callable(self.required) else self.required

    def _settings(self, context: Context) -> Settings:
        node = context.node_config
        keys = self._keys
        if keys is None:
            keys = signing.load_keys(
                node.get(NODE_SIGNING_KEY),  # type: ignore[arg-type]
                node.get(NODE_KEY_DIRECTORY),  # type: ignore[arg-type]
                f"node config {NODE_SIGNING_KEY}",
                SecureAggregationRefused,
            )
        floor = self.min_noise_multiplier
        if node.get(NODE_MIN_NOISE) is not None:  # the operator's: the stricter wins
            theirs = _floor(
                node.get(NODE_MIN_NOISE),
                f"node config {NODE_MIN_NOISE}",
                SecureAggregationRefused,
            )
            floor = theirs if floor is None else max(floor, cast(float, theirs))
        size = self.min_neighbourhood
        if node.get(NODE_MIN_NEIGHBOURHOOD) is not None:  # the stricter wins
            theirs = _size_floor(
                node.get(NODE_MIN_NEIGHBOURHOOD),
                f"node config {NODE_MIN_NEIGHBOURHOOD}",
                SecureAggregationRefused,
            )
            size = theirs if size is None else max(size, cast(int, theirs))
        return Settings(
            allow_weak_threshold=self.allow_weak_threshold,
            min_neighbourhood=size,
            signing_key=keys[0] if keys else None,
            directory=keys[1] if keys else frozenset(),
            min_noise_multiplier=floor,
        )

    def _collect(
        self,
        message: Message,
        context: Context,
        call_next: CallNext,
        config: ConfigRecord,
        state: State,
        settings: Settings,
    ) -> Message:
        node_id = message.metadata.dst_node_id
        receive_shares(config, state, node_id)
        try:
            plan = DDPRound.from_config(config)
        except ValueError as err:
            why = f"secure aggregation collect: {err}"
            raise SecureAggregationRefused(why) from err
        if plan is None and settings.min_noise_multiplier is not None:
            raise SecureAggregationRefused(
                "secure aggregation collect: this node requires distributed DP "
                f"(noise multiplier >= {settings.min_noise_multiplier:g}) and the "
                "server asks for a plain sum: refused before training; run the "
                "server's SecAggPlus with distributed_dp=DistributedDP(...)"
            )
        content = RecordDict(
            {k: v for k, v in message.content.items() if k != SECAGG_RECORD}
        )
        sent = dict(content.array_records)
        # The train function sees the message as the strategy built it.
        message.content = content
        reply = call_next(message, context)
        if reply.has_error():
            return reply
        metrics = only_metrics(reply.content)
        if plan is None:
            vector, clipped = masked_vector(
                reply.content.array_records, metrics, config, state, node_id
            )
            what = f"{clipped} clipped"
        else:
            vector, factor = ddp_masked_vector(
                reply.content.array_records, sent, plan, state, node_id, settings
            )
            what = f"distributed DP, clip factor {factor:.3g}"
        out = RecordDict(
            {
                "metrics": metrics,
                SECAGG_RECORD: ConfigRecord({Key.MASKED_PARAMETERS: to_bytes(vector)}),
            }
        )
        log(
            INFO,
            "SecAggPlusMod: node %d sent its masked vector (%d values, %s)",
            node_id,
            vector.size,
            what,
        )
        return Message(out, reply_to=message)


def _floor(
    value: object, name: str, error: type[ValueError] = ValueError
) -> float | None:
    """Return a noise-multiplier floor (None: none); refuse anything not > 0."""
    if value is None:
        return None
    try:
        floor = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        floor = math.nan
    if isinstance(value, bool) or not (math.isfinite(floor) and floor > 0):
        raise error(f"{name} must be a finite number > 0, got {value!r}")
    return floor


def _size_floor(
    value: object, name: str, error: type[ValueError] = ValueError
) -> int | None:
    """Return a neighbourhood floor (None: none); refuse anything not an int >= 1."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # a node config given on the command line
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name} must be an int >= 1, got {value!r}")
    return value


def _flag(value: object, name: str) -> bool:
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise SecureAggregationRefused(
        f"secure aggregation: node config {name}={value!r} is not true or false"
    )


_STAGES: dict[str, Callable[[ConfigRecord, State, int, Settings], dict[str, Any]]] = {
    Stage.SETUP: setup,
    Stage.SHARE_KEYS: send_shares,
    CONSISTENCY_STAGE: sign_survivors,
    Stage.UNMASK: reveal_shares,
}

"""The client half of SecAgg+: a ClientApp mod that masks what the server sums.

:class:`SecAggPlusMod` answers the protocol's stages itself (``setup``:
key pairs; ``share_keys``: Shamir shares of its secrets, encrypted to each
neighbour; ``unmask``: the shares the server asks for) and, at
``collect_masked_vectors``, lets the ClientApp train, then replaces every
ArrayRecord of the reply by one masked integer vector. A message without the
protocol's record passes through untouched, so one ClientApp serves runs with
and without secure aggregation.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable, Mapping
from logging import INFO
from typing import Any, cast

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from numpy.typing import NDArray

from ..transport.flower import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)
from ..transport.secagg import (
    CLIPPED_METRIC,
    COMMITMENT_KEY,
    ROUND_KEY,
    SECAGG_RECORD,
    WEIGHT_KEY,
    Key,
    Layout,
    Quantizer,
    Stage,
    add_mask,
    commitment,
    pairwise_sign,
    reduce,
    to_bytes,
)

STATE_RECORD = "secagg-plus-state"
_NEXT = {
    Stage.SHARE_KEYS: Stage.SETUP,
    Stage.COLLECT_MASKED_VECTORS: Stage.SHARE_KEYS,
    Stage.UNMASK: Stage.COLLECT_MASKED_VECTORS,
}

CallNext = Callable[[Message, Context], Message]


class SecureAggregationRefused(ValueError):
    """The client mod will not mask this reply (or answer this stage): why."""


def pairwise_seed(own_sk1: bytes, their_pk1: bytes) -> bytes:
    """Return the seed of the mask two nodes share (ECDH, then HKDF: Flower's)."""
    key = generate_shared_key(
        bytes_to_private_key(own_sk1), bytes_to_public_key(their_pk1)
    )
    return base64.urlsafe_b64decode(key)


class SecAggPlusMod:
    """ClientApp mod: the client's part of SecAgg+ for the pack's strategies.

    Add it to your ClientApp beside the rule (``ClientApp(mods=[SecAggPlusMod()])``,
    or in ``@app.train(mods=[...])``); the pack's own ClientApps have it. It
    answers the key-exchange stages itself and, when the server collects,
    masks every record the strategy sums (declared by the server in the
    message), weighted by the reply's weight metric. It refuses (the reply
    becomes an error naming the reason, and the client's state is not
    committed) a reply with NaN or inf values, a missing or differently shaped
    record, or a weight not in ``(0, max_weight]``; values beyond
    ``clipping_range`` are clipped and counted in the reply's
    ``secagg-clipped`` metric. Messages without the protocol's record pass
    through untouched.

    Parameters
    ----------
    None
    """

    def __call__(
        self, message: Message, context: Context, call_next: CallNext
    ) -> Message:
        """Run one stage, or pass the message on when it carries no stage."""
        if message.metadata.message_type.split(".")[0] != "train":
            return call_next(message, context)
        config = message.content.config_records.get(SECAGG_RECORD)
        if config is None:
            return call_next(message, context)
        stage = config.get(Key.STAGE)
        node_id = message.metadata.dst_node_id
        state = _State.load(context)
        if stage == Stage.SETUP:
            state = _State({})
        elif stage in _NEXT:
            if state.get("stage") != _NEXT[stage] or state.get("round") != config.get(
                ROUND_KEY
            ):
                raise SecureAggregationRefused(
                    f"secure aggregation: stage {stage!r} of round "
                    f"{config.get(ROUND_KEY)!r} after {state.get('stage')!r} of round "
                    f"{state.get('round')}: out of order, refused"
                )
        else:
            raise SecureAggregationRefused(
                f"secure aggregation: unknown stage {stage!r}"
            )
        if stage == Stage.COLLECT_MASKED_VECTORS:
            reply = self._collect(message, context, call_next, config, state, node_id)
        else:
            answer = {
                Stage.SETUP: _setup,
                Stage.SHARE_KEYS: _share_keys,
                Stage.UNMASK: _unmask,
            }[cast(str, stage)](config, state, node_id)
            reply = Message(
                RecordDict({SECAGG_RECORD: ConfigRecord(answer)}), reply_to=message
            )
        state["stage"] = stage
        state["round"] = config.get(ROUND_KEY)
        state.save(context)
        return reply

    def _collect(
        self,
        message: Message,
        context: Context,
        call_next: CallNext,
        config: ConfigRecord,
        state: _State,
        node_id: int,
    ) -> Message:
        _receive_shares(config, state, node_id)
        content = RecordDict(
            {k: v for k, v in message.content.items() if k != SECAGG_RECORD}
        )
        # The train function sees the message as the strategy built it.
        message.content = content
        reply = call_next(message, context)
        if reply.has_error():
            return reply
        metrics = _only_metrics(reply.content)
        vector, clipped = _masked_vector(
            reply.content.array_records, metrics, config, state, node_id
        )
        metrics[CLIPPED_METRIC] = clipped
        out = RecordDict(
            {
                "metrics": metrics,
                SECAGG_RECORD: ConfigRecord({Key.MASKED_PARAMETERS: to_bytes(vector)}),
            }
        )
        log(
            INFO,
            "SecAggPlusMod: node %d sent its masked vector (%d values, %d clipped)",
            node_id,
            vector.size,
            clipped,
        )
        return Message(out, reply_to=message)


class _State(dict[str, Any]):
    """The mod's state between stages, kept in ``context.state``."""

    @classmethod
    def load(cls, context: Context) -> _State:
        record = context.state.config_records.get(STATE_RECORD)
        return cls(dict(record) if record is not None else {})

    def save(self, context: Context) -> None:
        context.state.config_records[STATE_RECORD] = ConfigRecord(dict(self))


def _setup(config: ConfigRecord, state: _State, node_id: int) -> dict[str, Any]:
    for key, kind in (
        (Key.SHARE_NUMBER, int),
        (Key.THRESHOLD, int),
        (Key.CLIPPING_RANGE, float),
        (Key.TARGET_RANGE, int),
        (Key.MOD_RANGE, int),
        (Key.MAX_WEIGHT, float),
    ):
        if type(config.get(key)) is not kind:
            raise SecureAggregationRefused(
                f"secure aggregation setup: {key!r} missing or not {kind.__name__}"
            )
        state[key] = config[key]
    sk1, pk1 = generate_key_pairs()
    sk2, pk2 = generate_key_pairs()
    state["sk1"], state["pk1"] = private_key_to_bytes(sk1), public_key_to_bytes(pk1)
    state["sk2"], state["pk2"] = private_key_to_bytes(sk2), public_key_to_bytes(pk2)
    return {Key.PUBLIC_KEY_1: state["pk1"], Key.PUBLIC_KEY_2: state["pk2"]}


def _share_keys(config: ConfigRecord, state: _State, node_id: int) -> dict[str, Any]:
    keys: dict[int, tuple[bytes, bytes]] = {}
    for name, value in config.items():
        if name in (Key.STAGE, ROUND_KEY):
            continue
        if not (
            name.isdigit()
            and isinstance(value, list)
            and len(value) == 2
            and all(isinstance(v, bytes) for v in value)
        ):
            raise SecureAggregationRefused(
                f"secure aggregation share_keys: malformed entry {name!r}"
            )
        keys[int(name)] = (cast(bytes, value[0]), cast(bytes, value[1]))
    if keys.get(node_id) != (state["pk1"], state["pk2"]):
        raise SecureAggregationRefused(
            "secure aggregation share_keys: this node's own public keys are not "
            "among those forwarded (refused: the server may be impersonating it)"
        )
    every = [k for pair in keys.values() for k in pair]
    if len(set(every)) != len(every):
        raise SecureAggregationRefused(
            "secure aggregation share_keys: two neighbours have the same public key"
        )
    threshold = state[Key.THRESHOLD]
    if len(keys) < threshold:
        raise SecureAggregationRefused(
            f"secure aggregation share_keys: {len(keys)} neighbours, fewer than the "
            f"threshold {threshold}"
        )
    seed = os.urandom(32)
    order = sorted(keys)
    secrets: dict[int, bytes] = {}
    seed_shares = create_shares(seed, threshold, len(order))
    sk1_shares = create_shares(state["sk1"], threshold, len(order))
    dsts, ciphertexts = [], []
    for index, other in enumerate(order):
        if other == node_id:
            state["own-seed-share"] = seed_shares[index]
            state["own-sk1-share"] = sk1_shares[index]
            continue
        secret = generate_shared_key(
            bytes_to_private_key(state["sk2"]), bytes_to_public_key(keys[other][1])
        )
        secrets[other] = secret
        plaintext = share_keys_plaintext_concat(
            node_id, other, seed_shares[index], sk1_shares[index]
        )
        dsts.append(other)
        ciphertexts.append(encrypt(secret, plaintext))
    state["seed"] = seed
    state["nids"] = order
    # Each neighbour's two shared secrets, agreed once: the key its shares are
    # encrypted with (from the second key pairs) and its mask seed (the first).
    state["share-keys"] = [secrets.get(n, b"") for n in order]
    state["mask-seeds"] = [
        b"" if n == node_id else pairwise_seed(state["sk1"], keys[n][0]) for n in order
    ]
    return {
        Key.DESTINATION_LIST: dsts,
        Key.CIPHERTEXT_LIST: ciphertexts,
        COMMITMENT_KEY: commitment(seed),
    }


def _receive_shares(config: ConfigRecord, state: _State, node_id: int) -> None:
    srcs, ciphertexts = config.get(Key.SOURCE_LIST), config.get(Key.CIPHERTEXT_LIST)
    if not (
        isinstance(srcs, list)
        and isinstance(ciphertexts, list)
        and len(srcs) == len(ciphertexts)
    ):
        raise SecureAggregationRefused(
            "secure aggregation collect: malformed forwarded shares"
        )
    share_keys = dict(zip(state["nids"], state["share-keys"], strict=True))
    owners, seed_shares, sk1_shares = (
        [node_id],
        [state["own-seed-share"]],
        [state["own-sk1-share"]],
    )
    for src, ciphertext in zip(srcs, ciphertexts, strict=True):
        if src not in share_keys or src == node_id:
            raise SecureAggregationRefused(
                f"secure aggregation collect: a share from node {src}, not a neighbour"
            )
        actual_src, dst, seed_share, sk1_share = share_keys_plaintext_separate(
            decrypt(share_keys[src], cast(bytes, ciphertext))
        )
        if (actual_src, dst) != (src, node_id):
            raise SecureAggregationRefused(
                f"secure aggregation collect: a share from {actual_src} to {dst} "
                f"forwarded as from {src} to {node_id}"
            )
        owners.append(cast(int, src))
        seed_shares.append(seed_share)
        sk1_shares.append(sk1_share)
    if len(owners) < state[Key.THRESHOLD]:
        raise SecureAggregationRefused(
            f"secure aggregation collect: {len(owners)} nodes in the neighbourhood "
            f"left, fewer than the threshold {state[Key.THRESHOLD]}"
        )
    state["share-owners"] = owners
    state["seed-shares"] = seed_shares
    state["sk1-shares"] = sk1_shares


def _masked_vector(
    records: Mapping[str, ArrayRecord],
    metrics: MetricRecord,
    config: ConfigRecord,
    state: _State,
    node_id: int,
) -> tuple[NDArray[np.uint32], int]:
    """Return the reply's masked vector and how many values were clipped."""
    try:
        layout = Layout.from_config(config)
    except ValueError as err:
        raise SecureAggregationRefused(f"secure aggregation collect: {err}") from err
    quantizer = Quantizer(
        state[Key.CLIPPING_RANGE], state[Key.TARGET_RANGE], state[Key.MOD_RANGE]
    )
    weight_key = config.get(WEIGHT_KEY)
    max_weight = float(state[Key.MAX_WEIGHT])
    if weight_key:
        weight = metrics.get(cast(str, weight_key))
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not 0 < weight <= max_weight
        ):
            raise SecureAggregationRefused(
                f"secure aggregation refused to mask the reply: its weight "
                f"{weight_key!r} = {weight!r} is not in "
                f"(0, max_weight={max_weight:g}] "
                "(raise max_weight on the server's SecAggPlus)"
            )
        code = quantizer.weight_code(float(weight), max_weight)
    else:
        code = quantizer.quantization_range  # uniform: every r is 1
    ratio = code / quantizer.quantization_range
    rng = np.random.default_rng()
    parts: list[NDArray[np.int64]] = [np.array([code], dtype=np.int64)]
    clipped = 0
    for name, kind, size, keys in zip(
        layout.records, layout.kinds, layout.sizes, layout.keys, strict=True
    ):
        if name not in records or set(records[name]) != set(keys):
            found = sorted(records[name]) if name in records else sorted(records)
            raise SecureAggregationRefused(
                f"secure aggregation refused to mask the reply: record {name!r} "
                f"missing or with other keys ({found}; expected {list(keys)})"
            )
        flat = [records[name][k].numpy().astype(np.float64).ravel() for k in keys]
        values = np.concatenate(flat) if flat else np.zeros(0)
        if values.size != size:
            raise SecureAggregationRefused(
                f"secure aggregation refused to mask the reply: record {name!r} "
                f"holds {values.size} values, the server's layout {size}"
            )
        if not np.isfinite(values).all():
            raise SecureAggregationRefused(
                f"secure aggregation refused to mask the reply: record {name!r} "
                f"holds {int((~np.isfinite(values)).sum())} NaN or inf values"
            )
        if kind == "mean":
            values = values * ratio
        clipped += int((np.abs(values) > quantizer.clipping_range).sum())
        parts.append(quantizer.encode(values, rng))
    vector = np.concatenate(parts).astype(np.uint32)
    add_mask(vector, state["seed"], 1)
    seeds = dict(zip(state["nids"], state["mask-seeds"], strict=True))
    for other in state["share-owners"]:
        if other != node_id:
            add_mask(vector, seeds[other], pairwise_sign(node_id, other))
    return reduce(vector, quantizer.modulus_range), clipped


def _only_metrics(content: RecordDict) -> MetricRecord:
    records = list(content.metric_records.values())
    if len(records) != 1:
        raise SecureAggregationRefused(
            f"secure aggregation: the reply has {len(records)} MetricRecords, "
            "expected exactly one"
        )
    return MetricRecord(dict(records[0]))


def _unmask(config: ConfigRecord, state: _State, node_id: int) -> dict[str, Any]:
    active, dead = (
        config.get(Key.ACTIVE_NODE_ID_LIST),
        config.get(Key.DEAD_NODE_ID_LIST),
    )
    if not (isinstance(active, list) and isinstance(dead, list)):
        raise SecureAggregationRefused(
            "secure aggregation unmask: malformed node lists"
        )
    if set(active) & set(dead):
        raise SecureAggregationRefused(
            "secure aggregation unmask: the server asked for both shares of nodes "
            f"{sorted(cast(set[int], set(active) & set(dead)))} (that would reveal "
            "their vectors): "
            "refused"
        )
    owners = state["share-owners"]
    index = {owner: i for i, owner in enumerate(owners)}
    if unknown := [n for n in [*active, *dead] if n not in index]:
        raise SecureAggregationRefused(
            f"secure aggregation unmask: no shares of nodes {unknown}"
        )
    if len(active) < state[Key.THRESHOLD]:
        raise SecureAggregationRefused(
            f"secure aggregation unmask: {len(active)} contributors among the "
            f"neighbours, fewer than the threshold {state[Key.THRESHOLD]}: refused"
        )
    shares = [state["seed-shares"][index[n]] for n in active] + [
        state["sk1-shares"][index[n]] for n in dead
    ]
    return {Key.NODE_ID_LIST: [*active, *dead], Key.SHARE_LIST: shares}

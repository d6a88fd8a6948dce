"""The node's SecAgg+ masked vector, and the shares it reveals to unmask a round.

The handlers of :class:`~flwr_prox_strategies.SecAggPlusMod` for what follows
the key exchange: ``collect_masked_vectors`` (every record the server sums,
clipped, quantised and masked into one integer vector), in active-adversary
mode ``consistency-check`` (its signature on the survivor set) and
``unmask`` (the shares the server asks for, never both of one node).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from numpy.typing import NDArray

from . import signing
from .secagg import (
    ROUND_KEY,
    SIGNATURE_KEY,
    SIGNERS_KEY,
    SURVIVORS_KEY,
    WEIGHT_KEY,
    Key,
    Layout,
    Quantizer,
    add_mask,
    pairwise_sign,
    reduce,
)
from .secagg_shares import SecureAggregationRefused, Settings, State, node_ids, refuse


def sign_survivors(
    config: ConfigRecord, state: State, node_id: int, settings: Settings
) -> dict[str, Any]:
    """Sign the survivor set the server announces (once a round)."""
    stage = "consistency-check"
    survivors = node_ids(stage, config.get(SURVIVORS_KEY), "the survivors")
    if node_id not in survivors:
        raise refuse(stage, "this node sent its masked vector and is not a survivor")
    threshold = state[Key.THRESHOLD]
    alive = set(survivors) & set(state["share-owners"])
    if len(alive) < threshold:
        raise refuse(
            stage,
            f"{len(alive)} of this node's neighbours survive, fewer than the "
            f"threshold {threshold}",
        )
    state["survivors"] = sorted(survivors)
    assert settings.signing_key is not None
    signature = signing.sign(
        settings.signing_key,
        signing.SURVIVORS_CONTEXT,
        signing.survivors_statement(
            cast(int, config.get(ROUND_KEY)), state["pk1"], state["survivors"]
        ),
    )
    return {SIGNATURE_KEY: signature}


def reveal_shares(
    config: ConfigRecord, state: State, node_id: int, settings: Settings
) -> dict[str, Any]:
    """Return the shares the server asks for: seeds of the active, keys of the dead."""
    stage = "unmask"
    active = node_ids(stage, config.get(Key.ACTIVE_NODE_ID_LIST), "the active nodes")
    dead = node_ids(stage, config.get(Key.DEAD_NODE_ID_LIST), "the dead nodes")
    if both := sorted(set(active) & set(dead)):
        raise refuse(
            stage,
            f"the server asked for both shares of nodes {both} (that would reveal "
            "their vectors)",
        )
    owners = state["share-owners"]
    index = {owner: i for i, owner in enumerate(owners)}
    if unknown := [n for n in [*active, *dead] if n not in index]:
        raise refuse(stage, f"no shares of nodes {unknown}")
    if node_id not in active:
        raise refuse(
            stage, "this node sent its masked vector and is not among the active nodes"
        )
    if missing := sorted(set(owners) - set(active) - set(dead)):
        raise refuse(
            stage,
            f"nodes {missing} whose shares this node holds are neither active nor "
            "dead (the sets differ from those of the collect stage)",
        )
    threshold = state[Key.THRESHOLD]
    if len(active) < threshold:
        raise refuse(
            stage,
            f"{len(active)} distinct contributors among the neighbours, fewer than "
            f"the threshold {threshold}",
        )
    if state.get("active"):
        _check_survivors(config, state, active, threshold)
    shares = [state["seed-shares"][index[n]] for n in active] + [
        state["sk1-shares"][index[n]] for n in dead
    ]
    return {Key.NODE_ID_LIST: [*active, *dead], Key.SHARE_LIST: shares}


def _check_survivors(
    config: ConfigRecord, state: State, active: list[int], threshold: int
) -> None:
    """Refuse an unmask request that does not match the survivor set signed.

    Active-adversary mode: the active nodes must be this node's neighbours in
    the set it signed, and ``t`` of them must have signed the same set.
    """
    stage = "unmask"
    survivors = set(state["survivors"])
    if set(active) != set(state["share-owners"]) & survivors:
        raise refuse(
            stage,
            "the active nodes differ from the survivor set this node signed (the "
            "server tells clients different stories)",
        )
    signers = node_ids(stage, config.get(SIGNERS_KEY), "the signers")
    signatures = config.get(SIGNATURE_KEY)
    if not (isinstance(signatures, list) and len(signatures) == len(signers)):
        raise refuse(stage, "malformed signatures of the survivor set")
    known = dict(zip(state["nids"], state["signing-keys"], strict=True))
    pk1_of = dict(zip(state["nids"], state["pk1s"], strict=True))
    server_round = cast(int, config.get(ROUND_KEY))
    valid = {
        signer
        for signer, signature in zip(signers, signatures, strict=True)
        if signer in known
        and signer in survivors
        and signing.verify(
            known[signer],
            signature,
            signing.SURVIVORS_CONTEXT,
            signing.survivors_statement(
                server_round, pk1_of[signer], state["survivors"]
            ),
        )
    }
    if len(valid) < threshold:
        raise refuse(
            stage,
            f"{len(valid)} of this node's neighbours signed the survivor set it "
            f"signed, fewer than the threshold {threshold} (the server tells "
            "clients different stories, or forged signatures)",
        )


def masked_vector(
    records: Mapping[str, ArrayRecord],
    metrics: MetricRecord,
    config: ConfigRecord,
    state: State,
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
            raise _not_masked(
                f"its weight {weight_key!r} = {weight!r} is not in "
                f"(0, max_weight={max_weight:g}] "
                "(raise max_weight on the server's SecAggPlus)"
            )
        code = quantizer.weight_code(float(weight), max_weight)
    else:
        code = quantizer.quantization_range  # uniform: every r is 1
    rng = np.random.default_rng()
    parts: list[NDArray[np.int64]] = []
    clipped = 0
    for name, kind, size, keys in zip(
        layout.records, layout.kinds, layout.sizes, layout.keys, strict=True
    ):
        if name not in records or set(records[name]) != set(keys):
            found = sorted(records[name]) if name in records else sorted(records)
            raise _not_masked(
                f"record {name!r} missing or with other keys ({found}; expected "
                f"{list(keys)})"
            )
        flat = [records[name][k].numpy().astype(np.float64).ravel() for k in keys]
        values = np.concatenate(flat) if flat else np.zeros(0)
        if values.size != size:
            raise _not_masked(
                f"record {name!r} holds {values.size} values, the server's layout "
                f"{size}"
            )
        if not np.isfinite(values).all():
            bad = int((~np.isfinite(values)).sum())
            raise _not_masked(f"record {name!r} holds {bad} NaN or inf values")
        clipped += int((np.abs(values) > quantizer.clipping_range).sum())
        parts.append(quantizer.encode(values, rng, code if kind == "mean" else None))
    # The clipped count travels masked: capped at T, the round's sum cannot wrap.
    header = np.array([code, min(clipped, quantizer.quantization_range)], np.int64)
    vector = np.concatenate([header, *parts]).astype(np.uint32)
    add_mask(vector, state["seed"], 1)
    seeds = dict(zip(state["nids"], state["mask-seeds"], strict=True))
    for other in state["share-owners"]:
        if other != node_id:
            add_mask(vector, seeds[other], pairwise_sign(node_id, other))
    return reduce(vector, quantizer.modulus_range), clipped


def _not_masked(why: str) -> SecureAggregationRefused:
    return SecureAggregationRefused(
        f"secure aggregation refused to mask the reply: {why}"
    )


def only_metrics(content: RecordDict) -> MetricRecord:
    """Return the reply's one MetricRecord (it travels in the clear, as metrics)."""
    records = list(content.metric_records.values())
    if len(records) != 1:
        raise SecureAggregationRefused(
            f"secure aggregation: the reply has {len(records)} MetricRecords, "
            "expected exactly one"
        )
    return MetricRecord(dict(records[0]))

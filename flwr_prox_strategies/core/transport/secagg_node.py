"""The node's side of SecAgg+: its answer to each stage, or its refusal.

The handlers :class:`~flwr_prox_strategies.SecAggPlusMod` runs: ``setup`` (two
key pairs, signed in active-adversary mode), ``share_keys`` (Shamir shares of
its mask seed and first private key, encrypted to each neighbour), the shares
it receives and its masked vector at ``collect_masked_vectors``,
``consistency-check`` (its signature on the survivor set) and ``unmask`` (the
shares the server asks for, never both of one node). Every request that could
let the server rebuild one client's vector is refused with the rule it breaks.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)
from numpy.typing import NDArray

from ...ops.privacy.neighbourhoods import neighbourhood_size
from . import agreement, shamir, signing
from .ddp import NODE_MIN_NOISE, DDPRound, encode_records, noise_multiplier_at
from .secagg import (
    ACTIVE_KEY,
    COMMITMENT_KEY,
    CONSISTENCY_STAGE,
    HEADER,
    ROUND_KEY,
    SIGNATURE_KEY,
    SIGNERS_KEY,
    SIGNING_KEY_KEY,
    SURVIVORS_KEY,
    WEIGHT_KEY,
    Key,
    Layout,
    Quantizer,
    Stage,
    add_masks,
    commitment,
    pairwise_seeds,
    pairwise_sign,
)

STATE_RECORD = "secagg-plus-state"
#: Node-config keys a SuperNode's operator sets (``flower-supernode
#: --node-config "secagg-required=true ..."``): the server cannot change them.
NODE_REQUIRED = "secagg-required"
NODE_SIGNING_KEY = "secagg-signing-key"
NODE_KEY_DIRECTORY = "secagg-key-directory"
NODE_MIN_NEIGHBOURHOOD = "secagg-min-neighbourhood"

#: Each stage and the one it must follow (active-adversary mode signs between).
_AFTER = {
    Stage.SHARE_KEYS: Stage.SETUP,
    Stage.COLLECT_MASKED_VECTORS: Stage.SHARE_KEYS,
    CONSISTENCY_STAGE: Stage.COLLECT_MASKED_VECTORS,
}


class SecureAggregationRefused(ValueError):
    """The client mod will not mask this reply (or answer this stage): why."""


@dataclass(frozen=True)
class Settings:
    """What this node insists on in a round: the mod's arguments, its node config."""

    allow_weak_threshold: bool
    signing_key: signing.SigningKey | None = None
    directory: frozenset[bytes] = frozenset()
    #: Distributed DP's floor: the least noise multiplier this node masks at
    #: (None: it accepts plain SecAgg+ rounds).
    min_noise_multiplier: float | None = None
    #: The fewest members (itself included) this node shares its secrets with
    #: (None: only the automatic size's floor).
    min_neighbourhood: int | None = None

    @property
    def signs(self) -> bool:
        """Whether this node has a signing key (it runs active-adversary mode only)."""
        return self.signing_key is not None


class State(dict[str, Any]):
    """The mod's state between stages, kept in ``context.state``."""

    @classmethod
    def load(cls, context: Context) -> State:
        """Return the state the node's last stage saved (empty: none)."""
        record = context.state.config_records.get(STATE_RECORD)
        return cls(dict(record) if record is not None else {})

    def save(self, context: Context) -> None:
        """Keep the state in ``context.state`` for the next stage."""
        context.state.config_records[STATE_RECORD] = ConfigRecord(dict(self))


def refuse(stage: str, why: str) -> SecureAggregationRefused:
    """Return the refusal of ``stage``, naming the rule the request breaks."""
    return SecureAggregationRefused(f"secure aggregation {stage}: {why}: refused")


def check_order(stage: object, config: ConfigRecord, state: State) -> None:
    """Refuse a stage that does not follow the one this node answered last."""
    if stage == CONSISTENCY_STAGE and not state.get("active"):
        raise refuse(str(stage), "asked outside active-adversary mode")
    if stage == Stage.UNMASK:
        expected = (
            CONSISTENCY_STAGE if state.get("active") else _AFTER[CONSISTENCY_STAGE]
        )
    elif stage in _AFTER:
        expected = _AFTER[cast(str, stage)]
    else:
        raise SecureAggregationRefused(f"secure aggregation: unknown stage {stage!r}")
    if state.get("stage") != expected or state.get("round") != config.get(ROUND_KEY):
        raise SecureAggregationRefused(
            f"secure aggregation: stage {stage!r} of round "
            f"{config.get(ROUND_KEY)!r} after {state.get('stage')!r} of round "
            f"{state.get('round')} (it must follow {expected!r} of the same round, "
            "once): out of order, refused"
        )


def node_ids(stage: str, value: object, what: str) -> list[int]:
    """Return ``value`` as distinct node ids; refuse anything else."""
    if not (
        isinstance(value, list)
        and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
    ):
        raise refuse(stage, f"{what} is not a list of node ids")
    ids = cast(list[int], value)
    if len(set(ids)) != len(ids):
        repeated = sorted({n for n in ids if ids.count(n) > 1})
        raise refuse(stage, f"node ids {repeated} repeated in {what}")
    return ids


def setup(
    config: ConfigRecord, state: State, node_id: int, settings: Settings
) -> dict[str, Any]:
    """Check the round's settings; return two new public keys (signed if active)."""
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
    if state[Key.THRESHOLD] < 1:
        raise refuse("setup", f"threshold {state[Key.THRESHOLD]} below 1")
    check_neighbourhood(config, state, settings)
    active = config.get(ACTIVE_KEY, False)
    if not isinstance(active, bool):
        raise refuse("setup", f"{ACTIVE_KEY!r} = {active!r} is not a bool")
    if settings.signs and not active:
        raise refuse(
            "setup",
            "this node signs its keys and the survivor set (a signing key is set) "
            "and the server did not ask for the consistency check; the server must "
            "run SecAggPlus(..., active_adversary=True)",
        )
    if active and not settings.signs:
        raise refuse(
            "setup",
            "the server asks for active-adversary mode and this node has no signing "
            f"key: give SecAggPlusMod(signing_key=..., key_directory=...) or node "
            f"config {NODE_SIGNING_KEY} and {NODE_KEY_DIRECTORY}",
        )
    state["active"] = active
    state["sk1"], state["pk1"] = agreement.generate_key_pair()
    state["sk2"], state["pk2"] = agreement.generate_key_pair()
    answer: dict[str, Any] = {
        Key.PUBLIC_KEY_1: state["pk1"],
        Key.PUBLIC_KEY_2: state["pk2"],
    }
    if active:
        assert settings.signing_key is not None
        answer[SIGNATURE_KEY] = signing.sign(
            settings.signing_key,
            signing.KEYS_CONTEXT,
            signing.keys_statement(
                cast(int, config.get(ROUND_KEY)), node_id, state["pk1"], state["pk2"]
            ),
        )
        answer[SIGNING_KEY_KEY] = signing.public_of(settings.signing_key)
    return answer


def check_neighbourhood(config: ConfigRecord, state: State, settings: Settings) -> None:
    """Refuse a round whose neighbourhoods are too small to hide this node.

    The server picks the neighbourhoods: a lying one could fill a node's
    with its colluders. Before any secret leaves, the node asks for at least
    what ``num_shares="auto"`` gives (at the pack's default assumptions) for
    the nodes the server declares, and at least its own floor
    (``min_neighbourhood``); at ``share_keys`` the threshold ``t > k/2``
    then keeps the neighbourhood it is given above half of that (and no
    larger than declared).
    """
    sampled, size = config.get(Key.SAMPLE_NUMBER), state[Key.SHARE_NUMBER]
    threshold = state[Key.THRESHOLD]
    if type(sampled) is not int or not 1 <= size <= sampled:
        raise refuse(
            "setup",
            f"{Key.SAMPLE_NUMBER!r} = {sampled!r} is not an int at least the "
            f"neighbourhood {size}",
        )
    floor = settings.min_neighbourhood
    if floor is not None and size < floor:
        raise refuse(
            "setup",
            f"neighbourhoods of {size}, below this node's floor {floor} "
            "(SecAggPlusMod(min_neighbourhood=...), node config "
            f"{NODE_MIN_NEIGHBOURHOOD})",
        )
    if settings.allow_weak_threshold:
        return  # a server this node trusts (tests, tiny federations)
    least = min(sampled, neighbourhood_size(sampled).size)
    if size < least:
        raise refuse(
            "setup",
            f"neighbourhoods of {size} among {sampled} nodes, below the {least} "
            "that num_shares='auto' gives (a server could surround this node "
            "with its colluders); run the server's SecAggPlus with "
            "num_shares='auto'",
        )
    if 2 * threshold <= size:
        raise refuse(
            "setup",
            f"the threshold {threshold} is at most half of the neighbourhoods of "
            f"{size}: a server could ask one half for its mask seed and the other "
            f"half for its key; it must exceed {size // 2}",
        )


def send_shares(
    config: ConfigRecord, state: State, node_id: int, settings: Settings
) -> dict[str, Any]:
    """Check the neighbours' keys; return its secrets' shares, one per neighbour."""
    active = bool(state.get("active"))
    width = 4 if active else 2  # pk1, pk2 (, signature, signing key)
    keys: dict[int, tuple[bytes, ...]] = {}
    for name, value in config.items():
        if name in (Key.STAGE, ROUND_KEY):
            continue
        if not (name.isdigit() and str(int(name)) == name):
            # "0042" and "42" would both be node 42: one node counted twice.
            raise refuse("share_keys", f"malformed or repeated node id {name!r}")
        if not (
            isinstance(value, list)
            and len(value) == width
            and all(isinstance(v, bytes) for v in value)
        ):
            raise refuse("share_keys", f"malformed entry {name!r}")
        keys[int(name)] = tuple(cast(list[bytes], value))
    if keys.get(node_id, ())[:2] != (state["pk1"], state["pk2"]):
        raise refuse(
            "share_keys",
            "this node's own public keys are not among those forwarded (the server "
            "may be impersonating it)",
        )
    every = [k for entry in keys.values() for k in entry[:2]]
    if len(set(every)) != len(every):
        raise refuse("share_keys", "two neighbours have the same public key")
    if active:
        state["signing-keys"] = _verified_signers(config, keys, node_id, settings)
    threshold = state[Key.THRESHOLD]
    if len(keys) < threshold:
        raise refuse(
            "share_keys",
            f"{len(keys)} neighbours, fewer than the threshold {threshold}",
        )
    if len(keys) > state[Key.SHARE_NUMBER]:
        raise refuse(
            "share_keys",
            f"{len(keys)} neighbours, more than the neighbourhood of "
            f"{state[Key.SHARE_NUMBER]} declared at setup",
        )
    floor = settings.min_neighbourhood
    if floor is not None and len(keys) < floor:
        raise refuse(
            "share_keys",
            f"a neighbourhood of {len(keys)}, below this node's floor {floor} "
            f"({NODE_MIN_NEIGHBOURHOOD})",
        )
    if 2 * threshold <= len(keys) and not settings.allow_weak_threshold:
        raise refuse(
            "share_keys",
            f"the threshold {threshold} is at most half of the {len(keys)} nodes "
            "this node shares with: a server could ask one half for its mask seed "
            f"and the other half for its key; it must exceed {len(keys) // 2} "
            "(SecAggPlusMod(allow_weak_threshold=True) accepts it)",
        )
    seed = os.urandom(32)
    order = sorted(keys)
    others = [n for n in order if n != node_id]
    try:  # a lying server could forward a key whose agreement everyone knows
        share_keys = agreement.shared_keys(
            state["sk2"], [keys[n][1] for n in others], agreement.SHARE_KEY
        )
        mask_seeds = pairwise_seeds(state["sk1"], [keys[n][0] for n in others])
    except agreement.UnusableKey as err:
        raise refuse(
            "share_keys",
            f"node {others[err.position]}'s key is {err}",
        ) from err
    # Each neighbour's two secrets, agreed once: the key its shares are
    # encrypted with (Fernet's encoding of it) and its mask seed.
    fernet_keys = {
        n: base64.urlsafe_b64encode(key)
        for n, key in zip(others, share_keys, strict=True)
    }
    seeds = dict(zip(others, mask_seeds, strict=True))
    seed_shares, sk1_shares = shamir.split([seed, state["sk1"]], threshold, len(order))
    dsts, ciphertexts = [], []
    for index, other in enumerate(order):
        if other == node_id:
            state["own-seed-share"] = seed_shares[index]
            state["own-sk1-share"] = sk1_shares[index]
            continue
        plaintext = share_keys_plaintext_concat(
            node_id, other, seed_shares[index], sk1_shares[index]
        )
        dsts.append(other)
        ciphertexts.append(encrypt(fernet_keys[other], plaintext))
    state["seed"] = seed
    state["nids"] = order
    state["pk1s"] = [keys[n][0] for n in order]
    state["share-keys"] = [fernet_keys.get(n, b"") for n in order]
    state["mask-seeds"] = [seeds.get(n, b"") for n in order]
    return {
        Key.DESTINATION_LIST: dsts,
        Key.CIPHERTEXT_LIST: ciphertexts,
        COMMITMENT_KEY: commitment(seed),
    }


def _verified_signers(
    config: ConfigRecord,
    keys: Mapping[int, tuple[bytes, ...]],
    node_id: int,
    settings: Settings,
) -> list[bytes]:
    """Check each neighbour's signed keys; return their signing keys, by node id."""
    assert settings.signing_key is not None
    seen: set[bytes] = set()
    for node in sorted(keys):
        pk1, pk2, signature, public = keys[node]
        if node == node_id and public != signing.public_of(settings.signing_key):
            raise refuse("share_keys", "this node's own signing key was replaced")
        if public not in settings.directory:
            raise refuse(
                "share_keys",
                f"node {node} signs with a key outside this node's key directory "
                "(a participant the server invented?)",
            )
        if public in seen:
            raise refuse(
                "share_keys", f"node {node} signs with another neighbour's key"
            )
        seen.add(public)
        statement = signing.keys_statement(
            cast(int, config.get(ROUND_KEY)), node, pk1, pk2
        )
        if not signing.verify(public, signature, signing.KEYS_CONTEXT, statement):
            raise refuse(
                "share_keys",
                f"node {node}'s keys do not carry its signature (replaced on the way?)",
            )
    return [keys[node][3] for node in sorted(keys)]


def receive_shares(config: ConfigRecord, state: State, node_id: int) -> None:
    """Decrypt and keep the shares the server forwards from the neighbours."""
    stage = "collect"
    srcs, ciphertexts = config.get(Key.SOURCE_LIST), config.get(Key.CIPHERTEXT_LIST)
    sources = node_ids(stage, srcs, "the sources of the forwarded shares")
    if not (isinstance(ciphertexts, list) and len(sources) == len(ciphertexts)):
        raise refuse(stage, "malformed forwarded shares")
    share_keys = dict(zip(state["nids"], state["share-keys"], strict=True))
    owners, seed_shares, sk1_shares = (
        [node_id],
        [state["own-seed-share"]],
        [state["own-sk1-share"]],
    )
    for src, ciphertext in zip(sources, ciphertexts, strict=True):
        if src not in share_keys or src == node_id:
            raise refuse(stage, f"a share from node {src}, not a neighbour")
        actual_src, dst, seed_share, sk1_share = share_keys_plaintext_separate(
            decrypt(share_keys[src], cast(bytes, ciphertext))
        )
        if (actual_src, dst) != (src, node_id):
            raise refuse(
                stage,
                f"a share from {actual_src} to {dst} forwarded as from {src} to "
                f"{node_id}",
            )
        owners.append(src)
        seed_shares.append(seed_share)
        sk1_shares.append(sk1_share)
    if len(owners) < state[Key.THRESHOLD]:
        raise refuse(
            stage,
            f"{len(owners)} nodes in the neighbourhood left, fewer than the "
            f"threshold {state[Key.THRESHOLD]}",
        )
    state["share-owners"] = owners
    state["seed-shares"] = seed_shares
    state["sk1-shares"] = sk1_shares


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
    # The codes go straight into the masked vector: no list of parts to join.
    vector = np.empty(layout.length, dtype=np.uint32)
    start = HEADER
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
        arrays = [records[name][k].numpy() for k in keys]
        held = sum(a.size for a in arrays)
        if held != size:
            raise _not_masked(
                f"record {name!r} holds {held} values, the server's layout {size}"
            )
        bad = sum(int(a.size - np.count_nonzero(np.isfinite(a))) for a in arrays)
        if bad:
            raise _not_masked(f"record {name!r} holds {bad} NaN or inf values")
        # Array by array straight into the masked vector: one stream of draws,
        # so the same codes as the record's values concatenated.
        c = np.float64(quantizer.clipping_range)  # compared in float64, as coded
        for array in arrays:
            clipped += int(np.count_nonzero((array > c) | (array < -c)))
            quantizer.encode(
                array,
                rng,
                code if kind == "mean" else None,
                out=vector[start : start + array.size],
            )
            start += array.size
    # The clipped count travels masked: capped at T, the round's sum cannot wrap.
    vector[0], vector[1] = code, min(clipped, quantizer.quantization_range)
    return _masked(vector, state, node_id, quantizer.modulus_range), clipped


def _masked(
    vector: NDArray[np.uint32], state: State, node_id: int, modulus: int
) -> NDArray[np.uint32]:
    """Return ``vector`` with its private and pairwise masks, modulo ``modulus``."""
    seeds = dict(zip(state["nids"], state["mask-seeds"], strict=True))
    add_masks(
        vector,
        [(state["seed"], 1)]
        + [
            (seeds[other], pairwise_sign(node_id, other))
            for other in state["share-owners"]
            if other != node_id
        ],
    )
    np.bitwise_and(vector, np.uint32(modulus - 1), out=vector)  # reduce, in place
    return vector


def ddp_masked_vector(
    records: Mapping[str, ArrayRecord],
    sent: Mapping[str, ArrayRecord],
    plan: DDPRound,
    state: State,
    node_id: int,
    settings: Settings,
) -> tuple[NDArray[np.uint32], float]:
    """Return the reply's distributed-DP upload, masked, and its clip factor.

    Refused before anything is masked when the round's noise is below this
    node's floor (``settings.min_noise_multiplier``) at the fewest
    contributors the threshold allows, or when the masks' modulus is not
    ``2**bits``.
    """
    modulus = int(state[Key.MOD_RANGE])
    bits = int(plan.settings.bits)
    if bits > 32 or modulus != 1 << bits:
        raise _not_masked(
            f"distributed DP sums modulo 2**{bits} but the round's masks are "
            f"modulo {modulus}"
        )
    rng = np.random.default_rng()
    try:
        upload = encode_records(records, sent, plan, rng)
    except ValueError as err:
        raise _not_masked(str(err)) from err
    floor = settings.min_noise_multiplier
    if floor is not None:
        threshold = int(state[Key.THRESHOLD])
        reach = noise_multiplier_at(plan.settings, upload.layout.padded_dim, threshold)
        if reach < floor:
            raise _not_masked(
                f"distributed DP: the round's noise gives a noise multiplier of "
                f"{reach:.4g} at the threshold's {threshold} contributors, below "
                f"this node's floor {floor:g} ({NODE_MIN_NOISE})"
            )
    vector = upload.values.astype(np.uint32)
    return _masked(vector, state, node_id, modulus), upload.clip_factor


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

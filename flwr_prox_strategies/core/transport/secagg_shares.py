"""The node's SecAgg+ key exchange: its state, its key pairs, its shares in and out.

The handlers of :class:`~flwr_prox_strategies.SecAggPlusMod` for ``setup``
(two key pairs, signed in active-adversary mode) and ``share_keys`` (Shamir
shares of its mask seed and first private key, encrypted to each neighbour),
and the shares it receives at ``collect_masked_vectors``. Every request that
could let the server rebuild one client's vector is refused with the rule it
breaks (:class:`SecureAggregationRefused`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from flwr.app import ConfigRecord, Context
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
    decrypt,
    encrypt,
    generate_shared_key,
)
from flwr.common.secure_aggregation.secaggplus_utils import (
    share_keys_plaintext_concat,
    share_keys_plaintext_separate,
)

from . import shamir, signing
from .flower import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)
from .secagg import (
    ACTIVE_KEY,
    COMMITMENT_KEY,
    CONSISTENCY_STAGE,
    ROUND_KEY,
    SIGNATURE_KEY,
    SIGNING_KEY_KEY,
    Key,
    Stage,
    commitment,
    pairwise_seed,
)

STATE_RECORD = "secagg-plus-state"
#: Node-config keys a SuperNode's operator sets (``flower-supernode
#: --node-config "secagg-required=true ..."``): the server cannot change them.
NODE_REQUIRED = "secagg-required"
NODE_SIGNING_KEY = "secagg-signing-key"
NODE_KEY_DIRECTORY = "secagg-key-directory"

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
    sk1, pk1 = generate_key_pairs()
    sk2, pk2 = generate_key_pairs()
    state["sk1"], state["pk1"] = private_key_to_bytes(sk1), public_key_to_bytes(pk1)
    state["sk2"], state["pk2"] = private_key_to_bytes(sk2), public_key_to_bytes(pk2)
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
    secrets: dict[int, bytes] = {}
    seed_shares, sk1_shares = shamir.split([seed, state["sk1"]], threshold, len(order))
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
    state["pk1s"] = [keys[n][0] for n in order]
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

"""The server's SecAgg+ key exchange: one round's state, setup and share_keys.

:class:`KeyExchange` is the part of :class:`~flwr_prox_strategies.SecAggPlus`
that sizes a round's neighbourhoods and threshold, sends each stage to the
nodes and keeps only well-formed answers, checks the public keys (and, in
active-adversary mode, their signatures) and forwards each node's encrypted
shares to its neighbours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

from ...ops.privacy.encoding import UploadLayout
from ...ops.privacy.neighbourhoods import fraction_threshold, neighbourhood_size
from ..contract.validation import client_error_text
from ..server.strategy import ValidatedFedAvg
from ..transport import signing
from ..transport.agreement import check_public_key
from ..transport.ddp import DDPRound
from ..transport.records import RecordSpec
from ..transport.secagg import (
    ACTIVE_KEY,
    COMMITMENT_KEY,
    MISSING_MOD_HINT,
    SECAGG_RECORD,
    SIGNATURE_KEY,
    SIGNING_KEY_KEY,
    Key,
    Layout,
    Quantizer,
    Stage,
    neighbours,
    stage_message,
)
from .distributed import DistributedDP


@dataclass
class _Round:
    """One round's protocol: who is in it, their keys, what went wrong."""

    server_round: int
    messages: dict[int, Message]
    num_shares: int = 0
    threshold: int = 0
    layout: Layout | None = None
    spec: dict[str, RecordSpec] = field(default_factory=dict)  # the expected records
    zeros: dict[str, ArrayRecord] = field(default_factory=dict)  # stand-ins, once
    neighbours: dict[int, set[int]] = field(default_factory=dict)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    commitments: dict[int, bytes] = field(default_factory=dict)
    signing_keys: dict[int, bytes] = field(default_factory=dict)  # active mode
    key_signatures: dict[int, bytes] = field(default_factory=dict)  # on its keys
    survivor_signatures: dict[int, bytes] = field(default_factory=dict)
    shared: set[int] = field(default_factory=set)  # completed share_keys
    dropped: dict[int, str] = field(default_factory=dict)  # node -> why
    failure: str | None = None  # why the round cannot be aggregated
    ddp: DDPRound | None = None  # distributed DP's encoding of the round
    upload: UploadLayout | None = None  # ... and the arrays of each upload
    rdp: NDArray[np.float64] | None = None  # ... and what it charges when revealed
    fewest: int = 0  # ... the fewest contributors whose noise the sum holds

    @property
    def length(self) -> int:
        """The masked vector's length: the padded upload, or the layout's."""
        if self.upload is not None:
            return self.upload.padded_dim
        return self.layout.length if self.layout is not None else 0


class KeyExchange:
    """The stages of a SecAgg+ round up to the collection of masked vectors."""

    strategy: ValidatedFedAvg
    num_shares: int | float | str
    reconstruction_threshold: int | float | None
    security_bits: float
    correctness_bits: float
    corrupt_fraction: float
    dropout_fraction: float
    max_weight: float
    quantizer: Quantizer
    timeout: float | None
    active_adversary: bool
    allow_weak_threshold: bool
    _weak_warned: bool
    _forwarded: dict[int, tuple[list[int], list[bytes]]]
    distributed_dp: DistributedDP | None

    @property
    def masking_modulus(self) -> int:
        """The masks' modulus (``2**bits`` under distributed DP)."""
        dp = self.distributed_dp
        return self.quantizer.modulus_range if dp is None else 1 << int(dp.bits)

    def _size_round(self, state: _Round, sampled: int) -> None:
        shares, threshold = self.num_shares, self.reconstruction_threshold
        if shares == "auto" and self.distributed_dp is not None:
            # Distributed DP counts the noise of the fewest contributors a
            # revealed sum holds, t: a sparse ring's small t would cost budget.
            shares = 1.0
        if shares == "auto":
            auto = neighbourhood_size(
                max(sampled, 1),
                threshold=threshold,
                security_bits=self.security_bits,
                correctness_bits=self.correctness_bits,
                corrupt_fraction=self.corrupt_fraction,
                dropout_fraction=self.dropout_fraction,
            )
            state.num_shares, state.threshold = min(auto.size, sampled), auto.threshold
        else:
            count = (
                sampled
                if isinstance(shares, float) and shares >= 1.0
                else min(
                    sampled,
                    round(shares * sampled)
                    if isinstance(shares, float)
                    else cast(int, shares),
                )
            )
            if count < 3:
                count = sampled  # as Flower: too small a fraction means everyone
            if count < sampled and count % 2 == 0:
                count += 1  # a ring neighbourhood is the node and as many each side
            state.num_shares = count
            state.threshold = (
                # Rounded up (0.6 of 4 is 3, not 2): above half at every size.
                fraction_threshold(0.6 if threshold is None else threshold, count)
                if not isinstance(threshold, int)
                else threshold
            )
        count = state.num_shares
        if sampled < state.threshold or sampled < 2:
            state.failure = (
                f"{sampled} node(s) sampled, fewer than the reconstruction threshold "
                f"{state.threshold}"
            )
        elif (
            self.distributed_dp is None and sampled > self.quantizer.max_contributors()
        ):
            state.failure = (
                f"{sampled} nodes sampled, more than modulus_range / "
                f"quantization_range allows ({self.quantizer.max_contributors()})"
            )
        elif 2 * state.threshold <= count:
            self._weak_threshold(state)
        state.spec = spec = self.strategy.expected_train_arrays(
            state.server_round + self.strategy.round_offset
        )
        declared = self.strategy.secure_sums() or {}
        state.layout = Layout.from_declaration(
            declared,
            {name: {k: a.shape for k, a in spec[name].items()} for name in declared},
            uniform=self.strategy.weighting == "uniform",
        )

    def _weak_threshold(self, state: _Round) -> None:
        """Fail a round whose threshold is at most half a neighbourhood, or warn."""
        count, threshold = state.num_shares, state.threshold
        if not self.allow_weak_threshold:
            state.failure = (
                f"the threshold {threshold} is at most half of this round's "
                f"neighbourhoods of {count}: a lying server could rebuild a client's "
                f"update; raise reconstruction_threshold above {count // 2} (or "
                "allow_weak_threshold=True)"
            )
        elif not self._weak_warned:
            self._weak_warned = True
            log(
                WARNING,
                "SecAggPlus: round %d: the threshold %d is at most half of the "
                "neighbourhoods of %d (allow_weak_threshold=True): a server that lies "
                "about who dropped can rebuild a client's update (warned once per run)",
                state.server_round + self.strategy.round_offset,
                threshold,
                count,
            )

    def _exchange(
        self,
        grid: Grid,
        state: _Round,
        stage: str,
        contents: Mapping[int, dict[str, Any]],
        expected: tuple[str, ...],
    ) -> dict[int, ConfigRecord]:
        """Send one stage to ``contents``' nodes; return the well-formed answers.

        A node that fails, answers without the stage's record or values, or
        not at all, is dropped from the round with the reason.
        """
        messages = {
            node: stage_message(node, state.server_round, stage, values)
            for node, values in contents.items()
        }
        replies = list(
            grid.send_and_receive(list(messages.values()), timeout=self.timeout)
        )
        sent = {m.metadata.message_id: node for node, m in messages.items()}
        answers: dict[int, ConfigRecord] = {}
        for reply in replies:
            node = sent.get(reply.metadata.reply_to_message_id)
            if node is None:
                continue
            if reply.has_error():
                text = client_error_text(str(reply.error.reason))
                hint = f" (if its ClientApp lacks the mod, {MISSING_MOD_HINT})"
                state.dropped[node] = f"{stage}: error reply: {text}" + (
                    hint if stage == Stage.SETUP else ""
                )
                continue
            record = reply.content.config_records.get(SECAGG_RECORD)
            if record is None:
                state.dropped[node] = (
                    f"{stage}: the reply has no secure-aggregation record, so the "
                    f"node's ClientApp does not run the protocol: {MISSING_MOD_HINT}"
                )
                continue
            if missing := [key for key in expected if key not in record]:
                state.dropped[node] = f"{stage}: the reply lacks {missing}"
                continue
            answers[node] = record
        for node in messages:
            if node not in answers and node not in state.dropped:
                state.dropped[node] = f"{stage}: no reply within the stage's timeout"
        return answers

    def _setup(self, grid: Grid, state: _Round, nodes: list[int]) -> None:
        config = {
            Key.SAMPLE_NUMBER: len(nodes),
            Key.SHARE_NUMBER: state.num_shares,
            Key.THRESHOLD: state.threshold,
            Key.CLIPPING_RANGE: self.quantizer.clipping_range,
            Key.TARGET_RANGE: self.quantizer.quantization_range,
            Key.MOD_RANGE: self.masking_modulus,
            Key.MAX_WEIGHT: self.max_weight,
            ACTIVE_KEY: self.active_adversary,
        }
        signed = (SIGNATURE_KEY, SIGNING_KEY_KEY) if self.active_adversary else ()
        answers = self._exchange(
            grid,
            state,
            Stage.SETUP,
            {node: config for node in nodes},
            (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2, *signed),
        )
        seen: set[bytes] = set()
        for node, record in answers.items():
            keys = (record[Key.PUBLIC_KEY_1], record[Key.PUBLIC_KEY_2])
            try:
                for key in map(check_public_key, keys):
                    if key in seen:
                        raise ValueError("a public key repeated")
                    seen.add(key)
                if self.active_adversary:
                    self._check_signed_keys(state, node, record, seen)
            except ValueError as err:
                state.dropped[node] = f"setup: malformed public keys ({err})"
                continue
            state.public_keys[node] = (keys[0], keys[1])  # type: ignore[assignment]
        active = sorted(state.public_keys)
        rng = np.random.default_rng(
            [self.strategy.seed, state.server_round + self.strategy.round_offset, 7]
        )
        state.neighbours = neighbours(active, state.num_shares, rng)
        self._check_neighbourhoods(state, set(active), "setup")

    def _check_signed_keys(
        self, state: _Round, node: int, record: ConfigRecord, seen: set[bytes]
    ) -> None:
        """Keep a node's signature on its keys, if it is one (active mode)."""
        signature, public = record[SIGNATURE_KEY], record[SIGNING_KEY_KEY]
        if not isinstance(public, bytes) or public in seen:
            raise ValueError("a signing key repeated or not bytes")
        statement = signing.keys_statement(
            state.server_round,
            node,
            cast(bytes, record[Key.PUBLIC_KEY_1]),
            cast(bytes, record[Key.PUBLIC_KEY_2]),
        )
        if not signing.verify(public, signature, signing.KEYS_CONTEXT, statement):
            raise ValueError("its keys do not carry its signature")
        seen.add(public)
        state.signing_keys[node] = public
        state.key_signatures[node] = cast(bytes, signature)

    def _share_keys(self, grid: Grid, state: _Round) -> None:
        active = set(state.public_keys)

        def entry(other: int) -> list[bytes]:
            keys = list(state.public_keys[other])
            if self.active_adversary:
                keys += [state.key_signatures[other], state.signing_keys[other]]
            return keys

        contents = {
            node: {
                str(other): entry(other)
                for other in sorted(state.neighbours[node] & active)
            }
            for node in sorted(active)
        }
        answers = self._exchange(
            grid,
            state,
            Stage.SHARE_KEYS,
            contents,
            (Key.DESTINATION_LIST, Key.CIPHERTEXT_LIST, COMMITMENT_KEY),
        )
        self._forwarded = {}
        outgoing: dict[int, list[tuple[int, bytes]]] = {}
        for node, record in answers.items():
            dsts, texts = record[Key.DESTINATION_LIST], record[Key.CIPHERTEXT_LIST]
            allowed = (state.neighbours[node] & active) - {node}
            committed = record[COMMITMENT_KEY]
            if not (
                isinstance(dsts, list)
                and isinstance(texts, list)
                and len(dsts) == len(texts)
                and sorted(dsts) == sorted(allowed)
                and all(isinstance(t, bytes) for t in texts)
                and isinstance(committed, bytes)
                and len(committed) == 32
            ):
                state.dropped[node] = (
                    "share_keys: malformed shares (destinations other than its "
                    "neighbours, or not one ciphertext each)"
                )
                continue
            state.commitments[node] = committed
            outgoing[node] = list(
                zip(cast(list[int], dsts), cast(list[bytes], texts), strict=True)
            )
        state.shared = set(outgoing)
        for src, pairs in outgoing.items():
            for dst, text in pairs:
                if dst in state.shared:
                    srcs, texts = self._forwarded.setdefault(dst, ([], []))
                    srcs.append(src)
                    texts.append(text)
        self._check_neighbourhoods(state, state.shared, "share_keys")

    def _check_neighbourhoods(self, state: _Round, alive: set[int], stage: str) -> None:
        short = sorted(
            node
            for node in alive
            if len(state.neighbours[node] & alive) < state.threshold
        )
        if len(alive) < state.threshold:
            state.failure = (
                f"after {stage}, {len(alive)} node(s) left, fewer than the "
                f"reconstruction threshold {state.threshold}"
            )
        elif short:
            state.failure = (
                f"after {stage}, nodes {short} have fewer than {state.threshold} "
                "neighbours left"
            )

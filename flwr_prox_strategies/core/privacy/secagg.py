"""The server half of SecAgg+: a wrapper that runs any summing strategy securely.

:class:`SecAggPlus` wraps one of the pack's strategies, as Flower's central-DP
wrappers do. Each training round it runs the protocol's stages over the
Message-API ``Grid`` inside the strategy's own round: ``configure_train`` (the
strategy samples and builds its messages) is followed by ``setup`` and
``share_keys``; the strategy's train messages then go out as the
``collect_masked_vectors`` stage; ``aggregate_train`` screens the replies' plain
parts (metrics, client keys) with the strategy's own checks, runs ``unmask``
for the replies that passed, and hands the strategy's rule the unmasked sums.
The rule itself is unchanged: it reads the replies only through
``weighted_mean`` and sums over the replies (its ``secure_sums()``
declaration), and under the wrapper every reply holds the contributors' mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any, NamedTuple, cast

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

from ..client.secagg import pairwise_seed
from ..contract.validation import ReplyRejected, ValidReply, client_error_text
from ..server.strategy import ScreenedRound, ValidatedFedAvg
from ..transport import shamir, signing
from ..transport.flower import (
    bytes_to_private_key,
    bytes_to_public_key,
    public_key_to_bytes,
)
from ..transport.records import RecordSpec, dict_to_record
from ..transport.secagg import (
    ACTIVE_KEY,
    COMMITMENT_KEY,
    CONSISTENCY_STAGE,
    MISSING_MOD_HINT,
    ROUND_KEY,
    SECAGG_RECORD,
    SIGNATURE_KEY,
    SIGNERS_KEY,
    SIGNING_KEY_KEY,
    SURVIVORS_KEY,
    WEIGHT_KEY,
    Key,
    Layout,
    Quantizer,
    Stage,
    add_mask,
    commitment,
    from_bytes,
    neighbours,
    pairwise_sign,
    reduce,
)
from ..wrapper import StrategyWrapper

PHASE = "aggregate_train"
#: The error code of the stand-in reply of a node the protocol dropped.
SECAGG_DROPPED_CODE = 0


def _check_strong_threshold(num_shares: int | float, threshold: int | float) -> None:
    """Refuse a threshold a lying server could split (at most half a neighbourhood)."""
    fix = (
        "a lying server could ask one half of a client's neighbours for its mask "
        "seed and the other half for its key, and rebuild its update; raise it, "
        "or pass allow_weak_threshold=True"
    )
    if isinstance(threshold, float) and threshold <= 0.5:
        raise ValueError(
            f"reconstruction_threshold={threshold} is at most half of a "
            f"neighbourhood: {fix}"
        )
    if (
        isinstance(threshold, int)
        and isinstance(num_shares, int)
        and 2 * threshold <= num_shares
    ):
        raise ValueError(
            f"reconstruction_threshold={threshold} is at most half of "
            f"num_shares={num_shares}: {fix}"
        )


def _check_fraction_or_count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be an int or a float, got {value!r}")
    if isinstance(value, int) and value < least:
        raise ValueError(f"{name} as a count must be >= {least}, got {value}")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"{name} as a fraction must be in (0, 1], got {value}")


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


class SecAggPlus(StrategyWrapper):
    """Secure aggregation (SecAgg+) for any strategy of the pack that only sums.

    The server learns the sums the strategy's rule needs (the weighted mean of
    the models, SCAFFOLD's and FedDC's control sums, FedDyn's drift sum) and
    never a client's update, control variate or any other record. Clients
    need :class:`~flwr_prox_strategies.SecAggPlusMod` among their ClientApp's
    mods. Each client's values are clipped to ``clipping_range`` and
    quantised; the unmasked weighted mean differs from the plain one by at
    most ``3 n c / (T sum r)`` per entry (the round's ``secagg-error-bound``
    metric: ``n`` contributors, ``c`` the clipping range, ``T`` the
    quantisation range, ``r`` the weights over ``max_weight``; ``2c/T`` under
    uniform weights). Clients that drop after sharing their keys are
    survived while every neighbourhood keeps ``reconstruction_threshold``
    members; a round that cannot be unmasked keeps the previous model.

    Parameters
    ----------
    strategy : ValidatedFedAvg
        The strategy to run securely: one whose ``secure_sums()`` declares
        what its rule reads (FedAvg, FedProx, SCAFFOLD, FedDyn, FedDC, APFL,
        SFedAvg, SFedProx). FedEPM, a rule of your own that was not declared,
        and ``monitor_dissimilarity=True`` (it reads each reply) are refused.
    num_shares : int | float (default: 1.0)
        Each client's neighbourhood (itself included), which holds the shares
        of its secrets and masks with it: a count (>= 3), or a fraction of
        the round's sampled nodes (1.0: everyone, SecAgg).
    reconstruction_threshold : int | float (default: 0.6)
        Shares needed to rebuild a secret: a count (>= 2), or a fraction of
        ``num_shares`` (rounded up, at least 2). Up to ``num_shares -
        reconstruction_threshold`` neighbours may drop after sharing keys;
        fewer than the threshold cannot learn anything. It must exceed half
        of every neighbourhood: at or below half, a lying server can ask one
        half of a client's neighbours for its mask seed and the other half
        for its key, and rebuild its update. A fraction must be above 0.5; a
        count above half of ``num_shares`` (checked each round when
        ``num_shares`` is a fraction).
    max_weight : float (default: 1000.0)
        The largest weight (``num-examples``, or the ``weighted_by_key``
        metric) a client may mask; a client with a larger one refuses.
        Unused under ``weighting="uniform"``.
    clipping_range : float (default: 8.0)
        ``c``: values are clipped to ``[-c, c]`` before quantisation (each
        client moves a sum by at most ``c`` per entry).
    quantization_range : int (default: 2**22)
        ``T``: quantisation steps across ``[-c, c]``.
    modulus_range : int (default: 2**32)
        The masks' modulus: a power of 2 above ``quantization_range``, at
        most ``2**32``; it bounds the contributors per round to
        ``(modulus_range - 1) // quantization_range``.
    timeout : float | None (default: 300.0)
        Seconds each key-exchange stage waits for replies (None: until every
        node answers or is reported lost).
    active_adversary : bool (default: False)
        Run the consistency check of Bonawitz et al. (2017), which Bell et
        al. (2020) keep for SecAgg+: each node signs its public keys and,
        before any share is revealed, the survivor set; a node reveals shares
        only after verifying ``t`` of its neighbours' signatures on the set it
        signed. The server relays signatures it cannot forge, so it cannot
        invent participants or tell clients different stories. Every node
        needs a signing key and the directory of its peers' public keys
        (:class:`~flwr_prox_strategies.SecAggPlusMod`'s ``signing_key`` and
        ``key_directory``, or its node config). One more stage per round.
    allow_weak_threshold : bool (default: False)
        Accept a threshold at most half of a neighbourhood, with a warning
        once per run. Clients refuse such a round unless their mod allows it
        too. For tests and federations whose server you trust.
    """

    strategy: ValidatedFedAvg

    def __init__(
        self,
        strategy: ValidatedFedAvg,
        *,
        num_shares: int | float = 1.0,
        reconstruction_threshold: int | float = 0.6,
        max_weight: float = 1000.0,
        clipping_range: float = 8.0,
        quantization_range: int = 2**22,
        modulus_range: int = 2**32,
        timeout: float | None = 300.0,
        active_adversary: bool = False,
        allow_weak_threshold: bool = False,
    ) -> None:
        if not isinstance(strategy, ValidatedFedAvg):
            raise ValueError(
                f"SecAggPlus wraps one of the pack's single-model strategies, got "
                f"{type(strategy).__name__} (P-FedAvg's servers exchange models "
                "among themselves)"
            )
        name = type(strategy).__name__
        declared = strategy.secure_sums()
        if declared is None:
            raise ValueError(f"SecAggPlus cannot run {name}: {strategy.secure_refusal}")
        if strategy.monitor_dissimilarity:
            raise ValueError(
                "SecAggPlus cannot run monitor_dissimilarity=True: the dissimilarity "
                "B needs each client's gradient, which secure aggregation hides"
            )
        carried = set(strategy.expected_train_arrays(1))
        if set(declared) != carried:
            raise ValueError(
                f"SecAggPlus cannot run {name}: its replies carry {sorted(carried)} "
                f"but secure_sums() declares {sorted(declared)}; every record must "
                "be declared (or not uploaded)"
            )
        _check_fraction_or_count("num_shares", num_shares, 3)
        _check_fraction_or_count(
            "reconstruction_threshold", reconstruction_threshold, 2
        )
        if (
            isinstance(num_shares, int)
            and isinstance(reconstruction_threshold, int)
            and reconstruction_threshold > num_shares
        ):
            raise ValueError(
                f"reconstruction_threshold ({reconstruction_threshold}) must be "
                f"<= num_shares ({num_shares})"
            )
        for key, flag in (
            ("active_adversary", active_adversary),
            ("allow_weak_threshold", allow_weak_threshold),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{key} must be a bool, got {flag!r}")
        if not allow_weak_threshold:
            _check_strong_threshold(num_shares, reconstruction_threshold)
        if (
            isinstance(reconstruction_threshold, int)
            and reconstruction_threshold > strategy.min_train_nodes
        ):
            raise ValueError(
                f"reconstruction_threshold ({reconstruction_threshold}) is larger than "
                f"the nodes a round may sample ({name}'s min_train_nodes = "
                f"{strategy.min_train_nodes}): no round could be unmasked; raise "
                "min_train_nodes or lower the threshold"
            )
        for key, value in (
            ("max_weight", max_weight),
            ("clipping_range", clipping_range),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"{key} must be a finite number > 0, got {value!r}")
        if (
            isinstance(quantization_range, bool)
            or not isinstance(quantization_range, int)
            or quantization_range < 2
        ):
            raise ValueError(
                f"quantization_range must be an int >= 2, got {quantization_range!r}"
            )
        if (
            isinstance(modulus_range, bool)
            or not isinstance(modulus_range, int)
            or modulus_range <= quantization_range
            or modulus_range > 2**32
            or modulus_range & (modulus_range - 1)
        ):
            raise ValueError(
                "modulus_range must be a power of 2 above quantization_range and at "
                f"most 2**32, got {modulus_range!r}"
            )
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 or None, got {timeout!r}")
        super().__init__(strategy)
        self.num_shares = num_shares
        self.reconstruction_threshold = reconstruction_threshold
        self.max_weight = float(max_weight)
        self.quantizer = Quantizer(
            float(clipping_range), quantization_range, modulus_range
        )
        self.timeout = timeout
        self.active_adversary = active_adversary
        self.allow_weak_threshold = allow_weak_threshold
        self._weak_warned = False
        self._grid: Grid | None = None
        self._round: _Round | None = None
        self._forwarded: dict[int, tuple[list[int], list[bytes]]] = {}
        self._clip_warned = False

    clipping_range = property(lambda self: self.quantizer.clipping_range)
    quantization_range = property(lambda self: self.quantizer.quantization_range)
    modulus_range = property(lambda self: self.quantizer.modulus_range)

    def __repr__(self) -> str:
        """Return the wrapper's settings around the strategy's ``repr``."""
        return (
            f"SecAggPlus({self.strategy!r}, num_shares={self.num_shares}, "
            f"reconstruction_threshold={self.reconstruction_threshold}, "
            f"max_weight={self.max_weight:g}, clipping_range={self.clipping_range:g}, "
            f"quantization_range={self.quantization_range}, "
            f"modulus_range={self.modulus_range})"
        )

    def summary(self) -> None:
        """Log what is summed securely, then the strategy's summary."""
        log(
            INFO,
            "SecAggPlus: secure aggregation of %s's sums %s (num_shares=%s, "
            "reconstruction_threshold=%s, clipping_range=%g, quantization_range=%d, "
            "max_weight=%g%s); the server sees per-client metrics only",
            type(self.strategy).__name__,
            self.strategy.secure_sums(),
            self.num_shares,
            self.reconstruction_threshold,
            self.clipping_range,
            self.quantization_range,
            self.max_weight,
            ", active adversary: signed keys and survivor set"
            if self.active_adversary
            else "",
        )
        self.strategy.summary()

    # ------------------------------------------------------------------ run
    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Begin the strategy's run; this run's warnings are new."""
        super().begin_run(initial_arrays, num_rounds)
        self._clip_warned = self._weak_warned = False

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Let the strategy sample and build its messages; exchange keys; collect.

        Returns the strategy's train messages for the nodes that completed
        ``setup`` and ``share_keys``, each carrying the ``collect`` stage.
        """
        self._grid = grid
        messages = list(
            self.strategy.configure_train(server_round, arrays, config, grid)
        )
        if not messages:
            self._round = None
            return messages
        state = _Round(server_round, {m.metadata.dst_node_id: m for m in messages})
        self._round = state
        nodes = sorted(state.messages)
        self._size_round(state, len(nodes))
        if state.failure is None:
            self._setup(grid, state, nodes)
        if state.failure is None:
            self._share_keys(grid, state)
        shown = server_round + self.strategy.round_offset
        if state.failure is not None:
            log(
                WARNING,
                "SecAggPlus: round %d: the protocol could not start: %s; no node "
                "trains this round",
                shown,
                state.failure,
            )
            return []
        assert state.layout is not None
        outgoing = []
        forwarded = self._forwarded
        for node in sorted(state.shared):
            srcs, texts = forwarded.get(node, ([], []))
            message = state.messages[node]
            message.content.config_records[SECAGG_RECORD] = ConfigRecord(
                {
                    Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                    ROUND_KEY: server_round,
                    Key.SOURCE_LIST: srcs,
                    Key.CIPHERTEXT_LIST: texts,
                    WEIGHT_KEY: self._weight_key(),
                    **state.layout.config(),
                }
            )
            outgoing.append(message)
        log(
            INFO,
            "SecAggPlus: round %d: %d of %d sampled nodes shared their keys "
            "(neighbourhoods of %d, threshold %d); collecting masked vectors",
            shown,
            len(state.shared),
            len(nodes),
            state.num_shares,
            state.threshold,
        )
        return outgoing

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen the replies' plain parts, unmask their sum, run the rule."""
        inner = self.strategy
        state = self._round
        if state is None:  # the strategy sampled nobody
            return inner.aggregate_train(server_round, replies)
        vectors: dict[int, NDArray[np.uint32]] = {}
        passed: list[Message] = []
        length = state.layout.length if state.layout is not None else 0
        sent = {m.metadata.message_id: node for node, m in state.messages.items()}
        for reply in replies:
            node = sent.get(
                reply.metadata.reply_to_message_id, reply.metadata.src_node_id
            )
            if reply.has_error():
                passed.append(reply)
                continue
            try:
                vectors[node] = self._masked(reply, length)
            except ValueError as err:
                state.dropped[node] = f"collect_masked_vectors: {err}"
                continue
            passed.append(self._skeleton(reply, state))
        # Nodes the protocol lost, or a round it could not start, reach the
        # strategy as error replies: counted and logged as failures, as always.
        for node, message in sorted(state.messages.items()):
            why = state.dropped.get(node)
            if why is None and state.failure is not None and node not in vectors:
                why = f"the round's protocol could not start ({state.failure})"
            if why is not None:
                reason = f"secure aggregation dropped the node: {why}"
                passed.append(
                    Message(
                        Error(code=SECAGG_DROPPED_CODE, reason=reason), reply_to=message
                    )
                )
        round_ = server_round + inner.round_offset
        screened = inner.screen_train(round_, passed)
        contributors = [r.node_id for r in screened.valid]
        sums = None
        before = set(state.dropped)
        if state.failure is None:
            weights = {r.node_id: self._weight_code(r) for r in screened.valid}
            try:
                sums = self._unmask(
                    state, {n: vectors[n] for n in contributors}, weights
                )
            except _UnmaskFailed as err:
                state.failure = str(err)
        for node in sorted(set(state.dropped) - before):  # unmask-stage trouble
            log(
                WARNING,
                "SecAggPlus: round %d: node %d: %s",
                round_,
                node,
                state.dropped[node],
            )
        if state.failure is not None:
            log(
                WARNING,
                "SecAggPlus: round %d cannot be unmasked: %s; "
                "keeping the previous model",
                round_,
                state.failure,
            )
            for valid_reply in screened.valid:
                self._count(valid_reply.node_id, "secagg-unmask", state.failure, round_)
            screened = ScreenedRound(
                [],
                screened.failed,
                screened.rejected + len(screened.valid),
                screened.absent,
                screened.capped,
                screened.k_before,
            )
            arrays, metrics = inner.aggregate_screened(round_, screened)
            return arrays, self._metrics(metrics, state, [], None, 0)
        assert sums is not None
        means, replies_hold, weight_sum, clipped = sums
        for valid_reply in screened.valid:
            valid_reply.arrays = replies_hold
        inner._secure_means = means
        try:
            arrays, metrics = inner.aggregate_screened(round_, screened)
        finally:
            inner._secure_means = None
        return arrays, self._metrics(
            metrics, state, screened.valid, weight_sum, clipped
        )

    # ------------------------------------------------------------- stages
    def _size_round(self, state: _Round, sampled: int) -> None:
        shares = self.num_shares
        count = (
            sampled
            if isinstance(shares, float) and shares >= 1.0
            else min(
                sampled,
                round(shares * sampled) if isinstance(shares, float) else shares,
            )
        )
        if count < 3:
            count = sampled  # as Flower: too small a fraction means everyone
        if count < sampled and count % 2 == 0:
            count += 1  # a ring neighbourhood is the node and as many on each side
        threshold = self.reconstruction_threshold
        state.num_shares = count
        state.threshold = (
            # Rounded up (0.6 of 4 is 3, not 2): above half at every size.
            max(2, math.ceil(round(threshold * count, 9)))
            if isinstance(threshold, float)
            else threshold
        )
        if sampled < state.threshold or sampled < 2:
            state.failure = (
                f"{sampled} node(s) sampled, fewer than the reconstruction threshold "
                f"{state.threshold}"
            )
        elif sampled > self.quantizer.max_contributors():
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

    def _weight_key(self) -> str:
        if self.strategy.weighting == "uniform":
            return ""
        return self.strategy.weighted_by_key

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
            node: Message(
                RecordDict(
                    {
                        SECAGG_RECORD: ConfigRecord(
                            {Key.STAGE: stage, ROUND_KEY: state.server_round, **values}
                        )
                    }
                ),
                dst_node_id=node,
                message_type=MessageType.TRAIN,
                group_id=str(state.server_round),
            )
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
            Key.CLIPPING_RANGE: self.clipping_range,
            Key.TARGET_RANGE: self.quantization_range,
            Key.MOD_RANGE: self.modulus_range,
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
                for key in keys:
                    if not isinstance(key, bytes) or key in seen:
                        raise ValueError("a public key repeated or not bytes")
                    bytes_to_public_key(key)
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
        statement: list[bytes | int] = [
            state.server_round,
            node,
            cast(bytes, record[Key.PUBLIC_KEY_1]),
            cast(bytes, record[Key.PUBLIC_KEY_2]),
        ]
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

    # ------------------------------------------------------------- unmask
    def _masked(self, reply: Message, length: int) -> NDArray[np.uint32]:
        record = reply.content.config_records.get(SECAGG_RECORD)
        if record is None:
            raise ValueError(
                f"the reply has no masked vector: the node's ClientApp does not mask "
                f"its reply; {MISSING_MOD_HINT}"
            )
        if reply.content.array_records:
            raise ValueError(
                "the reply carries plain ArrayRecords beside its masked vector "
                f"{sorted(reply.content.array_records)}: refused unread"
            )
        return from_bytes(
            cast(bytes, record.get(Key.MASKED_PARAMETERS)),
            length,
            self.modulus_range,  # type: ignore[arg-type]
        )

    def _skeleton(self, reply: Message, state: _Round) -> Message:
        """Return the reply as the strategy screens it: its metrics, zero arrays."""
        if not state.zeros:  # one set per round, shared by every stand-in
            state.zeros = {
                name: dict_to_record(
                    {k: np.zeros(a.shape, dtype=a.dtype) for k, a in layout.items()}
                )
                for name, layout in state.spec.items()
            }
        reply.content = RecordDict(
            {**state.zeros, **dict(reply.content.metric_records)}
        )
        return reply

    def _unmask(
        self,
        state: _Round,
        vectors: dict[int, NDArray[np.uint32]],
        weights: Mapping[int, int],
    ) -> _Sums:
        """Run the unmask stage; return the unmasked sums, decoded and checked.

        ``weights`` holds each contributor's weight code, from its plain weight.
        """
        assert self._grid is not None and state.layout is not None
        contributors = set(vectors)
        dead = state.shared - contributors
        if len(contributors) < state.threshold:
            raise _UnmaskFailed(
                f"{len(contributors)} valid masked vector(s), fewer than the "
                f"reconstruction threshold {state.threshold}"
            )
        signatures: dict[str, Any] = {}
        if self.active_adversary:
            self._consistency(state, contributors)
            signers = sorted(state.survivor_signatures)
            signatures = {
                SIGNERS_KEY: signers,
                SIGNATURE_KEY: [state.survivor_signatures[n] for n in signers],
            }
        contents = {
            node: {
                Key.ACTIVE_NODE_ID_LIST: sorted(state.neighbours[node] & contributors),
                Key.DEAD_NODE_ID_LIST: sorted(state.neighbours[node] & dead),
                **signatures,
            }
            for node in sorted(contributors)
        }
        answers = self._exchange(
            self._grid,
            state,
            Stage.UNMASK,
            contents,
            (Key.NODE_ID_LIST, Key.SHARE_LIST),
        )
        shares: dict[int, dict[int, bytes]] = {n: {} for n in state.shared}
        for holder, record in answers.items():
            nids, given = record[Key.NODE_ID_LIST], record[Key.SHARE_LIST]
            asked = contents[holder]
            if not (
                isinstance(nids, list)
                and isinstance(given, list)
                and len(nids) == len(given)
                and sorted(nids)
                == sorted(asked[Key.ACTIVE_NODE_ID_LIST] + asked[Key.DEAD_NODE_ID_LIST])
                and all(isinstance(s, bytes) for s in given)
            ):
                state.dropped.setdefault(holder, "unmask: malformed shares (ignored)")
                continue
            for owner, share in zip(nids, given, strict=True):
                shares[cast(int, owner)][holder] = cast(bytes, share)
        total = np.zeros(state.layout.length, dtype=np.uint32)  # sums wrap mod 2**32
        for vector in vectors.values():
            total += vector
        for owner in sorted(contributors):
            seed = self._recover(
                state,
                owner,
                shares[owner],
                _matches(commitment, state.commitments[owner]),
            )
            add_mask(total, seed, -1)
        for owner in sorted(dead):
            sk1 = self._recover(
                state,
                owner,
                shares[owner],
                _matches(_public_of, state.public_keys[owner][0]),
            )
            for other in sorted(state.neighbours[owner] & contributors):
                seed = pairwise_seed(sk1, state.public_keys[other][0])
                # ``other`` added its mask for ``owner``; take it out again.
                add_mask(total, seed, -pairwise_sign(other, owner))
        total = reduce(total, self.modulus_range)
        return self._decode(state, total.astype(np.int64), weights)

    def _consistency(self, state: _Round, contributors: set[int]) -> None:
        """Have every contributor sign the survivor set; keep the valid signatures.

        Active-adversary mode: a node reveals shares only after checking ``t``
        of its neighbours' signatures on the set it signed itself.
        """
        assert self._grid is not None
        survivors = sorted(contributors)
        answers = self._exchange(
            self._grid,
            state,
            CONSISTENCY_STAGE,
            {node: {SURVIVORS_KEY: survivors} for node in survivors},
            (SIGNATURE_KEY,),
        )
        for node, record in answers.items():
            signature = record[SIGNATURE_KEY]
            statement = signing.survivors_statement(
                state.server_round, state.public_keys[node][0], survivors
            )
            if signing.verify(
                state.signing_keys[node],
                signature,
                signing.SURVIVORS_CONTEXT,
                statement,
            ):
                state.survivor_signatures[node] = cast(bytes, signature)
            else:
                state.dropped.setdefault(
                    node, "consistency-check: its signature of the survivors is invalid"
                )
        log(
            INFO,
            "SecAggPlus: round %d: consistency check: %d of %d contributors signed "
            "the survivor set; each reveals shares only after checking %d signatures",
            state.server_round + self.strategy.round_offset,
            len(state.survivor_signatures),
            len(survivors),
            state.threshold,
        )

    def _recover(
        self,
        state: _Round,
        owner: int,
        shares: dict[int, bytes],
        valid: Callable[[bytes], bool],
    ) -> bytes:
        """Rebuild one secret from the shares that came back; name holders of bad ones.

        The owner split its secrets over its neighbourhood as the server sent
        it at ``share_keys`` (sorted), so a holder's share is the polynomials
        at the holder's position there plus one. Recovery tolerates wrong
        shares (error correction, then a search of subsets checked against the
        owner's commitment or public key) and drops every holder whose share
        disagrees with the secret found.
        """
        order = sorted(state.neighbours[owner] & set(state.public_keys))
        x_of = {node: position + 1 for position, node in enumerate(order)}
        given = {x_of[holder]: share for holder, share in shares.items()}
        t = state.threshold
        if len(given) < t:
            raise _UnmaskFailed(
                f"{len(given)} share(s) of node {owner}'s secret came back, fewer "
                f"than the threshold {t}"
            )
        try:
            found = shamir.recover(given, t, valid)
        except shamir.ShamirError as err:
            raise _UnmaskFailed(
                f"no {t} of the {len(given)} shares of node {owner}'s secret "
                f"rebuild it (corrupt shares): {err}"
            ) from err
        for x in found.disagreeing:
            state.dropped.setdefault(
                order[x - 1],
                f"unmask: its share of node {owner}'s secret is corrupt (ignored)",
            )
        return found.secret

    def _weight_code(self, reply: ValidReply) -> int:
        """Return the weight code a reply's plain weight metric gives (as masked)."""
        key = self._weight_key()
        if not key:
            return self.quantization_range
        weight = reply.metrics.get(key)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            return -1  # no honest code: the check below names the round
        return self.quantizer.weight_code(float(weight), self.max_weight)

    def _decode(
        self, state: _Round, total: NDArray[np.int64], weights: Mapping[int, int]
    ) -> _Sums:
        """Decode the unmasked sums; fail unless honest contributors could send them.

        The weight code sum must equal, exactly, the sum of the codes of the
        contributors' plain weights; each record's code sums must lie where
        clipped values of those weights put them (:meth:`Quantizer.code_range`).
        """
        assert state.layout is not None
        layout, q = state.layout, self.quantizer
        count, t = len(weights), q.quantization_range
        expected = sum(weights.values())
        if int(total[0]) != expected:
            raise _UnmaskFailed(
                f"the unmasked weight sum {int(total[0])} is not {expected}, the sum "
                f"of the codes of the {count} contributors' plain weights: a "
                "contributor masked another weight than it reported (or a corrupt "
                "vector)"
            )
        clipped = int(total[1])
        if not 0 <= clipped <= count * t:
            raise _UnmaskFailed(
                "the unmasked count of clipped values is out of range: a "
                "contributor sent a corrupt masked vector"
            )
        weight_sum = expected / t
        ranges = {
            "mean": [q.code_range(w) for w in weights.values()],
            "sum": [q.code_range(t)] * count,
        }
        spec = state.spec
        means: dict[str, dict[str, NDArray]] = {}
        holds: dict[str, dict[str, NDArray]] = {}
        for name, kind, keys, codes in zip(
            layout.records, layout.kinds, layout.keys, layout.split(total), strict=True
        ):
            low = sum(r[0] for r in ranges[kind])
            high = sum(r[1] for r in ranges[kind])
            if codes.size and (int(codes.min()) < low or int(codes.max()) > high):
                raise _UnmaskFailed(
                    f"the unmasked sum of {name!r} lies outside [{low}, {high}], "
                    "where the clipped values of honest contributors put it: a "
                    "contributor sent values beyond clipping_range (or a corrupt "
                    "vector)"
                )
            summed = q.decode_sum(codes, count)
            value = summed / (weight_sum if kind == "mean" else count)
            arrays = _unflatten(value, keys, spec[name])
            if kind == "mean" or name not in means:
                means[name] = arrays
            if kind == "sum" or name not in holds:
                holds[name] = arrays
        return _Sums(means, holds, weight_sum, clipped)

    def _metrics(
        self,
        metrics: MetricRecord | None,
        state: _Round,
        valid: list[ValidReply],
        weight_sum: float | None,
        total_clipped: int,
    ) -> MetricRecord | None:
        if metrics is None or not self.strategy.pack_metrics:
            return metrics
        # What came in: the contributors' masked vectors, not the plain records
        # the strategy counted from its stand-ins.
        assert state.layout is not None
        metrics["bytes-received"] = 4 * state.layout.length * len(valid)
        metrics["secagg-contributors"] = len(valid) if weight_sum is not None else 0
        contributed = len(valid) if weight_sum is not None else 0
        metrics["secagg-dropped"] = len(state.messages) - contributed
        metrics["secagg-clipped"] = total_clipped  # unmasked: the round's total
        if total_clipped and not self._clip_warned:
            self._clip_warned = True
            log(
                WARNING,
                "SecAggPlus: round %d: the clients clipped %d values to "
                "clipping_range=%g before masking, so the sums the rule got are not "
                "the replies' sums; raise clipping_range (warned once per run; each "
                "round's secagg-clipped metric counts them)",
                state.server_round + self.strategy.round_offset,
                total_clipped,
                self.clipping_range,
            )
        if weight_sum is not None and valid:
            # Each client's code is off by less than one step: n steps per sum.
            metrics["secagg-sum-error-bound"] = len(valid) * self.quantizer.step
            uniform = self.strategy.weighting == "uniform"
            metrics["secagg-error-bound"] = (
                self.quantizer.step
                if uniform
                else self.quantizer.mean_error_bound(len(valid), weight_sum)
            )
        return metrics

    def _count(self, node: int, kind: str, why: str, server_round: int) -> None:
        log(WARNING, "SecAggPlus: round %d: node %d: %s", server_round, node, why)
        self.strategy.screen.count(node, ReplyRejected(kind, why), PHASE)


class _Sums(NamedTuple):
    """A round's unmasked sums, decoded."""

    means: dict[str, dict[str, NDArray]]  # each record's mean (or sum over n)
    holds: dict[str, dict[str, NDArray]]  # what each stand-in reply holds
    weight_sum: float  # sum of r = weight code / T
    clipped: int  # values the contributors clipped, in total


class _UnmaskFailed(Exception):
    """The round's sum cannot be unmasked: why."""


def _matches(
    derive: Callable[[bytes], bytes | None], expected: bytes
) -> Callable[[bytes], bool]:
    """Return a check that a rebuilt secret derives ``expected``."""
    return lambda secret: derive(secret) == expected


def _public_of(private_key: bytes) -> bytes | None:
    try:
        return public_key_to_bytes(bytes_to_private_key(private_key).public_key())
    except (ValueError, TypeError):
        return None


def _unflatten(
    values: NDArray, keys: tuple[str, ...], spec: Mapping[str, Any]
) -> dict[str, NDArray]:
    arrays, start = {}, 0
    for key in keys:
        shape, dtype = spec[key].shape, spec[key].dtype
        size = int(np.prod(shape))
        array = values[start : start + size].reshape(shape).astype(dtype)
        array.flags.writeable = False
        arrays[key] = array
        start += size
    return arrays

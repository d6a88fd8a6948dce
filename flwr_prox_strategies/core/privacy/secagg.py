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
from typing import Any, cast

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
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from numpy.typing import NDArray

from ..client.secagg import pairwise_seed
from ..contract.validation import ReplyRejected, ValidReply, client_error_text
from ..server.strategy import ScreenedRound, ValidatedFedAvg
from ..transport.flower import (
    bytes_to_private_key,
    bytes_to_public_key,
    public_key_to_bytes,
)
from ..transport.records import RecordSpec, dict_to_record
from ..transport.secagg import (
    CLIPPED_METRIC,
    COMMITMENT_KEY,
    MISSING_MOD_HINT,
    ROUND_KEY,
    SECAGG_RECORD,
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

PHASE = "aggregate_train"
#: The error code of the stand-in reply of a node the protocol dropped.
SECAGG_DROPPED_CODE = 0


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
    shared: set[int] = field(default_factory=set)  # completed share_keys
    dropped: dict[int, str] = field(default_factory=dict)  # node -> why
    failure: str | None = None  # why the round cannot be aggregated


class SecAggPlus(Strategy):
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
        ``num_shares`` (at least 2). Up to ``num_shares -
        reconstruction_threshold`` neighbours may drop after sharing keys;
        fewer than the threshold cannot learn anything.
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
    """

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
        self.strategy = strategy
        self.num_shares = num_shares
        self.reconstruction_threshold = reconstruction_threshold
        self.max_weight = float(max_weight)
        self.quantizer = Quantizer(
            float(clipping_range), quantization_range, modulus_range
        )
        self.timeout = timeout
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
            "max_weight=%g); the server sees per-client metrics only",
            type(self.strategy).__name__,
            self.strategy.secure_sums(),
            self.num_shares,
            self.reconstruction_threshold,
            self.clipping_range,
            self.quantization_range,
            self.max_weight,
        )
        self.strategy.summary()

    # ------------------------------------------------------------------ run
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run Flower's ``Strategy.start`` here; fail as the strategy would.

        Same parameters and result as the wrapped strategy's ``start()``.
        """
        self.strategy.reset_run()
        self._clip_warned = False
        self.strategy.stall.final_round = self.strategy.round_offset + num_rounds
        result = super().start(
            grid=grid,
            initial_arrays=initial_arrays,
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
        )
        return self.strategy.check_run(result, num_rounds=num_rounds)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Return the strategy's evaluation messages (replies carry metrics only)."""
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Return the strategy's evaluation metrics."""
        return self.strategy.aggregate_evaluate(server_round, replies)

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
            try:
                sums = self._unmask(state, {n: vectors[n] for n in contributors})
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
            return arrays, self._metrics(metrics, state, [], None)
        assert sums is not None
        means, replies_hold, weight_sum = sums
        for valid_reply in screened.valid:
            valid_reply.arrays = replies_hold
        inner._secure_means = means
        try:
            arrays, metrics = inner.aggregate_screened(round_, screened)
        finally:
            inner._secure_means = None
        return arrays, self._metrics(metrics, state, screened.valid, weight_sum)

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
            max(2, round(threshold * count))
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
        state.spec = spec = self.strategy.expected_train_arrays(
            state.server_round + self.strategy.round_offset
        )
        declared = self.strategy.secure_sums() or {}
        state.layout = Layout.from_declaration(
            declared,
            {name: {k: a.shape for k, a in spec[name].items()} for name in declared},
            uniform=self.strategy.weighting == "uniform",
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
        }
        answers = self._exchange(
            grid,
            state,
            Stage.SETUP,
            {node: config for node in nodes},
            (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2),
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

    def _share_keys(self, grid: Grid, state: _Round) -> None:
        active = set(state.public_keys)
        contents = {
            node: {
                str(other): list(state.public_keys[other])
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
        self, state: _Round, vectors: dict[int, NDArray[np.uint32]]
    ) -> tuple[dict[str, dict[str, NDArray]], dict[str, dict[str, NDArray]], float]:
        """Run the unmask stage; return the means, what each reply holds, sum r."""
        assert self._grid is not None and state.layout is not None
        contributors = set(vectors)
        dead = state.shared - contributors
        if len(contributors) < state.threshold:
            raise _UnmaskFailed(
                f"{len(contributors)} valid masked vector(s), fewer than the "
                f"reconstruction threshold {state.threshold}"
            )
        contents = {
            node: {
                Key.ACTIVE_NODE_ID_LIST: sorted(state.neighbours[node] & contributors),
                Key.DEAD_NODE_ID_LIST: sorted(state.neighbours[node] & dead),
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
        return self._decode(state, total.astype(np.int64), len(contributors))

    def _recover(
        self,
        state: _Round,
        owner: int,
        shares: dict[int, bytes],
        valid: Callable[[bytes], bool],
    ) -> bytes:
        """Rebuild one secret from ``threshold`` shares; name holders of bad ones."""
        holders = sorted(shares)
        t = state.threshold
        if len(holders) < t:
            raise _UnmaskFailed(
                f"{len(holders)} share(s) of node {owner}'s secret came back, fewer "
                f"than the threshold {t}"
            )
        first = _combine([shares[h] for h in holders[:t]])
        if first is not None and valid(first):
            return first  # the usual case: one combination (Shamir is slow)
        good = None
        for start in range(1, len(holders) - t + 1):
            subset = holders[start : start + t]
            secret = _combine([shares[h] for h in subset])
            if secret is not None and valid(secret):
                good = (subset, secret)
                break
        if good is None:
            raise _UnmaskFailed(
                f"no {t} of the {len(holders)} shares of node {owner}'s secret "
                "rebuild it (corrupt shares)"
            )
        # Some of the first t shares are corrupt: find whose, against a good set.
        subset, secret = good
        for holder in holders:
            if holder in subset:
                continue
            trial = _combine([shares[h] for h in subset[1:]] + [shares[holder]])
            if trial is None or not valid(trial):
                state.dropped.setdefault(
                    holder,
                    f"unmask: its share of node {owner}'s secret is corrupt (ignored)",
                )
        return secret

    def _decode(
        self, state: _Round, total: NDArray[np.int64], count: int
    ) -> tuple[dict[str, dict[str, NDArray]], dict[str, dict[str, NDArray]], float]:
        assert state.layout is not None
        layout, q = state.layout, self.quantizer
        weight_code = int(total[0])
        if not count <= weight_code <= count * q.quantization_range:
            raise _UnmaskFailed(
                "the unmasked weight sum is out of range: a contributor sent a "
                "corrupt masked vector"
            )
        weight_sum = weight_code / q.quantization_range
        spec = state.spec
        means: dict[str, dict[str, NDArray]] = {}
        holds: dict[str, dict[str, NDArray]] = {}
        for name, kind, keys, codes in zip(
            layout.records, layout.kinds, layout.keys, layout.split(total), strict=True
        ):
            if codes.size and (
                int(codes.min()) < 0 or int(codes.max()) > count * q.quantization_range
            ):
                raise _UnmaskFailed(
                    f"the unmasked sum of {name!r} is out of range: a contributor "
                    "sent a corrupt masked vector"
                )
            summed = q.decode_sum(codes, count)
            value = summed / (weight_sum if kind == "mean" else count)
            arrays = _unflatten(value, keys, spec[name])
            if kind == "mean" or name not in means:
                means[name] = arrays
            if kind == "sum" or name not in holds:
                holds[name] = arrays
        return means, holds, weight_sum

    def _metrics(
        self,
        metrics: MetricRecord | None,
        state: _Round,
        valid: list[ValidReply],
        weight_sum: float | None,
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
        clipped = [r.metrics.get(CLIPPED_METRIC, 0) for r in valid]
        total_clipped = int(sum(c for c in clipped if isinstance(c, int)))
        metrics["secagg-clipped"] = total_clipped
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


class _UnmaskFailed(Exception):
    """The round's sum cannot be unmasked: why."""


def _matches(
    derive: Callable[[bytes], bytes | None], expected: bytes
) -> Callable[[bytes], bool]:
    """Return a check that a rebuilt secret derives ``expected``."""
    return lambda secret: derive(secret) == expected


def _combine(shares: list[bytes]) -> bytes | None:
    try:
        return combine_shares(shares)
    except (ValueError, IndexError):
        return None


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

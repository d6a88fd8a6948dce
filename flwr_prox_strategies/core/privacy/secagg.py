"""The server half of SecAgg+: a wrapper that runs any summing strategy securely.

:class:`SecAggPlus` runs the protocol's stages (its bases
:class:`.secagg_exchange.KeyExchange` and :class:`.secagg_unmask.Unmasking`) inside
the strategy's own round, as ``docs/explanation/secure-aggregation.md`` describes.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from numpy.typing import NDArray

from ...ops.checks import check_positive
from ...ops.privacy.accounting import (
    DEFAULT_ORDERS,
    rdp_to_epsilon,
    smallest_contributors,
)
from ...ops.privacy.encoding import upload_layout
from ...ops.privacy.neighbourhoods import (
    CORRECTNESS_BITS,
    CORRUPT_FRACTION,
    DROPOUT_FRACTION,
    SECURITY_BITS,
    check_settings,
)
from ..contract.ledger import DELTA_METRIC, EPSILON_TOTAL_METRIC
from ..contract.validation import ReplyRejected, ValidReply
from ..server.strategy import ScreenedRound, ValidatedFedAvg
from ..transport.ddp import DDPRound, noise_multiplier_at
from ..transport.records import dict_to_record
from ..transport.secagg import (
    MISSING_MOD_HINT,
    ROUND_KEY,
    SECAGG_RECORD,
    WEIGHT_KEY,
    Key,
    Quantizer,
    Stage,
    from_bytes,
)
from ..wrapper import StrategyWrapper
from .distributed import Account, DistributedDP, PrivacyBudgetSpentError
from .secagg_exchange import _Round
from .secagg_unmask import UnmaskFailed, Unmasking

PHASE = "aggregate_train"
EPSILON_MAX_METRIC = f"{EPSILON_TOTAL_METRIC}-max"
EPSILON_MEAN_METRIC = f"{EPSILON_TOTAL_METRIC}-mean"
#: The error code of the stand-in reply of a node the protocol dropped.
SECAGG_DROPPED_CODE = 0


def _check_strong_threshold(
    num_shares: int | float | str, threshold: int | float | None
) -> None:
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


class SecAggPlus(Unmasking, StrategyWrapper):
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
    num_shares : int | float | str (default: "auto")
        Each client's neighbourhood (itself included), which holds the shares
        of its secrets and masks with it: ``"auto"``, the smallest that keeps
        the round private, connected and unmaskable under
        ``corrupt_fraction`` and ``dropout_fraction`` (it grows as ``log n``:
        13 of 50 sampled nodes, 23 of 100, 33 of 200, 47 of 1,000; everyone
        up to 5;
        ``ops.privacy.neighbourhoods.neighbourhood_size``);
        a count (>= 3); or a fraction of the round's sampled nodes (1.0:
        everyone, SecAgg). Under ``distributed_dp``, ``"auto"`` is everyone:
        its account counts the noise of only ``t`` contributors, and a small
        neighbourhood's ``t`` would spend the budget faster.
    reconstruction_threshold : int | float | None (default: None)
        Shares needed to rebuild a secret: a count (>= 2), or a fraction of
        ``num_shares`` (rounded up, at least 2); None: the least the
        automatic size allows (it survives the most dropouts), else 0.6.
        Up to ``num_shares -
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
    security_bits : float (default: 40)
        ``sigma`` of ``num_shares="auto"`` (Bell et al. 2020's statistical
        security parameter): a round leaks (some client has ``t`` colluding
        neighbours, or the honest survivors split) with probability at most
        ``2**-sigma``.
    correctness_bits : float (default: 20)
        ``eta`` of ``num_shares="auto"``: a round cannot be unmasked (it keeps
        the previous model) with probability at most ``2**-eta``.
    corrupt_fraction : float (default: 0.1)
        The fraction of sampled clients ``num_shares="auto"`` assumes collude
        with the server (rounded up), in ``[0, 0.5)``.
    dropout_fraction : float (default: 0.1)
        The fraction of sampled clients ``num_shares="auto"`` assumes drop
        out during a round (rounded up), in ``[0, 0.5)``.
    distributed_dp : DistributedDP | None (default: None)
        User-level DP against the server
        (:class:`~flwr_prox_strategies.DistributedDP`): each client clips
        every record it uploads together, adds its share of discrete noise
        and masks it modulo ``2**bits`` (``clipping_range``,
        ``quantization_range`` and ``modulus_range`` are then unused). The
        strategy must weigh uniformly. Each round's metrics carry the
        round's and the run's epsilon (``ddp-epsilon``,
        ``ddp-epsilon-total``); a round that would pass ``target_epsilon``
        is not started.
    """

    strategy: ValidatedFedAvg

    def __init__(
        self,
        strategy: ValidatedFedAvg,
        *,
        num_shares: int | float | str = "auto",
        reconstruction_threshold: int | float | None = None,
        max_weight: float = 1000.0,
        clipping_range: float = 8.0,
        quantization_range: int = 2**22,
        modulus_range: int = 2**32,
        timeout: float | None = 300.0,
        active_adversary: bool = False,
        allow_weak_threshold: bool = False,
        security_bits: float = SECURITY_BITS,
        correctness_bits: float = CORRECTNESS_BITS,
        corrupt_fraction: float = CORRUPT_FRACTION,
        dropout_fraction: float = DROPOUT_FRACTION,
        distributed_dp: DistributedDP | None = None,
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
        if num_shares != "auto":
            _check_fraction_or_count("num_shares", num_shares, 3)
        check_settings(
            threshold=None,  # checked below, as every threshold
            security_bits=security_bits,
            correctness_bits=correctness_bits,
            corrupt_fraction=corrupt_fraction,
            dropout_fraction=dropout_fraction,
        )
        if reconstruction_threshold is not None:
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
        if not allow_weak_threshold and reconstruction_threshold is not None:
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
        check_positive("max_weight", max_weight)
        check_positive("clipping_range", clipping_range)
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
        if distributed_dp is not None:
            if not isinstance(distributed_dp, DistributedDP):
                raise ValueError(
                    f"distributed_dp must be a DistributedDP, got {distributed_dp!r}"
                )
            if strategy.weighting != "uniform":
                raise ValueError(
                    f"distributed_dp needs {name} with weighting='uniform' (it has "
                    f"{strategy.weighting!r}): a client's weight would scale what "
                    "it can move the sum by, so the noise would not cover it; "
                    "distributed DP averages every client's clipped upload once"
                )
        super().__init__(strategy)
        self.distributed_dp = distributed_dp
        self.account = Account(distributed_dp.delta) if distributed_dp else None
        self.num_shares = num_shares
        self.reconstruction_threshold = reconstruction_threshold
        self.security_bits = security_bits
        self.correctness_bits = correctness_bits
        self.corrupt_fraction = corrupt_fraction
        self.dropout_fraction = dropout_fraction
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
            f"modulus_range={self.modulus_range}"
            + (
                ""
                if self.distributed_dp is None
                else f", distributed_dp={self.distributed_dp!r}"
            )
            + ")"
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
            (
                f"auto: sized for {self.corrupt_fraction:g} colluding and "
                f"{self.dropout_fraction:g} dropping, 2**-{self.security_bits:g} "
                f"leak, 2**-{self.correctness_bits:g} lost round"
            )
            if self.num_shares == "auto"
            else self.num_shares,
            self.reconstruction_threshold,
            self.clipping_range,
            self.quantization_range,
            self.max_weight,
            ", active adversary: signed keys and survivor set"
            if self.active_adversary
            else "",
        )
        dp = self.distributed_dp
        if dp is not None:
            log(
                INFO,
                "SecAggPlus: distributed DP (%s noise, noise_multiplier=%g over %d "
                "expected clients, l2_clip=%g on every summed record together, "
                "%d bits, delta=%g, target_epsilon=%s): clients noise their uploads, "
                "the server sees only noisy sums; each round is charged with the "
                "fewest contributors the threshold allows",
                dp.mechanism,
                dp.noise_multiplier,
                dp.expected_clients,
                dp.l2_clip,
                dp.bits,
                dp.delta,
                dp.target_epsilon,
            )
        self.strategy.summary()

    # ------------------------------------------------------------------ run
    def begin_run(self, initial_arrays: ArrayRecord, num_rounds: int) -> None:
        """Begin the strategy's run; this run's warnings are new."""
        super().begin_run(initial_arrays, num_rounds)
        self._clip_warned = self._weak_warned = False
        if self.distributed_dp is not None:
            self.account = Account(self.distributed_dp.delta)

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
        if state.failure is None and self.distributed_dp is not None:
            self._plan_noise(state, arrays)
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
                    **(state.ddp.config() if state.ddp is not None else {}),
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
        length = state.length
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
            except UnmaskFailed as err:
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
        if self.account is not None and state.rdp is not None:
            self.account.charge(state.rdp)
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

    def _weight_key(self) -> str:
        if self.strategy.weighting == "uniform":
            return ""
        return self.strategy.weighted_by_key

    # ------------------------------------------------------ collected replies
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
            self.masking_modulus,
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

    def _weight_code(self, reply: ValidReply) -> int:
        """Return the weight code a reply's plain weight metric gives (as masked)."""
        key = self._weight_key()
        if not key:
            return self.quantization_range
        weight = reply.metrics.get(key)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            return -1  # no honest code: the check below names the round
        return self.quantizer.weight_code(float(weight), self.max_weight)

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
        metrics["bytes-received"] = 4 * state.length * len(valid)
        contributed = len(valid) if weight_sum is not None else 0
        metrics["secagg-contributors"] = contributed
        metrics["secagg-dropped"] = len(state.messages) - contributed
        if state.ddp is not None:
            return self._privacy_metrics(metrics, state, contributed)
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

    # ------------------------------------------------------ distributed DP
    def _plan_noise(self, state: _Round, arrays: ArrayRecord) -> None:
        """Set the round's distributed-DP encoding; stop the run past its budget.

        Every declared record is uploaded; a record the train messages carry
        (the global model) as its change. The round is charged with the fewest
        contributors the threshold allows; when that would pass
        ``target_epsilon``, nothing is sent (:class:`PrivacyBudgetSpentError`).
        """
        dp, account = self.distributed_dp, self.account
        assert dp is not None and account is not None
        shown = state.server_round + self.strategy.round_offset
        names = sorted(self.strategy.secure_sums() or {})
        sent = [m.content.array_records for m in state.messages.values()]
        relative = [n for n in names if n in sent[0]]
        for name in relative:
            if any(not _same(records.get(name), sent[0][name]) for records in sent):
                state.failure = (
                    f"distributed DP uploads {name!r} as each client's change of "
                    "the record sent, and the round sends different ones"
                )
                return
        try:
            upload = upload_layout(
                {
                    name: {
                        key: np.broadcast_to(np.zeros((), spec.dtype), spec.shape)
                        for key, spec in state.spec[name].items()
                    }
                    for name in names
                }
            )
            settings = dp.encoding(upload.dim, len(state.messages))
            fewest = smallest_contributors(
                len(state.messages), state.threshold, dp.colluding
            )
        except ValueError as err:
            state.failure = f"distributed DP: {err}"
            return
        rdp = dp.round_rdp(settings, upload.padded_dim, fewest)
        if account.rounds == 0 and self.strategy.round_offset > 0:
            # A resumed run: its earlier rounds are charged at this round's rate
            # (once: the charge counts them, so account.rounds is no longer 0).
            account.charge(rdp, self.strategy.round_offset)
            log(
                INFO,
                "SecAggPlus: distributed DP: resumed after round %d; its %d earlier "
                "rounds are charged at this round's rate (epsilon %.4g so far)",
                self.strategy.round_offset,
                self.strategy.round_offset,
                account.epsilon(),
            )
        after = account.epsilon(rdp)
        if dp.target_epsilon is not None and after > dp.target_epsilon:
            raise PrivacyBudgetSpentError(
                f"SecAggPlus: distributed DP: round {shown} would take epsilon from "
                f"{account.epsilon():.4g} to {after:.4g} (delta {dp.delta:g}), past "
                f"target_epsilon={dp.target_epsilon:g}: training stops before it",
                Result(arrays=arrays),
                shown,
            )
        seed = secrets.randbelow(2**31)  # the rotation's: any seed keeps the bound
        state.ddp = DDPRound(settings, seed, tuple(names), tuple(relative))
        state.upload = upload
        state.rdp = rdp
        state.fewest = fewest

    def _privacy_metrics(
        self,
        metrics: MetricRecord,
        state: _Round,
        contributed: int,
    ) -> MetricRecord:
        """Add the round's distributed-DP figures: what was charged, and the total."""
        dp, account = self.distributed_dp, self.account
        assert dp is not None and account is not None and state.ddp is not None
        assert state.upload is not None and state.rdp is not None
        revealed = contributed > 0  # the sum was unmasked: the round was charged
        settings, padded = state.ddp.settings, state.upload.padded_dim
        multiplier = noise_multiplier_at(settings, padded, state.fewest)
        spent = account.epsilon()
        metrics["ddp-epsilon"] = (
            rdp_to_epsilon(DEFAULT_ORDERS, state.rdp, dp.delta) if revealed else 0.0
        )
        metrics["ddp-epsilon-total"] = spent
        metrics["ddp-delta"] = float(dp.delta)
        metrics["ddp-noise-contributors"] = state.fewest
        metrics["ddp-noise-multiplier"] = multiplier
        metrics["ddp-granularity"] = float(settings.granularity)
        if EPSILON_MAX_METRIC not in metrics:  # no client reports its own (DP-SGD)
            # User level: every client is charged the same, so the ledger's
            # summary, plot and log line read the run's figure.
            metrics[EPSILON_MAX_METRIC] = metrics[EPSILON_MEAN_METRIC] = spent
            metrics[DELTA_METRIC] = float(dp.delta)
        log(
            INFO,
            "SecAggPlus: round %d: distributed DP: %s; noise of at least %d "
            "contributors (noise multiplier %.3g over the integer sensitivity, "
            "granularity %.3g); epsilon %.4g for the run so far (delta %g)",
            state.server_round + self.strategy.round_offset,
            f"{contributed} noisy uploads summed" if revealed else "nothing revealed",
            state.fewest,
            multiplier,
            settings.granularity,
            spent,
            dp.delta,
        )
        return metrics

    def _count(self, node: int, kind: str, why: str, server_round: int) -> None:
        log(WARNING, "SecAggPlus: round %d: node %d: %s", server_round, node, why)
        self.strategy.screen.count(node, ReplyRejected(kind, why), PHASE)


def _same(record: ArrayRecord | None, first: ArrayRecord) -> bool:
    """Whether a train message's record is the first message's (same values)."""
    if record is first:
        return True
    if record is None or set(record) != set(first):
        return False
    return all(np.array_equal(record[k].numpy(), first[k].numpy()) for k in first)

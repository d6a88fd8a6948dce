"""The server's SecAgg+ unmasking: the shares asked for, secrets rebuilt, sums checked.

:class:`Unmasking` is the part of :class:`~flwr_prox_strategies.SecAggPlus`
that runs the last stages (in active-adversary mode the survivor set signed,
then ``unmask``), rebuilds each contributor's mask seed and each dropped
node's key from the shares that come back (naming the holders of corrupt
ones), takes every mask out of the sum and decodes it, refusing sums that
honest contributors could not have sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from logging import INFO
from typing import Any, NamedTuple, cast

import numpy as np
from flwr.common.logger import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

from ...ops.privacy.encoding import decode_sum
from ..transport import secagg as protocol
from ..transport import shamir, signing
from ..transport.agreement import public_of
from ..transport.secagg import (
    CONSISTENCY_STAGE,
    SIGNATURE_KEY,
    SIGNERS_KEY,
    SURVIVORS_KEY,
    Key,
    Stage,
)
from .secagg_exchange import KeyExchange, _Round


class Unmasking(KeyExchange):
    """The stages of a SecAgg+ round after collection, and the sums they unmask."""

    _grid: Grid | None

    def _unmask(
        self,
        state: _Round,
        vectors: dict[int, NDArray[np.uint32]],
        weights: Mapping[int, int],
    ) -> Sums:
        """Run the unmask stage; return the unmasked sums, decoded and checked.

        ``weights`` holds each contributor's weight code, from its plain weight.
        """
        assert self._grid is not None and state.layout is not None
        contributors = set(vectors)
        dead = state.shared - contributors
        if len(contributors) < state.threshold:
            raise UnmaskFailed(
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
        total = np.zeros(state.length, dtype=np.uint32)  # sums wrap mod 2**32
        for vector in vectors.values():
            np.add(total, vector, out=total)
        owners = sorted(contributors) + sorted(dead)
        secrets = self._recover_all(
            state,
            [
                (
                    owner,
                    shares[owner],
                    _matches(protocol.commitment, state.commitments[owner])
                    if owner in contributors
                    else _matches(_public_of, state.public_keys[owner][0]),
                )
                for owner in owners
            ],
        )
        masks: list[tuple[bytes, int]] = [
            (secrets[owner], -1) for owner in sorted(contributors)
        ]
        for owner in sorted(dead):
            sk1 = secrets[owner]
            others = sorted(state.neighbours[owner] & contributors)
            seeds = protocol.pairwise_seeds(
                sk1, [state.public_keys[other][0] for other in others]
            )
            for other, seed in zip(others, seeds, strict=True):
                # ``other`` added its mask for ``owner``; take it out again.
                masks.append((seed, -protocol.pairwise_sign(other, owner)))
        protocol.add_masks(total, masks)  # one buffer for every mask
        total = protocol.reduce(total, self.masking_modulus)
        if state.ddp is not None:
            return self._decode_noisy(state, total.astype(np.int64), len(weights))
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

    def _recover_all(
        self,
        state: _Round,
        wanted: list[tuple[int, dict[int, bytes], Callable[[bytes], bool]]],
    ) -> dict[int, bytes]:
        """Rebuild each owner's secret from the shares that came back, together.

        The owner split its secrets over its neighbourhood as the server sent
        it at ``share_keys`` (sorted), so a holder's share is the polynomials
        at the holder's position there plus one. Recovery (vectorised over
        the secrets, :func:`shamir.recover_many`) tolerates wrong shares
        (error correction, then a search of subsets checked against the
        owner's commitment or public key) and drops every holder whose share
        disagrees with the secret found. The first owner, in ``wanted``'s
        order, whose secret cannot be rebuilt fails the round.
        """
        t = state.threshold
        orders, sharings = {}, {}
        for owner, shares, valid in wanted:
            order = sorted(state.neighbours[owner] & set(state.public_keys))
            x_of = {node: position + 1 for position, node in enumerate(order)}
            orders[owner] = order
            sharings[owner] = (
                {x_of[holder]: share for holder, share in shares.items()},
                valid,
            )
        enough = [owner for owner, _, _ in wanted if len(sharings[owner][0]) >= t]
        found = dict(
            zip(
                enough,
                shamir.recover_many([sharings[o] for o in enough], t),
                strict=True,
            )
        )
        secrets: dict[int, bytes] = {}
        for owner, _, _ in wanted:
            given = sharings[owner][0]
            if owner not in found:
                raise UnmaskFailed(
                    f"{len(given)} share(s) of node {owner}'s secret came back, "
                    f"fewer than the threshold {t}"
                )
            result = found[owner]
            if isinstance(result, shamir.ShamirError):
                raise UnmaskFailed(
                    f"no {t} of the {len(given)} shares of node {owner}'s secret "
                    f"rebuild it (corrupt shares): {result}"
                ) from result
            for x in result.disagreeing:
                state.dropped.setdefault(
                    orders[owner][x - 1],
                    f"unmask: its share of node {owner}'s secret is corrupt (ignored)",
                )
            secrets[owner] = result.secret
        return secrets

    def _decode(
        self, state: _Round, total: NDArray[np.int64], weights: Mapping[int, int]
    ) -> Sums:
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
            raise UnmaskFailed(
                f"the unmasked weight sum {int(total[0])} is not {expected}, the sum "
                f"of the codes of the {count} contributors' plain weights: a "
                "contributor masked another weight than it reported (or a corrupt "
                "vector)"
            )
        clipped = int(total[1])
        if not 0 <= clipped <= count * t:
            raise UnmaskFailed(
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
                raise UnmaskFailed(
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
        return Sums(means, holds, weight_sum, clipped)

    def _decode_noisy(
        self, state: _Round, total: NDArray[np.int64], count: int
    ) -> Sums:
        """Decode distributed DP's noisy sum into each record's mean and sum.

        A record uploaded as a change of the record sent gets it back
        (``count`` times in the sum). A mean divides by the contributors, or
        by ``expected_clients`` (``denominator="expected"``). No range check:
        the noise can put an honest sum anywhere modulo ``2**bits``.
        """
        assert state.ddp is not None and state.upload is not None
        dp = self.distributed_dp
        assert dp is not None
        summed = decode_sum(
            total, state.upload, state.ddp.settings, round_seed=state.ddp.seed
        )
        sent = next(iter(state.messages.values())).content.array_records
        divisor = count if dp.denominator == "contributors" else dp.expected_clients
        means: dict[str, dict[str, NDArray]] = {}
        holds: dict[str, dict[str, NDArray]] = {}
        for name, arrays in summed.items():
            base = (
                {k: a.numpy() for k, a in sent[name].items()}
                if name in state.ddp.relative
                else {k: 0.0 for k in arrays}
            )
            spec = state.spec[name]
            mean = {k: base[k] + arrays[k].astype(np.float64) / divisor for k in arrays}
            hold = {k: base[k] + arrays[k].astype(np.float64) / count for k in arrays}
            means[name] = _frozen(mean, spec)
            holds[name] = _frozen(hold, spec)
        return Sums(means, holds, float(count), 0)


class Sums(NamedTuple):
    """A round's unmasked sums, decoded."""

    means: dict[str, dict[str, NDArray]]  # each record's mean (or sum over n)
    holds: dict[str, dict[str, NDArray]]  # what each stand-in reply holds
    weight_sum: float  # sum of r = weight code / T
    clipped: int  # values the contributors clipped, in total


class UnmaskFailed(Exception):
    """The round's sum cannot be unmasked: why."""


def _matches(
    derive: Callable[[bytes], bytes | None], expected: bytes
) -> Callable[[bytes], bool]:
    """Return a check that a rebuilt secret derives ``expected``."""
    return lambda secret: derive(secret) == expected


def _public_of(private_key: bytes) -> bytes | None:
    try:
        return public_of(private_key)
    except (ValueError, TypeError):
        return None


def _frozen(arrays: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, NDArray]:
    out = {}
    for key in spec:  # the model's order: a client may load arrays by position
        array = np.asarray(arrays[key]).astype(spec[key].dtype)
        array.flags.writeable = False
        out[key] = array
    return out


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

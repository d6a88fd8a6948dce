"""SecAgg+ over the Message API: what both sides share, the wire and the arithmetic.

Secure aggregation (Bell et al., 2020, "SecAgg+") lets the server learn the sum
of the round's client vectors and nothing else about any one of them: each
client quantises what the server rule sums into one integer vector, adds a
private mask and pairwise masks, and the masks are removed with Shamir shares
the survivors hold. The protocol's messages are Flower's; the key agreement is
X25519 (:mod:`.agreement`, where Flower uses P-384), the masks AES-128 in
counter mode keyed by a hash of the whole seed (:func:`expand_mask`, where Flower's
``pseudo_rand_gen`` keeps 32 bits), and the quantisation's rounding noise
comes from a generator of its own, not numpy's global one. The protocol and these
changes: the documentation's explanation of secure aggregation.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from numpy.typing import NDArray

from .agreement import MASK_SEED, shared_keys
from .keys import MISSING_MOD_HINT, SECAGG_RECORD

#: Keys of that record beside Flower's :class:`Key` (``stage``, ``pk1``, ...).
ROUND_KEY = "server-round"
RECORDS_KEY = "records"  # the declared records, in the vector's order
KINDS_KEY = "kinds"  # "mean" (weighted) or "sum" (plain), one per record
SIZES_KEY = "sizes"  # each record's element count
WEIGHT_KEY = "weight-key"  # the reply metric that weighs "mean" records ("" = 1)
COMMITMENT_KEY = "seed-commitment"  # SHA-256 of the private mask seed
# Active-adversary mode (the consistency check of Bonawitz et al. 2017): the
# setup asks for it; each node signs its keys, then the survivor set.
ACTIVE_KEY = "active-adversary"
CONSISTENCY_STAGE = "consistency-check"
SIGNATURE_KEY = "signature"  # a node's signature (setup: its keys; then survivors)
SIGNING_KEY_KEY = "signing-key"  # the node's public signing key (DER)
SURVIVORS_KEY = "survivors"  # the contributors, as the server tells them
SIGNERS_KEY = "signers"  # who signed the survivor set, beside SIGNATURE_KEY's list
#: A masked vector starts with the weight code, then the clipped count.
HEADER = 2
# Values a Quantizer codes at a time: two float64 buffers of 512 KB stay in
# cache and are reused, instead of a fresh model-sized array per operation.
_ENCODE_BLOCK = 1 << 16
__all__ = ["MISSING_MOD_HINT", "SECAGG_RECORD", "Key", "Stage"]


@dataclass(frozen=True)
class Quantizer:
    """The fixed-point code of the masked vectors.

    A value ``x`` is clipped to ``[-clipping_range, clipping_range]`` and
    mapped to an integer in ``[0, quantization_range]``; sums of ``n`` codes
    stay below ``modulus_range`` while ``n * quantization_range`` does.

    Parameters
    ----------
    clipping_range : float
        ``c``: the largest magnitude kept.
    quantization_range : int
        ``T``: the number of steps across ``[-c, c]``.
    modulus_range : int
        The modulus of the masked arithmetic (a power of 2, at most ``2**32``).
    """

    clipping_range: float
    quantization_range: int
    modulus_range: int

    @property
    def step(self) -> float:
        """One quantum, ``2c / T``: the largest rounding error of one value."""
        return 2.0 * self.clipping_range / self.quantization_range

    def max_contributors(self) -> int:
        """Return the most clients whose summed codes cannot wrap the modulus."""
        return (self.modulus_range - 1) // self.quantization_range

    def encode(
        self,
        values: NDArray,
        rng: np.random.Generator,
        weight_code: int | None = None,
        *,
        out: NDArray[np.integer] | None = None,
    ) -> NDArray[np.integer]:
        """Return the codes of ``values`` (stochastic rounding: unbiased).

        Each value is clipped to ``[-c, c]``, then scaled by ``weight_code / T``
        when a weight code is given (a weighted record's ``r x``): the codes
        stay within :meth:`code_range` of that weight, so the server can check
        every sum against what honest clients could have sent.

        ``values`` are taken block by block through two reused float64
        buffers, so no model-sized temporary is allocated (each one's first
        touch cost as much as the arithmetic); the codes go to ``out`` (the
        masked vector's slice, when given) or a new int64 array. The random
        draws are one stream in the values' order: encoding a record's arrays
        one after the other gives the codes of their concatenation.
        """
        c, t = self.clipping_range, self.quantization_range
        weight = t if weight_code is None else weight_code
        low, high = self.code_range(weight)
        flat = np.asarray(values).reshape(-1)
        codes = np.empty(flat.size, dtype=np.int64) if out is None else out
        if codes.shape != flat.shape:
            raise ValueError(f"out holds {codes.size} codes for {flat.size} values")
        scaled = np.empty(min(flat.size, _ENCODE_BLOCK), dtype=np.float64)
        draws = np.empty_like(scaled)
        for begin in range(0, flat.size, _ENCODE_BLOCK):
            stop = min(begin + _ENCODE_BLOCK, flat.size)
            part, fate = scaled[: stop - begin], draws[: stop - begin]
            part[...] = flat[begin:stop]  # float64 first: clip at c exactly
            # The operations and their order of ``(clip(x) * (w / t) + c) /
            # step``: the same codes as over the whole record at once.
            np.clip(part, -c, c, out=part)
            part *= weight / t
            part += c
            part /= self.step
            whole = np.floor(part)
            part -= whole  # the fraction: rounded up with that probability
            rng.random(out=fate)
            whole += fate < part
            np.clip(whole, low, high, out=whole)
            codes[begin:stop] = whole
        return codes

    def code_range(self, weight_code: int) -> tuple[int, int]:
        """Return the least and the greatest code of ``r x``, ``|x| <= c``.

        With ``r = weight_code / T`` the scaled value lies in ``[(T - w)/2,
        (T + w)/2]``; rounding gives its floor or its ceiling. A plain value
        (``w = T``) has codes in ``[0, T]``.
        """
        t = self.quantization_range
        return (t - weight_code) // 2, (t + weight_code + 1) // 2

    def decode_sum(self, codes: NDArray[np.int64], contributors: int) -> NDArray:
        """Return the sum of ``contributors`` values from the sum of their codes."""
        return codes.astype(np.float64) * self.step - contributors * self.clipping_range

    def weight_code(self, weight: float, max_weight: float) -> int:
        """Return a weight's code: ``round(T * weight / max_weight)``, at least 1."""
        return max(1, round(self.quantization_range * weight / max_weight))

    def mean_error_bound(self, contributors: int, weight_sum: float) -> float:
        r"""Return the largest error of one unmasked weighted mean's entry.

        With :math:`r_i` the coded weights (``weight_code / T``, at most 1), each
        client's :math:`r_i x_i` is off by less than one quantum :math:`2c/T`,
        and each :math:`r_i` by at most :math:`1/(2T)` from
        ``weight / max_weight``: :math:`|\hat m - m| < n(2c/T)/\sum r_i +
        n\,c/(T\sum r_i) = 3nc/(T\sum r_i)` for values within :math:`[-c, c]`.
        Uniform weights (:math:`r_i = 1`, exact) leave :math:`2c/T`.

        Parameters
        ----------
        contributors : int
            ``n``, the clients in the sum.
        weight_sum : float
            :math:`\sum r_i`.
        """
        return (
            3.0
            * contributors
            * self.clipping_range
            / (self.quantization_range * weight_sum)
        )


def expand_mask(seed: bytes, size: int) -> NDArray[np.uint32]:
    """Return ``size`` pseudo-random 32-bit words from ``seed``.

    AES-128 in counter mode from zero, keyed by the first 16 bytes of the
    seed's SHA-256: every bit of the seed matters (Flower's
    ``pseudo_rand_gen`` keeps 32 of them). 128 bits, because the key
    agreement the seeds come from (X25519) gives 128-bit security: a longer
    key would add none and cost 14 rounds a block instead of 10. Masked
    arithmetic runs on these words modulo ``2**32`` (numpy's uint32 wraps);
    any power-of-2 modulus up to ``2**32`` divides it, so the low bits are the
    masks modulo that modulus (:func:`reduce`).
    """
    words = np.zeros(size, dtype=np.uint32)
    add_masks(words, [(seed, 1)])
    return words


#: Words of a vector masked at a time: the block and the keystream's buffer
#: stay in the core's cache while every mask is added to the block.
_MASK_BLOCK = 1 << 15


def add_masks(vector: NDArray[np.uint32], masks: Iterable[tuple[bytes, int]]) -> None:
    """Add (sign 1) or subtract (-1) each ``(seed, sign)``'s mask, in place.

    Block by block: each mask's keystream continues where it stopped, so the
    words are those of :func:`expand_mask`, and a block of the vector is
    read and written once while all ``k`` masks pass through it (a client
    with ``k`` neighbours, or the server unmasking a round, allocates one
    small buffer, not ``k`` vectors).
    """
    streams = [
        (
            Cipher(
                algorithms.AES(hashlib.sha256(seed).digest()[:16]),
                modes.CTR(b"\0" * 16),
            ).encryptor(),
            sign > 0,
        )
        for seed, sign in masks
    ]
    zeros = memoryview(bytes(4 * _MASK_BLOCK))  # the keystream is AES-CTR of zeros
    # update_into asks for a cipher block's slack beyond the data.
    buffer = np.empty(_MASK_BLOCK + 4, dtype="<u4")
    out = memoryview(buffer.data).cast("B")
    for start in range(0, vector.size, _MASK_BLOCK):
        block = vector[start : start + _MASK_BLOCK]
        mask, plain = buffer[: block.size], zeros[: 4 * block.size]
        for stream, add in streams:
            stream.update_into(plain, out)
            if add:
                np.add(block, mask, out=block)
            else:
                np.subtract(block, mask, out=block)


def pairwise_seed(own_sk1: bytes, their_pk1: bytes) -> bytes:
    """Return the seed of the mask two nodes share (X25519, then HKDF)."""
    return pairwise_seeds(own_sk1, [their_pk1])[0]


def pairwise_seeds(own_sk1: bytes, their_pk1s: Sequence[bytes]) -> list[bytes]:
    """Return :func:`pairwise_seed` with each of ``their_pk1s``.

    ``ValueError`` if one of them is not a usable X25519 public key.
    """
    return shared_keys(own_sk1, their_pk1s, MASK_SEED)


def pairwise_sign(node: int, other: int) -> int:
    """Return the sign ``node`` adds its mask with ``other`` by (theirs: opposite)."""
    return 1 if node > other else -1


def reduce(vector: NDArray[np.uint32], modulus: int) -> NDArray[np.uint32]:
    """Return ``vector`` modulo ``modulus`` (a power of 2 at most ``2**32``)."""
    return vector & np.uint32(modulus - 1)


def commitment(seed: bytes) -> bytes:
    """Return the SHA-256 of a private mask seed (checked after reconstruction)."""
    return hashlib.sha256(b"secagg-plus-seed" + seed).digest()


def neighbours(
    nodes: Sequence[int], num_shares: int, rng: np.random.Generator
) -> dict[int, set[int]]:
    """Return each node's neighbourhood: itself and ``num_shares - 1`` others.

    SecAgg+'s ring: the nodes in a random order, each with the
    ``num_shares // 2`` on either side (everyone, when ``num_shares`` covers
    the sample). Symmetric: ``a`` is ``b``'s neighbour iff ``b`` is ``a``'s.
    """
    # Permute positions, not the ids: Flower's 64-bit node ids above 2**63 would
    # turn a numpy array of them into float64 and round them.
    ranked = [int(n) for n in sorted(nodes)]
    order = [ranked[i] for i in rng.permutation(len(ranked))]
    count = len(order)
    if num_shares >= count:
        return {node: set(order) for node in order}
    half = num_shares // 2
    return {
        node: {order[(i + offset) % count] for offset in range(-half, half + 1)}
        for i, node in enumerate(order)
    }


@dataclass(frozen=True)
class Layout:
    """What one masked vector holds: the weight, the clipped count, each record.

    The first value is the client's weight code, the second how many of its
    values it clipped (summed like the rest, so the server learns only the
    round's total), then each declared record.

    Parameters
    ----------
    records : tuple[str, ...]
        Record names, in order (a record read both ways appears twice).
    kinds : tuple[str, ...]
        ``"mean"`` (the client sends ``r x``, ``r`` its coded weight) or
        ``"sum"`` (``x``), one per record.
    sizes : tuple[int, ...]
        Each record's element count (all its arrays, flattened in key order).
    keys : tuple[tuple[str, ...], ...]
        Each record's array keys, in the order they are flattened.
    """

    records: tuple[str, ...]
    kinds: tuple[str, ...]
    sizes: tuple[int, ...]
    keys: tuple[tuple[str, ...], ...]

    @classmethod
    def from_declaration(
        cls,
        sums: Mapping[str, Sequence[str]],
        shapes: Mapping[str, Mapping[str, tuple[int, ...]]],
        uniform: bool,
    ) -> Layout:
        """Build the layout a strategy's ``secure_sums()`` declares.

        Under uniform weights a weighted sum is the plain sum: a record read
        both ways is masked once, as ``"sum"``.
        """
        records, kinds = [], []
        for name, ways in sums.items():
            wanted = {"sum"} if uniform else set(ways)
            for kind in ("mean", "sum"):
                if kind in wanted:
                    records.append(name)
                    kinds.append(kind)
        return cls(
            tuple(records),
            tuple(kinds),
            tuple(
                sum(int(np.prod(shape)) for shape in shapes[r].values())
                for r in records
            ),
            tuple(tuple(shapes[r]) for r in records),
        )

    @property
    def length(self) -> int:
        """The vector's length: the weight code, the clipped count, the records."""
        return HEADER + sum(self.sizes)

    def config(self) -> dict[str, list[str] | list[int]]:
        """Return the layout as config values (lists)."""
        config: dict[str, list[str] | list[int]] = {
            RECORDS_KEY: list(self.records),
            KINDS_KEY: list(self.kinds),
            SIZES_KEY: list(self.sizes),
        }
        for index, keys in enumerate(self.keys):
            config[f"keys-{index}"] = list(keys)
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> Layout:
        """Read a layout back from a config; raise ValueError if malformed."""
        records, kinds, sizes = (
            config.get(RECORDS_KEY),
            config.get(KINDS_KEY),
            config.get(SIZES_KEY),
        )
        if not (
            isinstance(records, list)
            and isinstance(kinds, list)
            and isinstance(sizes, list)
            and len(records) == len(kinds) == len(sizes)
            and all(isinstance(r, str) for r in records)
            and all(k in ("mean", "sum") for k in kinds)
            and all(isinstance(n, int) and n >= 0 for n in sizes)
        ):
            raise ValueError("malformed secure-aggregation layout")
        keys = [config.get(f"keys-{index}") for index in range(len(records))]
        if not all(
            isinstance(k, list) and all(isinstance(x, str) for x in k) for k in keys
        ):
            raise ValueError("malformed secure-aggregation layout (keys)")
        return cls(
            tuple(records),
            tuple(kinds),
            tuple(sizes),
            tuple(tuple(cast(list[str], k)) for k in keys),
        )

    def split(self, vector: NDArray) -> list[NDArray]:
        """Return the parts of a decoded vector after its header, one per record."""
        bounds = np.cumsum((HEADER, *self.sizes))
        return [vector[a:b] for a, b in itertools.pairwise(bounds)]


def stage_message(
    node: int, server_round: int, stage: str, values: Mapping[str, Any]
) -> Message:
    """Return the train message that asks ``node`` for one stage of a round."""
    config = ConfigRecord({Key.STAGE: stage, ROUND_KEY: server_round, **values})
    return Message(
        RecordDict({SECAGG_RECORD: config}),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
        group_id=str(server_round),
    )


def to_bytes(vector: NDArray[np.uint32]) -> bytes:
    """Return a masked vector as little-endian uint32."""
    return vector.astype("<u4").tobytes()


def from_bytes(data: bytes, length: int, modulus: int) -> NDArray[np.uint32]:
    """Read a masked vector; ValueError unless ``length`` codes below ``modulus``."""
    if not isinstance(data, bytes) or len(data) != 4 * length:
        got = len(data) if isinstance(data, bytes) else type(data).__name__
        raise ValueError(f"masked vector of {got} bytes, expected {4 * length}")
    vector = np.frombuffer(data, dtype="<u4").astype(np.uint32)
    if vector.size and int(vector.max()) >= modulus:
        raise ValueError(f"masked vector holds values >= the modulus {modulus}")
    return vector

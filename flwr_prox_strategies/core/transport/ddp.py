"""Distributed DP over SecAgg+: the round's encoding on the wire, and a client's upload.

Under distributed DP (:class:`~flwr_prox_strategies.DistributedDP`) the server
asks, in the ``collect`` stage, for one integer vector per client: every record
the strategy sums, flattened, clipped to L2 norm ``l2_clip``, rotated, scaled,
rounded and noised (:func:`~flwr_prox_strategies.ops.privacy.encoding.encode_upload`),
then masked modulo ``2**bits``. A record the server sent (the global model) is
uploaded as the client's change of it. Both halves read the round's settings
from :class:`DDPRound`; a client checks them against its own floor
(:func:`noise_multiplier_at`) before it adds a single mask.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord
from numpy.typing import NDArray

from ...ops.privacy.encoding import DDPSettings, EncodedUpload, encode_upload
from ...ops.privacy.quantise import rounding_norm_bound

#: The collect stage's keys for distributed DP (absent: plain SecAgg+).
_FIELDS = {
    "ddp-l2-clip": float,
    "ddp-bits": int,
    "ddp-beta": float,
    "ddp-noise": str,
    "ddp-local-variance": float,
    "ddp-granularity": float,
    "ddp-seed": int,
}
RECORDS_KEY = "ddp-records"  # the records uploaded, in the vector's order
RELATIVE_KEY = "ddp-relative"  # the records uploaded as the change of what was sent
#: The node-config key a SuperNode's operator sets to require distributed DP.
NODE_MIN_NOISE = "ddp-min-noise-multiplier"


@dataclass(frozen=True)
class DDPRound:
    """One round's distributed-DP encoding, as the server asks for it.

    Parameters
    ----------
    settings : DDPSettings
        Clip, bit width, rounding, noise and granularity of every client.
    seed : int
        The rotation's seed, the same for every client of the round.
    records : tuple[str, ...]
        The record names uploaded.
    relative : tuple[str, ...]
        Those uploaded as the client's change of the record the server sent.
    """

    settings: DDPSettings
    seed: int
    records: tuple[str, ...]
    relative: tuple[str, ...]

    def config(self) -> dict[str, Any]:
        """Return the round as config values."""
        s = self.settings
        return {
            "ddp-l2-clip": float(s.l2_clip),
            "ddp-bits": int(s.bits),
            "ddp-beta": float(s.beta),
            "ddp-noise": str(s.noise),
            "ddp-local-variance": float(s.local_variance),
            "ddp-granularity": float(s.granularity),
            "ddp-seed": int(self.seed),
            RECORDS_KEY: list(self.records),
            RELATIVE_KEY: list(self.relative),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> DDPRound | None:
        """Read a round back (None: the config asks for no distributed DP).

        Raises
        ------
        ValueError
            Some keys present and others missing, of the wrong type or out of
            range: the message names them.
        """
        present = [key for key in (*_FIELDS, RECORDS_KEY) if key in config]
        if not present:
            return None
        values: dict[str, Any] = {}
        for key, kind in _FIELDS.items():
            value = config.get(key)
            if type(value) is not kind:
                raise ValueError(
                    f"distributed DP: {key!r} missing or not {kind.__name__}"
                )
            values[key] = value
        records, relative = config.get(RECORDS_KEY), config.get(RELATIVE_KEY)
        for key, names in ((RECORDS_KEY, records), (RELATIVE_KEY, relative)):
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise ValueError(f"distributed DP: {key!r} is not a list of names")
        records_, relative_ = cast(list[str], records), cast(list[str], relative)
        if not records_ or not set(relative_) <= set(records_):
            raise ValueError(
                f"distributed DP: {RELATIVE_KEY!r} must name uploaded records"
            )
        settings = DDPSettings(
            l2_clip=values["ddp-l2-clip"],
            bits=values["ddp-bits"],
            beta=values["ddp-beta"],
            noise=values["ddp-noise"],
            local_variance=values["ddp-local-variance"],
            granularity=values["ddp-granularity"],
        )
        if values["ddp-seed"] < 0:
            raise ValueError("distributed DP: 'ddp-seed' must be >= 0")
        return cls(settings, values["ddp-seed"], tuple(records_), tuple(relative_))


def sensitivity(settings: DDPSettings, padded_dim: int) -> float:
    r"""Return one client's L2 sensitivity in the integer domain, :math:`\Delta_2`.

    The conditional rounding keeps every rounded upload within
    :func:`~flwr_prox_strategies.ops.privacy.quantise.rounding_norm_bound` of
    ``l2_clip / granularity``, whatever the rotation, so no choice of seed by
    the server raises it.
    """
    return rounding_norm_bound(
        float(settings.l2_clip) / float(settings.granularity),
        int(padded_dim),
        float(settings.beta),
    )


def noise_multiplier_at(
    settings: DDPSettings, padded_dim: int, contributors: int
) -> float:
    r"""Return :math:`\sqrt{m\sigma^2}/\Delta_2`, the sum's noise over one's reach.

    ``contributors`` (:math:`m`) is the fewest clients whose noise the sum
    holds. The ratio governs the privacy of the round (the RDP of the
    discrete Gaussian or Skellam sum is close to :math:`\alpha/(2z^2)`); a
    client compares it with its own floor before masking anything.
    """
    spread = math.sqrt(max(int(contributors), 0) * float(settings.local_variance))
    return spread / sensitivity(settings, padded_dim)


def encode_records(
    records: Mapping[str, ArrayRecord],
    sent: Mapping[str, ArrayRecord],
    plan: DDPRound,
    rng: np.random.Generator,
) -> EncodedUpload:
    """Return a client's upload of ``plan.records``: clipped, rotated, noised, wrapped.

    A record in ``plan.relative`` is uploaded as its change from the record of
    the same name in ``sent`` (the train message's), in the record's dtype.

    Raises
    ------
    ValueError
        A record missing, a relative record not sent or with other keys or
        shapes, or values not finite.
    """
    floats: dict[str, dict[str, NDArray[np.floating]]] = {}
    for name in plan.records:
        if name not in records:
            raise ValueError(f"record {name!r} missing (found {sorted(records)})")
        arrays = {k: a.numpy() for k, a in records[name].items()}
        if name in plan.relative:
            base = sent.get(name)
            if base is None or set(base) != set(arrays):
                raise ValueError(
                    f"record {name!r} is uploaded as a change of the record the "
                    "server sent, and the train message holds no such record"
                )
            sent_arrays = {k: a.numpy() for k, a in base.items()}
            for key, array in arrays.items():
                if sent_arrays[key].shape != array.shape:
                    raise ValueError(
                        f"record {name!r}[{key!r}] has shape {array.shape}, the "
                        f"server's {sent_arrays[key].shape}"
                    )
            arrays = {
                k: (a.astype(np.float64) - sent_arrays[k]).astype(a.dtype)
                for k, a in arrays.items()
            }
        floats[name] = arrays
    return encode_upload(floats, plan.settings, round_seed=plan.seed, rng=rng)

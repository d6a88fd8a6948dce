"""SecAgg+'s key agreement: X25519 key pairs and the secrets two nodes derive.

Each node makes two key pairs a round. With the first, two neighbours agree on
the seed of their pairwise mask; with the second, on the key that encrypts the
Shamir shares one sends the other. Keys travel as their raw 32 bytes (RFC
7748), so the first private key, which the node shares out so that the server
can remove a dropped node's masks, is a 32-byte secret.

X25519 rather than Flower's NIST P-384 in PEM: one agreement costs about a
tenth as much (the pack's secure-aggregation benchmark), and every 32 bytes
are a valid key, so nothing needs parsing. A public key of small order would
make the shared secret all zeros, known to anyone: :func:`check_public_key`
and :func:`shared_keys` refuse it (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Sequence

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
#: HKDF's ``info`` for each use of an agreed secret: a mask seed never doubles
#: as an encryption key, even if a node reused one key pair for both.
MASK_SEED = b"flwr-prox-strategies secagg+ pairwise mask seed"
SHARE_KEY = b"flwr-prox-strategies secagg+ share encryption key"

# Any fixed scalar detects a small-order point: X25519 clamps every scalar to
# a multiple of the cofactor 8, which sends such a point to the identity.
_PROBE = X25519PrivateKey.from_private_bytes(bytes(range(KEY_BYTES)))
_SMALL_ORDER = "a point of small order: its agreement with any key is all zeros"


class UnusableKey(ValueError):
    """A public key that is malformed or of small order, at ``position``."""

    def __init__(self, position: int, why: str) -> None:
        super().__init__(f"not a usable X25519 public key: {why}")
        self.position = position


def generate_key_pair() -> tuple[bytes, bytes]:
    """Return a fresh ``(private, public)`` X25519 key pair, 32 raw bytes each."""
    private = X25519PrivateKey.generate()
    return private.private_bytes_raw(), private.public_key().public_bytes_raw()


def public_of(private: bytes) -> bytes:
    """Return the public key of a raw private key (``ValueError`` if malformed)."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def check_public_key(public: object) -> bytes:
    """Return ``public`` if it is a usable X25519 public key, else raise ``ValueError``.

    Usable: 32 bytes, not a point of small order (whose agreement with any
    private key is all zeros).
    """
    if not isinstance(public, bytes) or len(public) != KEY_BYTES:
        raise ValueError(
            f"not a {KEY_BYTES}-byte X25519 public key (a node of an older pack "
            "release sends PEM P-384 keys: upgrade the server and clients together)"
        )
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as err:
        raise ValueError(_SMALL_ORDER) from err
    return public


def shared_keys(private: bytes, publics: Sequence[bytes], info: bytes) -> list[bytes]:
    """Return the 32-byte secret ``private`` agrees with each of ``publics``.

    X25519, then HKDF-SHA256 with ``info`` (:data:`MASK_SEED` or
    :data:`SHARE_KEY`). Both ends derive the same secret. :class:`UnusableKey`
    (a ``ValueError``) gives the position of a public key that is malformed
    or of small order.
    """
    own = X25519PrivateKey.from_private_bytes(private)
    secrets = []
    for index, public in enumerate(publics):
        try:
            key = X25519PublicKey.from_public_bytes(public)
        except (ValueError, TypeError) as err:
            raise UnusableKey(index, str(err)) from err
        try:
            shared = own.exchange(key)
        except ValueError as err:
            raise UnusableKey(index, _SMALL_ORDER) from err
        kdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info)
        secrets.append(kdf.derive(shared))
    return secrets

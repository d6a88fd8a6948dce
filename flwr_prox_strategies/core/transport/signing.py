"""Signing keys for secure aggregation's active-adversary mode.

A node proves who it is with a key pair its operator already has (a SuperNode
authentication key works: an OpenSSH or PEM EC private key); every node trusts
a directory of its peers' public keys. The server relays signatures it cannot
forge, so it can neither invent participants nor tell two clients different
stories about who survived.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

SigningKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
VerifyingKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey

#: What each signature covers starts with one of these, so a signature on a
#: node's keys can never pass as one on a survivor set, or the other way round.
KEYS_CONTEXT = b"flwr-prox-strategies secagg+ keys"
SURVIVORS_CONTEXT = b"flwr-prox-strategies secagg+ survivors"


def keys_statement(
    server_round: int, node: int, pk1: bytes, pk2: bytes
) -> list[bytes | int]:
    """Return what a node signs at setup: the round, its node id, its two keys."""
    return [int(server_round), node, pk1, pk2]


def survivors_statement(
    server_round: int, pk1: bytes, survivors: Iterable[int]
) -> list[bytes | int]:
    """Return what a node signs about a round's survivors.

    The signer's first public key of the round is part of it: the set alone
    would let a server replay a signature from another run that had the same
    round number and survivors.
    """
    return [int(server_round), pk1, *sorted(survivors)]


class KeyFileError(ValueError):
    """A signing key or key directory that cannot be read: which, and why."""


def load_keys(
    key: str | Path | None,
    directory: str | Path | None,
    name: str,
    error: type[Exception] = ValueError,
) -> tuple[SigningKey, frozenset[bytes]] | None:
    """Return the signing key and trusted directory, or None when neither is set.

    Raise ``error``, its message starting with ``name``, when only one is set
    or either cannot be read.
    """
    if key is None and directory is None:
        return None
    if key is None or directory is None:
        raise error(
            f"{name}: a signing key and a key directory go together (the directory "
            "holds the public keys this node trusts)"
        )
    try:
        own = load_signing_key(key)
        trusted = load_key_directory(directory)
    except KeyFileError as err:
        raise error(f"{name}: {err}") from err
    return own, trusted


def load_signing_key(path: str | Path) -> SigningKey:
    """Read a private key (OpenSSH or PEM; EC or Ed25519) from ``path``."""
    data = _read(path)
    loaders = (serialization.load_ssh_private_key, serialization.load_pem_private_key)
    for load in loaders:
        try:
            key = load(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            continue
        if isinstance(key, (ec.EllipticCurvePrivateKey, ed25519.Ed25519PrivateKey)):
            return key
        raise KeyFileError(f"{path}: not an EC or Ed25519 private key")
    raise KeyFileError(f"{path}: not an OpenSSH or PEM private key (or encrypted)")


def load_key_directory(path: str | Path) -> frozenset[bytes]:
    """Read the trusted public keys: a folder of ``*.pub``/``*.pem`` files, or a file.

    A file holds one OpenSSH public key per line (or comma-separated, as
    Flower's list of SuperNode public keys); a ``.pem`` file one PEM key.
    Returns each key's canonical bytes (:func:`key_id`).
    """
    folder = Path(path)
    if folder.is_dir():
        files = sorted([*folder.glob("*.pub"), *folder.glob("*.pem")])
        if not files:
            raise KeyFileError(f"{path}: a folder with no *.pub or *.pem file")
    else:
        files = [folder]
    keys: set[bytes] = set()
    for file in files:
        text = _read(file)
        if b"-----BEGIN" in text:
            keys.add(key_id(_public(serialization.load_pem_public_key, text, file)))
            continue
        for line in text.replace(b",", b"\n").splitlines():
            if line.strip():
                key = _public(serialization.load_ssh_public_key, line.strip(), file)
                keys.add(key_id(key))
    if not keys:
        raise KeyFileError(f"{path}: no public key")
    return frozenset(keys)


def key_id(key: VerifyingKey) -> bytes:
    """Return a public key's canonical bytes (DER SubjectPublicKeyInfo)."""
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def public_of(key: SigningKey) -> bytes:
    """Return the canonical bytes of ``key``'s public half."""
    return key_id(key.public_key())


def sign(key: SigningKey, context: bytes, parts: Iterable[bytes | int]) -> bytes:
    """Sign ``context`` and ``parts`` (unambiguously framed)."""
    data = frame(context, parts)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    return key.sign(data)


def verify(
    public: bytes, signature: object, context: bytes, parts: Iterable[bytes | int]
) -> bool:
    """Return whether ``signature`` is ``public``'s on ``context`` and ``parts``."""
    if not isinstance(signature, bytes):
        return False
    try:
        key = serialization.load_der_public_key(public)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return False
    data = frame(context, parts)
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        else:
            return False
    except InvalidSignature:
        return False
    return True


def frame(context: bytes, parts: Iterable[bytes | int]) -> bytes:
    """Return ``context`` and ``parts``, each length-prefixed (no two lists alias)."""
    out = [len(context).to_bytes(4, "big"), context]
    for part in parts:
        data = part if isinstance(part, bytes) else int(part).to_bytes(8, "big")
        out += [len(data).to_bytes(4, "big"), data]
    return b"".join(out)


def _read(path: str | Path) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as err:
        raise KeyFileError(f"{path}: {err.strerror or err}") from err


def _public(load, data: bytes, file: Path) -> VerifyingKey:  # type: ignore[no-untyped-def]
    try:
        key = load(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise KeyFileError(f"{file}: not a public key ({err})") from err
    if not isinstance(key, (ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey)):
        raise KeyFileError(f"{file}: not an EC or Ed25519 public key")
    return key

"""SecAgg+'s key agreement checked against RFC 7748's X25519 test vectors."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from flwr_prox_strategies.core.transport import agreement, shamir
from flwr_prox_strategies.core.transport.secagg import pairwise_seed

# RFC 7748, section 6.1: Alice's and Bob's key pairs and their shared secret.
ALICE = bytes.fromhex(
    "77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a"
)
ALICE_PUBLIC = bytes.fromhex(
    "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
)
BOB = bytes.fromhex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb")
BOB_PUBLIC = bytes.fromhex(
    "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f"
)
SHARED = bytes.fromhex(
    "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742"
)


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def test_public_keys_match_the_rfc():
    assert agreement.public_of(ALICE) == ALICE_PUBLIC
    assert agreement.public_of(BOB) == BOB_PUBLIC


@pytest.mark.parametrize("info", [agreement.MASK_SEED, agreement.SHARE_KEY])
def test_both_ends_derive_hkdf_of_the_rfc_secret(info):
    (alice,) = agreement.shared_keys(ALICE, [BOB_PUBLIC], info)
    (bob,) = agreement.shared_keys(BOB, [ALICE_PUBLIC], info)
    assert alice == bob == _hkdf(SHARED, info)


def test_a_mask_seed_never_doubles_as_a_share_key():
    seed = pairwise_seed(ALICE, BOB_PUBLIC)
    (key,) = agreement.shared_keys(ALICE, [BOB_PUBLIC], agreement.SHARE_KEY)
    assert seed == _hkdf(SHARED, agreement.MASK_SEED) != key


def test_fresh_pairs_agree_and_differ():
    (a, a_pub), (b, b_pub) = (
        agreement.generate_key_pair(),
        agreement.generate_key_pair(),
    )
    assert len(a) == len(a_pub) == 32 and a_pub != b_pub
    assert agreement.public_of(a) == a_pub
    assert pairwise_seed(a, b_pub) == pairwise_seed(b, a_pub)
    agreement.check_public_key(a_pub)


def test_a_private_key_rebuilt_from_shares_gives_its_public_key():
    """The server checks a dropped node's rebuilt key against its public key."""
    private, public = agreement.generate_key_pair()
    (shares,) = shamir.split([private], 3, 5)
    rebuilt = shamir.combine({2: shares[1], 4: shares[3], 5: shares[4]}, 3)
    assert rebuilt == private and agreement.public_of(rebuilt) == public


SMALL_ORDER = [
    bytes(32),
    (1).to_bytes(32, "little"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
]


@pytest.mark.parametrize("bad", SMALL_ORDER)
def test_points_of_small_order_are_refused(bad):
    with pytest.raises(ValueError, match="small order"):
        agreement.check_public_key(bad)
    good = agreement.generate_key_pair()[1]
    with pytest.raises(agreement.UnusableKey, match="small order") as caught:
        agreement.shared_keys(ALICE, [good, bad], agreement.MASK_SEED)
    assert caught.value.position == 1


@pytest.mark.parametrize("bad", [b"", b"\x09" * 31, b"\x09" * 33, "x" * 32, None])
def test_malformed_keys_are_refused(bad):
    with pytest.raises(ValueError, match="32-byte X25519"):
        agreement.check_public_key(bad)
    with pytest.raises(agreement.UnusableKey) as caught:
        agreement.shared_keys(ALICE, [bad], agreement.SHARE_KEY)  # type: ignore[list-item]
    assert caught.value.position == 0
    with pytest.raises(ValueError):
        agreement.public_of(b"\x01" * 31)

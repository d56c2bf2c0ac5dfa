"""Identity keys: peer IDs, signatures, and the small-order keys that must never verify."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.identity import (
    generate_identity,
    is_weak_public_key,
    peer_id_from_public_bytes,
    peer_id_of,
    private_key_from_bytes,
    private_key_to_bytes,
    public_key_bytes,
    short_id,
    sign,
    verify,
)

ALICE = generate_identity()
BOB = generate_identity()
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

def test_identity_round_trip_and_peer_id_format() -> None:
    key = generate_identity()
    raw = private_key_to_bytes(key)
    assert len(raw) == 32
    again = private_key_from_bytes(raw)
    assert public_key_bytes(again) == public_key_bytes(key)
    pid = peer_id_from_public_bytes(public_key_bytes(key))
    assert pid == peer_id_of(again) and len(pid) == 20
    assert set(pid) <= set("abcdefghijklmnopqrstuvwxyz234567")
    assert short_id(pid) == pid[:8]
    assert peer_id_of(ALICE) != peer_id_of(BOB)


def test_peer_id_is_domain_separated_sha256() -> None:
    import base64
    import hashlib

    pub = bytes(32)
    digest = hashlib.sha256(b"peertrain-peer-id" + pub).digest()
    assert peer_id_from_public_bytes(pub) == base64.b32encode(digest).decode().lower()[:20]


@pytest.mark.parametrize("bad", [b"", b"x" * 31, b"x" * 33, "a string"])
def test_private_key_from_bad_bytes_is_a_clear_value_error(bad) -> None:
    with pytest.raises(ValueError, match="32 raw bytes"):
        private_key_from_bytes(bad)


def test_sign_and_verify() -> None:
    sig = sign(ALICE, b"message")
    pub = public_key_bytes(ALICE)
    assert verify(pub, sig, b"message")
    assert not verify(pub, sig, b"massage")
    assert not verify(public_key_bytes(BOB), sig, b"message")


@FUZZ
@given(pub=st.binary(max_size=40), sig=st.binary(max_size=70), message=st.binary(max_size=20))
def test_verify_never_raises(pub: bytes, sig: bytes, message: bytes) -> None:
    assert verify(pub, sig, message) is False


# The eight points of small order, encoded (y little-endian, x's sign in the top bit): the identity,
# the point of order 2, the two of order 4 (y = 0) and the four of order 8.
_ORDER8_Y = ["26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
             "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a"]
SMALL_ORDER_KEYS = ([bytes([1]) + bytes(31), bytes([0xEC]) + b"\xff" * 30 + b"\x7f", bytes(32), bytes(31) + b"\x80"]
                    + [bytes.fromhex(h) for h in _ORDER8_Y]
                    + [bytes.fromhex(h)[:31] + bytes([bytes.fromhex(h)[31] | 0x80]) for h in _ORDER8_Y])


def test_small_order_keys_never_verify_though_openssl_would_accept_a_forgery() -> None:
    """With the all-zero (order 4) key, the all-zero signature passes OpenSSL's check for about one
    message in four: anyone could claim that key's peer ID. `verify` refuses every small-order key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    def openssl_accepts(message: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(bytes(32)).verify(bytes(64), message)
        except Exception:
            return False
        return True

    forged = next(m for m in (b"m%d" % i for i in range(200)) if openssl_accepts(m))
    assert not verify(bytes(32), bytes(64), forged)
    assert all(is_weak_public_key(k) for k in SMALL_ORDER_KEYS)
    assert not any(is_weak_public_key(public_key_bytes(generate_identity())) for _ in range(50))
    assert is_weak_public_key(b"\xff" * 32)  # y >= p: not a canonical encoding


def test_verify_with_wrong_types_is_false() -> None:
    assert verify(None, None, None) is False  # type: ignore[arg-type]



"""Long-term peer identities: Ed25519 keys and the peer IDs derived from them.

A peer is its Ed25519 key. The peer ID is a short, printable digest of the public
key so that logs, allow-lists and config files can name peers without carrying
32 raw bytes around; it is domain-separated so the same key used elsewhere never
yields a colliding "peer ID" in another protocol.

The X25519 keys used by the handshake are separate and throw-away: a peer signs
its handshake static key with its Ed25519 identity (see `protocol.handshake`), so
the identity never touches Diffie-Hellman.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

__all__ = [
    "KEY_SIZE",
    "PEER_ID_LENGTH",
    "SIGNATURE_SIZE",
    "MAX_IDENTITY_BITS",
    "generate_identity",
    "identity_work",
    "is_peer_id",
    "peer_id_from_public_bytes",
    "peer_id_of",
    "private_key_from_bytes",
    "private_key_to_bytes",
    "public_key_bytes",
    "short_id",
    "sign",
    "verify",
    "is_weak_public_key",
]

KEY_SIZE = 32  # Ed25519: raw private and public keys alike; every module checks key lengths against this one
SIGNATURE_SIZE = 64  # Ed25519
PEER_ID_LENGTH = 20
"""20 base32 characters = 100 bits of the hash: ample against accidental collisions,
short enough to read aloud. Peers are authenticated by their full key in the
handshake; the ID is a name, not the proof."""

_PEER_ID_DOMAIN = b"peertrain-peer-id"
_SHORT_ID_LENGTH = 8


_WORK_DOMAIN = b"peertrain-identity-work"
MAX_IDENTITY_BITS = 32
"""The most work a swarm may ask of a key (`[membership] identity_bits`): 2^32 keys, days of a core."""


def identity_work(pub: bytes) -> int:
    """The bits of work a public key carries: leading zero bits of a domain-separated SHA-256 of it. A swarm
    that asks `b` bits makes every identity cost about 2^b key generations (42 us each on the 2-core VM: 20
    bits, 44 s once per honest peer; a thousand Sybil keys, 12 hours of a core), and checks it in one hash."""
    digest = int.from_bytes(hashlib.sha256(_WORK_DOMAIN + bytes(pub)).digest(), "big")
    return 256 - digest.bit_length()


def generate_identity(bits: int = 0) -> Ed25519PrivateKey:
    """A fresh random identity (the daemon persists it with `private_key_to_bytes`) carrying at least `bits` of
    work (`identity_work`): about 2^bits keys are drawn."""
    if not 0 <= bits <= MAX_IDENTITY_BITS:
        raise ValueError(f"identity bits must be in [0, {MAX_IDENTITY_BITS}], got {bits}")
    while True:
        key = Ed25519PrivateKey.generate()
        if not bits or identity_work(public_key_bytes(key)) >= bits:
            return key


def private_key_to_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte seed: the smallest stable on-disk form of an identity."""
    return key.private_bytes(
        encoding=serialization.Encoding.Raw,
        format=serialization.PrivateFormat.Raw,
        encryption_algorithm=serialization.NoEncryption(),
    )


def private_key_from_bytes(data: bytes) -> Ed25519PrivateKey:
    """Load an identity saved by `private_key_to_bytes`.

    Raises ValueError (not ProtocolError: this is local configuration, not a remote
    peer misbehaving) with a message that says what was wrong.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(
            f"an Ed25519 private key must be {KEY_SIZE} raw bytes, got {type(data).__name__}"
        )
    raw = bytes(data)
    if len(raw) != KEY_SIZE:
        raise ValueError(
            f"an Ed25519 private key must be {KEY_SIZE} raw bytes, got {len(raw)} bytes"
        )
    return Ed25519PrivateKey.from_private_bytes(raw)


def public_key_bytes(key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public key, as carried in handshakes."""
    return key.public_key().public_bytes(
        encoding=serialization.Encoding.Raw,
        format=serialization.PublicFormat.Raw,
    )


def peer_id_from_public_bytes(pub: bytes) -> str:
    """Stable printable peer ID: lowercase unpadded base32 of a domain-separated
    SHA-256 of the raw public key, first 20 characters."""
    digest = hashlib.sha256(_PEER_ID_DOMAIN + bytes(pub)).digest()
    return base64.b32encode(digest).decode("ascii").lower().rstrip("=")[:PEER_ID_LENGTH]


_PEER_ID_RE = re.compile(rf"[a-z2-7]{{{PEER_ID_LENGTH}}}")


def is_peer_id(value: object) -> bool:
    """True for a string `peer_id_from_public_bytes` could return (20 lowercase base32 characters): what an
    allow-list may name; anything else would silently match no peer."""
    return isinstance(value, str) and _PEER_ID_RE.fullmatch(value) is not None


def peer_id_of(key: Ed25519PrivateKey) -> str:
    """Our own peer ID, for logs and for comparing against a remote's."""
    return peer_id_from_public_bytes(public_key_bytes(key))


def short_id(peer_id: str) -> str:
    """First 8 characters of a peer ID, enough to tell peers apart in log lines."""
    return peer_id[:_SHORT_ID_LENGTH]


def sign(key: Ed25519PrivateKey, message: bytes) -> bytes:
    """Ed25519 signature (64 bytes) over `message`."""
    return key.sign(bytes(message))


def verify(pub_bytes: bytes, signature: bytes, message: bytes) -> bool:
    """True only if `signature` is a valid signature of `message` by `pub_bytes`.

    Never raises: everything here comes from the network, and a malformed key or
    signature is just another way of being invalid. Keys of small order are refused
    outright (see `is_weak_public_key`).
    """
    try:
        if is_weak_public_key(bytes(pub_bytes)):
            return False
        public = Ed25519PublicKey.from_public_bytes(bytes(pub_bytes))
        public.verify(bytes(signature), bytes(message))
    except Exception:  # InvalidSignature, ValueError on bad lengths, TypeError on bad types
        return False
    return True


# ---- small-order keys --------------------------------------------------------------------------
# Why: Ed25519 verification as OpenSSL does it accepts a public key that is one of the curve's eight
# small-order points, and for such a key an all-zero (or any small-order) signature verifies for a
# fixed fraction of messages (about 1 in 4 for the all-zero key, measured) without anyone knowing a
# private key. A "peer" with such a
# key could then claim its peer ID in a handshake or a signed record by trying a few times. No honest
# key is ever of small order, so refusing them costs nothing (libsodium does the same).
# The check decodes the point (RFC 8032, 5.1.3) and multiplies it by the cofactor 8 with textbook
# affine Edwards arithmetic: this validates input, it computes nothing secret.

_P = 2**255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _decode_point(pub: bytes) -> tuple[int, int] | None:
    """The affine point an encoded Ed25519 public key names; None if it is not a canonical point."""
    if len(pub) != KEY_SIZE:
        return None
    y = int.from_bytes(pub, "little")
    sign = y >> 255
    y &= (1 << 255) - 1
    if y >= _P:
        return None
    x2 = (y * y - 1) * pow(_D * y * y + 1, _P - 2, _P) % _P
    if x2 == 0:
        return None if sign else (0, y)
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P:
        x = x * _SQRT_M1 % _P
    if (x * x - x2) % _P:
        return None
    if x & 1 != sign:
        x = _P - x
    return x, y


def _double(point: tuple[int, int]) -> tuple[int, int]:
    """2P on -x^2 + y^2 = 1 + d x^2 y^2 (the complete addition law with P = Q)."""
    x, y = point
    t = _D * x * x * y * y % _P
    return (2 * x * y * pow(1 + t, _P - 2, _P) % _P, (y * y + x * x) * pow(1 - t, _P - 2, _P) % _P)


@functools.lru_cache(maxsize=4096)  # pure; a peer's key is checked again with every record it signs
def is_weak_public_key(pub: bytes) -> bool:
    """True for an encoding that is not a canonical curve point or is a point of small order."""
    point = _decode_point(pub)
    if point is None:
        return True
    for _ in range(3):
        point = _double(point)
    return point == (0, 1)

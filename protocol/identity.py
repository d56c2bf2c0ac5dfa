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
import hashlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

__all__ = [
    "KEY_SIZE",
    "PEER_ID_LENGTH",
    "SIGNATURE_SIZE",
    "generate_identity",
    "peer_id_from_public_bytes",
    "peer_id_of",
    "private_key_from_bytes",
    "private_key_to_bytes",
    "public_key_bytes",
    "short_id",
    "sign",
    "verify",
]

KEY_SIZE = 32
SIGNATURE_SIZE = 64
PEER_ID_LENGTH = 20
"""20 base32 characters = 100 bits of the hash: ample against accidental collisions,
short enough to read aloud. Peers are authenticated by their full key in the
handshake; the ID is a name, not the proof."""

_PEER_ID_DOMAIN = b"peertrain-peer-id"
_SHORT_ID_LENGTH = 8


def generate_identity() -> Ed25519PrivateKey:
    """A fresh random identity (the daemon persists it with `private_key_to_bytes`)."""
    return Ed25519PrivateKey.generate()


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
    signature is just another way of being invalid.
    """
    try:
        public = Ed25519PublicKey.from_public_bytes(bytes(pub_bytes))
        public.verify(bytes(signature), bytes(message))
    except Exception:  # InvalidSignature, ValueError on bad lengths, TypeError on bad types
        return False
    return True

"""The session handshake: Noise XX (optionally XXpsk0) plus signed peer identities, sans-I/O.

Why Noise XX: both sides learn and authenticate each other's static key in three
messages, without knowing it in advance (peers find each other by discovery),
and every session gets fresh ephemeral Diffie-Hellman keys, so recording traffic
and stealing a key later reveals nothing (forward secrecy). The initiator only
reveals its identity after it has authenticated the responder.

Why a separate Ed25519 identity signing a throw-away X25519 static key: the peer
ID is derived from a signing key that never touches Diffie-Hellman, and the
signature over the static key the Noise handshake *actually authenticated* binds
that identity to this very session: a replayed identity payload is useless
without the matching X25519 private key.

Why the optional swarm key is mixed in first (psk0): a peer without the key
cannot even get the responder to answer with its encrypted identity, so a
private swarm is invisible to outsiders beyond "something is listening". In psk
mode the first message's payload is encrypted too (Noise requires MixKey(e)).

Handshake messages are u32-length-prefixed (at most 4096 bytes). After the
handshake both sides hold two `CipherState`s (send and receive) for the
negotiated transport AEAD, keyed from Noise's Split() and the handshake hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import PROTOCOL_VERSION
from .cipher import CIPHERS, DEFAULT_REKEY_INTERVAL, CipherState
from .errors import HandshakeError, ProtocolError
from .frames import LengthPrefixedReader, encode_length_prefixed
from .identity import (KEY_SIZE, MAX_IDENTITY_BITS, SIGNATURE_SIZE, identity_work, peer_id_from_public_bytes,
                       public_key_bytes, sign, verify)
from .noise import AUTHENTICATION_FAILED, TAG_LEN, NoiseXXState

__all__ = [
    "AUTHENTICATION_FAILED",
    "MAX_HANDSHAKE_MESSAGE",
    "Handshake",
    "HandshakeResult",
    "derive_swarm_key",
    "prologue_for",
]

MAX_HANDSHAKE_MESSAGE: Final = 4096

_STATIC_KEY_CONTEXT: Final = b"peertrain-static-key:"
_SWARM_KEY_INFO: Final = b"peertrain swarm key"
_TRANSPORT_INFO: Final = b"peertrain transport key "
_MAX_REMOTE_CIPHERS: Final = 16
_UNPACK_LIMITS: Final = dict(
    raw=False,
    strict_map_key=True,
    max_str_len=MAX_HANDSHAKE_MESSAGE,
    max_bin_len=MAX_HANDSHAKE_MESSAGE,
    max_array_len=256,
    max_map_len=256,
    max_ext_len=0,
)


def prologue_for(swarm: str) -> bytes:
    """Both sides must agree on this exactly, or the handshake fails."""
    return b"peertrain/" + str(PROTOCOL_VERSION).encode("ascii") + b"|" + swarm.encode("utf-8")


def derive_swarm_key(psk: bytes) -> bytes:
    """Any shared secret bytes (a passphrase, a key file) -> the 32-byte Noise PSK."""
    if not isinstance(psk, (bytes, bytearray, memoryview)):
        raise ValueError(f"the swarm key must be bytes, got {type(psk).__name__}")
    if len(psk) == 0:
        raise ValueError("the swarm key must not be empty (pass None for no swarm key)")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SWARM_KEY_INFO).derive(bytes(psk))


def _transport_key(split_key: bytes, handshake_hash: bytes, cipher: str) -> bytes:
    """Bind each direction's key to the whole transcript and to the negotiated AEAD."""
    info = _TRANSPORT_INFO + cipher.encode("ascii")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=handshake_hash, info=info).derive(split_key)


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises ValueError, FormatError, StackError, UnicodeDecodeError...
        raise HandshakeError(f"malformed {what} ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class HandshakeResult:
    """What an established session knows about its peer, and its transport keys."""

    peer_id: str
    remote_public_key: bytes
    """The remote's raw Ed25519 identity key (the peer ID is derived from it)."""
    cipher: str
    send: CipherState
    recv: CipherState
    remote_app_payload: dict[str, Any]
    handshake_hash: bytes
    """Identical on both sides; usable as a session identifier or for channel binding."""
    leftover: bytes = b""
    """Bytes that arrived after the last handshake message: feed them to the FrameReader."""


@dataclass(frozen=True)
class _Remote:
    public_key: bytes
    peer_id: str
    app: dict[str, Any]
    cipher: str | None


class Handshake:
    """One side of a handshake: bytes in via `receive_data`, bytes out via `data_to_send`.

    The initiator has message 1 ready right after construction. Any failure
    raises HandshakeError (or another ProtocolError, e.g. LimitExceeded) and
    leaves the object dead.
    """

    def __init__(
        self,
        *,
        initiator: bool,
        identity: Ed25519PrivateKey,
        swarm: str,
        psk: bytes | None = None,
        ciphers: Sequence[str] = CIPHERS,
        app_payload: dict[str, Any] | None = None,
        expected_peer_id: str | None = None,
        allowed_peer_ids: frozenset[str] | None = None,
        rekey_interval: int = DEFAULT_REKEY_INTERVAL,
        static_key: X25519PrivateKey | None = None,
        min_identity_bits: int = 0,
    ) -> None:
        ciphers = tuple(ciphers)
        if not ciphers:
            raise ValueError("at least one cipher must be offered")
        for name in ciphers:
            if name not in CIPHERS:  # also keeps NullCipher out of any negotiation
                raise ValueError(f"cipher {name!r} cannot be negotiated; choose from {', '.join(CIPHERS)}")
        if len(set(ciphers)) != len(ciphers):
            raise ValueError(f"duplicate cipher in {ciphers}")
        if app_payload is not None and not isinstance(app_payload, dict):
            raise ValueError("app_payload must be a dict")
        if rekey_interval < 1:
            raise ValueError("rekey_interval must be at least 1")
        if not 0 <= min_identity_bits <= MAX_IDENTITY_BITS:
            raise ValueError(f"min_identity_bits must be in [0, {MAX_IDENTITY_BITS}], got {min_identity_bits}")

        self.initiator: Final = initiator
        self._ciphers = ciphers
        self._expected = expected_peer_id
        self._allowed = allowed_peer_ids
        self._min_bits = min_identity_bits  # work a remote's identity key must carry (identity_work)
        self._rekey_interval = rekey_interval
        static = static_key if static_key is not None else X25519PrivateKey.generate()
        self._noise = NoiseXXState(
            initiator=initiator,
            prologue=prologue_for(swarm),
            static=static,
            psk=derive_swarm_key(psk) if psk is not None else None,
        )
        identity_fields: dict[str, Any] = {
            "id": public_key_bytes(identity),
            "sig": sign(identity, _STATIC_KEY_CONTEXT + self._noise.static_public),
            "app": app_payload if app_payload is not None else {},
        }
        try:
            self._identity_payload = msgpack.packb(identity_fields, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"app_payload cannot be encoded with msgpack: {exc}") from exc
        if not initiator:  # the responder also announces its cipher choice (message 2)
            identity_fields["cipher"] = max(CIPHERS, key=len)  # placeholder, for the size check
        # Message 2, the largest: e (32) + encrypted s (48) + encrypted payload (+16 tag).
        largest = len(msgpack.packb(identity_fields, use_bin_type=True)) + 32 + 48 + TAG_LEN
        if largest > MAX_HANDSHAKE_MESSAGE:
            raise ValueError(
                f"app_payload is too large: the handshake message would be {largest} bytes, "
                f"the limit is {MAX_HANDSHAKE_MESSAGE}"
            )
        self._identity_fields = identity_fields
        self._reader = LengthPrefixedReader(MAX_HANDSHAKE_MESSAGE)
        self._outgoing = bytearray()
        self._failed: str | None = None
        self._remote: _Remote | None = None
        self._chosen: str | None = None
        self._result: HandshakeResult | None = None
        self._leftover = b""

        if initiator:
            hello = msgpack.packb({"v": PROTOCOL_VERSION, "ciphers": list(ciphers)}, use_bin_type=True)
            self._send(self._noise.write_message(hello))

    # -- public API -------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return self._result is not None

    def data_to_send(self) -> bytes:
        """Bytes to write to the peer now (b"" if none)."""
        out = bytes(self._outgoing)
        self._outgoing.clear()
        return out

    def receive_data(self, data: bytes) -> None:
        """Bytes received from the peer: any split, several messages at once, or b"" for EOF."""
        if self._failed is not None:
            raise HandshakeError(f"handshake already failed: {self._failed}")
        if self._result is not None:
            self._leftover += data  # the transport should switch to its FrameReader now
            return
        if not data:
            self._fail(HandshakeError("connection closed during the handshake"))
        self._reader.feed(data)
        try:
            while self._result is None:
                message = self._reader.next_message()
                if message is None:
                    break
                self._handle(message)
        except ProtocolError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug or an exotic input: still only ever a HandshakeError
            self._fail(HandshakeError(f"malformed handshake ({type(exc).__name__}: {exc})"), cause=exc)
        if self._result is not None:
            self._leftover += self._reader.take_buffered()

    def result(self) -> HandshakeResult:
        """The established session (only once `complete`)."""
        if self._result is None:
            raise RuntimeError("the handshake is not complete")
        if self._leftover != self._result.leftover:
            self._result = replace(self._result, leftover=self._leftover)
        return self._result

    # -- internals ----------------------------------------------------------------

    def _fail(self, exc: ProtocolError, cause: BaseException | None = None) -> None:
        self._failed = str(exc)
        if cause is not None:
            raise exc from cause
        raise exc

    def _send(self, message: bytes) -> None:
        self._outgoing += encode_length_prefixed(message)

    def _handle(self, message: bytes) -> None:
        payload = self._noise.read_message(message)
        if self.initiator:  # message 2: the responder's identity and cipher choice
            self._remote = self._check_identity(payload, with_cipher=True)
            self._chosen = self._remote.cipher
            self._send(self._noise.write_message(self._identity_payload))
            self._finish()
        elif self._chosen is None:  # message 1: hello
            self._chosen = self._negotiate(payload)
            reply = msgpack.packb({**self._identity_fields, "cipher": self._chosen}, use_bin_type=True)
            self._send(self._noise.write_message(reply))
        else:  # message 3: the initiator's identity
            self._remote = self._check_identity(payload, with_cipher=False)
            self._finish()

    def _negotiate(self, payload: bytes) -> str:
        hello = _unpack(payload, "handshake hello (corrupted, or only the remote uses a swarm key)")
        if not isinstance(hello, dict):
            raise HandshakeError("malformed handshake hello (not a map)")
        version = hello.get("v")
        if not isinstance(version, int) or isinstance(version, bool):
            raise HandshakeError("malformed handshake hello (no protocol version)")
        if version != PROTOCOL_VERSION:
            raise HandshakeError(f"remote speaks protocol version {version}, we speak {PROTOCOL_VERSION}")
        offered = hello.get("ciphers")
        if (
            not isinstance(offered, list)
            or len(offered) > _MAX_REMOTE_CIPHERS
            or not all(isinstance(name, str) for name in offered)
        ):
            raise HandshakeError("malformed handshake hello (bad cipher list)")
        for name in self._ciphers:  # our preference wins
            if name in offered:
                return name
        raise HandshakeError(
            f"no cipher in common: we accept {', '.join(self._ciphers)}; "
            f"remote offers {', '.join(offered) or 'nothing'}"
        )

    def _check_identity(self, payload: bytes, *, with_cipher: bool) -> _Remote:
        body = _unpack(payload, "handshake identity payload")
        if not isinstance(body, dict):
            raise HandshakeError("malformed handshake identity payload (not a map)")
        public, signature = body.get("id"), body.get("sig")
        if not isinstance(public, bytes) or len(public) != KEY_SIZE:
            raise HandshakeError("remote identity payload has no valid Ed25519 public key")
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_SIZE:
            raise HandshakeError("remote identity payload has no valid Ed25519 signature")
        static = self._noise.remote_static
        assert static is not None  # read_message authenticated it before this payload
        if not verify(public, signature, _STATIC_KEY_CONTEXT + static):
            raise HandshakeError(
                "remote identity signature does not cover the static key this handshake "
                "authenticated (forged or replayed identity)"
            )
        peer_id = peer_id_from_public_bytes(public)
        if self._expected is not None and peer_id != self._expected:
            raise HandshakeError(f"expected peer {self._expected} but remote proved identity {peer_id}")
        if self._allowed is not None and peer_id not in self._allowed:
            raise HandshakeError(f"peer {peer_id} is not on this swarm's allow-list")
        if self._min_bits and (work := identity_work(public)) < self._min_bits:
            raise HandshakeError(f"peer {peer_id}'s identity key carries {work} bits of work; this swarm asks "
                                 f"{self._min_bits} ([membership] identity_bits)")
        app = body.get("app", {})
        if not isinstance(app, dict):
            raise HandshakeError("remote app payload is not a map")
        cipher = None
        if with_cipher:
            cipher = body.get("cipher")
            if cipher not in self._ciphers:
                raise HandshakeError(f"remote chose cipher {cipher!r}, which we did not offer")
        return _Remote(public_key=public, peer_id=peer_id, app=app, cipher=cipher)

    def _finish(self) -> None:
        assert self._remote is not None and self._chosen is not None
        h = self._noise.handshake_hash
        k1, k2 = self._noise.split()
        i2r = CipherState(self._chosen, _transport_key(k1, h, self._chosen), rekey_interval=self._rekey_interval)
        r2i = CipherState(self._chosen, _transport_key(k2, h, self._chosen), rekey_interval=self._rekey_interval)
        send, recv = (i2r, r2i) if self.initiator else (r2i, i2r)
        self._result = HandshakeResult(
            peer_id=self._remote.peer_id,
            remote_public_key=self._remote.public_key,
            cipher=self._chosen,
            send=send,
            recv=recv,
            remote_app_payload=self._remote.app,
            handshake_hash=h,
        )

"""The Noise XX handshake pattern (optionally XXpsk0), sans-I/O: Noise_XX_25519_ChaChaPoly_SHA256.

Its own module because it is the Noise Protocol Framework's state machine (revision 34: CipherState,
SymmetricState, the XX message pattern) and nothing of peertrain's: `protocol.handshake` runs it and
adds what peertrain sends inside it (signed identities, cipher negotiation, the swarm prologue).
"""

from __future__ import annotations

import hashlib
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import HandshakeError

__all__ = ["AUTHENTICATION_FAILED", "TAG_LEN", "NoiseXXState"]

AUTHENTICATION_FAILED: Final = (
    "handshake authentication failed (different swarm key or corrupted handshake)"
    " - check that both peers use the same swarm name and swarm key"
)
TAG_LEN: Final = 16  # ChaChaPoly's authentication tag

_NOISE_XX: Final = b"Noise_XX_25519_ChaChaPoly_SHA256"
_NOISE_XX_PSK0: Final = b"Noise_XXpsk0_25519_ChaChaPoly_SHA256"
_DH_LEN: Final = 32


def _hkdf(chaining_key: bytes, ikm: bytes, outputs: int) -> list[bytes]:
    """Noise's HKDF(ck, ikm, n) is exactly RFC 5869 HKDF with salt=ck and empty info."""
    okm = HKDF(algorithm=hashes.SHA256(), length=32 * outputs, salt=chaining_key, info=b"").derive(ikm)
    return [okm[i * 32 : (i + 1) * 32] for i in range(outputs)]


def _x25519_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _dh(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # low-order point: the shared secret would be all zeros
        raise HandshakeError("remote sent an invalid X25519 public key") from None


class _NoiseCipher:
    """Noise's handshake CipherState: ChaChaPoly with a little-endian counter nonce."""

    def __init__(self) -> None:
        self._aead: ChaCha20Poly1305 | None = None
        self._n = 0

    @property
    def has_key(self) -> bool:
        return self._aead is not None

    def initialize_key(self, key: bytes) -> None:
        self._aead = ChaCha20Poly1305(key)
        self._n = 0

    def _nonce(self) -> bytes:
        nonce = b"\x00" * 4 + self._n.to_bytes(8, "little")
        self._n += 1
        return nonce

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        if self._aead is None:
            return plaintext
        return self._aead.encrypt(self._nonce(), plaintext, ad)

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        if self._aead is None:
            return ciphertext
        try:
            return self._aead.decrypt(self._nonce(), ciphertext, ad)
        except InvalidTag:
            raise HandshakeError(AUTHENTICATION_FAILED) from None


class _SymmetricState:
    """Noise's SymmetricState: the running transcript hash `h` and chaining key `ck`."""

    def __init__(self, protocol_name: bytes) -> None:
        if len(protocol_name) <= 32:
            h = protocol_name.ljust(32, b"\x00")
        else:
            h = hashlib.sha256(protocol_name).digest()
        self.h = h
        self.ck = h
        self.cipher = _NoiseCipher()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = _hkdf(self.ck, ikm, 2)
        self.cipher.initialize_key(temp_k)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self.ck, temp_h, temp_k = _hkdf(self.ck, ikm, 3)
        self.mix_hash(temp_h)
        self.cipher.initialize_key(temp_k)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[bytes, bytes]:
        k1, k2 = _hkdf(self.ck, b"", 2)
        return k1, k2


class NoiseXXState:
    """The bare Noise_XX(psk0)_25519_ChaChaPoly_SHA256 handshake with raw byte payloads.

    Kept separate from `Handshake` so it can be checked against other Noise
    implementations' test vectors; `Handshake` adds identities and negotiation.
    `ephemeral` is injectable only for such tests.
    """

    def __init__(
        self,
        *,
        initiator: bool,
        prologue: bytes,
        static: X25519PrivateKey,
        psk: bytes | None = None,
        ephemeral: X25519PrivateKey | None = None,
    ) -> None:
        if psk is not None and len(psk) != 32:
            raise ValueError("a Noise PSK must be 32 bytes")
        self.initiator = initiator
        self._psk = psk
        self._ss = _SymmetricState(_NOISE_XX_PSK0 if psk is not None else _NOISE_XX)
        self._ss.mix_hash(prologue)
        self._s = static
        self._s_pub = _x25519_public(static)
        self._e = ephemeral
        self._re: bytes | None = None
        self.remote_static: bytes | None = None
        """The remote's X25519 static key, once the handshake has authenticated it."""
        first = ("psk", "e") if psk is not None else ("e",)
        self._patterns: list[tuple[str, ...]] = [first, ("e", "ee", "s", "es"), ("s", "se")]
        self._index = 0

    @property
    def handshake_hash(self) -> bytes:
        return self._ss.h

    @property
    def finished(self) -> bool:
        return self._index == len(self._patterns)

    @property
    def static_public(self) -> bytes:
        return self._s_pub

    def _my_turn(self) -> bool:
        return (self._index % 2 == 0) == self.initiator

    def _mix_dh(self, token: str) -> None:
        # Letters name (initiator's key, responder's key); each side uses its own private half.
        first, second = token[0], token[1]
        mine, theirs = (first, second) if self.initiator else (second, first)
        private = self._e if mine == "e" else self._s
        public = self._re if theirs == "e" else self.remote_static
        assert private is not None and public is not None
        self._ss.mix_key(_dh(private, public))

    def write_message(self, payload: bytes) -> bytes:
        if self.finished or not self._my_turn():
            raise RuntimeError("not our turn to write a handshake message")
        out = bytearray()
        for token in self._patterns[self._index]:
            if token == "psk":
                assert self._psk is not None
                self._ss.mix_key_and_hash(self._psk)
            elif token == "e":
                if self._e is None:
                    self._e = X25519PrivateKey.generate()
                e_pub = _x25519_public(self._e)
                out += e_pub
                self._ss.mix_hash(e_pub)
                if self._psk is not None:
                    self._ss.mix_key(e_pub)
            elif token == "s":
                out += self._ss.encrypt_and_hash(self._s_pub)
            else:
                self._mix_dh(token)
        out += self._ss.encrypt_and_hash(payload)
        self._index += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """Process one received message and return its (decrypted) payload.

        Raises HandshakeError on anything wrong: short message, bad key, failed
        authentication.
        """
        if self.finished or self._my_turn():
            raise RuntimeError("not our turn to read a handshake message")
        message = bytes(message)
        pos = 0
        for token in self._patterns[self._index]:
            if token == "psk":
                assert self._psk is not None
                self._ss.mix_key_and_hash(self._psk)
            elif token == "e":
                if len(message) - pos < _DH_LEN:
                    raise HandshakeError(f"handshake message {self._index + 1} is too short")
                self._re = message[pos : pos + _DH_LEN]
                pos += _DH_LEN
                self._ss.mix_hash(self._re)
                if self._psk is not None:
                    self._ss.mix_key(self._re)
            elif token == "s":
                size = _DH_LEN + (TAG_LEN if self._ss.cipher.has_key else 0)
                if len(message) - pos < size:
                    raise HandshakeError(f"handshake message {self._index + 1} is too short")
                self.remote_static = self._ss.decrypt_and_hash(message[pos : pos + size])
                pos += size
            else:
                self._mix_dh(token)
        if self._ss.cipher.has_key and len(message) - pos < TAG_LEN:
            raise HandshakeError(f"handshake message {self._index + 1} is too short")
        payload = self._ss.decrypt_and_hash(message[pos:])
        self._index += 1
        return payload

    def split(self) -> tuple[bytes, bytes]:
        """(initiator-to-responder key, responder-to-initiator key)."""
        if not self.finished:
            raise RuntimeError("the handshake is not finished")
        return self._ss.split()

"""The Noise XX core against an independent implementation's transcript."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from protocol.noise import NoiseXXState

# Generated with an independent implementation (the `noiseprotocol` 0.3.1 package) from
# the cacophony test keys, prologue b"John Galt" and payloads below; the first message
# matches cacophony's published Noise_NN/XX vectors.
VECTOR_KEYS = {
    "init_static": "e61ef9919cde45dd5f82166404bd08e38bceb5dfdfded0a34c8df7ed542214d1",
    "init_ephemeral": "893e28b9dc6ca8d611ab664754b8ceb7bac5117349a4439a6b0569da977c464a",
    "resp_static": "4a3acbfdb163dec651dfa3194dece676d437029c62a408b4c5ea9114246e4893",
    "resp_ephemeral": "bbdb4cdbd309f1a1f2e1456967fe288cadd6f712d65dc7b7793d5e63da6b375b",
}
VECTOR_PAYLOADS = [b"Ludwig von Mises", b"Murray Rothbard", b"F. A. Hayek"]
VECTORS = {
    None: (
        "ca35def5ae56cec33dc2036731ab14896bc4c75dbb07a61f879f8e3afa4c79444c756477696720766f6e204d69736573",
        "95ebc60d2b1fa672c1f46a8aa265ef51bfe38e7ccb39ec5be34069f14480884381cbad1f276e038c48378ffce2b65285"
        "e08d6b68aaa3629a5a8639392490e5b9bd5269c2f1e4f488ed8831161f19b7815528f8982ffe09be9b5c412f8a0db50f"
        "8814c7194e83f23dbd8d162c9326ad",
        "c7195ffacac1307ff99046f219750fc47693e23c3cb08b89c2af808b444850a80ae475b9df0f169ae80a89be0865b57f"
        "58c9fea0d4ec82a286427402f113e4b6ae769a1d95941d49b25030",
        "c8e5f64e846193be2a834104c2a009868d6c9f3bd3c186299888b488b2f1f58e",
        "3744e25d623542b0576724d2c54efc70916e296af7ecd4fd05336c",
    ),
    "54686973206973206d7920417573747269616e20706572737065637469766521": (
        "ca35def5ae56cec33dc2036731ab14896bc4c75dbb07a61f879f8e3afa4c794444e557af4bb1c735a4948bdd9aedbb4b"
        "3db9a8aed79bc6517b05eca117a755c3",
        "95ebc60d2b1fa672c1f46a8aa265ef51bfe38e7ccb39ec5be34069f14480884309813c929a2ee793a6909502f23492a9"
        "0b088e4acc71ae6ca49464e67d97fdf404b94bc46aad47491994c66e9a8832f1701cdc1f47fc2ba565695638f005ca2e"
        "7b9a569a4c241a57879a0779d8bdbd",
        "591674f2df5cc5e0a9b3ddea86bafb1219b36345c12aa4bd0526a9f727fe2e2a14efe7e0a7b7710d042006afd97e7cf5"
        "8a3efe9041dba7cf07099b7c2345135e8d51254f6f742730eb7755",
        "0793e6b2d2fed61d803e0d9de8a4b961436e896194246a784d30d1bb1fd42e54",
        "45c3c8395abf1a9ebbfa85d0e69d4f30a73f64e63adb97f5cacf36",
    ),
}


@pytest.mark.parametrize("psk", list(VECTORS))
def test_noise_core_matches_an_independent_implementation(psk: str | None) -> None:
    def key(name: str) -> X25519PrivateKey:
        return X25519PrivateKey.from_private_bytes(bytes.fromhex(VECTOR_KEYS[name]))

    psk_bytes = bytes.fromhex(psk) if psk else None
    init = NoiseXXState(initiator=True, prologue=b"John Galt", static=key("init_static"),
                        psk=psk_bytes, ephemeral=key("init_ephemeral"))
    resp = NoiseXXState(initiator=False, prologue=b"John Galt", static=key("resp_static"),
                        psk=psk_bytes, ephemeral=key("resp_ephemeral"))
    *messages, handshake_hash, transport = VECTORS[psk]
    for step, (payload, expected) in enumerate(zip(VECTOR_PAYLOADS, messages)):
        writer, reader = (init, resp) if step % 2 == 0 else (resp, init)
        sent = writer.write_message(payload)
        assert sent.hex() == expected, f"message {step + 1}"
        assert reader.read_message(sent) == payload
    assert init.handshake_hash.hex() == resp.handshake_hash.hex() == handshake_hash
    assert init.split() == resp.split()
    # Noise transport messages use the split key with a little-endian counter nonce (0 here).
    assert ChaCha20Poly1305(init.split()[0]).encrypt(bytes(12), b"Carl Menger", b"").hex() == transport

"""The session handshake: success, refusals, tampering, fuzzing."""

from __future__ import annotations

import struct
from collections.abc import Callable

import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import PROTOCOL_VERSION
from protocol.cipher import CIPHERS
from protocol.errors import HandshakeError, LimitExceeded, ProtocolError
from protocol.frames import KIND_MESSAGE, FrameReader, FrameWriter, encode_length_prefixed
from protocol.handshake import Handshake, prologue_for
from protocol.noise import NoiseXXState
from protocol.identity import generate_identity, peer_id_of, public_key_bytes, sign

ALICE = generate_identity()
BOB = generate_identity()
MALLORY = generate_identity()
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(initiator: bool, identity=None, **kwargs) -> Handshake:
    kwargs.setdefault("swarm", "test-swarm")
    if identity is None:
        identity = ALICE if initiator else BOB
    return Handshake(initiator=initiator, identity=identity, **kwargs)


def exchange(
    init: Handshake, resp: Handshake, tamper: Callable[[int, bytes], bytes] | None = None
) -> None:
    """Carry the three messages across; raises whatever a side raises."""
    message = init.data_to_send()
    for step in range(3):
        if tamper is not None:
            message = tamper(step, message)
        receiver = resp if step % 2 == 0 else init
        receiver.receive_data(message)
        message = receiver.data_to_send()
    assert message == b""


# ------------------------------------------------------------------------ happy paths


@pytest.mark.parametrize("cipher", CIPHERS)
@pytest.mark.parametrize("psk", [None, b"swarm secret"])
def test_handshake_succeeds_and_keys_match(cipher: str, psk: bytes | None) -> None:
    init = make(True, psk=psk, ciphers=[cipher], app_payload={"port": 7000, "role": "trainer"})
    resp = make(False, psk=psk, app_payload={"listen": ["127.0.0.1", 7001]})
    assert not init.complete and not resp.complete
    exchange(init, resp)
    assert init.complete and resp.complete
    a, b = init.result(), resp.result()
    assert a.cipher == b.cipher == cipher
    assert a.peer_id == peer_id_of(BOB) and b.peer_id == peer_id_of(ALICE)
    assert a.remote_public_key == public_key_bytes(BOB)
    assert b.remote_public_key == public_key_bytes(ALICE)
    assert a.remote_app_payload == {"listen": ["127.0.0.1", 7001]}
    assert b.remote_app_payload == {"port": 7000, "role": "trainer"}
    assert a.handshake_hash == b.handshake_hash and len(a.handshake_hash) == 32
    assert a.leftover == b.leftover == b""
    # Each direction has its own key, and the two sides agree on both.
    for sender, receiver in ((a.send, b.recv), (b.send, a.recv)):
        for i in range(3):
            assert receiver.open(sender.seal(b"m%d" % i, b"ad"), b"ad") == b"m%d" % i
    with pytest.raises(ProtocolError):
        a.recv.open(a.send.seal(b"own direction"))


def test_sessions_are_independent() -> None:
    first, second = (make(True), make(False)), (make(True), make(False))
    exchange(*first)
    exchange(*second)
    assert first[0].result().handshake_hash != second[0].result().handshake_hash
    with pytest.raises(ProtocolError):
        second[1].result().recv.open(first[0].result().send.seal(b"cross-session"))


def test_responder_preference_wins_among_common_ciphers() -> None:
    init = make(True, ciphers=["chacha20-poly1305", "aes-256-gcm"])
    resp = make(False, ciphers=["aes-256-gcm", "chacha20-poly1305"])
    exchange(init, resp)
    assert init.result().cipher == resp.result().cipher == "aes-256-gcm"
    init, resp = make(True), make(False, ciphers=["chacha20-poly1305"])
    exchange(init, resp)
    assert init.result().cipher == "chacha20-poly1305"



def test_peer_without_ocb_and_peer_with_it_agree_on_gcm_either_way() -> None:
    """A build whose cryptography lacks OCB (or an older peertrain) offers GCM and ChaCha20 only;
    a default peer, which prefers OCB, must settle on GCM whichever side dials."""
    old = ["aes-256-gcm", "chacha20-poly1305"]
    for init, resp in ((make(True), make(False, ciphers=old)), (make(True, ciphers=old), make(False))):
        exchange(init, resp)
        assert init.result().cipher == resp.result().cipher == "aes-256-gcm"
        sealed = init.result().send.seal(b"both ways")
        assert resp.result().recv.open(sealed) == b"both ways"

def test_byte_at_a_time_and_leftover_bytes() -> None:
    init, resp = make(True), make(False)
    for byte in init.data_to_send():
        resp.receive_data(bytes([byte]))
    init.receive_data(resp.data_to_send())
    assert init.complete
    # The initiator may pipeline its first transport frame right behind message 3.
    writer = FrameWriter(init.result().send, 1024)
    first_frame = bytes(writer.seal(KIND_MESSAGE, 0, msgpack.packb({"hello": 1})))
    resp.receive_data(init.data_to_send() + first_frame[:5])
    assert resp.complete
    resp.receive_data(first_frame[5:])  # late bytes are kept too
    result = resp.result()
    assert result.leftover == first_frame
    reader = FrameReader(result.recv, 1024)
    reader.feed(result.leftover)
    frame = reader.next_frame()
    assert frame is not None and msgpack.unpackb(frame.open()) == {"hello": 1}


def test_result_only_when_complete() -> None:
    init = make(True)
    with pytest.raises(RuntimeError):
        init.result()
    assert init.data_to_send() != b"" and init.data_to_send() == b""


# --------------------------------------------------------------------------- refusals


def test_wrong_swarm_key() -> None:
    init, resp = make(True, psk=b"key one"), make(False, psk=b"key two")
    with pytest.raises(HandshakeError, match=r"different swarm key or corrupted handshake"):
        exchange(init, resp)
    assert not resp.complete


def test_only_the_responder_has_a_swarm_key() -> None:
    with pytest.raises(HandshakeError, match="different swarm key"):
        exchange(make(True), make(False, psk=b"secret"))


def test_only_the_initiator_has_a_swarm_key() -> None:
    resp = make(False)
    with pytest.raises(HandshakeError):
        exchange(make(True, psk=b"secret"), resp)
    assert not resp.complete and resp.data_to_send() == b""  # it never revealed its identity


def test_wrong_swarm_name() -> None:
    init, resp = make(True, swarm="alpha"), make(False, swarm="beta")
    with pytest.raises(HandshakeError, match="handshake authentication failed"):
        exchange(init, resp)
    assert not init.complete


def test_expected_peer_id_mismatch() -> None:
    init = make(True, expected_peer_id=peer_id_of(MALLORY))
    with pytest.raises(HandshakeError) as info:
        exchange(init, make(False))
    assert str(info.value) == f"expected peer {peer_id_of(MALLORY)} but remote proved identity {peer_id_of(BOB)}"
    assert init.data_to_send() == b""  # the initiator did not reveal itself to the wrong peer


def test_expected_peer_id_match() -> None:
    init = make(True, expected_peer_id=peer_id_of(BOB))
    exchange(init, make(False))
    assert init.result().peer_id == peer_id_of(BOB)


def test_allow_list_refusal_by_responder() -> None:
    resp = make(False, allowed_peer_ids=frozenset({peer_id_of(MALLORY)}))
    with pytest.raises(HandshakeError) as info:
        exchange(make(True), resp)
    assert str(info.value) == f"peer {peer_id_of(ALICE)} is not on this swarm's allow-list"


def test_allow_list_refusal_by_initiator_and_acceptance() -> None:
    with pytest.raises(HandshakeError, match="allow-list"):
        exchange(make(True, allowed_peer_ids=frozenset()), make(False))
    init = make(True, allowed_peer_ids=frozenset({peer_id_of(BOB)}))
    resp = make(False, allowed_peer_ids=frozenset({peer_id_of(ALICE)}))
    exchange(init, resp)
    assert init.complete and resp.complete


def test_a_swarm_that_asks_work_of_keys_refuses_a_key_without_it() -> None:
    """`[membership] identity_bits` (issue 40: keys are free): a remote key must carry that many leading zero
    bits of work, checked at the handshake by both ends; a key made with them passes."""
    from protocol.identity import MAX_IDENTITY_BITS, identity_work

    weak = next(k for k in iter(generate_identity, None) if identity_work(public_key_bytes(k)) < 10)
    strong = generate_identity(10)
    assert identity_work(public_key_bytes(strong)) >= 10
    resp = make(False, identity=strong, min_identity_bits=10)
    with pytest.raises(HandshakeError) as info:
        exchange(make(True, identity=weak), resp)
    assert str(info.value) == (f"peer {peer_id_of(weak)}'s identity key carries {identity_work(public_key_bytes(weak))} "
                               "bits of work; this swarm asks 10 ([membership] identity_bits)")
    init, resp = make(True, identity=generate_identity(10), min_identity_bits=10), make(False, identity=strong,
                                                                                      min_identity_bits=10)
    exchange(init, resp)
    assert init.complete and resp.complete
    with pytest.raises(ValueError, match="min_identity_bits"):
        make(True, min_identity_bits=MAX_IDENTITY_BITS + 1)
    with pytest.raises(ValueError, match="identity bits"):
        generate_identity(-1)


def test_no_common_cipher() -> None:
    resp = make(False, ciphers=["aes-256-gcm"])
    with pytest.raises(HandshakeError, match="no cipher in common"):
        exchange(make(True, ciphers=["chacha20-poly1305"]), resp)


def test_protocol_version_mismatch_is_reported() -> None:
    future = NoiseXXState(initiator=True, prologue=prologue_for("test-swarm"), static=X25519PrivateKey.generate())
    hello = msgpack.packb({"v": PROTOCOL_VERSION + 1, "ciphers": list(CIPHERS)})
    resp = make(False)
    with pytest.raises(HandshakeError) as info:
        resp.receive_data(encode_length_prefixed(future.write_message(hello)))
    assert str(info.value) == f"remote speaks protocol version {PROTOCOL_VERSION + 1}, we speak {PROTOCOL_VERSION}"


def test_responder_choosing_an_unoffered_cipher_is_refused() -> None:
    init = make(True, ciphers=["chacha20-poly1305"])
    resp = make(False)
    resp._negotiate = lambda payload: "aes-256-gcm"  # a misbehaving responder
    with pytest.raises(HandshakeError, match="did not offer"):
        exchange(init, resp)


def test_identity_not_bound_to_the_static_key_is_refused() -> None:
    resp = make(False)
    # Replay an identity signature made for some other session's static key.
    other_static = X25519PrivateKey.generate().public_key().public_bytes_raw()
    resp._identity_fields["sig"] = sign(BOB, b"peertrain-static-key:" + other_static)
    with pytest.raises(HandshakeError, match="signature"):
        exchange(make(True), resp)


def test_null_cipher_is_never_negotiable() -> None:
    with pytest.raises(ValueError):
        make(True, ciphers=["null"])
    with pytest.raises(ValueError):
        make(False, ciphers=["aes-256-gcm", "null"])
    with pytest.raises(ValueError):
        make(True, ciphers=[])


def test_oversized_app_payload_is_refused_locally() -> None:
    with pytest.raises(ValueError, match="too large"):
        make(True, app_payload={"blob": b"x" * 5000})


# --------------------------------------------------------------- tampering, truncation


def _message_lengths() -> list[int]:
    init, resp = make(True), make(False)
    lengths: list[int] = []

    def record(step: int, message: bytes) -> bytes:
        lengths.append(len(message))
        return message

    exchange(init, resp, record)
    return lengths


MESSAGE_LENGTHS = _message_lengths()


@pytest.mark.parametrize("psk", [None, b"k"])
@pytest.mark.parametrize("step", [0, 1, 2])
def test_tampering_any_byte_of_any_message_fails(step: int, psk: bytes | None) -> None:
    for position in range(MESSAGE_LENGTHS[step]):
        init, resp = make(True, psk=psk), make(False, psk=psk)

        def flip(at: int, message: bytes) -> bytes:
            if at != step:
                return message
            tampered = bytearray(message)
            tampered[position] ^= 0x04
            return bytes(tampered)

        with pytest.raises(ProtocolError):
            exchange(init, resp, flip)
            # A longer length prefix just waits for more bytes: the EOF then ends it.
            (resp if step % 2 == 0 else init).receive_data(b"")
        assert not (init.complete and resp.complete), position


@pytest.mark.parametrize("step", [0, 1, 2])
def test_truncated_messages_fail(step: int) -> None:
    init, resp = make(True), make(False)

    def cut_stream(at: int, message: bytes) -> bytes:
        return message[:-1] if at == step else message

    with pytest.raises(HandshakeError, match="closed during the handshake"):
        exchange(init, resp, cut_stream)
        (resp if step % 2 == 0 else init).receive_data(b"")

    init, resp = make(True), make(False)

    def cut_message(at: int, message: bytes) -> bytes:  # consistent prefix, short message
        return encode_length_prefixed(message[4:-1]) if at == step else message

    with pytest.raises(HandshakeError):
        exchange(init, resp, cut_message)


def test_a_failed_handshake_stays_failed() -> None:
    resp = make(False)
    with pytest.raises(HandshakeError):
        resp.receive_data(encode_length_prefixed(b"short"))
    with pytest.raises(HandshakeError, match="already failed"):
        resp.receive_data(make(True).data_to_send())


def test_oversized_handshake_message() -> None:
    with pytest.raises(LimitExceeded):
        make(False).receive_data(struct.pack(">I", 4097))


# ----------------------------------------------------------------------------- fuzzing


@FUZZ
@given(garbage=st.binary(max_size=300), framed=st.booleans(), initiator=st.booleans(), psk=st.booleans())
def test_garbage_only_raises_handshake_errors(garbage: bytes, framed: bool, initiator: bool, psk: bool) -> None:
    side = make(initiator, psk=b"k" if psk else None)
    data = encode_length_prefixed(garbage) if framed else garbage
    try:
        side.receive_data(data)
        side.receive_data(b"")
    except ProtocolError:
        return
    raise AssertionError("EOF during a handshake must raise")


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=70),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
hello_like = st.fixed_dictionaries(
    {}, optional={"v": msgpack_values | st.just(PROTOCOL_VERSION), "ciphers": msgpack_values | st.just(list(CIPHERS))}
)


@FUZZ
@given(hello=hello_like | msgpack_values)
def test_arbitrary_hello_payloads_only_raise_handshake_errors(hello) -> None:
    noise = NoiseXXState(initiator=True, prologue=prologue_for("test-swarm"), static=X25519PrivateKey.generate())
    resp = make(False)
    try:
        resp.receive_data(encode_length_prefixed(noise.write_message(msgpack.packb(hello))))
    except HandshakeError:
        return
    assert hello == {"v": PROTOCOL_VERSION, "ciphers": list(CIPHERS)} or (
        isinstance(hello, dict) and hello.get("v") == PROTOCOL_VERSION
    )


identity_like = st.fixed_dictionaries(
    {},
    optional={
        "id": msgpack_values | st.binary(min_size=32, max_size=32),
        "sig": msgpack_values | st.binary(min_size=64, max_size=64),
        "app": msgpack_values,
        "cipher": msgpack_values | st.sampled_from(CIPHERS),
    },
)


@FUZZ
@given(identity=identity_like | msgpack_values | st.binary(max_size=50).map(lambda b: ("raw", b)))
def test_arbitrary_identity_payloads_from_a_keyholder_are_refused(identity) -> None:
    """Even a peer that completes the Noise part correctly cannot get past a bad identity."""
    init = make(True)
    rogue = NoiseXXState(initiator=False, prologue=prologue_for("test-swarm"), static=X25519PrivateKey.generate())
    hello = init.data_to_send()[4:]
    rogue.read_message(hello)
    if isinstance(identity, tuple):
        payload = identity[1]
    else:
        payload = msgpack.packb(identity)
    with pytest.raises(HandshakeError):
        init.receive_data(encode_length_prefixed(rogue.write_message(payload)))

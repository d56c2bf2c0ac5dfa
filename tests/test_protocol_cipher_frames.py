"""Transport cipher and frame format: round trips, tampering, limits, fuzzing."""

from __future__ import annotations

import array
import os
import struct

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESOCB3, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.cipher import CIPHERS, CipherState, NullCipher
from protocol.errors import AuthenticationError, LimitExceeded, ProtocolError
from protocol.frames import (
    HEADER_SIZE,
    KIND_CHUNK,
    KIND_MESSAGE,
    FrameReader,
    FrameWriter,
    LengthPrefixedReader,
    encode_length_prefixed,
)

KEY = bytes(range(32))
MAX_BODY = 4096 + 16
# Each negotiable name and the primitive it must be, checked against cryptography's own classes.
PRIMITIVES = {"aes-256-ocb": AESOCB3, "aes-256-gcm": AESGCM, "chacha20-poly1305": ChaCha20Poly1305}
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pair(cipher: str = "aes-256-gcm", *, max_body: int = MAX_BODY, rekey: int = 2**20, buffer_size: int = 65536):
    writer = FrameWriter(CipherState(cipher, KEY, rekey_interval=rekey), max_body)
    reader = FrameReader(CipherState(cipher, KEY, rekey_interval=rekey), max_body, buffer_size=buffer_size)
    return writer, reader


def wire(writer: FrameWriter, frames) -> bytes:
    return b"".join(bytes(writer.seal(kind, stream, data)) for kind, stream, data in frames)


def drain(reader: FrameReader) -> list[tuple[int, int, bytes]]:
    out = []
    while (frame := reader.next_frame()) is not None:
        out.append((frame.kind, frame.stream, bytes(frame.open())))
    return out


def push(reader: FrameReader, data: bytes, splits: list[int]) -> list[tuple[int, int, bytes]]:
    """Deliver `data` through want()/got() in pieces no larger than the given sizes."""
    received, pos, i = [], 0, 0
    while pos < len(data):
        view = reader.want()
        assert len(view) > 0
        n = min(len(view), len(data) - pos, splits[i % len(splits)] if splits else len(data))
        view[:n] = data[pos : pos + n]
        reader.got(n)
        pos += n
        i += 1
        received += drain(reader)
    return received


# ----------------------------------------------------------------------------- cipher


@pytest.mark.parametrize("name", CIPHERS)
def test_cipher_round_trip_and_overhead(name: str) -> None:
    send, recv = CipherState(name, KEY), CipherState(name, KEY)
    for i in range(5):
        sealed = send.seal(b"x" * i, b"aad")
        assert len(sealed) == i + send.overhead == i + 16
        assert recv.open(sealed, b"aad") == b"x" * i
    assert send.counter == recv.counter == 5


@pytest.mark.parametrize("name", CIPHERS)
def test_nonce_is_four_zero_bytes_and_big_endian_counter(name: str) -> None:
    aead = PRIMITIVES[name]
    send = CipherState(name, KEY)
    first, second = send.seal(b"a", b"h"), send.seal(b"b", b"h")
    assert aead(KEY).decrypt(bytes(12), first, b"h") == b"a"
    assert aead(KEY).decrypt(bytes(4) + (1).to_bytes(8, "big"), second, b"h") == b"b"



def test_ocb_is_left_out_where_the_build_lacks_it(monkeypatch) -> None:
    """On a cryptography build without OCB (LibreSSL, BoringSSL) the probe says so instead of raising,
    so CIPHERS shrinks to GCM and ChaCha20 and negotiation still works."""
    import protocol.cipher as cipher_module
    from cryptography.exceptions import UnsupportedAlgorithm

    def unsupported(key):
        raise UnsupportedAlgorithm("OCB is not supported by this backend")

    assert cipher_module._has_ocb() is ("aes-256-ocb" in CIPHERS)
    monkeypatch.setattr(cipher_module, "AESOCB3", unsupported)
    assert cipher_module._has_ocb() is False

@pytest.mark.parametrize("name", CIPHERS)
def test_seal_into_and_open_into_caller_buffers(name: str) -> None:
    send, recv = CipherState(name, KEY), CipherState(name, KEY)
    values = array.array("f", [1.5, -2.0, 3.25])
    out = bytearray(100)
    n = send.seal_into(values, b"", out)
    assert n == 12 + 16
    dest = array.array("f", [0.0] * 3)
    assert recv.open_into(memoryview(out)[:n], b"", dest) == 12
    assert dest == values


def test_wrong_aad_or_key_fails_and_zeroes_the_output() -> None:
    sealed = CipherState("aes-256-gcm", KEY).seal(b"secret", b"hdr")
    dest = bytearray(b"??????")
    with pytest.raises(AuthenticationError, match="tampered, replayed, reordered or truncated"):
        CipherState("aes-256-gcm", KEY).open_into(sealed, b"HDR", dest)
    assert dest == bytes(6)  # no unauthenticated plaintext left behind
    with pytest.raises(AuthenticationError):
        CipherState("aes-256-gcm", bytes(32)).open(sealed, b"hdr")
    with pytest.raises(AuthenticationError):
        CipherState("aes-256-gcm", KEY).open(b"short")


@pytest.mark.parametrize("name", CIPHERS)
def test_rekey_happens_in_lock_step(name: str) -> None:
    send = CipherState(name, KEY, rekey_interval=3)
    recv = CipherState(name, KEY, rekey_interval=3)
    for i in range(20):
        assert recv.open(send.seal(b"frame %d" % i)) == b"frame %d" % i
    assert send.rekeys == recv.rekeys == 6
    # The key really changed: frame 3 is sealed under HKDF(key, "peertrain rekey").
    send = CipherState(name, KEY, rekey_interval=3)
    sealed = [send.seal(b"m") for _ in range(4)]
    nonce3 = bytes(4) + (3).to_bytes(8, "big")
    aead = PRIMITIVES[name]
    new_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"peertrain rekey").derive(KEY)
    assert aead(new_key).decrypt(nonce3, sealed[3], b"") == b"m"
    # A receiver that rekeys on a different schedule fails exactly at the first divergence.
    recv = CipherState(name, KEY, rekey_interval=4)
    for frame in sealed[:3]:
        recv.open(frame)
    with pytest.raises(AuthenticationError):
        recv.open(sealed[3])


def test_counter_never_wraps() -> None:
    state = CipherState("aes-256-gcm", KEY)
    state._counter = 2**64 - 1  # white-box: 2**64 real frames would take centuries
    with pytest.raises(ProtocolError, match="exhausted"):
        state.seal(b"x")


def test_cipher_state_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError):
        CipherState("rot13", KEY)
    with pytest.raises(ValueError):
        CipherState("aes-256-gcm", b"short")
    with pytest.raises(ValueError):
        CipherState("aes-256-gcm", KEY, rekey_interval=0)
    assert "null" not in CIPHERS
    assert set(CIPHERS) <= set(PRIMITIVES) and {"aes-256-gcm", "chacha20-poly1305"} <= set(CIPHERS)
    assert KEY.hex() not in repr(CipherState("aes-256-gcm", KEY))


def test_null_cipher_passes_through() -> None:
    writer = FrameWriter(NullCipher(), 1000)
    reader = FrameReader(NullCipher(), 1000)
    data = wire(writer, [(KIND_MESSAGE, 0, b"plain"), (KIND_CHUNK, 7, b"")])
    assert b"plain" in data
    reader.feed(data)
    assert drain(reader) == [(KIND_MESSAGE, 0, b"plain"), (KIND_CHUNK, 7, b"")]


# ----------------------------------------------------------------------------- frames

frame_strategy = st.tuples(
    st.sampled_from([KIND_MESSAGE, KIND_CHUNK]),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=600),
).map(lambda t: (t[0], 0 if t[0] == KIND_MESSAGE else t[1], t[2]))


@FUZZ
@given(
    frames=st.lists(frame_strategy, max_size=12),
    splits=st.lists(st.integers(1, 700), max_size=8),
    cipher=st.sampled_from(CIPHERS),
    buffer_size=st.sampled_from([64, 100, 333, 65536]),
)
def test_round_trip_with_random_read_splits(frames, splits, cipher, buffer_size) -> None:
    writer, reader = pair(cipher, max_body=616, buffer_size=buffer_size)
    assert push(reader, wire(writer, frames), splits) == frames
    reader.got(0)
    assert reader.eof


def test_header_layout_and_sizes() -> None:
    writer, _ = pair()
    framed = bytes(writer.seal(KIND_CHUNK, 0xDEADBEEF, b"12345"))
    assert len(framed) == HEADER_SIZE + 5 + 16
    assert struct.unpack(">IBI", framed[:9]) == (5 + 16, KIND_CHUNK, 0xDEADBEEF)


def test_open_into_caller_memory_at_an_offset() -> None:
    writer, reader = pair()
    values = array.array("d", [float(i) for i in range(64)])
    reader.feed(bytes(writer.seal(KIND_CHUNK, 3, values)))
    frame = reader.next_frame()
    assert frame is not None and (frame.kind, frame.stream, frame.size) == (KIND_CHUNK, 3, 512)
    tensor = array.array("d", [0.0] * 128)
    target = memoryview(tensor).cast("B")[256 : 256 + frame.size]
    assert frame.open_into(target) == 512
    assert tensor[32:96] == values and tensor[:32] == array.array("d", [0.0] * 32)


def test_frames_must_be_opened_exactly_once_in_order() -> None:
    writer, reader = pair()
    reader.feed(wire(writer, [(KIND_MESSAGE, 0, b"a"), (KIND_MESSAGE, 0, b"b")]))
    first = reader.next_frame()
    assert first is not None
    with pytest.raises(RuntimeError, match="opened"):
        reader.next_frame()
    with pytest.raises(RuntimeError, match="opened"):
        reader.want()
    with pytest.raises(ValueError):
        first.open_into(bytearray(0))  # too small: refused without consuming the frame
    assert bytes(first.open()) == b"a"
    with pytest.raises(RuntimeError, match="already opened"):
        first.open()
    second = reader.next_frame()
    assert second is not None and bytes(second.open()) == b"b"


@pytest.mark.parametrize("position", range(HEADER_SIZE + 5 + 16))
def test_tampering_any_byte_fails(position: int) -> None:
    writer, reader = pair()
    frames = [(KIND_CHUNK, 1, b"hello"), (KIND_CHUNK, 2, b"world")]
    data = bytearray(wire(writer, frames))
    data[position] ^= 0x01
    with pytest.raises(ProtocolError) as info:
        reader.feed(bytes(data))
        drain(reader)
        reader.feed(b"")
    if position >= 5:  # stream and body bytes: caught by the AEAD itself
        assert isinstance(info.value, AuthenticationError)


def test_swapping_the_kind_fails_authentication() -> None:
    writer, reader = pair()
    data = bytearray(writer.seal(KIND_MESSAGE, 0, b"{}"))
    data[4] = KIND_CHUNK
    reader.feed(bytes(data))
    with pytest.raises(AuthenticationError):
        drain(reader)


@pytest.mark.parametrize("bit", [1, 2, 0x80])
def test_tampering_the_length_never_goes_unnoticed(bit: int) -> None:
    writer, reader = pair(max_body=1 << 20)
    data = bytearray(wire(writer, [(KIND_CHUNK, 1, b"x" * 100), (KIND_CHUNK, 1, b"y" * 100)]))
    data[3] ^= bit
    with pytest.raises(ProtocolError):
        reader.feed(bytes(data))
        drain(reader)
        reader.feed(b"")


def test_replayed_frame_fails() -> None:
    writer, reader = pair()
    frame = bytes(writer.seal(KIND_MESSAGE, 0, b"pay me"))
    reader.feed(frame + frame)
    assert drain_one(reader) == b"pay me"
    with pytest.raises(AuthenticationError):
        drain_one(reader)


def test_reordered_frames_fail() -> None:
    writer, reader = pair()
    first, second = (bytes(writer.seal(KIND_CHUNK, 1, m)) for m in (b"one", b"two"))
    reader.feed(second + first)
    with pytest.raises(AuthenticationError):
        drain_one(reader)


def drain_one(reader: FrameReader) -> bytes:
    frame = reader.next_frame()
    assert frame is not None
    return bytes(frame.open())


@pytest.mark.parametrize("cut", [1, 8, 9, 10, 30])
def test_eof_mid_frame_is_truncation(cut: int) -> None:
    writer, reader = pair()
    data = wire(writer, [(KIND_MESSAGE, 0, b"complete"), (KIND_CHUNK, 4, b"x" * 21)])
    first_len = HEADER_SIZE + 8 + 16
    push(reader, data[: first_len + cut], [7])
    with pytest.raises(ProtocolError, match="truncated"):
        reader.got(0)


def test_truncated_large_body() -> None:
    writer, reader = pair(max_body=1 << 20, buffer_size=1024)
    data = bytes(writer.seal(KIND_CHUNK, 1, os.urandom(100_000)))
    push(reader, data[:-1], [5000])
    with pytest.raises(ProtocolError, match="truncated"):
        reader.got(0)


def test_clean_eof_between_frames() -> None:
    writer, reader = pair()
    assert push(reader, wire(writer, [(KIND_MESSAGE, 0, b"bye")]), []) == [(KIND_MESSAGE, 0, b"bye")]
    reader.want()
    reader.got(0)
    assert reader.eof


def test_four_gigabyte_length_prefix_costs_nothing() -> None:
    _, reader = pair(max_body=1 << 20)
    view = reader.want()
    view[:HEADER_SIZE] = struct.pack(">IBI", 0xFFFFFFFF, KIND_CHUNK, 1)
    reader.got(HEADER_SIZE)
    with pytest.raises(LimitExceeded, match="exceeds the limit"):
        reader.next_frame()
    assert len(reader._big) == 0 and len(reader._plain) == 0  # nothing was allocated for it


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (struct.pack(">IBI", 16, 9, 0), "unknown frame kind"),
        (struct.pack(">IBI", 15, KIND_CHUNK, 0), "shorter than"),
        (struct.pack(">IBI", 16, KIND_MESSAGE, 5), "stream"),
    ],
)
def test_bad_headers_are_protocol_errors(header: bytes, message: str) -> None:
    _, reader = pair()
    reader.feed(header + bytes(16))
    with pytest.raises(ProtocolError, match=message):
        reader.next_frame()


@FUZZ
@given(garbage=st.binary(max_size=400), splits=st.lists(st.integers(1, 50), max_size=5))
def test_garbage_only_raises_protocol_errors(garbage: bytes, splits: list[int]) -> None:
    _, reader = pair(max_body=200, buffer_size=64)
    try:
        push(reader, garbage, splits)
        reader.got(0)
    except ProtocolError:
        pass


@FUZZ
@given(data=st.data())
def test_mutated_valid_streams_only_raise_protocol_errors(data) -> None:
    writer, reader = pair(max_body=616, buffer_size=100)
    frames = data.draw(st.lists(frame_strategy, min_size=1, max_size=4))
    stream = bytearray(wire(writer, frames))
    for _ in range(data.draw(st.integers(1, 3))):
        stream[data.draw(st.integers(0, len(stream) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        received = push(reader, bytes(stream), [data.draw(st.integers(1, 200))])
        reader.got(0)
    except ProtocolError:
        return
    assert received == frames  # a mutation that does not raise must not change anything...
    assert bytes(stream) == wire(pair(max_body=616)[0], frames)  # ...so there was none


def test_many_small_frames_arrive_in_one_read() -> None:
    writer, reader = pair()
    frames = [(KIND_MESSAGE, 0, b"m" * 100)] * 50
    data = wire(writer, frames)
    view = reader.want()
    assert len(view) >= len(data)
    view[: len(data)] = data
    reader.got(len(data))
    assert drain(reader) == frames


def test_large_body_is_read_straight_into_its_buffer() -> None:
    writer, reader = pair(max_body=(1 << 20) + 16)
    payload = os.urandom(1 << 20)
    data = bytes(writer.seal(KIND_CHUNK, 9, payload))
    view = reader.want()
    view[:1000] = data[:1000]
    reader.got(1000)
    assert reader.next_frame() is None
    rest = reader.want()
    assert len(rest) == len(data) - 1000  # exactly the missing body bytes
    rest[:] = data[1000:]
    reader.got(len(rest))
    frame = reader.next_frame()
    assert frame is not None and frame.size == len(payload)
    dest = bytearray(len(payload))
    frame.open_into(dest)
    assert dest == payload


def test_reader_buffers_are_reused() -> None:
    writer, reader = pair(max_body=(1 << 16) + 16, buffer_size=4096)
    payloads = [os.urandom(50_000) for _ in range(3)]
    first, *rest = (bytes(writer.seal(KIND_CHUNK, 1, p)) for p in payloads)
    assert push(reader, first, [30_000]) == [(KIND_CHUNK, 1, payloads[0])]
    big, plain = reader._big, reader._plain
    assert push(reader, b"".join(rest), [30_000]) == [(KIND_CHUNK, 1, p) for p in payloads[1:]]
    assert reader._big is big and reader._plain is plain


def test_writer_limits_and_validation() -> None:
    writer, _ = pair(max_body=100 + 16)
    assert len(writer.seal(KIND_CHUNK, 0, bytes(100))) == HEADER_SIZE + 116
    with pytest.raises(LimitExceeded):
        writer.seal(KIND_CHUNK, 0, bytes(101))
    with pytest.raises(ValueError):
        writer.seal(7, 0, b"")
    with pytest.raises(ValueError):
        writer.seal(KIND_MESSAGE, 1, b"")
    with pytest.raises(ValueError):
        writer.seal(KIND_CHUNK, 2**32, b"")


def test_writer_buffer_grows_and_is_reused() -> None:
    writer, reader = pair(max_body=(1 << 20) + 16)
    out = bytes(writer.seal(KIND_MESSAGE, 0, b"s"))
    out += bytes(writer.seal(KIND_CHUNK, 1, bytes(1 << 20)))
    grown = writer._buf
    out += bytes(writer.seal(KIND_MESSAGE, 0, b"t"))
    assert writer._buf is grown
    reader.feed(out)
    assert [len(p) for _, _, p in drain(reader)] == [1, 1 << 20, 1]


def test_feed_accepts_more_than_the_buffer_holds() -> None:
    writer, reader = pair(buffer_size=64)
    frames = [(KIND_CHUNK, i, bytes([i]) * (i * 7)) for i in range(40)]
    reader.feed(wire(writer, frames))
    assert drain(reader) == frames
    reader.feed(b"")
    assert reader.eof


# ----------------------------------------------------------------------- length prefix


def test_length_prefixed_round_trip_split_and_leftover() -> None:
    data = encode_length_prefixed(b"one") + encode_length_prefixed(b"") + encode_length_prefixed(b"three") + b"xyz"
    reader = LengthPrefixedReader(100)
    got = []
    for byte in data:
        reader.feed(bytes([byte]))
        while (message := reader.next_message()) is not None:
            got.append(message)
    assert got == [b"one", b"", b"three"]
    assert reader.take_buffered() == b"xyz"


def test_length_prefixed_limit_checked_on_the_prefix_alone() -> None:
    reader = LengthPrefixedReader(4096)
    reader.feed(struct.pack(">I", 4097))
    with pytest.raises(LimitExceeded):
        reader.next_message()
    with pytest.raises(LimitExceeded):
        reader.needed()


def test_length_prefixed_needed_is_exactly_the_rest_of_one_message() -> None:
    reader = LengthPrefixedReader(100)
    assert reader.needed() == 4
    reader.feed(b"\x00\x00")
    assert reader.needed() == 2
    reader.feed(b"\x00\x05ab")
    assert reader.next_message() is None and reader.needed() == 3
    reader.feed(b"cde")
    assert reader.next_message() == b"abcde" and reader.needed() == 4

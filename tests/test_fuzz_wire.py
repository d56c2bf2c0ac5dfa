"""Every wire decoder under hypothesis: only the documented errors escape AND what it allocates is bounded.

Exception types alone miss the other half of hostile input: a decoder that refuses a message correctly but
first allocates what the message claims. Each test here measures the allocation peak (`tracemalloc`, which
also sees numpy's buffers) or the decoder's own buffers against a bound derived from the limits.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.cipher import CipherState, NullCipher
from protocol.errors import LimitExceeded, ProtocolError
from protocol.frames import KIND_CHUNK, KIND_MESSAGE, FrameReader, LengthPrefixedReader
from protocol.limits import DEFAULT_LIMITS, KiB, MiB, WireLimits
from protocol.msgpack_scan import MAX_NESTING
from protocol.schema import DEFAULT_REGISTRY, MESSAGES, TensorHeader
from tests.test_protocol_messages import any_registered
from protocol.tensor_codec import CODECS, DTYPES, MAX_NDIM, MAX_Q8_BLOCK, tensor_nbytes
from protocol.tensor_decoder import TensorDecoder

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLACK = 64 * KiB
"""Allocation allowed beyond a decoder's own bound: exception objects, messages, hypothesis' bookkeeping."""


@contextmanager
def peak() -> Iterator[list[int]]:
    """Bytes allocated at the peak inside the block, beyond what was live when it began (box[0])."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    box = [0]
    try:
        yield box
    finally:
        box[0] = tracemalloc.get_traced_memory()[1] - base
        if started:
            tracemalloc.stop()


# --- frames ------------------------------------------------------------------------------------------


def body_lengths(max_body: int, overhead: int) -> st.SearchStrategy[int]:
    """Lengths near every edge the reader checks, and the 32-bit extremes."""
    edges = [0, overhead - 1, overhead, max_body - 1, max_body, max_body + 1, 2**31, 2**32 - 1]
    return st.sampled_from([e for e in edges if e >= 0]) | st.integers(0, max_body + 100)


@st.composite
def frame_streams(draw, max_body: int, overhead: int) -> bytes:
    """Headers with lengths near the limits, kinds and streams at random, bodies shorter or longer than said."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        length = draw(body_lengths(max_body, overhead))
        kind = draw(st.sampled_from([KIND_MESSAGE, KIND_CHUNK, 0, 3, 255]))
        stream = draw(st.sampled_from([0, 1, 2**32 - 1]))
        out += struct.pack(">IBI", length, kind, stream)
        out += bytes(max(0, min(length, max_body + 50) + draw(st.integers(-8, 8))) if draw(st.booleans()) else 0)
    return bytes(out + draw(st.binary(max_size=64)))


@FUZZ
@given(data=st.data(), max_body=st.integers(64, 20_000), buffer_size=st.sampled_from([64, 1000, 65536]),
       sealed=st.booleans())
def test_frame_reader_holds_at_most_one_frame_whatever_arrives(data, max_body, buffer_size, sealed) -> None:
    cipher = CipherState("aes-256-gcm", bytes(32)) if sealed else NullCipher()
    stream = data.draw(frame_streams(max_body, cipher.overhead))
    splits = data.draw(st.lists(st.integers(1, 3000), min_size=1, max_size=6))
    with peak() as used:
        reader = FrameReader(cipher, max_body, buffer_size=buffer_size)
        try:
            pos, i = 0, 0
            while pos < len(stream):
                view = reader.want()
                n = min(len(view), len(stream) - pos, splits[i % len(splits)])
                view[:n] = stream[pos : pos + n]
                reader.got(n)
                pos, i = pos + n, i + 1
                while (frame := reader.next_frame()) is not None:
                    assert frame.size <= max_body
                    frame.open()
                # the reader's buffers: the shared one as made, one body and one plaintext of at most max_body
                assert len(reader._small) == buffer_size
                assert len(reader._big) <= max_body and len(reader._plain) <= max_body
            reader.got(0)
        except ProtocolError:
            pass
    assert used[0] <= buffer_size + 2 * max_body + SLACK


@FUZZ
@given(data=st.data(), max_len=st.integers(1, 5000))
def test_length_prefixed_reader_holds_one_message_and_one_read(data, max_len) -> None:
    lengths = st.sampled_from([0, max_len - 1, max_len, max_len + 1, 2**32 - 1]) | st.integers(0, max_len)
    stream = bytearray()
    for length in data.draw(st.lists(lengths, max_size=20)):
        stream += struct.pack(">I", length) + bytes(min(length, max_len + 10))
    reads = data.draw(st.lists(st.integers(1, 2 * max_len + 10), min_size=1, max_size=8))
    reader = LengthPrefixedReader(max_len)
    pos, i = 0, 0
    try:
        while pos < len(stream):
            n = reads[i % len(reads)]
            reader.feed(bytes(stream[pos : pos + n]))
            pos, i = pos + n, i + 1
            while (message := reader.next_message()) is not None:
                assert len(message) <= max_len
            assert reader.buffered() < 4 + max_len  # only an incomplete message is left
            assert len(reader._buf) == reader.buffered()  # and nothing already returned
    except LimitExceeded:
        pass


def test_length_prefixed_reader_does_not_keep_returned_messages() -> None:
    """Regression: the consumed prefix was kept until a feed happened to end on a message boundary."""
    reader = LengthPrefixedReader(100)
    message = struct.pack(">I", 50) + bytes(50)
    reader.feed(message[:10])
    for _ in range(1000):
        reader.feed(message[10:] + message[:10])
        assert reader.next_message() == bytes(50)
    assert len(reader._buf) == reader.buffered() == 10


# --- messages ----------------------------------------------------------------------------------------

LIMITS = WireLimits(max_message_bytes=64 * KiB, max_str_len=4 * KiB, max_bin_len=4 * KiB, max_array_len=1000,
                    max_map_len=500)
AMPLIFICATION = 64
"""Bytes a decoded object may take per byte of message: a 1-byte msgpack nil in a list is an 8-byte slot,
a 3-byte map entry a dict slot and a str; anything far above means the decoder trusted a declared size."""

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
           | st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=4) | st.sampled_from("tvrqb"), inner, max_size=6),
                      max_leaves=40)
envelopes = st.fixed_dictionaries(
    {"t": st.sampled_from([c.TYPE for c in MESSAGES]) | st.text(max_size=8),
     "v": st.sampled_from([1, 2, 3, 0, -1, 2**63]) | values,
     "r": st.integers(-1, 2**64 - 1) | values, "q": st.integers(-1, 2**64 - 1) | values,
     "b": st.dictionaries(st.text(max_size=12), values, max_size=8) | values})


def headers_claiming(count: int) -> st.SearchStrategy[bytes]:
    """A container header that claims `count` elements (array or map, every width)."""
    return st.sampled_from([b"\xdc" + struct.pack(">H", min(count, 0xFFFF)), b"\xdd" + struct.pack(">I", count),
                            b"\xde" + struct.pack(">H", min(count, 0xFFFF)), b"\xdf" + struct.pack(">I", count),
                            b"\xc6" + struct.pack(">I", count), b"\xdb" + struct.pack(">I", count)])


lying_headers = st.lists(st.integers(0, 2**32 - 1) | st.sampled_from([999, 1000, 1001, 10**6]), min_size=1,
                         max_size=40).flatmap(lambda counts: st.tuples(*[headers_claiming(c) for c in counts]))


def decode_bounded(data: bytes) -> None:
    """Decode `data`; only ProtocolError (or a subclass) may escape, and the peak stays proportional."""
    with peak() as used:
        try:
            DEFAULT_REGISTRY.decode(data, LIMITS)
        except ProtocolError:
            pass
    assert used[0] <= AMPLIFICATION * len(data) + SLACK, f"{used[0]} bytes allocated for {len(data)}"


@FUZZ
@given(obj=envelopes | values)
def test_random_msgpack_only_raises_protocol_errors_and_allocates_in_proportion(obj) -> None:
    decode_bounded(msgpack.packb(obj, use_bin_type=True))


@FUZZ
@given(parts=lying_headers, tail=st.binary(max_size=50))
def test_declared_sizes_and_deep_nesting_allocate_nothing_they_claim(parts, tail) -> None:
    decode_bounded(b"".join(parts) + tail)


def test_nested_array_headers_are_refused_before_msgpack_preallocates() -> None:
    """Regression: 5 KB of nested array32 headers each claiming 100,000 elements made msgpack allocate 80 MB."""
    data = b"\xdd" + struct.pack(">I", 100_000)
    with peak() as used, pytest.raises(ProtocolError, match="elements in"):
        DEFAULT_REGISTRY.decode(data * 1000, DEFAULT_LIMITS)
    assert used[0] < SLACK


def test_nesting_is_capped() -> None:
    deep = msgpack.packb({"t": "ping", "v": 1, "b": {"sent": 1.0, "x": [[[0]]]}})
    DEFAULT_REGISTRY.decode(deep, DEFAULT_LIMITS)
    too_deep = b"\x91" * (MAX_NESTING + 1) + b"\xc0"
    with pytest.raises(ProtocolError, match="nested deeper"):
        DEFAULT_REGISTRY.decode(too_deep, DEFAULT_LIMITS)


def _encodable(msg) -> bool:
    try:
        DEFAULT_REGISTRY.encode(msg)
    except ValueError:
        return False
    return True


@st.composite
def valid_encodings(draw) -> bytes:
    msg = draw(any_registered.filter(_encodable))
    return DEFAULT_REGISTRY.encode(msg, rid=draw(st.integers(0, 2**64 - 1)))


@FUZZ
@given(data=st.data())
def test_mutated_messages_of_every_type_only_raise_protocol_errors(data) -> None:
    encoded = bytearray(data.draw(valid_encodings()))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "claim"]))
        at = data.draw(st.integers(0, len(encoded)))
        if op == "flip" and at < len(encoded):
            encoded[at] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del encoded[at:]
        elif op == "insert":
            encoded[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            encoded[at:at] = data.draw(headers_claiming(data.draw(st.integers(0, 2**32 - 1))))
    decode_bounded(bytes(encoded))


# --- the partial-view plane: bodies near and past every bound -------------------------------------------

VIEW_PLANE = [c for c in MESSAGES if c.__module__ == "protocol.schema.views"]
entries = st.fixed_dictionaries({"peer_id": st.text(max_size=70), "addresses": st.lists(st.text(max_size=5), max_size=6)})
field_values = (values | entries | st.lists(entries, max_size=40) | st.integers(-2, 70_000) | st.none()
                | st.lists(st.floats(), max_size=10) | st.floats())


@FUZZ
@given(cls=st.sampled_from(VIEW_PLANE), data=st.data())
def test_view_plane_messages_are_refused_or_within_their_bounds(cls, data) -> None:
    """View and gap messages are each a message of the registry (no body decoded apart): whatever their fields
    hold, decoding ends in ProtocolError or in a message that passed its bounds, and encodes back the same."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(cls)]
    body = data.draw(st.fixed_dictionaries({}, optional={n: field_values for n in names}))
    data_ = msgpack.packb({"t": cls.TYPE, "v": 1, "r": 0, "q": 0, "b": body}, use_bin_type=True)
    decode_bounded(data_)
    try:
        msg = DEFAULT_REGISTRY.decode(data_, LIMITS).message
    except ProtocolError:
        return
    assert type(msg) is cls
    assert DEFAULT_REGISTRY.decode(DEFAULT_REGISTRY.encode(msg), LIMITS).message == msg


# --- tensor headers ------------------------------------------------------------------------------------

dims = st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**62, 2**64 - 1, -(2**63)]) | st.integers(0, 64)
tensor_headers = st.builds(
    TensorHeader,
    stream=st.sampled_from([0, 1, 2**32 - 1, 2**32, -1]),
    name=st.text(max_size=10),
    dtype=st.sampled_from(list(DTYPES)) | st.sampled_from(["complex64", "object", ""]),
    shape=st.lists(dims, max_size=MAX_NDIM + 2),
    codec=st.sampled_from(CODECS) | st.just("zstd"),
    nbytes=st.sampled_from([0, 1, 2**63, -1]) | st.integers(0, 1 << 16),
    block=st.sampled_from([0, 1, 7, MAX_Q8_BLOCK, MAX_Q8_BLOCK + 1, -1]),
)
SMALL_TENSORS = WireLimits(max_tensor_bytes=1 * MiB, max_inflight_tensor_bytes=1 * MiB)


@FUZZ
@given(header=tensor_headers, consistent=st.booleans())
def test_tensor_headers_are_refused_without_allocating_or_accepted_within_limits(header, consistent) -> None:
    if consistent:  # make nbytes agree with the rest, so more headers get past that check
        try:
            header = TensorHeader(**{**{f: getattr(header, f) for f in TensorHeader.__dataclass_fields__},
                                     "nbytes": tensor_nbytes(header.dtype, header.shape, header.codec, header.block)})
        except (ValueError, TypeError):
            pass
    with peak() as used:
        try:
            numel, body = TensorDecoder.check_header(header, SMALL_TENSORS)
        except ProtocolError:
            accepted = False
        else:
            accepted = True
    assert used[0] < 16 * KiB  # the check allocates nothing tensor-sized, accepted or not
    if not accepted:
        return
    itemsize = DTYPES[header.dtype].itemsize
    assert numel * itemsize <= SMALL_TENSORS.max_tensor_bytes and body == header.nbytes <= SMALL_TENSORS.max_tensor_bytes
    assert all(type(d) is int and d >= 0 for d in header.shape) and len(header.shape) <= MAX_NDIM
    with peak() as used:
        decoder = TensorDecoder(header, SMALL_TENSORS)
    assert decoder.memory_bytes <= 2 * SMALL_TENSORS.max_tensor_bytes  # q8 adds its scales
    assert used[0] <= decoder.memory_bytes + SLACK


@FUZZ
@given(header=tensor_headers)
def test_tensor_headers_through_the_wire_only_raise_protocol_errors(header) -> None:
    try:
        encoded = DEFAULT_REGISTRY.encode(header)
    except ValueError:
        return  # not representable (e.g. an int beyond 64 bits): no peer can send it
    try:
        decoded = DEFAULT_REGISTRY.decode(encoded, DEFAULT_LIMITS).message
        assert isinstance(decoded, TensorHeader)
        with peak() as used:
            TensorDecoder.check_header(decoded, DEFAULT_LIMITS)
        assert used[0] < 16 * KiB
    except ProtocolError:
        pass


def test_a_refused_header_allocates_nothing_even_for_a_consistent_huge_one() -> None:
    big = TensorHeader(stream=1, name="w", dtype="float32", shape=[1 << 20, 1 << 20], codec="raw", nbytes=4 << 40)
    with peak() as used, pytest.raises(LimitExceeded):
        TensorDecoder(big, DEFAULT_LIMITS)
    assert used[0] < 16 * KiB

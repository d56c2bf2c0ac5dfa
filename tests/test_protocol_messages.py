"""Typed messages: round trips, schema validation and hostile input (the limits themselves: test_protocol_limits.py).

The decoder's contract is that *any* bytes end in a typed message or in
ProtocolError/LimitExceeded; the fuzz tests below hold it to that.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field, replace

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import identity
from protocol.errors import LimitExceeded, ProtocolError
from protocol.limits import DEFAULT_LIMITS, WireLimits
from protocol.messages import Envelope, Message, Registry
from protocol.schema import (
    DEFAULT_REGISTRY,
    MESSAGES,
    ErrorReply,
    Goodbye,
    PeerExchange,
    PeerRecord,
    Ping,
    Pong,
    TensorHeader,
    peer_record_signing_bytes,
)

REG = DEFAULT_REGISTRY
LIMITS = DEFAULT_LIMITS

# --- strategies ------------------------------------------------------------------

floats = st.floats(allow_nan=False, allow_infinity=False)
ids = st.integers(min_value=0, max_value=2**64 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
text = st.text(max_size=40)
blobs = st.binary(max_size=64)

peer_records = st.builds(
    PeerRecord,
    peer_id=st.text(min_size=1, max_size=40),
    public_key=st.binary(min_size=32, max_size=32),
    swarm=text,
    addresses=st.lists(text, max_size=4),
    issued=floats,
    expires=floats,
    signature=blobs,
)
tensor_headers = st.builds(
    TensorHeader,
    stream=u64,
    name=text,
    dtype=text,
    shape=st.lists(i64, max_size=8),
    codec=text,
    nbytes=i64,
    block=i64,
)
schema_messages = st.one_of(
    st.builds(Ping, sent=floats),
    st.builds(Pong, echo=floats),
    peer_records,
    st.builds(PeerExchange, peers=st.lists(peer_records, max_size=3)),
    st.builds(Goodbye, reason=text),
    st.builds(ErrorReply, code=text, message=text),
    tensor_headers,
)


def strategy_for(hint):
    """Valid values for any supported field type: covers schemas added by other modules too."""
    scalars = {float: floats, int: i64, str: text, bytes: blobs, bool: st.booleans()}
    if hint in scalars:
        return scalars[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=3)
    if origin is tuple:
        return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(text, strategy_for(args[1]), max_size=3)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | strategy_for(inner)
    hints = typing.get_type_hints(hint)
    kwargs = {f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(hint) if f.init}

    def build(kw):
        try:
            return hint(**kw)
        except (ValueError, TypeError):  # the schema's own __post_init__ said no
            return None

    return st.fixed_dictionaries(kwargs).map(build).filter(lambda m: m is not None)


any_registered = st.sampled_from(list(DEFAULT_REGISTRY)).flatmap(strategy_for)


def wire(t: str, body: dict, v: int = 1, **extra) -> bytes:
    return msgpack.packb({"t": t, "v": v, "r": 0, "q": 0, "b": body, **extra}, use_bin_type=True)


def record(**changes) -> PeerRecord:
    base = PeerRecord("peer", b"k" * 32, "swarm", ["10.0.0.1:4000"], 100.0, 200.0, b"s" * 64)
    return replace(base, **changes)


# --- round trips ----------------------------------------------------------------


@given(msg=schema_messages, rid=ids, reply_to=ids)
def test_every_schema_round_trips(msg, rid, reply_to):
    env = REG.decode(REG.encode(msg, rid=rid, reply_to=reply_to), LIMITS)
    assert env == Envelope(msg, rid, reply_to)
    assert type(env.message) is type(msg)


@given(msg=any_registered, rid=ids)
def test_every_registered_message_round_trips(msg, rid):
    assert REG.decode(REG.encode(msg, rid=rid), LIMITS) == Envelope(msg, rid, 0)


def test_every_schema_class_is_registered():
    for cls in (Ping, Pong, PeerRecord, PeerExchange, Goodbye, ErrorReply, TensorHeader):
        assert cls in REG and cls.TYPE in REG
    assert list(REG) == list(MESSAGES) and len(REG) == len(MESSAGES)
    assert REG.message_class("ping") is Ping


def test_wire_form_is_the_documented_map():
    data = REG.encode(Ping(sent=1.5), rid=7, reply_to=3)
    assert msgpack.unpackb(data) == {"t": "ping", "v": 1, "r": 7, "q": 3, "b": {"sent": 1.5}}


def test_bytes_like_input_is_accepted():
    data = REG.encode(Goodbye("done"))
    for form in (bytes(data), bytearray(data), memoryview(data)):
        assert REG.decode(form, LIMITS).message == Goodbye("done")


def test_int_is_accepted_for_float_and_converted():
    env = REG.decode(wire("ping", {"sent": 3}), LIMITS)
    assert env.message == Ping(3.0) and type(env.message.sent) is float
    assert type(REG.decode(REG.encode(Ping(3)), LIMITS).message.sent) is float


def test_fields_with_defaults_may_be_missing():
    body = {"stream": 1, "name": "w", "dtype": "float32", "shape": [2], "codec": "raw", "nbytes": 8}
    assert REG.decode(wire("tensor", body), LIMITS).message.block == 0


def test_extra_fields_and_envelope_keys_are_ignored():
    env = REG.decode(wire("ping", {"sent": 1.0, "future": [1, {"x": b""}]}, zz=5), LIMITS)
    assert env.message == Ping(1.0)


def test_older_version_is_accepted():
    @dataclass(frozen=True, slots=True)
    class Ping2(Message):
        TYPE = "ping"
        VERSION = 2
        sent: float
        seq: int = 0

    reg = Registry([Ping2])
    assert reg.decode(wire("ping", {"sent": 1.0}, v=1), LIMITS).message == Ping2(1.0, 0)


# --- refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, expected",
    [
        (wire("nope", {}), "unknown message type 'nope'"),
        (wire("ping", {"sent": 1.0}, v=2), "newer"),
        (wire("ping", {"sent": 1.0}, v=0), "bad version"),
        (wire("ping", {"sent": "1"}), "ping.sent: expected float, got str"),
        (wire("ping", {"sent": True}), "ping.sent: expected float, got bool"),
        (wire("ping", {"sent": None}), "ping.sent: expected float, got NoneType"),
        (wire("ping", {}), "ping.sent: missing required field"),
        (wire("ping", {"sent": math.nan}), "ping.sent: NaN/Inf"),
        (wire("ping", {"sent": -math.inf}), "ping.sent: NaN/Inf"),
        (wire("bye", {"reason": b"bytes"}), "bye.reason: expected str, got bytes"),
        (wire("tensor", {"stream": 1.0}), "tensor.stream: expected int, got float"),
        (wire("tensor", {"stream": False}), "tensor.stream: expected int, got bool"),
        (wire("tensor", {"stream": 1, "name": "w", "dtype": "f", "shape": [1, "2"], "codec": "raw",
                         "nbytes": 1}), "tensor.shape[1]: expected int, got str"),
        (wire("tensor", {"stream": 1, "name": "w", "dtype": "f", "shape": {}, "codec": "raw",
                         "nbytes": 1}), "tensor.shape: expected list, got dict"),
        (wire("peer_record", {"peer_id": "p", "public_key": "k"}), "peer_record.public_key: expected bytes"),
        (wire("pex", {"peers": [{"peer_id": "p"}]}), "pex.peers[0].public_key: missing required field"),
        (wire("pex", {"peers": [5]}), "pex.peers[0]: expected map, got int"),
        (wire("ping", [1.0]), "body must be a map"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"t": 5}), "type must be a str"),
        (msgpack.packb({"t": "ping", "v": 1, "r": -1, "b": {"sent": 1.0}}), "bad rid"),
        (msgpack.packb({"t": "ping", "v": 1, "q": "x", "b": {"sent": 1.0}}), "bad reply_to"),
        (msgpack.packb(5) + b"\x00", "malformed"),
        (b"", "malformed"),
        (msgpack.packb({1: 2}), "malformed"),
        (msgpack.packb(msgpack.ExtType(1, b"")), "must be a map"),
    ],
)
def test_invalid_messages_are_refused_with_a_precise_reason(data, expected):
    with pytest.raises(ProtocolError, match=None) as info:
        REG.decode(data, LIMITS)
    assert expected in str(info.value)


def test_oversize_message_is_refused_before_unpacking():
    limits = WireLimits(max_message_bytes=100)
    data = REG.encode(Goodbye("x" * 200))
    with pytest.raises(LimitExceeded, match="max_message_bytes"):
        REG.decode(data, limits)
    # not even valid msgpack: the size check comes first
    with pytest.raises(LimitExceeded):
        REG.decode(b"\xc1" * 101, limits)


@pytest.mark.parametrize(
    "limits, msg",
    [
        (WireLimits(max_str_len=10), Goodbye("x" * 11)),
        (WireLimits(max_bin_len=10), record(signature=b"s" * 11)),
        (WireLimits(max_array_len=3), record(addresses=["a"] * 4)),
        (WireLimits(max_map_len=4), Ping(1.0)),  # the envelope itself has 5 keys
    ],
)
def test_msgpack_container_limits_raise_limit_exceeded(limits, msg):
    with pytest.raises(LimitExceeded):
        REG.decode(REG.encode(msg), limits)


def test_schema_post_init_errors_become_protocol_errors():
    @dataclass(frozen=True, slots=True)
    class Positive(Message):
        TYPE = "pos"
        n: int

        def __post_init__(self):
            if self.n <= 0:
                raise ValueError("n must be positive")

    reg = Registry([Positive])
    assert reg.decode(wire("pos", {"n": 1}), LIMITS).message == Positive(1)
    with pytest.raises(ProtocolError, match="pos: n must be positive"):
        reg.decode(wire("pos", {"n": 0}), LIMITS)


# --- fuzzing --------------------------------------------------------------------


def decode_or_protocol_error(data, limits=LIMITS):
    try:
        assert isinstance(REG.decode(data, limits), Envelope)
    except ProtocolError:  # LimitExceeded is a ProtocolError
        pass


@given(st.binary(max_size=512))
def test_garbage_bytes_only_raise_protocol_errors(data):
    decode_or_protocol_error(data)


mutations = st.lists(
    st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]), st.integers(0, 10**6),
              st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


@given(msg=schema_messages | any_registered, edits=mutations)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_mutated_valid_messages_only_raise_protocol_errors(msg, edits):
    data = bytearray(REG.encode(msg))
    for op, pos, byte in edits:
        i = pos % (len(data) or 1)
        if op == "flip" and data:
            data[i] ^= 1 << (byte % 8)
        elif op == "set" and data:
            data[i] = byte
        elif op == "insert":
            data.insert(i, byte)
        elif op == "delete" and data:
            del data[i]
        elif op == "truncate":
            del data[i:]
    decode_or_protocol_error(bytes(data))
    decode_or_protocol_error(bytes(data), WireLimits(max_str_len=8, max_bin_len=8, max_array_len=2,
                                                     max_map_len=6))


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | text | blobs,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text | blobs, inner, max_size=4),
    max_leaves=12,
)
body_keys = st.sampled_from(
    ["sent", "echo", "peer_id", "public_key", "swarm", "addresses", "issued", "expires", "signature",
     "peers", "reason", "code", "message", "stream", "name", "dtype", "shape", "codec", "nbytes",
     "block", "other"]
)


@given(
    t=st.sampled_from([cls.TYPE for cls in MESSAGES] + ["x"]),
    v=msgpack_values | st.integers(0, 3),
    r=msgpack_values | ids,
    body=st.dictionaries(body_keys, msgpack_values, max_size=10) | msgpack_values,
)
def test_well_formed_msgpack_with_wrong_shapes_only_raises_protocol_errors(t, v, r, body):
    decode_or_protocol_error(msgpack.packb({"t": t, "v": v, "r": r, "q": r, "b": body}, use_bin_type=True))


# --- encoding side and registry construction -------------------------------------


def test_encode_validates_our_own_messages():
    with pytest.raises(ValueError, match="ping.sent: NaN/Inf"):
        REG.encode(Ping(math.nan))
    with pytest.raises(ValueError, match="ping.sent: expected float, got str"):
        REG.encode(Ping("soon"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"pex.peers\[0\].addresses\[0\]: expected str"):
        REG.encode(PeerExchange([record(addresses=[1])]))
    with pytest.raises(ValueError, match="rid"):
        REG.encode(Ping(1.0), rid=-1)
    with pytest.raises(ValueError, match="reply_to"):
        REG.encode(Ping(1.0), reply_to=2**64)
    with pytest.raises(ValueError, match="not in this registry"):
        Registry([Pong]).encode(Ping(1.0))
    with pytest.raises(ValueError, match="cannot encode"):
        REG.encode(Goodbye("\ud800"))


def test_registry_refuses_bad_schemas():
    @dataclass(frozen=True, slots=True)
    class OtherPing(Message):
        TYPE = "ping"
        x: int

    with pytest.raises(ValueError, match="duplicate message type 'ping'"):
        Registry([Ping, OtherPing])

    @dataclass(slots=True)
    class Mutable(Message):
        TYPE = "mut"

    with pytest.raises(TypeError, match="frozen"):
        Registry([Mutable])

    @dataclass(frozen=True, slots=True)
    class Weird(Message):
        TYPE = "weird"
        x: tuple[int, str]  # tuple[int, ...] is supported; a fixed-length tuple is not

    with pytest.raises(TypeError, match="unsupported field type"):
        Registry([Weird])

    @dataclass(frozen=True, slots=True)
    class NoType(Message):
        x: int

    with pytest.raises(ValueError, match="TYPE"):
        Registry([NoType])
    with pytest.raises(TypeError):
        Registry([int])  # type: ignore[list-item]


@dataclass(frozen=True, slots=True)
class Point:
    x: float
    y: float


@dataclass(frozen=True, slots=True)
class Rich(Message):
    """Exercises every supported field type."""

    TYPE = "rich"
    flag: bool
    maybe: int | None
    tags: dict[str, list[int]]
    points: list[Point]
    where: Point | None = None
    blob: bytes = b""
    names: list[str] = field(default_factory=list)


RICH = Registry([Rich])
points = st.builds(Point, x=floats, y=floats)
rich_messages = st.builds(
    Rich,
    flag=st.booleans(),
    maybe=st.none() | i64,
    tags=st.dictionaries(text, st.lists(i64, max_size=3), max_size=3),
    points=st.lists(points, max_size=3),
    where=st.none() | points,
    blob=blobs,
    names=st.lists(text, max_size=3),
)


@given(rich_messages)
def test_all_supported_field_types_round_trip(msg):
    assert RICH.decode(RICH.encode(msg), LIMITS).message == msg


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"flag": 1, "maybe": None, "tags": {}, "points": []}, "rich.flag: expected bool, got int"),
        ({"flag": True, "maybe": 1.5, "tags": {}, "points": []}, "rich.maybe: expected int, got float"),
        ({"flag": True, "maybe": None, "tags": {b"k": []}, "points": []}, "rich.tags: expected str keys"),
        ({"flag": True, "maybe": None, "tags": {"k": [True]}, "points": []}, "rich.tags['k'][0]: expected int"),
        ({"flag": True, "maybe": None, "tags": {}, "points": [{"x": 1}]}, "rich.points[0].y: missing"),
        ({"flag": True, "maybe": None, "tags": {}, "points": [], "where": [1, 2]}, "rich.where: expected map"),
    ],
)
def test_nested_field_errors_name_the_path(body, expected):
    with pytest.raises(ProtocolError) as info:
        RICH.decode(wire("rich", body), LIMITS)
    assert expected in str(info.value)


# --- peer records -----------------------------------------------------------------


def test_peer_record_signing_bytes_cover_everything_but_the_signature():
    base = record()
    signed = peer_record_signing_bytes(base)
    assert peer_record_signing_bytes(replace(base, signature=b"other")) == signed
    for change in [
        {"peer_id": "other"},
        {"public_key": b"x" * 32},
        {"swarm": "other"},
        {"addresses": ["10.0.0.1:4001"]},
        {"addresses": []},
        {"issued": 100.5},
        {"expires": 201.0},
    ]:
        assert peer_record_signing_bytes(replace(base, **change)) != signed, change
    # canonical: an int timestamp signs the same as its float, and decoding preserves the bytes
    assert peer_record_signing_bytes(replace(base, issued=100)) == signed
    decoded = REG.decode(REG.encode(base), LIMITS).message
    assert peer_record_signing_bytes(decoded) == signed
    assert b"peertrain/peer_record" in signed


@given(peer_records)
def test_peer_record_signing_bytes_survive_the_wire(rec):
    decoded = REG.decode(REG.encode(rec), LIMITS).message
    assert peer_record_signing_bytes(decoded) == peer_record_signing_bytes(rec)


def test_peer_record_signature_verifies_with_identity_helpers():
    key = identity.generate_identity()
    unsigned = record(public_key=identity.public_key_bytes(key))
    signed = replace(unsigned, signature=identity.sign(key, peer_record_signing_bytes(unsigned)))
    received = REG.decode(REG.encode(signed), LIMITS).message
    assert identity.verify(received.public_key, received.signature, peer_record_signing_bytes(received))
    forged = replace(received, addresses=["6.6.6.6:1"])
    assert not identity.verify(forged.public_key, forged.signature, peer_record_signing_bytes(forged))


@pytest.mark.process
def test_importing_the_protocol_stays_small():
    """An idle daemon must not pay for torch; the control plane not even for numpy."""
    code = (
        "import sys, protocol.messages, protocol.schema, protocol.limits;"
        "assert 'numpy' not in sys.modules and 'torch' not in sys.modules;"
        "import protocol.tensor_codec, protocol.tensor_encoder, protocol.tensor_decoder;"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

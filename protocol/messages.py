"""Typed, versioned control-plane messages and their msgpack wire form.

A message is a frozen dataclass subclassing `Message` with a short wire name::

    @dataclass(frozen=True, slots=True)
    class Ping(Message):
        TYPE = "ping"
        sent: float

On the wire it is one msgpack map::

    {"t": "ping", "v": 1, "r": rid, "q": reply_to, "b": {"sent": 12.5}}

`r` is the sender's request id and `q` the id of the request this one answers
(0 for none), so the transport can match replies without knowing any schema.

Decoding checks every field against the dataclass's type hints, because the
bytes come from a peer we do not trust: whatever arrives ends either in a fully
typed message or in `ProtocolError` / `LimitExceeded`, never in another
exception. Compatibility rules: unknown fields are ignored (a newer peer may add
fields), fields with defaults may be missing (so new fields must have defaults),
and a VERSION newer than ours is refused rather than misread (older ones are
decoded with the current schema). A schema may add semantic checks in
`__post_init__`; a ValueError/TypeError raised there becomes a ProtocolError.

Supported field types: int, float (an int is accepted and converted), str,
bytes, bool, `X | None`, `list[T]`, `dict[str, T]` and nested dataclasses
(encoded as maps). NaN and infinities are refused: they mean nothing on the
control plane and are a classic way to poison timers and averages.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from protocol.errors import LimitExceeded, ProtocolError
from protocol.limits import WireLimits

__all__ = ["MAX_NESTING", "Envelope", "Message", "Registry"]

_U64 = 1 << 64
_I64_MIN = -(1 << 63)


class Message:
    """Base of every wire message: gives it a wire name and a schema version.

    Subclasses are `@dataclass(frozen=True, slots=True)`; they set `TYPE` (and
    bump `VERSION` when a change is not covered by the compatibility rules).
    """

    __slots__ = ()
    TYPE: ClassVar[str]
    VERSION: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded message with the ids the transport uses to match replies."""

    message: Message
    rid: int
    reply_to: int


class _Invalid(Exception):
    """A value does not match its schema.

    Raised without a location; each enclosing container prepends its step
    (".field", "[3]") on the way out, so the happy path builds no path strings.
    """

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.steps: list[str] = []

    def at(self, step: str) -> _Invalid:
        self.steps.append(step)
        return self

    def render(self, root: str) -> str:
        return f"{root}{''.join(reversed(self.steps))}: {self.problem}"


# A compiled field type: (value, decoding) -> the value in its wire form
# (encoding) or its Python form (decoding). Built once per registry.
_Convert = Callable[[Any, bool], Any]


def _got(value: Any) -> str:
    return type(value).__name__


def _convert_int(value: Any, decoding: bool) -> int:
    if type(value) is not int:
        raise _Invalid(f"expected int, got {_got(value)}")
    if not _I64_MIN <= value < _U64:
        raise _Invalid("int out of the 64-bit range")
    return value


def _convert_float(value: Any, decoding: bool) -> float:
    if type(value) is int:
        if not _I64_MIN <= value < _U64:
            raise _Invalid("int out of the 64-bit range")
        value = float(value)
    elif type(value) is not float:
        raise _Invalid(f"expected float, got {_got(value)}")
    if not math.isfinite(value):
        raise _Invalid("NaN/Inf is not allowed")
    return value


def _convert_str(value: Any, decoding: bool) -> str:
    if type(value) is not str:
        raise _Invalid(f"expected str, got {_got(value)}")
    return value


def _convert_bytes(value: Any, decoding: bool) -> bytes:
    if type(value) is bytes:
        return value
    if not decoding and isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise _Invalid(f"expected bytes, got {_got(value)}")


def _convert_bool(value: Any, decoding: bool) -> bool:
    if type(value) is not bool:
        raise _Invalid(f"expected bool, got {_got(value)}")
    return value


_SCALARS: dict[Any, _Convert] = {
    int: _convert_int,
    float: _convert_float,
    str: _convert_str,
    bytes: _convert_bytes,
    bool: _convert_bool,
}


def _optional(inner: _Convert) -> _Convert:
    def convert(value: Any, decoding: bool) -> Any:
        return None if value is None else inner(value, decoding)

    return convert


def _list_of(item: _Convert) -> _Convert:
    def convert(value: Any, decoding: bool) -> list[Any]:
        if not (type(value) is list or (not decoding and type(value) is tuple)):
            raise _Invalid(f"expected list, got {_got(value)}")
        out = []
        try:
            for v in value:
                out.append(item(v, decoding))
        except _Invalid as e:
            raise e.at(f"[{len(out)}]") from None
        return out

    return convert


def _dict_of(item: _Convert) -> _Convert:
    def convert(value: Any, decoding: bool) -> dict[str, Any]:
        if type(value) is not dict:
            raise _Invalid(f"expected map, got {_got(value)}")
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise _Invalid(f"expected str keys, got {_got(k)}")
            try:
                out[k] = item(v, decoding)
            except _Invalid as e:
                raise e.at(f"[{k[:32]!r}]") from None
        return out

    return convert


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    convert: _Convert
    required: bool


class _Struct:
    """The compiled schema of one dataclass (a message or a nested record)."""

    __slots__ = ("cls", "fields")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.fields: tuple[_Field, ...] = ()  # filled in by the compiler (may recurse)

    def convert(self, value: Any, decoding: bool) -> Any:
        if decoding:
            if type(value) is not dict:
                raise _Invalid(f"expected map, got {_got(value)}")
            return self.from_wire(value)
        if type(value) is not self.cls:
            raise _Invalid(f"expected {self.cls.__name__}, got {_got(value)}")
        return self.to_wire(value)

    def to_wire(self, obj: Any) -> dict[str, Any]:
        out = {}
        for f in self.fields:
            try:
                out[f.name] = f.convert(getattr(obj, f.name), False)
            except _Invalid as e:
                raise e.at(f".{f.name}") from None
        return out

    def from_wire(self, body: dict[Any, Any]) -> Any:
        kwargs = {}
        for f in self.fields:
            if f.name in body:
                try:
                    kwargs[f.name] = f.convert(body[f.name], True)
                except _Invalid as e:
                    raise e.at(f".{f.name}") from None
            elif f.required:
                raise _Invalid("missing required field").at(f".{f.name}")
        try:
            return self.cls(**kwargs)
        except (TypeError, ValueError) as e:  # a schema's own __post_init__ checks
            raise _Invalid(str(e)) from None


class _Compiler:
    """Turns dataclass type hints into converters, once per class."""

    def __init__(self) -> None:
        self.structs: dict[type, _Struct] = {}

    def struct(self, cls: type) -> _Struct:
        if cls in self.structs:
            return self.structs[cls]
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"{cls!r} is not a dataclass")
        if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        struct = self.structs[cls] = _Struct(cls)  # before fields: schemas may recurse
        hints = typing.get_type_hints(cls)
        compiled = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            compiled.append(_Field(f.name, self.type(hints[f.name], f"{cls.__name__}.{f.name}"), required))
        struct.fields = tuple(compiled)
        return struct

    def type(self, hint: Any, where: str) -> _Convert:
        if hint in _SCALARS:
            return _SCALARS[hint]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (types.UnionType, typing.Union):
            others = [a for a in args if a is not type(None)]
            if len(args) == 2 and len(others) == 1:
                return _optional(self.type(others[0], where))
        elif origin is list and len(args) == 1:
            return _list_of(self.type(args[0], where))
        elif origin is dict and len(args) == 2 and args[0] is str:
            return _dict_of(self.type(args[1], where))
        elif origin is None and isinstance(hint, type) and dataclasses.is_dataclass(hint):
            return self.struct(hint).convert
        raise TypeError(f"{where}: unsupported field type {hint!r}")


MAX_NESTING = 32
"""Containers open at once in one message. The deepest schema nests 5 (envelope, body, a list of records,
a record, its links list, a link: `topo_records`); 32 leaves room for new schemas while bounding the work
and the preallocated containers of a message that is nothing but nested headers."""

# How the scan below reads each msgpack type byte: (kind, n). "skip": n more bytes follow; "str" (str or
# bin): a (-n)-byte big-endian length, then that many bytes; "array"/"map": n elements (n >= 0) or, for
# n < 0, a (-n)-byte big-endian count; "ext": like "str" plus a type byte (msgpack then refuses it:
# max_ext_len=0); "bad": 0xc1, which msgpack never uses.
_SCAN: list[tuple[str, int]] = [("bad", 0)] * 256
for _b in range(0x00, 0x80):
    _SCAN[_b] = ("skip", 0)  # positive fixint
for _b in range(0xE0, 0x100):
    _SCAN[_b] = ("skip", 0)  # negative fixint
for _b in range(0x80, 0x90):
    _SCAN[_b] = ("map", _b & 0x0F)
for _b in range(0x90, 0xA0):
    _SCAN[_b] = ("array", _b & 0x0F)
for _b in range(0xA0, 0xC0):
    _SCAN[_b] = ("skip", _b & 0x1F)  # fixstr
for _b, _spec in {
    0xC0: ("skip", 0), 0xC2: ("skip", 0), 0xC3: ("skip", 0),  # nil, false, true
    0xC4: ("str", -1), 0xC5: ("str", -2), 0xC6: ("str", -4),  # bin
    0xCA: ("skip", 4), 0xCB: ("skip", 8),  # float
    0xCC: ("skip", 1), 0xCD: ("skip", 2), 0xCE: ("skip", 4), 0xCF: ("skip", 8),  # uint
    0xD0: ("skip", 1), 0xD1: ("skip", 2), 0xD2: ("skip", 4), 0xD3: ("skip", 8),  # int
    0xD9: ("str", -1), 0xDA: ("str", -2), 0xDB: ("str", -4),  # str
    0xC7: ("ext", -1), 0xC8: ("ext", -2), 0xC9: ("ext", -4),  # ext: length, type byte, data
    0xD4: ("skip", 2), 0xD5: ("skip", 3), 0xD6: ("skip", 5), 0xD7: ("skip", 9), 0xD8: ("skip", 17),  # fixext
    0xDC: ("array", -2), 0xDD: ("array", -4), 0xDE: ("map", -2), 0xDF: ("map", -4),
}.items():
    _SCAN[_b] = _spec
del _b, _spec


def _check_structure(data: bytes | bytearray | memoryview) -> None:
    """Refuse a message whose containers claim more elements than its bytes could hold, before msgpack
    sees it. Why: msgpack's unpacker reserves a list for an array's declared length up front, so ~5 KB of
    nested array headers declaring 100,000 elements each made it allocate 80 MB before finding the message
    truncated. Every element takes at least one byte, so a count above the bytes left is a lie; with this
    check what decoding allocates stays proportional to the message's size. One pass, no allocation."""
    try:
        buf = data if isinstance(data, bytes) else memoryview(data).cast("B")
    except TypeError:  # a non-contiguous view
        raise ProtocolError("message must be contiguous bytes") from None
    size = len(buf)
    pos = 0
    pending = [1]  # elements still to read in each open container (the message itself first)
    scan = _SCAN
    while pending:
        if not pending[-1]:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= size:
            raise ProtocolError("malformed message: truncated")
        kind, n = scan[buf[pos]]
        pos += 1
        if kind == "skip":
            pos += n
            continue
        if kind == "bad":
            raise ProtocolError(f"malformed message: msgpack type byte {buf[pos - 1]:#04x} is unused")
        if n < 0:  # the count or length follows in -n bytes
            n, pos = int.from_bytes(buf[pos : pos - n], "big"), pos - n
        if kind == "str":
            pos += n
            continue
        if kind == "ext":
            pos += n + 1
            continue
        if kind == "map":
            n *= 2
        if n > size - pos:
            raise ProtocolError(f"malformed message: {kind} of {n} elements in {size - pos} remaining bytes")
        if n:
            if len(pending) > MAX_NESTING:
                raise ProtocolError(f"malformed message: containers nested deeper than {MAX_NESTING}")
            pending.append(n)
    if pos > size:
        raise ProtocolError("malformed message: truncated")


def _check_id(name: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value < _U64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value


class Registry:
    """The set of messages a session understands, keyed by wire name.

    Built once from an explicit list and never mutated; the type hints of every
    class are compiled here, so decoding does no reflection.
    """

    __slots__ = ("_by_type", "_structs")

    def __init__(self, messages: Iterable[type[Message]]) -> None:
        compiler = _Compiler()
        by_type: dict[str, type[Message]] = {}
        for cls in messages:
            if not (isinstance(cls, type) and issubclass(cls, Message)):
                raise TypeError(f"{cls!r} is not a Message subclass")
            name, version = getattr(cls, "TYPE", None), cls.VERSION
            if type(name) is not str or not name:
                raise ValueError(f"{cls.__name__}.TYPE must be a non-empty str")
            if type(version) is not int or version < 1:
                raise ValueError(f"{cls.__name__}.VERSION must be an int >= 1")
            if name in by_type:
                raise ValueError(
                    f"duplicate message type {name!r}: {by_type[name].__name__} and {cls.__name__}"
                )
            by_type[name] = cls
            compiler.struct(cls)
        self._by_type = by_type
        self._structs = compiler.structs

    def __contains__(self, item: object) -> bool:
        if isinstance(item, str):
            return item in self._by_type
        return isinstance(item, type) and self._by_type.get(getattr(item, "TYPE", None)) is item  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[type[Message]]:
        return iter(self._by_type.values())

    def __len__(self) -> int:
        return len(self._by_type)

    def message_class(self, type_name: str) -> type[Message]:
        """The class registered under a wire name (KeyError if none)."""
        return self._by_type[type_name]

    def encode(self, msg: Message, *, rid: int = 0, reply_to: int = 0) -> bytes:
        """Serialize `msg`; ValueError if it is not registered or does not match its schema.

        Validating on the way out too means our own bugs fail here, loudly,
        instead of making the remote peer close the session.
        """
        cls = type(msg)
        if cls not in self:
            raise ValueError(f"message class {cls.__name__} is not in this registry")
        try:
            body = self._structs[cls].to_wire(msg)
        except _Invalid as e:
            raise ValueError(e.render(cls.TYPE)) from None
        envelope = {
            "t": cls.TYPE,
            "v": cls.VERSION,
            "r": _check_id("rid", rid),
            "q": _check_id("reply_to", reply_to),
            "b": body,
        }
        try:
            return msgpack.packb(envelope, use_bin_type=True)
        except (ValueError, TypeError, OverflowError) as e:  # e.g. lone surrogates in a str
            raise ValueError(f"{cls.TYPE}: cannot encode: {e}") from None

    def decode(self, data: bytes | bytearray | memoryview, limits: WireLimits) -> Envelope:
        """Parse one message; any malformed input ends in ProtocolError/LimitExceeded."""
        try:
            size = memoryview(data).nbytes
        except TypeError:
            raise ProtocolError(f"message must be bytes-like, got {_got(data)}") from None
        if size > limits.max_message_bytes:
            raise LimitExceeded(
                f"message of {size} bytes exceeds max_message_bytes {limits.max_message_bytes}"
            )
        _check_structure(data)
        try:
            obj = msgpack.unpackb(
                data,
                raw=False,
                strict_map_key=True,
                use_list=True,
                max_str_len=limits.max_str_len,
                max_bin_len=limits.max_bin_len,
                max_array_len=limits.max_array_len,
                max_map_len=limits.max_map_len,
                max_ext_len=0,
            )
        except Exception as e:  # msgpack raises a zoo of ValueError subclasses
            reason = str(e)[:200]  # may quote the peer's bytes: keep logs bounded
            if "exceeds max_" in reason:
                raise LimitExceeded(f"message: {reason}") from None
            raise ProtocolError(f"malformed message: {type(e).__name__}: {reason}") from None
        return self._envelope(obj)

    def _envelope(self, obj: Any) -> Envelope:
        if type(obj) is not dict:
            raise ProtocolError(f"message must be a map, got {_got(obj)}")
        name = obj.get("t")
        if type(name) is not str:
            raise ProtocolError(f"message type must be a str, got {_got(name)}")
        cls = self._by_type.get(name)
        if cls is None:
            raise ProtocolError(f"unknown message type {name[:64]!r}")
        version = obj.get("v")
        if type(version) is not int or version < 1:
            raise ProtocolError(f"{name}: bad version {str(version)[:32]}")
        if version > cls.VERSION:
            raise ProtocolError(
                f"{name}: version {version} is newer than the version {cls.VERSION} we support"
            )
        rid, reply_to = obj.get("r", 0), obj.get("q", 0)
        if type(rid) is not int or not 0 <= rid < _U64:
            raise ProtocolError(f"{name}: bad rid {str(rid)[:32]}")
        if type(reply_to) is not int or not 0 <= reply_to < _U64:
            raise ProtocolError(f"{name}: bad reply_to {str(reply_to)[:32]}")
        body = obj.get("b")
        if type(body) is not dict:
            raise ProtocolError(f"{name}: body must be a map, got {_got(body)}")
        try:
            message = self._structs[cls].from_wire(body)
        except _Invalid as e:
            raise ProtocolError(e.render(name)) from None
        except RecursionError:  # a self-referencing schema nested absurdly deep
            raise ProtocolError(f"{name}: nested too deeply") from None
        return Envelope(message, rid, reply_to)

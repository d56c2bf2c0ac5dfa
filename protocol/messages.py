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

The field types a message may have are `protocol.message_fields`; before msgpack
decodes a message, `protocol.msgpack_scan` checks its containers fit its bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from protocol.errors import LimitExceeded, ProtocolError
from protocol.limits import WireLimits
from protocol.message_fields import U64, Compiler, Invalid, type_label
from protocol.msgpack_scan import check_structure

__all__ = ["Envelope", "Message", "Registry"]


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
    """A decoded message with the ids the transport uses to match replies, and its encoded `size` in bytes
    (what a per-session budget counts; not part of the message, so not compared)."""

    message: Message
    rid: int
    reply_to: int
    size: int = field(default=0, compare=False)


def _check_id(name: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value < U64:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value


class Registry:
    """The set of messages a session understands, keyed by wire name.

    Built once from an explicit list and never mutated; the type hints of every
    class are compiled here, so decoding does no reflection.
    """

    __slots__ = ("_by_type", "_structs")

    def __init__(self, messages: Iterable[type[Message]]) -> None:
        compiler = Compiler()
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
        except Invalid as e:
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
            raise ProtocolError(f"message must be bytes-like, got {type_label(data)}") from None
        if size > limits.max_message_bytes:
            raise LimitExceeded(
                f"message of {size} bytes exceeds max_message_bytes {limits.max_message_bytes}"
            )
        check_structure(data)
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
        return self._envelope(obj, size)

    def _envelope(self, obj: Any, size: int) -> Envelope:
        if type(obj) is not dict:
            raise ProtocolError(f"message must be a map, got {type_label(obj)}")
        name = obj.get("t")
        if type(name) is not str:
            raise ProtocolError(f"message type must be a str, got {type_label(name)}")
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
        if type(rid) is not int or not 0 <= rid < U64:
            raise ProtocolError(f"{name}: bad rid {str(rid)[:32]}")
        if type(reply_to) is not int or not 0 <= reply_to < U64:
            raise ProtocolError(f"{name}: bad reply_to {str(reply_to)[:32]}")
        body = obj.get("b")
        if type(body) is not dict:
            raise ProtocolError(f"{name}: body must be a map, got {type_label(body)}")
        try:
            message = self._structs[cls].from_wire(body)
        except Invalid as e:
            raise ProtocolError(e.render(name)) from None
        except RecursionError:  # a self-referencing schema nested absurdly deep
            raise ProtocolError(f"{name}: nested too deeply") from None
        return Envelope(message, rid, reply_to, size)

"""The field types a message may have, compiled once from its dataclass's type hints into converters.

Why compiled: the bytes come from a peer we do not trust, so every field is
checked on the way in (and on the way out, so our own bugs fail loudly); a
`Registry` compiles each class once, and decoding then does no reflection.

Supported field types: int, float (an int is accepted and converted), str,
bytes, bool, `X | None`, `list[T]`, `tuple[T, ...]` (a msgpack array too, decoded
as a tuple: for frozen records that are hashed or compared), `dict[str, T]` and
nested dataclasses (encoded as maps). NaN and infinities are refused: they mean nothing on the
control plane and are a classic way to poison timers and averages.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Compiler", "Invalid", "U64", "type_label"]

U64 = 1 << 64  # msgpack's widest unsigned integer: ids, sizes and counts are checked against it
_I64_MIN = -(1 << 63)


class Invalid(Exception):
    """A value does not match its schema.

    Raised without a location; each enclosing container prepends its step
    (".field", "[3]") on the way out, so the happy path builds no path strings.
    """

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.steps: list[str] = []

    def at(self, step: str) -> Invalid:
        self.steps.append(step)
        return self

    def render(self, root: str) -> str:
        return f"{root}{''.join(reversed(self.steps))}: {self.problem}"


# A compiled field type: (value, decoding) -> the value in its wire form
# (encoding) or its Python form (decoding). Built once per registry.
_Convert = Callable[[Any, bool], Any]


def type_label(value: Any) -> str:
    return type(value).__name__


def _convert_int(value: Any, decoding: bool) -> int:
    if type(value) is not int:
        raise Invalid(f"expected int, got {type_label(value)}")
    if not _I64_MIN <= value < U64:
        raise Invalid("int out of the 64-bit range")
    return value


def _convert_float(value: Any, decoding: bool) -> float:
    if type(value) is int:
        if not _I64_MIN <= value < U64:
            raise Invalid("int out of the 64-bit range")
        value = float(value)
    elif type(value) is not float:
        raise Invalid(f"expected float, got {type_label(value)}")
    if not math.isfinite(value):
        raise Invalid("NaN/Inf is not allowed")
    return value


def _convert_str(value: Any, decoding: bool) -> str:
    if type(value) is not str:
        raise Invalid(f"expected str, got {type_label(value)}")
    return value


def _convert_bytes(value: Any, decoding: bool) -> bytes:
    if type(value) is bytes:
        return value
    if not decoding and isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise Invalid(f"expected bytes, got {type_label(value)}")


def _convert_bool(value: Any, decoding: bool) -> bool:
    if type(value) is not bool:
        raise Invalid(f"expected bool, got {type_label(value)}")
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
            raise Invalid(f"expected list, got {type_label(value)}")
        out = []
        try:
            for v in value:
                out.append(item(v, decoding))
        except Invalid as e:
            raise e.at(f"[{len(out)}]") from None
        return out

    return convert


def _tuple_of(item: _Convert) -> _Convert:
    as_list = _list_of(item)

    def convert(value: Any, decoding: bool) -> Any:
        out = as_list(value, decoding)
        return tuple(out) if decoding else out

    return convert


def _dict_of(item: _Convert) -> _Convert:
    def convert(value: Any, decoding: bool) -> dict[str, Any]:
        if type(value) is not dict:
            raise Invalid(f"expected map, got {type_label(value)}")
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise Invalid(f"expected str keys, got {type_label(k)}")
            try:
                out[k] = item(v, decoding)
            except Invalid as e:
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
                raise Invalid(f"expected map, got {type_label(value)}")
            return self.from_wire(value)
        if type(value) is not self.cls:
            raise Invalid(f"expected {self.cls.__name__}, got {type_label(value)}")
        return self.to_wire(value)

    def to_wire(self, obj: Any) -> dict[str, Any]:
        out = {}
        for f in self.fields:
            try:
                out[f.name] = f.convert(getattr(obj, f.name), False)
            except Invalid as e:
                raise e.at(f".{f.name}") from None
        return out

    def from_wire(self, body: dict[Any, Any]) -> Any:
        kwargs = {}
        for f in self.fields:
            if f.name in body:
                try:
                    kwargs[f.name] = f.convert(body[f.name], True)
                except Invalid as e:
                    raise e.at(f".{f.name}") from None
            elif f.required:
                raise Invalid("missing required field").at(f".{f.name}")
        try:
            return self.cls(**kwargs)
        except (TypeError, ValueError) as e:  # a schema's own __post_init__ checks
            raise Invalid(str(e)) from None


class Compiler:
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
        elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return _tuple_of(self.type(args[0], where))
        elif origin is dict and len(args) == 2 and args[0] is str:
            return _dict_of(self.type(args[1], where))
        elif origin is None and isinstance(hint, type) and dataclasses.is_dataclass(hint):
            return self.struct(hint).convert
        raise TypeError(f"{where}: unsupported field type {hint!r}")

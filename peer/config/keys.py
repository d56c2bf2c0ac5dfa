"""How a config key is declared (its default, a one-line doc, the range a number accepts) and how a value
is checked against a key's type: shared by the sections that declare keys and the checks that load them."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(Exception):
    """A config value is wrong; the message names the file, line and key and says what is expected."""


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts, declared once beside the key: checked at load (finite numbers only)
    and shown in the config reference (docs/config.md), so a value that would crash or disarm the daemon later (NaN, a
    negative interval, an infinite timeout) is refused with the file and line instead."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    unit: str = ""

    def contains(self, v: float) -> bool:
        if isinstance(v, float) and not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def describe(self) -> str:
        lo, hi = _num(self.lo), _num(self.hi)
        if self.lo_open or self.hi_open:
            text = f"{'more than' if self.lo_open else 'at least'} {lo}, {'less than' if self.hi_open else 'at most'} {hi}"
        else:
            text = f"{lo} to {hi}"
        return f"{text} {self.unit}".rstrip()


def _f(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
       hi_open: bool = False, unit: str = "") -> Any:
    """A config key: its default, a one-line doc and, for a number, the range it accepts (both ends finite)."""
    meta: dict[str, Any] = {"doc": doc}
    if lo is not None or hi is not None:
        assert lo is not None and hi is not None, "a numeric key needs both ends of its range"
        meta["range"] = Range(lo, hi, lo_open, hi_open, unit)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


def _check_type(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp in (str, bool):
        return isinstance(value, tp)
    if origin is list or tp is list:
        args = typing.get_args(tp)
        return isinstance(value, list) and all(_check_type(v, args[0]) for v in value) if args else isinstance(value, list)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    return False


def _type_name(tp: Any) -> str:
    return {float: "a number", int: "an integer", str: "a string", bool: "true or false", dict: "a table"}.get(
        tp, "a list of strings" if typing.get_origin(tp) is list else str(tp))

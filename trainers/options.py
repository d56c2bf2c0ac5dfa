"""Typed trainer options: the `[trainer.options]` table becomes a frozen dataclass, or a clear error."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def parse_options(cls: type[T], options: dict[str, Any], *, trainer: str) -> T:
    """Build `cls` from a config table; unknown keys and wrong types name the key and the trainer."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in options.items():
        if key not in hints:
            raise ValueError(f"[trainer.options] {key}: unknown option for {trainer} (known: {', '.join(hints)})")
        tp = hints[key]
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        ok = isinstance(value, tp) if isinstance(tp, type) else True
        if tp is int and isinstance(value, bool):
            ok = False
        if not ok:
            raise ValueError(f"[trainer.options] {key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def as_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)

"""Typed trainer options: the `[trainer.options]` table becomes a frozen dataclass, or a clear error.

A trainer declares its options once, as the fields of its options dataclass, each with `option(default,
meaning)`: the name, type, default and meaning live there together, `parse_options` reads the types, and
docs/config.md's trainer tables are generated from the same fields (trainers/options_doc.py).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")

MEANING = "meaning"  # the field metadata key an option's meaning is kept under


def option(default: T, meaning: str) -> T:
    """One trainer option: its default and what it means (for users: docs/config.md shows it verbatim).

    Returns a dataclass field; typed as the default's type so the dataclass reads as a table of values. A
    mutable default (a dict) is copied for each instance."""
    made: Any
    if isinstance(default, (dict, list)):
        made = dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={MEANING: meaning})
    else:
        made = dataclasses.field(default=default, metadata={MEANING: meaning})
    return typing.cast(T, made)


@dataclasses.dataclass(frozen=True)
class OptionDoc:
    """One row of a trainer's options table, as docs/config.md shows it."""

    name: str
    type: str
    default: Any
    meaning: str


def option_docs(cls: type) -> list[OptionDoc]:
    """The options `cls` declares, in declaration order; every one must say what it means."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        meaning = f.metadata.get(MEANING)
        if not meaning:
            raise ValueError(f"{cls.__name__}.{f.name}: declare it with option(default, meaning)")
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise ValueError(f"{cls.__name__}.{f.name}: an option needs a default")
        tp = hints[f.name]
        rows.append(OptionDoc(f.name, getattr(tp, "__name__", str(tp)), default, meaning))
    return rows


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

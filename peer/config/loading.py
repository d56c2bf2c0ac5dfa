"""Reading a config: the defaults overlaid with a TOML file, whose unknown sections and keys and wrong types
are refused with errors that name the file, line and key (tomllib reports no positions: lines are found here)."""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from peer.config.checks import validate_semantics
from peer.config.keys import ConfigError, _check_type, _type_name
from peer.config.sections import Config

_SECTION_TYPES = typing.get_type_hints(Config)


def _line_of(text: str, section: str, key: str | None) -> int | None:
    """Best-effort line number of `key` inside `[section]` (tomllib does not report positions)."""
    current = ""
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        m = re.match(r"^\[\s*([A-Za-z0-9_.\-]+)\s*\]", stripped)
        if m:
            current = m.group(1)
            if key is None and current == section:
                return n
            continue
        if key is not None and current == section and re.match(rf"^{re.escape(key)}\s*=", stripped):
            return n
    return None


def _where(path: str, text: str, section: str, key: str | None) -> str:
    line = _line_of(text, section, key) if text else None
    loc = f"{path}:{line}" if line else (path or "<config>")
    return f"{loc}: [{section}]" + (f" {key}" if key else "")


def from_mapping(data: dict[str, Any], *, path: str = "", text: str = "") -> Config:
    """Build a Config from parsed TOML, rejecting unknown sections/keys and wrong types."""
    sections: dict[str, Any] = {}
    for name, value in data.items():
        if name not in _SECTION_TYPES or name == "source":
            known = ", ".join(n for n in _SECTION_TYPES if n != "source")
            raise ConfigError(f"{_where(path, text, name, None)}: unknown section (known sections: {known})")
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(path, text, name, None)}: expected a table like [{name}]")
        cls = _SECTION_TYPES[name]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, v in value.items():
            if key not in hints:
                raise ConfigError(f"{_where(path, text, name, key)}: unknown key (known keys: {', '.join(hints)})")
            if not _check_type(v, hints[key]):
                raise ConfigError(f"{_where(path, text, name, key)}: expected {_type_name(hints[key])}, got {type(v).__name__} {v!r}")
            try:
                kwargs[key] = float(v) if hints[key] is float else v
            except OverflowError:  # an integer too large for a float
                raise ConfigError(f"{_where(path, text, name, key)}: expected a finite number, got {v!r}") from None
        sections[name] = cls(**kwargs)
    cfg = Config(**sections, source=path)
    try:
        validate_semantics(cfg)
    except ConfigError as exc:
        msg = str(exc)
        m = re.match(r"\[(\w+)\] (\w+):", msg)
        if m and path:
            raise ConfigError(f"{_where(path, text, m.group(1), m.group(2))}:{msg[m.end():]}") from None
        raise
    return cfg


def load(path: str | Path | None) -> Config:
    """Defaults, overlaid with the TOML file at `path` if given."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
    return from_mapping(data, path=str(p), text=text)

"""Writing a config out: the effective config as TOML (`peer config show`, the home's snapshot) and the
reference table of every key (docs/config.md, `peer config docs`), made from the keys' own docs."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from peer.config.sections import Config


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):  # a JSON string is a TOML basic string, but for surrogate pairs and DEL
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(type(v))


def to_toml(cfg: Config) -> str:
    """The effective config as TOML (what `peer config show` prints and the home's snapshot holds)."""
    out = []
    for f in dataclasses.fields(cfg):
        if f.name == "source":
            continue
        out.append(f"[{f.name}]")
        section = getattr(cfg, f.name)
        for sf in dataclasses.fields(section):
            out.append(f"{sf.name} = {_toml_value(getattr(section, sf.name))}")
        out.append("")
    return "\n".join(out)


def docs_markdown() -> str:
    """The config reference table (docs/config.md, `peer config docs`), from the fields' docs."""
    rows = ["| key | default | range | meaning |", "| --- | --- | --- | --- |"]
    cfg = Config()
    for f in dataclasses.fields(cfg):
        if f.name == "source":
            continue
        section = getattr(cfg, f.name)
        for sf in dataclasses.fields(section):
            rng = sf.metadata.get("range")
            cells = [f"`{f.name}.{sf.name}`", f"`{_toml_value(getattr(section, sf.name))}`",
                     rng.describe() if rng else "", sf.metadata.get("doc", "")]
            rows.append("| " + " | ".join(cells).replace("|  |", "| |") + " |")
    return "\n".join(rows)

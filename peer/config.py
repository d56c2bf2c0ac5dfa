"""Daemon configuration: typed sections loaded from TOML, validated with errors that name file, line and key.

Precedence is defaults < config file < command-line flags. Every field carries a one-line doc in its
metadata; `peer config docs` prints them, and the README's config reference is generated from them,
so the docs cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.cipher import CIPHERS
from protocol.limits import DEFAULT_CHUNK_SIZE, DEFAULT_LIMITS, KiB, MiB


class ConfigError(Exception):
    """A config value is wrong; the message names the file, line and key and says what is expected."""


def _f(default: Any, doc: str) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class DaemonSection:
    swarm: str = _f("default", "Swarm name; daemons only connect to daemons of the same swarm.")
    listen: str = _f("0.0.0.0:7100", "HOST:PORT to accept peers on; port 0 picks a free port (the chosen address is logged and shown in `peer status`).")
    join: list[str] = _f([], "Bootstrap addresses HOST:PORT to dial at start (works with mDNS off).")
    log_format: str = _f("text", "'text' for readable lines, 'json' for one JSON object per line.")
    log_level: str = _f("info", "debug, info, warning or error.")


@dataclass(frozen=True)
class SecuritySection:
    swarm_key_file: str = _f("", "File holding a pre-shared swarm key; peers without the same key cannot complete a handshake. Relative paths are relative to the config file.")
    allow_peers: list[str] = _f([], "If non-empty, only these peer IDs may connect (allow-list).")
    ciphers: list[str] = _f(["auto"], "Session ciphers in preference order: aes-256-ocb, aes-256-gcm, chacha20-poly1305, or 'auto' (measure each at start, prefer the fastest).")


@dataclass(frozen=True)
class DiscoverySection:
    mdns: bool = _f(True, "Announce and browse `_peertrain._tcp.local.` with mDNS on the local link.")
    interfaces: list[str] = _f([], "IP addresses of the interfaces mDNS uses; empty means all. Use ['127.0.0.1'] for daemons on one host.")
    advertise: list[str] = _f([], "IP addresses to announce to peers; empty means the interface addresses.")


@dataclass(frozen=True)
class MembershipSection:
    heartbeat_interval: float = _f(1.0, "Seconds between pings on each session (also measures RTT).")
    dead_after: float = _f(6.0, "A peer silent for this many seconds is marked dead and its session closed.")
    handshake_timeout: float = _f(5.0, "Seconds a handshake may take before the connection is dropped (slowloris guard).")
    max_connections: int = _f(64, "Most sessions this daemon keeps open at once.")
    max_connections_per_ip: int = _f(16, "Most sessions from one remote IP address.")
    reconnect_min: float = _f(0.5, "First reconnect delay in seconds; doubles with jitter on each failure.")
    reconnect_max: float = _f(30.0, "Longest reconnect delay in seconds.")
    pex_interval: float = _f(5.0, "Seconds between peer-exchange messages (sharing signed peer records).")
    peer_record_ttl: float = _f(600.0, "Seconds a signed peer record stays valid.")


@dataclass(frozen=True)
class LimitsSection:
    # The defaults are protocol.limits.WireLimits' (where they are defined, with why), in this section's units
    # (the frame's rounded up to whole KiB: 4 MiB + 64 B is 4097 KiB).
    max_frame_kib: int = _f(-(-DEFAULT_LIMITS.max_frame_bytes // KiB), "Largest sealed frame accepted, in KiB.")
    max_message_kib: int = _f(DEFAULT_LIMITS.max_message_bytes // KiB, "Largest control message accepted, in KiB.")
    max_tensor_mib: int = _f(DEFAULT_LIMITS.max_tensor_bytes // MiB, "Largest tensor a peer may send us, in MiB.")
    max_inflight_tensor_mib: int = _f(DEFAULT_LIMITS.max_inflight_tensor_bytes // MiB,
                                      "Most tensor bytes a single session may have in flight, in MiB.")
    max_queued_messages: int = _f(DEFAULT_LIMITS.max_queued_messages,
                                  "Messages buffered per session before reading pauses (backpressure).")


@dataclass(frozen=True)
class TopologySection:
    kind: str = _f("rewired", "Gossip graph: rewired (adaptive), ring, exponential, random_regular or full.")
    target_degree: int = _f(4, "Neighbours each peer aims for.")
    min_degree: int = _f(2, "A peer never drops an edge that leaves it or a neighbour below this (one exception: "
                            "a relink, between two peers behind slow links of their own, may leave the other "
                            "one below for a moment; it re-adds a well-linked peer at once).")
    max_degree: int = _f(8, "A peer refuses edges above this degree.")
    gap_floor: float = _f(0.05, "Rewiring never lets the spectral gap of the local view fall below this.")
    confidence: float = _f(1.5, "Standard errors of a link's bandwidth estimate by which rewiring judges a link it "
                                "would replace at its best and the new one at its worst: a speed-up inside the "
                                "measurement noise is no speed-up. Raise it on noisy (shared, loaded) hosts; 0 "
                                "compares bare estimates.")
    rewire_interval: float = _f(4.0, "Mean seconds between rewiring attempts (randomized).")
    record_interval: float = _f(2.0, "Seconds between topology-record broadcasts.")
    seed: int = _f(0, "Seed for fixed random topologies.")


@dataclass(frozen=True)
class GossipSection:
    exchange_timeout: float = _f(30.0, "Deadline for one averaging exchange; a slow or dead neighbour is skipped.")
    max_concurrent_exchanges: int = _f(4, "Most averaging exchanges this peer serves at once.")
    codec: str = _f("raw", "Tensor codec for averaging: raw, float16 or q8.")
    # (the default is protocol.limits.DEFAULT_CHUNK_SIZE, defined there with why)
    chunk_kib: int = _f(DEFAULT_CHUNK_SIZE // KiB, "Tensor chunk (frame) size in KiB.")
    max_update_ratio: float = _f(8.0, "Both sides clip an exchange's difference to this times the smaller model norm (sum kept); 1 to 1e6. Independent inits differ by ~1.4x.")


@dataclass(frozen=True)
class TrainerSection:
    name: str = _f("", "Import path of the trainer module the daemon hosts (e.g. trainers.gossip_sgd); empty: no training.")
    options: dict = _f({}, "Trainer options (see the trainer's docs).")


@dataclass(frozen=True)
class Config:
    daemon: DaemonSection = field(default_factory=DaemonSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    discovery: DiscoverySection = field(default_factory=DiscoverySection)
    membership: MembershipSection = field(default_factory=MembershipSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    topology: TopologySection = field(default_factory=TopologySection)
    gossip: GossipSection = field(default_factory=GossipSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    source: str = field(default="", compare=False)  # file it came from, for messages

    def replace(self, **sections: dict[str, Any]) -> "Config":
        """A copy with some fields of some sections changed: cfg.replace(daemon={'swarm': 'x'})."""
        changes = {name: dataclasses.replace(getattr(self, name), **vals) for name, vals in sections.items()}
        new = dataclasses.replace(self, **changes)
        validate_semantics(new)
        return new


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
            kwargs[key] = float(v) if hints[key] is float else v
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


def parse_hostport(value: str, *, what: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), with an error that says what was wrong."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", value.strip())
    if not m:
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what}: port {port} out of range 0..65535")
    return host, port


def validate_semantics(cfg: Config) -> None:
    """Checks that need more than a type: ranges, enums, address syntax."""
    d, m, t = cfg.daemon, cfg.membership, cfg.topology
    if not d.swarm or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,63}", d.swarm):
        raise ConfigError(f"[daemon] swarm: use 1-63 letters, digits, '.', '-' or '_' (got {d.swarm!r})")
    parse_hostport(d.listen, what="[daemon] listen")
    for j in d.join:
        parse_hostport(j, what="[daemon] join")
    if d.log_format not in ("text", "json"):
        raise ConfigError(f"[daemon] log_format: expected 'text' or 'json', got {d.log_format!r}")
    if d.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"[daemon] log_level: expected debug, info, warning or error, got {d.log_level!r}")
    for c in cfg.security.ciphers:
        if c != "auto" and c not in CIPHERS:
            raise ConfigError(f"[security] ciphers: unknown cipher {c!r} (use {', '.join(CIPHERS)} or auto)")
    for name in ("heartbeat_interval", "dead_after", "handshake_timeout", "reconnect_min", "reconnect_max", "pex_interval", "peer_record_ttl"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"[membership] {name}: must be > 0")
    if m.dead_after <= m.heartbeat_interval:
        raise ConfigError("[membership] dead_after: must exceed heartbeat_interval, or every peer looks dead")
    for name in ("max_connections", "max_connections_per_ip"):
        if getattr(m, name) < 1:
            raise ConfigError(f"[membership] {name}: must be >= 1")
    for f in dataclasses.fields(cfg.limits):
        if getattr(cfg.limits, f.name) < 1:
            raise ConfigError(f"[limits] {f.name}: must be >= 1")
    if t.kind not in ("rewired", "ring", "exponential", "random_regular", "full"):
        raise ConfigError(f"[topology] kind: expected rewired, ring, exponential, random_regular or full, got {t.kind!r}")
    if not 1 <= t.min_degree <= t.target_degree <= t.max_degree:
        raise ConfigError("[topology] target_degree: need 1 <= min_degree <= target_degree <= max_degree")
    if not 0 <= t.confidence <= 10:
        raise ConfigError(f"[topology] confidence: expected 0 to 10 standard errors, got {t.confidence}")
    if cfg.gossip.codec not in ("raw", "float16", "q8"):
        raise ConfigError(f"[gossip] codec: expected raw, float16 or q8, got {cfg.gossip.codec!r}")
    if not 1.0 <= cfg.gossip.max_update_ratio <= 1e6:
        raise ConfigError(f"[gossip] max_update_ratio: expected 1 to 1e6, got {cfg.gossip.max_update_ratio}")


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


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
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
    """The config reference table for the README, from the fields' docs."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    cfg = Config()
    for f in dataclasses.fields(cfg):
        if f.name == "source":
            continue
        section = getattr(cfg, f.name)
        for sf in dataclasses.fields(section):
            rows.append(f"| `{f.name}.{sf.name}` | `{_toml_value(getattr(section, sf.name))}` | {sf.metadata.get('doc', '')} |")
    return "\n".join(rows)

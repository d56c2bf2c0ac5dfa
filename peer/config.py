"""Daemon configuration: typed sections loaded from TOML, validated with errors that name file, line and key.

Precedence is defaults < config file < command-line flags. Every field carries a one-line doc in its
metadata; `peer config docs` prints them, and the README's config reference is generated from them,
so the docs cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol import identity as ident
from protocol.cipher import CIPHERS
from protocol.limits import DEFAULT_CHUNK_SIZE, DEFAULT_LIMITS, KiB, MiB
from protocol.schema.topology import MAX_RECORD_NEIGHBOURS


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


# Largest frame the 32-bit length field can carry with any AEAD tag added (protocol.frames), in KiB: < 4 GiB.
_MAX_FRAME_KIB = (1 << 32) // KiB - 1
# Seconds: the longest interval or timeout a key takes (an hour; a day for how long a peer may stay silent):
# longer is never useful and an infinite one disables the guard it sets.
_HOUR, _DAY = 3600.0, 86400.0
# Shortest interval: 10 ms; below it a loop spins.
_TICK = 0.01


@dataclass(frozen=True)
class DaemonSection:
    swarm: str = _f("default", "Swarm name; daemons connect only within their swarm.")
    listen: str = _f("0.0.0.0:7100", "HOST:PORT to accept peers on; port 0 picks a free port (logged, and shown in `peer status`).")
    join: list[str] = _f([], "Bootstrap addresses HOST:PORT to dial at start (works with mDNS off).")
    log_format: str = _f("text", "'text' for readable lines, 'json' for one JSON object per line.")
    log_level: str = _f("info", "debug, info, warning or error.")


@dataclass(frozen=True)
class SecuritySection:
    swarm_key_file: str = _f("", "File with a pre-shared swarm key; peers without it cannot complete a handshake. Relative to the config file.")
    allow_peers: list[str] = _f([], "If non-empty, only these peer IDs (as `peer id` prints them) may connect.")
    ciphers: list[str] = _f(["auto"], "Session ciphers by preference: aes-256-ocb, aes-256-gcm, chacha20-poly1305, or 'auto' (the fastest, measured at start).")


@dataclass(frozen=True)
class DiscoverySection:
    mdns: bool = _f(True, "Announce and browse `_peertrain._tcp.local.` with mDNS on the local link.")
    interfaces: list[str] = _f([], "IPs of the interfaces mDNS uses (empty: all); ['127.0.0.1'] for daemons on one host.")
    advertise: list[str] = _f([], "IPs to announce to peers (empty: the interface addresses).")
    private_addresses: bool = _f(False, "Dial loopback, link-local and private addresses (and host names) that "
                                 "other peers told us (peer exchange, peer cache); mDNS, --join and connecting "
                                 "peers' own addresses are always used. On for a LAN or one host.")


@dataclass(frozen=True)
class MembershipSection:
    heartbeat_interval: float = _f(1.0, "Seconds between pings on each session (also measures RTT).", lo=_TICK, hi=_HOUR, unit="s")
    dead_after: float = _f(6.0, "A peer silent this many seconds (> heartbeat_interval) is dead; its session is closed.",
                            lo=_TICK, hi=_DAY, unit="s")
    handshake_timeout: float = _f(5.0, "Seconds a handshake may take before the connection is dropped (slowloris guard).",
                                   lo=0.1, hi=120.0, unit="s")
    max_connections: int = _f(64, "Most sessions this daemon keeps open at once.", lo=1, hi=65536)
    max_connections_per_ip: int = _f(16, "Most sessions from one remote IP address.", lo=1, hi=65536)
    reconnect_min: float = _f(0.5, "First reconnect delay in seconds; doubles with jitter on each failure.",
                               lo=_TICK, hi=_HOUR, unit="s")
    reconnect_max: float = _f(30.0, "Longest reconnect delay in seconds (at least reconnect_min).", lo=_TICK, hi=_DAY, unit="s")
    pex_interval: float = _f(5.0, "Seconds between peer-exchange (signed peer record) messages.",
                              lo=_TICK, hi=_HOUR, unit="s")
    peer_record_ttl: float = _f(600.0, "Seconds a signed peer record stays valid.", lo=1.0, hi=30 * _DAY, unit="s")


@dataclass(frozen=True)
class LimitsSection:
    # The defaults are protocol.limits.WireLimits' (where they are defined, with why), in this section's units
    # (the frame's rounded up to whole KiB: 4 MiB + 64 B is 4097 KiB).
    max_frame_kib: int = _f(-(-DEFAULT_LIMITS.max_frame_bytes // KiB), "Largest sealed frame accepted, in KiB.",
                        lo=64, hi=_MAX_FRAME_KIB)
    max_message_kib: int = _f(DEFAULT_LIMITS.max_message_bytes // KiB, "Largest control message accepted, in KiB (at most max_frame_kib).",
                          lo=16, hi=_MAX_FRAME_KIB)
    max_tensor_mib: int = _f(DEFAULT_LIMITS.max_tensor_bytes // MiB, "Largest tensor a peer may send us, in MiB (at most max_inflight_tensor_mib).",
                         lo=1, hi=1 << 20)
    max_inflight_tensor_mib: int = _f(DEFAULT_LIMITS.max_inflight_tensor_bytes // MiB,
                                      "Tensor MiB one session may have in flight.",
                                      lo=1, hi=1 << 20)
    max_queued_messages: int = _f(DEFAULT_LIMITS.max_queued_messages,
                                  "Messages buffered per session before reading pauses (backpressure).",
                                  lo=1, hi=1 << 20)


@dataclass(frozen=True)
class TopologySection:
    kind: str = _f("rewired", "Gossip graph: rewired (adaptive), ring, exponential, random_regular or full.")
    target_degree: int = _f(4, "Neighbours each peer aims for (min_degree to max_degree).", lo=1, hi=MAX_RECORD_NEIGHBOURS)
    min_degree: int = _f(2, "A peer never drops an edge that leaves it or a neighbour below this (except a relink "
                            "between two slow-linked peers, which re-adds a well-linked peer at once).", lo=1, hi=MAX_RECORD_NEIGHBOURS)
    max_degree: int = _f(8, "A peer refuses edges above this degree (a topology record lists at most 64 neighbours).", lo=1, hi=MAX_RECORD_NEIGHBOURS)
    gap_floor: float = _f(0.05, "Rewiring never lets the spectral gap of the local view fall below this.",
                           lo=0.0, hi=1.0, hi_open=True)
    confidence: float = _f(1.5, "Rewiring judges the link it would replace at its best and the new one at its worst by "
                                "this many standard errors of their bandwidth estimates (a speed-up within the noise "
                                "is none); raise it on noisy hosts.",
                           lo=0.0, hi=10.0, unit="standard errors")
    rewire_interval: float = _f(4.0, "Mean seconds between rewiring attempts (randomized).", lo=_TICK, hi=_HOUR, unit="s")
    record_interval: float = _f(2.0, "Seconds between topology-record broadcasts.", lo=_TICK, hi=_HOUR, unit="s")
    seed: int = _f(0, "Seed for fixed random topologies.", lo=0, hi=(1 << 32) - 1)


@dataclass(frozen=True)
class GossipSection:
    exchange_timeout: float = _f(30.0, "Deadline for one averaging exchange; a slow or dead neighbour is skipped.",
                                 lo=0.1, hi=_HOUR, unit="s")
    max_concurrent_exchanges: int = _f(4, "Most averaging exchanges this peer serves at once.", lo=1, hi=1024)
    codec: str = _f("raw", "Tensor codec for averaging: raw, float16 or q8.")
    # (the default is protocol.limits.DEFAULT_CHUNK_SIZE, defined there with why)
    chunk_kib: int = _f(DEFAULT_CHUNK_SIZE // KiB, "Tensor chunk (one frame) in KiB, at most max_frame_kib.",
                         lo=1, hi=_MAX_FRAME_KIB)
    max_update_ratio: float = _f(8.0, "Both sides clip an exchange's difference to this times the smaller of the two "
                                 "models' norms, so the sum is kept (independently initialised models differ by "
                                 "about 1.4x their norm).", lo=1.0, hi=1e6)


@dataclass(frozen=True)
class PipelineSection:
    """Bounds on the swarm pipeline's calls (peer/pipeline/): what a driver waits for and what a server holds."""

    max_queue: int = _f(16, "Stage calls this daemon holds at once (received, queued or computing), from all "
                        "drivers; more are refused as busy (the driver tries another peer of the stage).",
                        lo=1, hi=4096)
    max_queue_per_peer: int = _f(8, "Stage calls one driver may have at this daemon at once.", lo=1, hi=4096)
    call_timeout: float = _f(10.0, "Base deadline of one stage call; a call's deadline adds 4x its expected "
                             "queue, compute and transfer time (measured), up to max_call_timeout.",
                             lo=0.1, hi=_HOUR, unit="s")
    max_call_timeout: float = _f(120.0, "Longest deadline one stage call may get, however slow the peer.",
                                 lo=0.1, hi=_HOUR, unit="s")
    max_retries: int = _f(4, "Times one stage call is re-sent to another peer of the stage before its microbatch "
                          "fails.", lo=0, hi=64)
    stage_wait: float = _f(120.0, "Longest a driver waits for a stage with no live peer before failing the "
                           "microbatch (the wait shows in `peer status`).", lo=0.1, hi=_DAY, unit="s")
    first_ban: float = _f(2.0, "Seconds a driver avoids a peer after a failed call; doubles with each further "
                          "failure in a row, up to max_ban.", lo=0.0, hi=_HOUR, unit="s")
    max_ban: float = _f(120.0, "Longest a driver avoids a failing peer.", lo=0.0, hi=_DAY, unit="s")
    max_state_uploads: int = _f(2, "Stage states (weights and optimizer state) this daemon sends at once to peers "
                                "taking a stage over; each holds a snapshot of the stage in memory while it streams.",
                                lo=1, hi=64)
    state_timeout: float = _f(120.0, "Longest one stage-state transfer may take (a stage of 100 MB at ~10 MB/s, "
                              "with room); a slower one is abandoned and the mover asks another holder.",
                              lo=1.0, hi=_DAY, unit="s")


@dataclass(frozen=True)
class NatSection:
    """Being reachable from the internet (peer/nat/): dial-back, relays we use, hole punching."""

    reachability: str = _f("auto", "'auto': ask peers to dial our advertised addresses back and conclude public, "
                           "nat or unknown; 'public' or 'private' to skip asking (you know the port is open, or not).")
    dialback_peers: int = _f(3, "Peers (at distinct IPs) asked to dial us back each round; two agreeing decide.",
                             lo=1, hi=16)
    recheck_interval: float = _f(300.0, "Seconds between reachability checks once decided (sooner while unknown).",
                                 lo=1.0, hi=_DAY, unit="s")
    use_relays: bool = _f(True, "When not publicly reachable, keep reservations with public peers that relay, "
                          "and advertise the relayed addresses in our signed peer record.")
    relays: int = _f(2, "Relay reservations to hold (two: losing one relay does not cut us off).", lo=1, hi=8)
    hole_punching: bool = _f(True, "Over a relayed session, try a simultaneous TCP open for a direct one.")


@dataclass(frozen=True)
class RelaySection:
    """Relaying for peers behind NAT, offered only while we are publicly reachable: a relay is a service
    strangers in the swarm use, so everything it holds is capped here."""

    enabled: bool = _f(True, "Offer relaying while this daemon is publicly reachable.")
    max_reservations: int = _f(64, "Peers that may hold a reservation with us at once.", lo=0, hi=65536)
    max_circuits: int = _f(64, "Relayed connections at once, in total.", lo=0, hi=65536)
    max_circuits_per_peer: int = _f(8, "Relayed connections at once from one peer, and to one peer (a peer behind "
                                    "a NAT that cannot be punched needs one per peer it talks to, spread over its "
                                    "relays).", lo=1, hi=1024)
    max_circuit_mib: int = _f(1024, "Bytes one relayed connection may carry (both directions), in MiB; then it is "
                              "closed and its peers reconnect.", lo=1, hi=1 << 30)
    max_circuit_seconds: float = _f(3600.0, "Longest a relayed connection stays open.", lo=1.0, hi=_DAY, unit="s")
    max_bandwidth_mib_s: float = _f(25.0, "Bytes per second, in MiB, all relayed connections together may use "
                                    "(shared fairly by taking turns).", lo=0.01, hi=1 << 20, unit="MiB/s")


@dataclass(frozen=True)
class AttachSection:
    enabled: bool = _f(True, "Let training processes of this host's user attach to this daemon (peertrain.attach) "
                       "through the control socket (mode 0600).")
    max_clients: int = _f(16, "Processes attached at once (a torchrun job attaches once, from its rank 0).",
                          lo=1, hi=1024)
    max_shared_mib: int = _f(16384, "Tensors all attached processes may share, in MiB (the daemon keeps snapshot "
                             "buffers of that size for the exchanges).", lo=1, hi=1 << 24)


@dataclass(frozen=True)
class MetricsSection:
    """Prometheus metrics over HTTP (peer/metrics/): off unless an address is given."""

    listen: str = _f("", "HOST:PORT serving Prometheus metrics at GET /metrics; empty: off. Port 0 picks a free "
                     "port (logged, and shown in `peer status` as metrics.listen). It tells whoever reaches it "
                     "about this daemon and its peers: keep it on 127.0.0.1 or a private network.")


@dataclass(frozen=True)
class TrainerSection:
    name: str = _f("", "Trainer module the daemon hosts (e.g. trainers.gossip_sgd); empty: no training.")
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
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    nat: NatSection = field(default_factory=NatSection)
    relay: RelaySection = field(default_factory=RelaySection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    attach: AttachSection = field(default_factory=AttachSection)
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


def check_ranges(cfg: Config) -> None:
    """Every numeric key against the Range declared with it: finite, right type, inside."""
    for sec in dataclasses.fields(cfg):
        if sec.name == "source":
            continue
        section = getattr(cfg, sec.name)
        hints = typing.get_type_hints(type(section))
        for f in dataclasses.fields(section):
            rng: Range | None = f.metadata.get("range")
            if rng is None:
                continue
            v = getattr(section, f.name)
            tp = hints[f.name]
            if not _check_type(v, tp):
                raise ConfigError(f"[{sec.name}] {f.name}: expected {_type_name(tp)}, got {type(v).__name__} {v!r}")
            if not rng.contains(v):
                raise ConfigError(f"[{sec.name}] {f.name}: expected {rng.describe()}, got {v!r}")


def validate_semantics(cfg: Config) -> None:
    """Checks that need more than a type: the declared ranges, rules between keys, enums, address syntax."""
    check_ranges(cfg)
    d, m, t, lim = cfg.daemon, cfg.membership, cfg.topology, cfg.limits
    if not d.swarm or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,63}", d.swarm):
        raise ConfigError(f"[daemon] swarm: use 1-63 letters, digits, '.', '-' or '_' (got {d.swarm!r})")
    parse_hostport(d.listen, what="[daemon] listen")
    for j in d.join:
        parse_hostport(j, what="[daemon] join")
    if cfg.metrics.listen:
        _, metrics_port = parse_hostport(cfg.metrics.listen, what="[metrics] listen")
        if metrics_port and metrics_port == parse_hostport(d.listen, what="[daemon] listen")[1]:
            raise ConfigError(f"[metrics] listen: port {metrics_port} is [daemon] listen's; pick another (or 0)")
    if d.log_format not in ("text", "json"):
        raise ConfigError(f"[daemon] log_format: expected 'text' or 'json', got {d.log_format!r}")
    if d.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"[daemon] log_level: expected debug, info, warning or error, got {d.log_level!r}")
    for c in cfg.security.ciphers:
        if c != "auto" and c not in CIPHERS:
            raise ConfigError(f"[security] ciphers: unknown cipher {c!r} (use {', '.join(CIPHERS)} or auto)")
    for p in cfg.security.allow_peers:
        if not ident.is_peer_id(p):
            raise ConfigError(f"[security] allow_peers: {p!r} is not a peer ID ({ident.PEER_ID_LENGTH} characters "
                              "a-z and 2-7, as `peer id` prints it)")
    if m.dead_after <= m.heartbeat_interval:
        raise ConfigError("[membership] dead_after: must exceed heartbeat_interval, or every peer looks dead")
    if m.reconnect_max < m.reconnect_min:
        raise ConfigError(f"[membership] reconnect_max: must be at least reconnect_min ({_num(m.reconnect_min)})")
    # protocol.limits.WireLimits' own rules, so a config that would stop the daemon at start fails here
    if lim.max_message_kib > lim.max_frame_kib:
        raise ConfigError(f"[limits] max_message_kib: a message must fit in one frame (max_frame_kib {lim.max_frame_kib})")
    if lim.max_tensor_mib > lim.max_inflight_tensor_mib:
        raise ConfigError(f"[limits] max_tensor_mib: must fit in max_inflight_tensor_mib ({lim.max_inflight_tensor_mib})")
    pl = cfg.pipeline
    if pl.max_call_timeout < pl.call_timeout:
        raise ConfigError(f"[pipeline] max_call_timeout: must be at least call_timeout ({_num(pl.call_timeout)})")
    if pl.max_ban < pl.first_ban:
        raise ConfigError(f"[pipeline] max_ban: must be at least first_ban ({_num(pl.first_ban)})")
    if cfg.gossip.chunk_kib > lim.max_frame_kib:
        raise ConfigError(f"[gossip] chunk_kib: a chunk is one frame, so at most [limits] max_frame_kib ({lim.max_frame_kib})")
    if t.kind not in ("rewired", "ring", "exponential", "random_regular", "full"):
        raise ConfigError(f"[topology] kind: expected rewired, ring, exponential, random_regular or full, got {t.kind!r}")
    if not t.min_degree <= t.target_degree <= t.max_degree:
        raise ConfigError("[topology] target_degree: need min_degree <= target_degree <= max_degree")
    if cfg.nat.reachability not in ("auto", "public", "private"):
        raise ConfigError(f"[nat] reachability: expected 'auto', 'public' or 'private', got {cfg.nat.reachability!r}")
    if cfg.gossip.codec not in ("raw", "float16", "q8"):
        raise ConfigError(f"[gossip] codec: expected raw, float16 or q8, got {cfg.gossip.codec!r}")


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

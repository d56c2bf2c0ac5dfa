"""What a config must meet beyond its types: every number inside the range declared with it, the rules
between keys, enums and address syntax. Run at load and by `Config.replace`, so a config that would fail
the daemon later is refused now, with the key named."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import TYPE_CHECKING

from peer.config.keys import ConfigError, Range, _check_type, _num, _type_name
from protocol import identity as ident
from peer.topology.fixed import FIXED_KINDS
from peer.topology.local_gap import GapConfig
from protocol.cipher import CIPHERS

if TYPE_CHECKING:
    from peer.config.sections import Config


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


# A token shorter than this is guessable by whoever can reach the port (the server answers as fast as asked).
MIN_DASHBOARD_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP or a name) only ever means this machine."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_listen_ports(cfg: Config) -> None:
    """The HTTP listeners (`[metrics]`, `[dashboard]`) parse, and none takes a port a listener before it has."""
    taken = {"[daemon] listen": parse_hostport(cfg.daemon.listen, what="[daemon] listen")[1]}
    for key, listen in (("[metrics] listen", cfg.metrics.listen), ("[dashboard] listen", cfg.dashboard.listen)):
        if not listen:
            continue
        port = parse_hostport(listen, what=key)[1]
        for other, other_port in taken.items():
            if port and port == other_port:
                raise ConfigError(f"{key}: port {port} is {other}'s; pick another (or 0)")
        taken[key] = port


def check_dashboard(cfg: Config) -> None:
    """A `[dashboard] listen` that is not loopback needs a token, since the page tells whoever reaches it about
    this daemon and its peers (its port: `check_listen_ports`)."""
    dash = cfg.dashboard
    if dash.token and (len(dash.token) < MIN_DASHBOARD_TOKEN_CHARS or not dash.token.isprintable()
                       or any(c.isspace() for c in dash.token)):
        raise ConfigError(f"[dashboard] token: use at least {MIN_DASHBOARD_TOKEN_CHARS} printable characters "
                          f"without spaces (got {len(dash.token)} characters)")
    if not dash.listen:
        return
    host, _ = parse_hostport(dash.listen, what="[dashboard] listen")
    if not is_loopback(host) and not dash.token:
        raise ConfigError(f"[dashboard] token: [dashboard] listen = {dash.listen!r} is not a loopback address, so "
                          "the dashboard needs a token (or listen on 127.0.0.1 and use an SSH tunnel)")


VIEW_MODES = ("auto", "full", "partial")  # [membership] views (peer/membership/view_mode.py, auto_view.py)


def partial_views_refusal(t) -> str | None:
    """Why partial views cannot run with these `[topology]` settings (a config error under views = 'partial';
    under 'auto' the daemon then keeps the full view), or None."""
    if t.kind != "rewired":
        return (f"[topology] kind: {t.kind!r} lays its graph over every peer's ID, which partial views "
                "do not know; use kind = 'rewired' with [membership] views = 'partial' (or views = 'full')")
    if t.max_degree > 32:
        return ("[topology] max_degree: partial views carry at most 32 neighbours in a message; "
                f"at most 32 with [membership] views = 'partial', got {t.max_degree}")
    return None


def validate_semantics(cfg: Config) -> None:
    """Checks that need more than a type: the declared ranges, rules between keys, enums, address syntax."""
    check_ranges(cfg)
    d, m, t, lim = cfg.daemon, cfg.membership, cfg.topology, cfg.limits
    if not d.swarm or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,63}", d.swarm):
        raise ConfigError(f"[daemon] swarm: use 1-63 letters, digits, '.', '-' or '_' (got {d.swarm!r})")
    check_listen_ports(cfg)
    for j in d.join:
        parse_hostport(j, what="[daemon] join")
    check_dashboard(cfg)
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
    if m.views not in VIEW_MODES:
        raise ConfigError(f"[membership] views: expected {', '.join(repr(v) for v in VIEW_MODES)}, got {m.views!r}")
    refusal = partial_views_refusal(t)
    if m.views == "partial" and refusal is not None:
        raise ConfigError(refusal)
    if m.gap_every and m.gap_every < GapConfig.rounds * m.gap_round:
        raise ConfigError(f"[membership] gap_every: an estimate takes {GapConfig.rounds} rounds of gap_round "
                          f"({_num(m.gap_round)} s), so 0 or at least {_num(GapConfig.rounds * m.gap_round)} s")
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
    if not re.fullmatch(r"auto|cpu|cuda(:\d{1,2})?", pl.device):
        raise ConfigError(f"[pipeline] device: expected auto, cpu, cuda or cuda:N, got {pl.device!r}")
    if cfg.gossip.chunk_kib > lim.max_frame_kib:
        raise ConfigError(f"[gossip] chunk_kib: a chunk is one frame, so at most [limits] max_frame_kib ({lim.max_frame_kib})")
    if t.kind not in ("rewired", *FIXED_KINDS):
        raise ConfigError(f"[topology] kind: expected one of rewired, {', '.join(FIXED_KINDS)}, got {t.kind!r}")
    if not t.min_degree <= t.target_degree <= t.max_degree:
        raise ConfigError("[topology] target_degree: need min_degree <= target_degree <= max_degree")
    if cfg.nat.reachability not in ("auto", "public", "private"):
        raise ConfigError(f"[nat] reachability: expected 'auto', 'public' or 'private', got {cfg.nat.reachability!r}")
    if cfg.gossip.codec not in ("raw", "float16", "q8"):
        raise ConfigError(f"[gossip] codec: expected raw, float16 or q8, got {cfg.gossip.codec!r}")

"""`peer doctor`'s checks of a running daemon, from its status alone (pure functions, so they are tested
with made-up statuses): reachability, NAT mapping, relays, the daemon's view of its bootstrap peers, and
clocks. A status lacking a section (an older daemon) gets that check skipped, never an error."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from peer.membership.store import MAX_CLOCK_SKEW

CLOCK_WARN_S = 30.0
"""Clocks this far apart work, but NTP keeps them within a second: a gap this large is drifting."""
CLOCK_FAIL_S = MAX_CLOCK_SKEW  # peer records issued further in the future than this are refused
NTP_FIX = "enable NTP (timedatectl set-ntp true) on the machine whose clock is off"


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, what was found, and what to try when it is not ok."""

    name: str
    status: str  # ok | warn | fail | skip
    finding: str
    fix: str = ""


def short(peer_id: Any) -> str:
    from protocol.identity import short_id

    return short_id(peer_id) if isinstance(peer_id, str) and peer_id else "?"


def _dict(v: Any) -> dict:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


def clock_check(offsets: Iterable[tuple[str, float]]) -> Check:
    """The largest clock difference to a peer (`offsets`: who, remote clock minus ours, in seconds)."""
    readings = [(who, float(o)) for who, o in offsets if isinstance(o, (int, float)) and math.isfinite(o)]
    if not readings:
        return Check("clock", "skip", "no clock readings (peers send their clock in the handshake)")
    who, worst = max(readings, key=lambda r: abs(r[1]))
    text = f"largest difference {worst if abs(worst) >= 0.05 else 0.0:+.1f} s (with {who}; {len(readings)} readings)"
    if abs(worst) < CLOCK_WARN_S:
        return Check("clock", "ok", text)
    if abs(worst) < CLOCK_FAIL_S:
        return Check("clock", "warn", text, NTP_FIX)
    return Check("clock", "fail", text + f": peer records issued more than {CLOCK_FAIL_S:.0f} s in the future "
                 "are refused", NTP_FIX)


def checks_from_status(status: dict, *, probe_offsets: Iterable[tuple[str, float]] = ()) -> list[Check]:
    """Reachability, NAT mapping, relays, the daemon's bootstrap peers and clocks, from a running daemon's
    status. Tolerant of missing keys (an older daemon): what is missing is skipped, never an error."""
    nat = _dict(status.get("nat"))
    port = str(status.get("listen", "")).rpartition(":")[2] or "7100"
    checks = [_reachability(nat, port), _mapping(nat, port), _relays(nat), *_bootstrap_view(status)]
    peer_offsets = [(short(p.get("peer_id")), p.get("clock_offset_s")) for p in _list(status.get("peers"))
                    if isinstance(p, dict) and p.get("clock_offset_s") is not None]
    return checks + [clock_check(peer_offsets + list(probe_offsets))]


def _reachability(nat: dict, port: str) -> Check:
    state, reason = nat.get("reachability"), nat.get("reason") or ""
    if state == "public":
        good = [e.get("address") for e in _list(nat.get("evidence")) if isinstance(e, dict) and e.get("ok")]
        where = good[0] if good else ", ".join(map(str, _list(nat.get("advertised")))) or "our address"
        return Check("reachability", "ok", f"public: peers dialed back {where}" + (f" ({reason})" if reason else ""))
    if state == "nat":
        return Check("reachability", "warn", f"behind NAT or a firewall: {reason or 'peers could not dial us back'}",
                     f"forward TCP {port} on your router to this machine for direct connections; until then "
                     "traffic goes through relays")
    if state == "unknown":
        return Check("reachability", "warn", f"unknown{f' ({reason})' if reason else ''}: needs answers from at "
                     "least 2 peers at different addresses", "--join peers on other networks, or wait for more")
    return Check("reachability", "skip", "this daemon does not report reachability (an older version?)")


def _mapping(nat: dict, port: str) -> Check:
    mapping, punches = nat.get("nat_mapping"), _dict(nat.get("punches"))
    tried = f"; hole punching {punches.get('succeeded', 0)} of {punches.get('attempts')} succeeded" \
        if punches.get("attempts") else ""
    if mapping == "random":
        return Check("NAT mapping", "warn", "random: the NAT gives each destination a new port, so hole punching "
                     "cannot work behind it; connections stay relayed" + tried,
                     f"forward TCP {port} on the router (or use a NAT that keeps ports)")
    if mapping == "preserving":
        return Check("NAT mapping", "ok", "port-preserving: hole punching can work" + tried)
    if mapping == "none":
        return Check("NAT mapping", "ok", "no NAT: peers see our own address and port" + tried)
    return Check("NAT mapping", "skip", "not measured yet" + tried)


def _relays(nat: dict) -> Check:
    state = nat.get("reachability")
    relays = [r for r in _list(nat.get("relays")) if isinstance(r, dict)]
    held = ", ".join(f"{short(r.get('peer_id'))} at {r.get('address')}" for r in relays)
    server = _dict(nat.get("relay_server"))
    serving = (f"; relaying for {server.get('reservations', 0)} peers ({server.get('circuits', 0)} circuits open, "
               f"{server.get('bytes_relayed', 0)} bytes so far)" if server.get("offering") else "")
    if state == "nat":
        if not relays:
            return Check("relays", "fail", "no relay accepted us: a public peer with [relay] enabled = true is needed",
                         "run a daemon on a publicly reachable machine (its port open or forwarded) with [relay] "
                         "enabled = true, and --join it")
        return Check("relays", "ok", f"reachable through {held}")
    if state == "public":
        return Check("relays", "ok", "not needed (publicly reachable)" + serving)
    if relays:
        return Check("relays", "ok", f"reservations with {held}")
    return Check("relays", "skip", "decided once reachability is known")


def _bootstrap_view(status: dict) -> list[Check]:
    entries = [b for b in _list(status.get("bootstrap")) if isinstance(b, dict)]
    failing = [b for b in entries if b.get("state") == "failing"]
    alone = not status.get("connected")  # failing matters most when it is our only way in
    checks = [Check(f"bootstrap {b.get('address')} (daemon)", "fail" if alone else "warn",
                    f"{b.get('failures', 0)} failed dials: {b.get('cause') or 'no reason reported'}",
                    b.get("fix") or "")
              for b in failing]
    if entries and not failing:
        states = ", ".join(f"{b.get('address')} {b.get('state')}" for b in entries)
        checks.append(Check("bootstrap (daemon)", "ok", states))
    return checks

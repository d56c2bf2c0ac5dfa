"""What membership knows of each peer (`PeerInfo`), of each host it dials (`HostBackoff`) and of each
bootstrap address (`BootstrapTarget`), and the limits on all of it: what remote peers can make a daemon
remember or dial. The loops that use them are `peer.membership.service`."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Callable

from peer.nat.addresses import RelayedAddress
from peer.session.transport import Session
from protocol.schema import PeerRecord

MAX_ADDRESSES = 8
MAX_RELAYED = 4
"""Relayed addresses kept per peer, and advertised by us: a peer holds a couple of reservations
(`[nat] relays`), and a record carries at most 16 addresses in all (MAX_ADDRESSES direct + these)."""
MAX_PEERS = 4096  # learned from peer exchange; bounds what remote peers can make us remember
FORGET_AFTER_FAILURES = 8  # a peer we never reached is forgotten after this many failed dials
MAX_DIALS_IN_PROGRESS = 8
"""Outgoing dials at once, per daemon. Each holds a socket and a handshake for up to `handshake_timeout`;
8 lets a joining daemon reach several peers at once, while records from others (whose addresses may
name anyone) can make us hold no more than 8 attempts, whatever they list."""
SECOND_HAND = frozenset({"pex", "cache", "view"})
"""Sources whose addresses another peer told us (directly, in a partial view's entry, or, for the cache,
in an earlier run): these
are dialed with per-host backoff that new records do not reset, and never at private addresses unless
`[discovery] private_addresses` allows it. mDNS, --join and a connecting peer's own address are first-hand."""
OBSERVED_QUORUM = 2
"""Distinct peers, at distinct IP addresses, that must report the same address of ours (the `observed`
field of a handshake we initiated) before we advertise it: one responder could otherwise make us sign
and spread whatever address it likes."""
MAX_OBSERVED_CANDIDATES = 16  # addresses reported to us that we still count votes for (oldest forgotten)
IDLE_ROUNDS = 6
"""An inbound session is *idle*, and `serve` may close it when a newcomer needs its slot, when its peer is
not a topology neighbour and has sent nothing but heartbeats (`transport.HEARTBEATS`) for this many
`pex_interval`s. Why in rounds of peer exchange: a daemon sends peer exchange (and topology records) to
every session every round, so an honest peer is never idle, while one that only answers pings holds a
slot for nothing; 6 rounds (30 s by default) also spare a peer that missed a few, or was just admitted."""


def pick_idle(sessions, *, now: float, idle_after: float, keep: Callable[[str], bool]) -> Session | None:
    """Of `sessions`, the one idle longest (see IDLE_ROUNDS), or None. Never one still open for less
    than `idle_after` or useful more recently, and never one whose peer `keep`s (a neighbour)."""
    idle = [s for s in sessions if not s.closed.is_set() and now - s.stats.last_useful >= idle_after
            and not keep(s.peer_id)]
    return min(idle, key=lambda s: s.stats.last_useful, default=None)


@dataclass
class PeerInfo:
    """What we know of one peer; `state` is discovered, connecting, connected or dead."""

    peer_id: str
    addresses: list[tuple[str, int]] = field(default_factory=list)
    state: str = "discovered"
    source: str = ""
    session: Session | None = None
    rtt: float | None = None
    last_seen: float = 0.0  # wall clock, for display
    failures: int = 0
    next_attempt: float = 0.0  # trio clock
    dialing: bool = False
    record: PeerRecord | None = None
    firsthand: set[tuple[str, int]] = field(default_factory=set)  # addresses not learned from others
    relayed: list[RelayedAddress] = field(default_factory=list)  # reachable through these relays (peer/nat)
    dead_reason: str = ""
    bytes_in_closed: int = 0  # from sessions that ended
    bytes_out_closed: int = 0
    bytes_by_path: dict[str, int] = field(default_factory=dict)  # in + out of ended sessions, by path
    first_connected: float = 0.0  # wall clock of our first session with it
    connected_since: float = 0.0  # wall clock the current session started
    ended_at: float = 0.0  # trio clock when its last session ended (partial views forget it a while later)

    def add_addresses(self, addrs) -> bool:
        """Put new addresses first, keep MAX_ADDRESSES. Linear: the input is cut to MAX_ADDRESSES before
        anything is compared (a record listing 90,000 addresses once made this quadratic)."""
        new = list(dict.fromkeys((str(a[0]), int(a[1])) for a in list(addrs)[:MAX_ADDRESSES]))
        known = set(self.addresses)
        fresh = [a for a in new if a not in known]
        if not fresh:
            return False
        self.addresses = (fresh + self.addresses)[:MAX_ADDRESSES]
        return True

    def add_relayed(self, addrs: list[RelayedAddress]) -> bool:
        fresh = [a for a in addrs[:MAX_RELAYED] if a not in self.relayed]
        self.relayed = (fresh + self.relayed)[:MAX_RELAYED]
        return bool(fresh)


@dataclass
class HostBackoff:
    """Failed dials to one host at addresses others told us; no record resets it, a success does."""

    failures: int = 0
    next_attempt: float = 0.0  # trio clock


@dataclass
class BootstrapTarget:
    host: str
    port: int
    peer_id: str | None = None
    failures: int = 0
    next_attempt: float = 0.0
    dialing: bool = False
    cause: str = ""  # why the last dial failed, and what to try (peer/nat/explain.py)
    fix: str = ""


def is_public_address(host: str) -> bool:
    """True for a global unicast IP literal. Loopback, link-local, private, multicast, reserved and
    unspecified addresses are not, nor is a host name (it may resolve to any of those)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_global and not ip.is_multicast

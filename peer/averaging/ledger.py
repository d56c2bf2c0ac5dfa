"""What averaging did, and what each peer earned by it: the counters `peer status` shows, and strikes.

Both sides of an exchange and both sides of a download write here: completed exchanges (their bytes and
seconds, per peer), how far each partner was and whether its update was clipped (peer/averaging/radius.py),
failures, refusals, and the strikes a peer earns (an exchange we accepted that it let lapse or aborted,
values whose distance is evidence against it, a download past max_update_ratio), which ban it
(peer/averaging/bans.py). The clock is trio's, as the bans' (tests drive it).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import trio

from peer.averaging.bans import BanList
from peer.metrics.histogram import Histogram
from peer.per_peer import count, touch

log = logging.getLogger("peertrain.gossip")

# Upper bounds, in seconds, of the exchange-duration histogram (`peer status`, Prometheus): from a small
# vector on loopback (a few ms) to [gossip] exchange_timeout's default (30 s), about x2-2.5 a step, so an
# exchange that takes twice as long lands a bucket higher; slower ones count in +Inf only.
EXCHANGE_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RECENT_EXCHANGES = 20  # durations `peer status` lists
CLIP_WINDOW = 20  # a peer's last exchanges its clip rate is over: recent enough to show a change, enough to be a rate


@dataclass
class GossipStats:
    exchanges: int = 0
    served: int = 0
    failed: int = 0
    rejected: int = 0
    bytes_sent: int = 0  # tensor bytes of completed exchanges, ours on the wire
    bytes_received: int = 0  # tensor bytes of completed exchanges, the other side's on the wire
    last_seconds: float = 0.0
    last_error: str = ""
    recent: list = field(default_factory=list)  # seconds of the last exchanges
    clipped: dict = field(default_factory=dict)  # peer -> exchanges whose update was clipped (bounds.py), downloads refused
    struck: dict = field(default_factory=dict)  # peer -> strikes for values far past our radius (radius.py) or a refused download
    lapsed: dict = field(default_factory=dict)  # peer -> exchanges it let lapse or aborted after we accepted
    params_refused: int = 0  # parameter requests refused (not a neighbour, banned, no such group)
    by_peer: dict = field(default_factory=dict)  # peer -> PeerExchanges (peers we averaged with)
    # the per-peer tables keep the MAX_PEERS_SHOWN peers most recently touched (peer/per_peer.py): keys are free
    durations: Histogram = field(default_factory=lambda: Histogram(EXCHANGE_SECONDS_BUCKETS))  # completed ones


@dataclass
class PeerExchanges:
    """Exchanges with one peer, for `peer status` and `peer bench nat` (which link paths carry averaging)."""

    exchanges: int = 0
    bytes: int = 0  # sent (the exchange's codec is both sides': as many arrive)
    first_at: float = 0.0  # wall clock of the first one
    last_s: float = 0.0
    clipped: int = 0  # exchanges whose update was clipped
    recent_clips: list = field(default_factory=list)  # clipped or not, its last CLIP_WINDOW exchanges
    distance: float | None = None  # ||b - a|| at its last exchange, before any clip
    radius: float | None = None  # the radius we announced for it then (None: none, inf)

    def as_status(self) -> dict:
        n = len(self.recent_clips)
        return {"exchanges": self.exchanges, "bytes": self.bytes, "first_at": self.first_at, "last_s": self.last_s,
                "clipped": self.clipped, "clip_rate": round(sum(self.recent_clips) / n, 3) if n else None,
                "distance": _finite(self.distance), "radius": _finite(self.radius)}


def _finite(x: float | None) -> float | None:
    """A float for status (JSON has no inf or NaN), to 4 significant digits."""
    return float(f"{x:.4g}") if x is not None and math.isfinite(x) else None


class Ledger:
    """The averaging counters and the ban list, and the rules that move them."""

    def __init__(self) -> None:
        self.stats = GossipStats()
        self.bans = BanList()

    def completed(self, peer_id: str, seconds: float, sent: int, received: int) -> None:
        """An exchange with `peer_id` committed and was applied, on either side: `sent` and `received`
        are the two sides' tensor bytes on the wire."""
        s = self.stats
        s.exchanges += 1
        s.bytes_sent += sent
        s.bytes_received += received
        s.last_seconds = seconds
        s.recent = (s.recent + [round(seconds, 4)])[-RECENT_EXCHANGES:]
        s.durations.observe(seconds)
        p = self._peer(peer_id)
        p.exchanges += 1
        p.bytes += sent
        p.last_s = round(seconds, 4)

    def _peer(self, peer_id: str) -> PeerExchanges:
        return touch(self.stats.by_peer, peer_id, lambda: PeerExchanges(first_at=time.time()))

    def judged(self, peer_id: str, *, scale: float, distance: float, radius: float, strike: str | None) -> None:
        """A committed exchange with `peer_id` was applied with clip `scale`, at `distance` (before the clip),
        our radius being `radius`; `strike`: why its distance is evidence against it (radius.py), or None."""
        p = self._peer(peer_id)
        p.recent_clips = (p.recent_clips + [scale < 1.0])[-CLIP_WINDOW:]
        p.distance, p.radius = distance, radius
        if scale < 1.0:
            p.clipped += 1
            count(self.stats.clipped, peer_id)
        if strike is not None:
            self.struck(peer_id, strike)

    def failed(self, short: str, reason: str) -> None:
        """An exchange with the peer `short` names ended without applying anything."""
        self.stats.failed += 1
        self.stats.last_error = f"{short}: {reason}"

    def lapsed(self, peer_id: str, reason: str) -> None:
        """An exchange we accepted held our weight for nothing: count it, and ban a peer that keeps doing it."""
        count(self.stats.lapsed, peer_id)
        self.strike(peer_id, reason)

    def refused_download(self, peer_id: str, reason: str) -> None:
        """`peer_id` sent parameters past max_update_ratio of ours (peer/averaging/download.py): count it as a
        clip (all of it was left out) and strike it."""
        count(self.stats.clipped, peer_id)
        self.struck(peer_id, reason)

    def struck(self, peer_id: str, reason: str) -> None:
        """`peer_id`'s values are evidence against it: count it and strike it."""
        count(self.stats.struck, peer_id)
        self.strike(peer_id, reason)

    def strike(self, peer_id: str, reason: str) -> None:
        if self.bans.strike(peer_id, reason, trio.current_time()):
            log.warning("banned %s from averaging with us: %s", peer_id[:8], self.banned(peer_id))

    def banned(self, peer_id: str) -> str | None:
        """Why `peer_id` is banned now, or None."""
        return self.bans.banned(peer_id, trio.current_time())

    def ban_list(self) -> list[dict]:
        """Bans in force for `peer status`: peer, until (unix time), reason."""
        wall, now = time.time(), trio.current_time()
        return [{"peer": p, "until": round(wall + left, 1), "reason": reason}
                for p, left, reason in self.bans.active(now)]

    def status(self) -> dict:
        """The counters, as `peer status` (and Prometheus) read them."""
        s = self.stats
        return {"exchanges": s.exchanges, "served": s.served, "failed": s.failed, "rejected": s.rejected,
                "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received,
                "last_exchange_s": round(s.last_seconds, 4), "recent_s": s.recent, "last_error": s.last_error,
                "exchange_seconds": s.durations.as_dict(),  # completed exchanges, both roles (histogram)
                "clipped": dict(s.clipped), "struck": dict(s.struck), "lapsed": dict(s.lapsed),
                "params_refused": s.params_refused, "bans": self.ban_list(),
                "by_peer": {pid: p.as_status() for pid, p in s.by_peer.items()}}

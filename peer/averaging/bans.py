"""Which peers we no longer average with for a while, and why (docs/design.md, "The averaging exchange").

A peer earns a strike when an exchange we accepted from it lapses (it never commits before the hold runs
out, or it aborts after we accepted), or when its update had to be clipped (peer/averaging/bounds.py).
Each such exchange held part of our budget of weight for nothing, or pushed values far from ours.
`BAN_AFTER` strikes within `STRIKE_WINDOW_S` ban it; every further ban doubles the interval, up to
`MAX_BAN_S`. A banned peer's offers and parameter requests are refused with the reason, and we do not
initiate with it. The clock is the caller's (trio.current_time in the engine), so tests drive it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

BAN_AFTER = 3  # strikes in the window: an honest peer on a bad link may lapse once or twice, not three times in a row
STRIKE_WINDOW_S = 600.0  # 10 min: long enough that a lapse every hold period (seconds) adds up, short enough to forget old trouble
FIRST_BAN_S = 60.0  # a minute: a few exchange rounds without that peer cost an honest swarm little
MAX_BAN_S = 86_400.0  # a day: past this a peer that keeps misbehaving is better dropped by its operator
MAX_TRACKED = 1024  # peers with strikes or bans kept: only neighbours exchange with us, far fewer than this
# When full, a record without a ban in force goes first (the stalest): strikes from fresh keys are free to make,
# and if they pushed out the oldest record of any kind, 1,024 of them lifted a live ban. Only a table of live bans
# gives one up, the one that ends soonest.


@dataclass
class _Record:
    strikes: list[float] = field(default_factory=list)  # times of recent strikes
    bans: int = 0  # bans so far: the next lasts FIRST_BAN_S * 2**bans
    until: float = 0.0  # banned until then (caller's clock)
    reason: str = ""


class BanList:
    """Strikes and bans with expiry, per peer, bounded to `MAX_TRACKED` peers (the stalest without a ban in
    force dropped first)."""

    def __init__(self) -> None:
        self._peers: OrderedDict[str, _Record] = OrderedDict()

    def strike(self, peer_id: str, reason: str, now: float) -> bool:
        """Count a strike; True if it bans the peer now."""
        rec = self._peers.pop(peer_id, None) or _Record()
        self._peers[peer_id] = rec  # most recently touched last
        if len(self._peers) > MAX_TRACKED:
            self._evict(now)
        rec = self._peers.get(peer_id)
        if rec is None:  # a table of live bans keeps them, and this striker goes untracked
            return False
        rec.strikes = [t for t in rec.strikes if now - t < STRIKE_WINDOW_S] + [now]
        if len(rec.strikes) < BAN_AFTER or now < rec.until:
            return False
        rec.until = now + min(MAX_BAN_S, FIRST_BAN_S * 2 ** rec.bans)
        rec.bans += 1
        rec.strikes = []
        rec.reason = f"{reason} ({BAN_AFTER} times within {STRIKE_WINDOW_S:.0f}s)"
        return True

    def _evict(self, now: float) -> None:
        unbanned = next((p for p, r in self._peers.items() if now >= r.until), None)
        if unbanned is not None:
            del self._peers[unbanned]
        else:
            del self._peers[min(self._peers, key=lambda p: self._peers[p].until)]

    def banned(self, peer_id: str, now: float) -> str | None:
        """Why `peer_id` is banned now, or None."""
        rec = self._peers.get(peer_id)
        if rec is None or now >= rec.until:
            return None
        return f"banned for {rec.until - now:.0f}s more: {rec.reason}"

    def active(self, now: float) -> list[tuple[str, float, str]]:
        """(peer, seconds left, reason) of every ban in force."""
        return [(p, r.until - now, r.reason) for p, r in self._peers.items() if now < r.until]

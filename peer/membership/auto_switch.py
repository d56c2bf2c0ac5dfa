"""When `[membership] views = "auto"` leaves the full view for partial views: the decision alone, no I/O.

The daemon's `AutoView` (peer/membership/auto_view.py) asks `AutoSwitch` each round how big the swarm is
as far as the full view knows it, and tells it of every partial-view message an authenticated peer sends.
It switches once, for good, when either says so. See docs/design.md, "Auto views".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

AUTO_SWITCH_PEERS = 16
"""The swarm size (us and the peers we know) at which "auto" switches to partial views: the largest at which the
full view was measured to work. `peer bench discovery --trials 1 --timeout 90` with `views = "full"`
(docs/benchmarks.md, 2026-11-28): 8 daemons all connected in 4.8 s, 16 in 12.2 s, 20 and 24 not within 90 s;
partial views connected 14, 16 and 32 daemons within seconds (32 in 11 s, 5-12 sessions each instead of 31).
Every test swarm on the full view is smaller (at most 14), so "auto" keeps their behaviour."""


@dataclass
class AutoSwitch:
    """Full view until `threshold` members are known or a peer speaks partial views; then partial, once.

    One-way on purpose: partial views forget the peers they do not use, so a switched daemon no longer
    counts the swarm and could not tell when to switch back; and partial views were measured to work for
    swarms as small as 14, so a swarm that shrinks after the switch loses nothing by staying partial."""

    threshold: int = AUTO_SWITCH_PEERS
    possible: bool = True  # False: partial views cannot run with this config (a fixed [topology] kind)
    switched_at: float | None = None  # wall clock
    reason: str = ""

    @property
    def partial(self) -> bool:
        return self.switched_at is not None

    def size(self, members: int, now: float) -> bool:
        """The full view knows `members` (us included). True: switch now."""
        if members >= self.threshold:
            return self._switch(f"{members} peers known, at least {self.threshold}", now)
        return False

    def view_message(self, sender: str, now: float) -> bool:
        """An authenticated peer sent a partial-view message: it runs partial views, so we switch too (the
        message is then handled, and our answer keeps it from timing out). True: switch now."""
        return self._switch(f"a partial-view message from {sender[:8]}", now)

    def _switch(self, reason: str, now: float) -> bool:
        if self.partial or not self.possible:
            return False
        self.switched_at, self.reason = now, reason
        return True

    def describe(self, members: int) -> str:
        """What `peer status` says of the mode in effect."""
        if not self.possible:
            return "auto (full: partial views cannot run with this [topology]; never switches)"
        if self.switched_at is None:
            return f"auto (full, {members} of {self.threshold} peers known; switches at {self.threshold})"
        return f"auto (partial since {_utc(self.switched_at)}: {self.reason})"


def _utc(t: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))

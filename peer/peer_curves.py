"""Other peers' loss and accuracy curves, from the training figures their signed topology records carry
(protocol/schema/training.py), for `peer status` and the dashboard (docs/design.md, "Dashboard").

A record arrives every `[topology] record_interval` from each peer we hear of; a point is added only when
its figures moved to a newer step, at the time we received it (our clock: a peer's own timestamps are not
trusted). Each curve is a `TrainingCurve` (the same halving buffer as our own trainer's), and the curves
are bounded in number: when they are full, a newcomer takes the place of the peer not heard from longest,
and only if that one has been silent for RECORD_TTL (it left the view); otherwise the newcomer is not drawn.
Replacing a live curve instead would, in a swarm of more training peers than curves, drop and restart
every curve each round. A hostile peer can only put
range-checked values into its own curve, since records are signed by their owner.
"""

from __future__ import annotations

import time
from collections.abc import Container

from peer.topology.records import RECORD_TTL
from peer.training_curve import TrainingCurve
from protocol.schema.training import TrainingFigures

# Peers whose curves a daemon holds: a chart of more lines is unreadable, and 64 curves of PEER_CURVE_POINTS
# add ~120 KB to `peer status --json` at most. The dashboard shows fewer still (peer/dashboard/feed.py).
MAX_PEER_CURVES = 64
# Points of each of their curves: a quarter of our own trainer's (peer/training_curve.py's MAX_POINTS), as
# they are drawn many to a chart; the whole run is still kept, at a coarser resolution.
PEER_CURVE_POINTS = 60


class _Heard:
    """One peer's latest figures, when we last heard them (wall clock) and its curve."""

    __slots__ = ("figures", "heard", "curve")

    def __init__(self, figures: TrainingFigures, heard: float, max_points: int):
        self.figures, self.heard = figures, heard
        self.curve = TrainingCurve(max_points)


class PeerCurves:
    """At most `max_peers` peers' curves; one silent for `stale_after` seconds makes room for a newcomer."""

    def __init__(self, max_peers: int = MAX_PEER_CURVES, max_points: int = PEER_CURVE_POINTS,
                 stale_after: float = RECORD_TTL):
        if max_peers < 1:
            raise ValueError("PeerCurves needs room for at least 1 peer")
        self.max_peers, self.max_points, self.stale_after = max_peers, max_points, stale_after
        self._peers: dict[str, _Heard] = {}  # least recently heard first
        self.dropped = 0  # silent peers' curves dropped for a newcomer
        self.refused = 0  # figures of newcomers not drawn: every curve was live

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def heard(self, peer_id: str, figures: TrainingFigures | None, now: float | None = None) -> None:
        """A record of `peer_id` carrying `figures` was accepted: a point if its step is newer; a step
        below the last one starts a new curve (the peer restarted its run without its checkpoint)."""
        if figures is None:
            return
        now = time.time() if now is None else now
        if peer_id not in self._peers and len(self._peers) >= self.max_peers:
            oldest = next(iter(self._peers))
            if now - self._peers[oldest].heard < self.stale_after:
                self.refused += 1
                return
            del self._peers[oldest]
            self.dropped += 1
        h = self._peers.pop(peer_id, None)  # re-inserted last: the most recently heard
        if h is None or figures.step < h.figures.step:
            h = _Heard(figures, now, self.max_points)
            h.curve.add(now, figures.loss, figures.accuracy)
        elif figures.step > h.figures.step:
            h.curve.add(now, figures.loss, figures.accuracy)
        h.figures, h.heard = figures, now
        self._peers[peer_id] = h

    def retain(self, peer_ids: Container[str]) -> None:
        """Release the curves of peers not in `peer_ids` (those whose records the daemon forgot)."""
        for pid in [p for p in self._peers if p not in peer_ids]:
            del self._peers[pid]

    def status(self, now: float | None = None) -> dict:
        """The curves, the most recently heard first: each peer's latest figures, how long ago they came
        and its [time, loss, accuracy] points (as `TrainingCurve.status`)."""
        now = time.time() if now is None else now
        peers = {}
        for pid, h in reversed(self._peers.items()):
            f = h.figures
            peers[pid] = {"step": f.step, "loss": f.loss, "accuracy": f.accuracy, "samples_per_s": f.samples_per_s,
                          "heard_s": round(max(0.0, now - h.heard), 1), "curve": h.curve.status()}
        return {"total": len(peers), "max_peers": self.max_peers, "dropped": self.dropped, "refused": self.refused,
                "peers": peers}

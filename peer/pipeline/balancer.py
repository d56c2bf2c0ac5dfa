"""Which peer of a stage gets a driver's next call: the one expected to finish it first.

A virtual-clock weighted round robin, as SWARM's balancer: every peer of a stage has a virtual time, the
moment this driver's work already sent to it should be done. A call goes to the peer with the earliest
expected finish, max(its virtual time, now + the work others queued there) + the call's cost at its speed,
and advances that peer's virtual time by the cost. Speeds are this driver's own measurements (seconds per
sample of whole calls: queue, wire and compute, what the driver actually waits for), seeded from the peer's
announced throughput; a peer never measured is assumed as fast as the fastest we know, so new peers are tried
early. Over many calls each peer gets a share of the work proportional to its speed.

A failed call (error, refusal, deadline) makes the driver avoid that peer for a while: `first_ban` seconds,
doubling with every further failure in a row up to `max_ban`; one success forgives it. Calls that were already
under way when the peer failed fail with it (a dead peer fails all of them at once): they are the same failure
and do not double the interval again. A peer that refuses a call as busy is not failing: it is avoided only
for about one call's time there (at most `first_ban`), and its failures in a row stay as they were. The clock
is the caller's (trio.current_time in the driver), so tests drive it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from peer.pipeline.directory import StagePeer

EWMA = 0.3  # weight of the newest measurement: a slowed peer is noticed within a few calls
DEFAULT_SECONDS_PER_SAMPLE = 0.01  # a first guess for a stage nobody measured yet (100 samples/s)
MAX_TRACKED = 1024  # peers one driver keeps estimates of; the ones unseen longest are forgotten first


@dataclass
class PeerEstimate:
    seconds_per_sample: float | None = None  # measured by us (None: not yet)
    virtual_time: float = 0.0
    outstanding: int = 0  # our calls sent to it and not yet finished
    last_done: float = float("-inf")  # when our last call there ended
    calls: int = 0  # calls finished (ok or not), for the share report
    failures_in_row: int = 0
    failed_at: float = float("-inf")  # when the last failure counted in `failures_in_row` happened
    avoid_until: float = 0.0
    last_failure: str = ""


class Balancer:
    def __init__(self, *, first_ban: float, max_ban: float, rng: random.Random | None = None):
        self.first_ban = first_ban
        self.max_ban = max_ban
        self.peers: dict[str, PeerEstimate] = {}
        self.rng = rng or random.Random()

    def _get(self, peer_id: str) -> PeerEstimate:
        est = self.peers.pop(peer_id, None) or PeerEstimate()
        self.peers[peer_id] = est  # most recently used last
        while len(self.peers) > MAX_TRACKED:
            del self.peers[next(iter(self.peers))]
        return est

    def avoided(self, peer_id: str, now: float) -> str | None:
        est = self.peers.get(peer_id)
        if est is None or now >= est.avoid_until:
            return None
        return f"avoided for {est.avoid_until - now:.1f}s more: {est.last_failure}"

    def _speed(self, peer: StagePeer, est: PeerEstimate, fastest: float) -> float:
        if est.seconds_per_sample is not None:
            return est.seconds_per_sample
        if peer.samples_per_s > 0:
            return 1.0 / peer.samples_per_s
        return fastest  # never measured: optimistic, so it is tried early

    def choose(self, peers: list[StagePeer], batch: int, now: float, *, exclude: set[str] = frozenset()) -> str | None:
        """The peer to send a call of `batch` samples to, or None if every live peer is avoided or excluded.
        Marks the call as outstanding there (finish it with `done`)."""
        usable = [p for p in peers if p.peer_id not in exclude and self.avoided(p.peer_id, now) is None]
        if not usable:
            return None
        known = [e.seconds_per_sample for p in usable if (e := self.peers.get(p.peer_id)) and e.seconds_per_sample]
        known += [1.0 / p.samples_per_s for p in usable if p.samples_per_s > 0]
        fastest = min(known, default=DEFAULT_SECONDS_PER_SAMPLE)
        best, best_finish = None, 0.0
        for p in self.rng.sample(usable, len(usable)):  # random order: ties go to a random peer
            est = self._get(p.peer_id)
            spp = self._speed(p, est, fastest)
            others = max(0, p.queue - est.outstanding)  # work other drivers queued there, as it announced
            start = max(est.virtual_time, now + others * spp * batch)
            cost = spp * batch
            if best is None or start + cost < best_finish:
                best, best_finish = p.peer_id, start + cost
        est = self.peers[best]
        est.virtual_time = best_finish
        est.outstanding += 1
        return best

    def done(self, peer_id: str, batch: int, seconds: float, now: float, *, failure: str | None = None,
             busy: bool = False) -> None:
        """A call to `peer_id` ended after `seconds`: measured on success, avoided for a while on failure
        (briefly if it only refused the call as `busy`)."""
        est = self._get(peer_id)
        est.outstanding = max(0, est.outstanding - 1)
        est.calls += 1
        # A peer serves one call at a time: a call of ours queued behind our previous one there waited for it,
        # and that wait is in its virtual time already. Its own time there started when both it was sent
        # and the previous one ended.
        service = now - max(now - seconds, est.last_done)
        est.last_done = now
        if failure is None:
            spp = max(service, 1e-6) / max(batch, 1)
            est.seconds_per_sample = spp if est.seconds_per_sample is None else (
                (1 - EWMA) * est.seconds_per_sample + EWMA * spp)
            est.failures_in_row = 0
            return
        est.last_failure = failure[:200]
        if busy:  # full, not broken: a slot frees within about one call there
            pause = min(self.first_ban, self.expected_seconds(peer_id, None, batch))
            est.avoid_until = max(est.avoid_until, now + pause)
            return
        if now - seconds >= est.failed_at or est.failures_in_row == 0:  # sent after the last failure: a new one
            est.failures_in_row += 1
            est.failed_at = now
        est.avoid_until = max(est.avoid_until,
                              now + min(self.max_ban, self.first_ban * 2 ** (est.failures_in_row - 1)))
        est.virtual_time = now  # its queue of our work is gone with the failure

    def expected_seconds(self, peer_id: str, peer: StagePeer | None, batch: int) -> float:
        """How long a call of `batch` samples should take there: for the call's deadline."""
        est = self.peers.get(peer_id)
        if est is not None and est.seconds_per_sample is not None:
            return est.seconds_per_sample * batch
        if peer is not None and peer.samples_per_s > 0:
            return batch / peer.samples_per_s
        return DEFAULT_SECONDS_PER_SAMPLE * batch

    def report(self, now: float) -> list[dict]:
        return [{"peer_id": pid, "samples_per_s": round(1.0 / e.seconds_per_sample, 2) if e.seconds_per_sample else None,
                 "calls": e.calls, "outstanding": e.outstanding, "avoided": self.avoided(pid, now)}
                for pid, e in self.peers.items()]

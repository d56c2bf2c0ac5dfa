"""Our clip radius for an exchange, and what an exchange's distance says about the partner
(docs/design.md, "Robust averaging").

The radius bounds how far one partner can move us, relative to how far our honest partners are from us.
For each group we keep, per recent partner, its distances ||b - a|| at committed exchanges with us (before
any clip): the largest of each PEAK_BUCKET_S, for PEAK_WINDOW_S, and the latest. The radius we announce for
an exchange of that group with partner p is

    r(p)      = min(ceiling, robust(p))
    ceiling   = max_update_ratio * ||x||            (none for a model of all zeros: see below)
    robust(p) = max(RADIUS_MARGIN * d_ref(p), RADIUS_FLOOR * ||x||)
    d_ref(p)  = over our *other* partners, each one's largest distance of the last PEAK_WINDOW_S (or its
                latest, within RADIUS_MEMORY_S); the largest of those once the farthest floor(β n) of the
                n are set aside (β = [gossip] byzantine_share, the share of partners assumed to lie)

and none (inf) where there is nothing to judge by. This is the self-centred clipping of ClippedGossip (He,
Karimireddy and Jaggi, 2022) with an adaptive radius in the manner of CS+-RG (Gaucher, Dieuleveut and
Hendrikx): the far tail that may be Byzantine sets no radius. Why p's own distances are left out: a liar
that stays far would otherwise set its own radius. Why per partner, not a window of exchanges: a peer that
exchanges with us often would fill the window. Why each partner's peak of the last minute, not its latest
distance: honest distances swing with the phase of training (in local steps a partner that has just taken
its outer step is far, one that has not is near; independently initialised models start far apart), and
the latest of each caught a trough as often as not (in the training tests honest partners were struck
and banned). Why the margin: at one moment honest partners' distances differ (one just averaged with us,
another not for a while); in a simulation of AD-PSGD with heterogeneous data (8 and 16 peers, degree 4;
3 peers fully connected) an honest distance exceeded the largest of the others' by at most 2.7x, and 1.9x
without heterogeneity. The floor keeps a swarm that agrees to rounding (a consensus run) from clipping
the rounding.

Both sides apply the smaller of the two radii (bounds.py), so only each side's own rule matters for what
it accepts: a partner that announces more gains nothing. A model of all zeros (a freshly initialised
linear model; a joiner normally downloads first) has no norm to bound by: it announces no ceiling, and
its exchanges are judged by its partner's radius, which the swarm's distances set. With no other partner
to compare (a pair, or our first exchange) only the ceiling applies, as before this rule.

Evidence (`judge`): an exchange is a strike against the partner when its distance says more than an honest
peer's could. A distance that overflows is one, and so are values pointing away from ours (bounds.opposed:
nothing of them was applied, on either side; no honest model of the task does that). Past STRIKE_EXCESS
radii a distance counts within a *run* (consecutive exchanges that far): for its first RUN_GRACE exchanges
and RUN_GRACE_S nothing in it is struck (past FAR_EXCESS radii, 32x the largest recent distance of our other
partners, the RUN_GRACE exchanges only: no honest peer stays that far from a swarm whose other members are
within a radius of us, but one a liar pushed away gets there, and its honest partners pull it back; and
past the ceiling too, max_update_ratio times our norm, no grace at all: no honest peer is that far; early
in training, peers at different progress drift apart for seconds; an honest peer far at first is pulled in
by the clipped exchanges); after that each exchange is, unless the run has closed in by
at least half of what its updates closed (each moves both sides w * s * distance towards each other). A
liar that keeps its distance, or swings between far and farther, is struck on every exchange once its run
is RUN_GRACE_S old, and banned BAN_AFTER exchanges later (peer/averaging/bans.py). Within STRIKE_EXCESS radii nothing is a strike, and
neither is a run that closes in as an honest one would: a liar there (one answering with a shrunk copy of
our model closes in just so, since we move towards it) moves us by at most w times our radius per exchange
(the clip), and distances alone cannot tell it from an honest peer that far; our honest partners pull us
back as much each exchange. Strikes are judged against the robust radius when there is one (our swarm's
distances), so a fresh model far from a trained partner does not get that partner struck.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from peer.averaging.shares import MoveShares

RADIUS_MARGIN = 2.0  # times the reference: above the 1.9-2.7x honest spread simulated (docstring); with w <= 1/2, margin * w <= 1 keeps a liar's pushes from feeding the radius without end
RADIUS_FLOOR = 1e-3  # of our norm: raw float32 rounding is ~1e-7 of it, float16's ~5e-4; a liar's reach below it is 1/3000 of the norm
PEAK_WINDOW_S = 60.0  # a partner's reference is its largest distance this recent: a local-steps round, a start's independent models
PEAK_BUCKET_S = 10.0  # kept as the largest of each bucket this long: six numbers a partner, not every exchange
RADIUS_MEMORY_S = 300.0  # ... or, older, its latest distance this recent (minutes: a partner that averages once a round)
STRIKE_EXCESS = 4.0  # radii: past them a run of exchanges that does not close in is struck (8x the reference)
FAR_EXCESS = 16.0  # radii past which every exchange is a strike: 32x the largest recent distance of our other partners
RUN_GRACE = 2  # exchanges of a run past STRIKE_EXCESS never struck for not closing in: honest distances jump around,
RUN_GRACE_S = 60.0  # nor in its first minute: peers at different progress early in training drift apart for seconds
MAX_PARTNERS = 64  # partners remembered per group: above max_degree (8) with room for churn
NO_DEFENCE_ENV = "PEERTRAIN_BENCH_NO_DEFENCE"  # "1": announce no radius and never clip (`peer bench average --no-defence` only)


@dataclass(frozen=True)
class Radius:
    """The radius we announce for one exchange, the part of it our other partners set (inf: none), and the
    ceiling of our norm (inf: a model of zeros)."""

    announced: float
    robust: float
    ceiling: float = math.inf


@dataclass
class _Run:
    """Consecutive exchanges with one partner past STRIKE_EXCESS radii."""

    first: float  # the distance it started at
    at: float  # when
    closed: float = 0.0  # what the updates since closed of the pair's distance: 2 * w * s * distance each
    length: int = 0


@dataclass
class _Seen:
    """One partner of one group: its distances at committed exchanges with us (before any clip)."""

    latest: float
    at: float  # when (the caller's clock)
    peaks: deque = field(default_factory=deque)  # [bucket start, largest distance in it], oldest first
    run: _Run | None = None

    def observe(self, distance: float, now: float) -> None:
        self.latest, self.at = distance, now
        if self.peaks and now - self.peaks[-1][0] < PEAK_BUCKET_S:
            self.peaks[-1][1] = max(self.peaks[-1][1], distance)
        else:
            self.peaks.append([now, distance])
        while self.peaks and now - self.peaks[0][0] >= PEAK_WINDOW_S:
            self.peaks.popleft()

    def reference(self, now: float) -> float | None:
        """Its largest distance within PEAK_WINDOW_S, or its latest within RADIUS_MEMORY_S; None: stale."""
        if now - self.at >= RADIUS_MEMORY_S:
            return None
        return max([self.latest] + [m for t, m in self.peaks if now - t < PEAK_WINDOW_S])


class Radii:
    """Per group, our recent partners' distances; the radius for an exchange; the evidence in its distance."""

    def __init__(self, *, max_ratio: float, byzantine_share: float):
        self.max_ratio = max_ratio  # [gossip] max_update_ratio: the ceiling, times our norm
        self.byzantine_share = byzantine_share  # [gossip] byzantine_share: β
        self._seen: dict[str, OrderedDict[str, _Seen]] = {}
        self.shares = MoveShares()  # how far each partner moved us lately: the bound over time (shares.py)

    def radius(self, group: str, peer: str, own_norm: float, now: float) -> Radius:
        """The radius to announce for an exchange of `group` with `peer`, our norm being `own_norm`."""
        if not math.isfinite(own_norm):
            return Radius(0.0, 0.0)  # our own values overflow: take nothing (the distance would too)
        ceiling = self.max_ratio * own_norm if own_norm > 0.0 else math.inf
        ref = self.reference(group, peer, now)
        robust = math.inf if ref is None else max(RADIUS_MARGIN * ref, RADIUS_FLOOR * own_norm)
        return Radius(min(ceiling, robust), robust, ceiling)

    def reference(self, group: str, peer: str, now: float) -> float | None:
        """d_ref: the largest recent distance of our partners other than `peer` (each its largest of the last
        PEAK_WINDOW_S) once the farthest floor(β n) are set aside; None if none is known (distances of 0 say
        nothing: equal models)."""
        seen = self._seen.get(group, {})
        others = sorted(d for p, s in seen.items() if p != peer and (d := s.reference(now)) is not None and d > 0.0)
        if not others:
            return None
        return others[len(others) - 1 - int(self.byzantine_share * len(others))]

    def judge(self, group: str, peer: str, *, distance: float, radius: Radius, moved: float, now: float,
              opposed: bool = False) -> str | None:
        """Remember `peer`'s distance at a committed exchange of `group` (`moved`: w * s); the reason for a
        strike if the distance, or values pointing away from ours (`opposed`: bounds.opposed), are evidence
        against it, else None (the module docstring)."""
        seen = self._seen.setdefault(group, OrderedDict())
        rec = seen.pop(peer, None)
        if rec is not None and now - rec.at >= RADIUS_MEMORY_S:
            rec = None
        if not math.isfinite(distance):
            if rec is not None:
                seen[peer] = rec
            return "sent values whose distance from ours overflows"
        if rec is None:
            rec = _Seen(distance, now)
        rec.observe(distance, now)
        self.shares.record(group, peer, moved * distance, now)
        seen[peer] = rec  # most recently touched last
        while len(seen) > MAX_PARTNERS:
            seen.popitem(last=False)
        if opposed:  # nothing of it was applied (bounds.clip_scale); no honest model of the task does this
            rec.run = None
            return "sent values pointing away from ours"
        base = radius.robust if math.isfinite(radius.robust) else radius.announced  # the swarm's, if known
        excess = distance / base if math.isfinite(base) and base > 0.0 else 0.0  # 0: nothing to judge by
        if excess <= STRIKE_EXCESS:
            rec.run = None
            return None
        run = rec.run = rec.run or _Run(first=distance, at=now)
        run.length += 1
        strike = None
        graced = excess > FAR_EXCESS or now - run.at >= RUN_GRACE_S  # that far, no minute's grace
        if excess > FAR_EXCESS and distance > radius.ceiling:
            strike = f"sent values {excess:.3g} radii and more than max_update_ratio times our norm from ours"
        elif run.length > RUN_GRACE and graced and distance > run.first - run.closed / 2:
            strike = (f"sent values {excess:.3g} radii from ours, {run.length} exchanges running, "
                      "not closing in as its updates would")
        run.closed += 2.0 * moved * distance
        return strike

    def forget(self, group: str) -> None:
        """A group we no longer share: its partners' distances go with it."""
        self._seen.pop(group, None)
        self.shares.forget(group)

"""Our clip radius for an exchange, and what an exchange's distance says about the partner
(docs/design.md, "Robust averaging").

The radius bounds how far one partner can move us, relative to how far our honest partners are from us.
For each group we keep every recent partner's distance ||b - a|| at its last committed exchange with us
(before any clip). The radius we announce for an exchange of that group with partner p is

    r(p)      = min(ceiling, robust(p))
    ceiling   = max_update_ratio * ||x||            (none for a model of all zeros: see below)
    robust(p) = max(RADIUS_MARGIN * d_ref(p), RADIUS_FLOOR * ||x||)
    d_ref(p)  = the largest distance of our *other* partners once the farthest floor(β n) of those n are
                set aside (β = [gossip] byzantine_share, the share of partners assumed to lie)

and none (inf) where there is nothing to judge by. This is the self-centred clipping of ClippedGossip (He,
Karimireddy and Jaggi, 2022) with an adaptive radius in the manner of CS+-RG (Gaucher, Dieuleveut and
Hendrikx): the far tail that may be Byzantine sets no radius. Why p's own distance is left out: a liar that
stays far would otherwise set its own radius. Why the latest distance per partner, not per exchange: a
peer that exchanges with us often would fill a window of exchanges with its own values. Why the margin:
at one moment honest partners' distances differ (one just averaged with us, another not for a while); in
a simulation of AD-PSGD with heterogeneous data (8 and 16 peers, degree 4; 3 peers fully connected) an
honest distance exceeded the largest of the others' by at most 2.7x, and 1.9x without heterogeneity. The
floor keeps a swarm that agrees to rounding (a consensus run) from clipping the rounding.

Both sides apply the smaller of the two radii (bounds.py), so only each side's own rule matters for what
it accepts: a partner that announces more gains nothing. A model of all zeros (a freshly initialised
linear model; a joiner normally downloads first) has no norm to bound by: it announces no ceiling, and
its exchanges are judged by its partner's radius, which the swarm's distances set. With no other partner
to compare (a pair, or our first exchange) only the ceiling applies, as before this rule.

Evidence (`judge`): an exchange is a strike against the partner when its distance says more than an honest
peer's could. A distance that overflows is one, and so is one past FAR_EXCESS radii: no honest peer is that
far from a swarm whose other members are within a radius of us (a joiner downloads first; a fresh model of
zeros, which has no radius of its own, is judged by its partners', and its own exchanges set them). Past
STRIKE_EXCESS radii a distance counts within a *run* (consecutive exchanges past our radius): the first of a
run is no strike (an honest peer far at first is pulled in by the clipped exchanges), each later one is,
unless it has come closer than the run's smallest distance by at least half of what each update since
closed (both sides move w * s * distance towards each other). A liar that keeps its distance, or swings
between far and farther, is struck every exchange and banned after BAN_AFTER (peer/averaging/bans.py).
Within STRIKE_EXCESS radii nothing is a strike, and neither is a run that closes in as an honest one
would: a liar there (one answering with a shrunk copy of our model closes in just so, since we move towards
it) moves us by at most w times our radius per exchange (the clip), and distances alone cannot tell it from
an honest peer that far; our honest partners pull us back as much each exchange. Strikes are judged against
the robust radius when there is one (our swarm's distances), so a fresh model far from a trained partner
does not get that partner struck.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

RADIUS_MARGIN = 2.0  # times the reference distance: above the 1.9-2.7x honest spread simulated (docstring)
RADIUS_FLOOR = 1e-3  # of our norm: raw float32 rounding is ~1e-7 of it, float16's ~5e-4; a liar's reach below it is 1/3000 of the norm
STRIKE_EXCESS = 4.0  # radii past which a run that does not close in is a strike: 8x the reference, 3x the largest honest spread simulated
FAR_EXCESS = 16.0  # radii past which every exchange is a strike: 32x our other partners' distance, 12x the largest honest spread simulated
RADIUS_MEMORY_S = 300.0  # seconds a partner's distance stays a reference (minutes: many exchanges; stale ones describe another phase of training)
MAX_PARTNERS = 64  # partners remembered per group: above max_degree (8) with room for churn
NO_DEFENCE_ENV = "PEERTRAIN_BENCH_NO_DEFENCE"  # "1": announce no radius and never clip (`peer bench average --no-defence` only)


@dataclass(frozen=True)
class Radius:
    """The radius we announce for one exchange, and the part of it our other partners set (inf: none)."""

    announced: float
    robust: float


@dataclass
class _Seen:
    distance: float  # ||b - a|| at its last committed exchange with us, before any clip
    at: float  # when (the caller's clock)
    # in a run of exchanges past our radius: the distance its next one must be under to count as coming
    # closer (the run's smallest distance, less half of what each update since closed of it); None: no run
    bar: float | None


class Radii:
    """Per group, our recent partners' distances; the radius for an exchange; the evidence in its distance."""

    def __init__(self, *, max_ratio: float, byzantine_share: float):
        self.max_ratio = max_ratio  # [gossip] max_update_ratio: the ceiling, times our norm
        self.byzantine_share = byzantine_share  # [gossip] byzantine_share: β
        self._seen: dict[str, OrderedDict[str, _Seen]] = {}

    def radius(self, group: str, peer: str, own_norm: float, now: float) -> Radius:
        """The radius to announce for an exchange of `group` with `peer`, our norm being `own_norm`."""
        if not math.isfinite(own_norm):
            return Radius(0.0, 0.0)  # our own values overflow: take nothing (the distance would too)
        ceiling = self.max_ratio * own_norm if own_norm > 0.0 else math.inf
        ref = self.reference(group, peer, now)
        robust = math.inf if ref is None else max(RADIUS_MARGIN * ref, RADIUS_FLOOR * own_norm)
        return Radius(min(ceiling, robust), robust)

    def reference(self, group: str, peer: str, now: float) -> float | None:
        """d_ref: the largest recent distance of our partners other than `peer` once the farthest
        floor(β n) are set aside; None if none is known (distances of 0 say nothing: equal models)."""
        seen = self._seen.get(group, {})
        others = sorted(s.distance for p, s in seen.items()
                        if p != peer and s.distance > 0.0 and now - s.at < RADIUS_MEMORY_S)
        if not others:
            return None
        return others[len(others) - 1 - int(self.byzantine_share * len(others))]

    def judge(self, group: str, peer: str, *, distance: float, radius: Radius, moved: float, now: float) -> str | None:
        """Remember `peer`'s distance at a committed exchange of `group` (`moved`: w * s); the reason for a
        strike if the distance is evidence against it, else None (the module docstring)."""
        seen = self._seen.setdefault(group, OrderedDict())
        prev = seen.pop(peer, None)
        if prev is not None and now - prev.at >= RADIUS_MEMORY_S:
            prev = None
        if not math.isfinite(distance):
            if prev is not None:
                seen[peer] = prev
            return "sent values whose distance from ours overflows"
        base = radius.robust if math.isfinite(radius.robust) else radius.announced  # the swarm's, if known
        excess = distance / base if math.isfinite(base) and base > 0.0 else 0.0  # 0: nothing to judge by
        bar = prev.bar if prev is not None else None
        strike = None
        if excess <= 1.0:
            bar = None  # within our radius: a run of clipped exchanges (if any) ends
        else:
            if excess > FAR_EXCESS:
                strike = f"sent values {excess:.3g} radii from ours"
            elif bar is not None and excess > STRIKE_EXCESS and distance > bar:
                strike = f"sent values {excess:.3g} radii from ours, no closer than its run of clipped exchanges"
            bar = distance * (1.0 - moved) if bar is None else min(bar, distance) * (1.0 - moved)
        seen[peer] = _Seen(distance, now, bar)  # most recently touched last
        while len(seen) > MAX_PARTNERS:
            seen.popitem(last=False)
        return strike

    def forget(self, group: str) -> None:
        """A group we no longer share: its partners' distances go with it."""
        self._seen.pop(group, None)

"""How far each partner has moved us lately, and which one has moved us more than its share
(docs/design.md, "Robust averaging": a budget per partner over time).

The radius (radius.py) bounds one exchange. A liar that stays inside it can still steer us by exchanging
often: the dissensus attack (He et al. 2022) sends x - e(m - x), close to our own model x but away from our
other partners' mean m, and starts every one of its exchanges with its one victim, where an honest
neighbour spreads its exchanges over all its neighbours. Each such exchange undoes more than one honest
exchange pulls (e = 1.5 in the library), so at k times an honest partner's rate the victim drifts away and
stays there (in the byzantine test, honest peers at 69 and 83% after 1,500 steps against 95% without it).

So per group and partner we sum our own moves, w * s * ||b - a|| at each committed exchange (what it
changed of our model), over the last SHARE_WINDOW_S, and a partner whose sum is past SHARE_MARGIN times the
upper median of our other partners' sums may not average that group with us until its window drains: we
neither start an exchange with it nor serve its offers (refused as busy, no strike: an honest neighbour of
low degree also exchanges with us more often than others). The upper median, not the largest, so that a
colluder's share does not raise its ally's while they are fewer than half of our partners; partners with no
move in the window do not count; with no other partner there is nothing to compare and no bound (a pair).
Why a margin of 1.5: honest shares differ with the partners' degrees and speeds (a degree-2 neighbour starts
twice the exchanges with us that a degree-4 one does) and by chance, and an honest partner above the margin
waits until it is back under it, which slows mixing; a liar held to 1.5 times an honest partner's share
among two honest ones pushes three quarters of what they pull. In `peer bench byzantine` (dissensus, 8
peers, rewired, seeds 0-2; docs/benchmarks.md, 2026-11-29) the honest peers' mean drop at 1/8 liars was
3.41 points without the bound, 1.27 at 1.5 and 0.39 at 1; but at 1 the byzantine test's slowest honest peer
reached its target after 1,500 and 520 steps in two of four runs (ipm_10; at 1.5, 3 of 3 within 220), the
rest of the swarm done and frozen by then.

A partner closing in has a floor under its reference: SHARE_FLOOR_MOVES times its own largest move of the
window. Once our other partners have converged with us their moves shrink to nothing, and a partner still far
(an honest laggard) was past any multiple of them after one exchange, refused for the whole window, and again
after its next: `peer bench gossip`'s ring of 4 stalled at 0.045 of its start error in 1 run in 4
(docs/benchmarks.md, 2026-11-30), its laggard's offers refused by both its neighbours. An honest laggard closes
in, each exchange taking 2w of its distance (2/3 at w = 1/3), so its moves form a geometric series, at most 1.5x
its first: never past the floor. Closing in means its latest move is at most CLOSING of its largest in the
window, or it has made one move only. A partner that keeps its distance (the dissensus liar) gets its second
move of a window past the others' median, and is held after; one that alternates large and small moves to look
as if it closed in gets at most SHARE_MARGIN x SHARE_FLOOR_MOVES = 3 of its largest a window.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

SHARE_WINDOW_S = 30.0  # the window of moves summed: tens of exchanges per partner at the pace of the training tests
SHARE_BUCKET_S = 1.0  # moves are summed per bucket this long: at most 30 numbers a partner, not every exchange
SHARE_MARGIN = 1.5  # times the upper median of the others' sums (docstring: measured against 1 and none)
SHARE_FLOOR_MOVES = 2.0  # ... or, closing in, of its own largest move in the window, twice: a laggard's series <= 1.5x
CLOSING = 0.5  # its latest move at most this share of its largest in the window: closing in (a laggard's: 1/3 a move)
MAX_PARTNERS = 64  # per group, as radius.py's: above max_degree with room for churn


class MoveShares:
    """Per group, per partner: our moves of the last SHARE_WINDOW_S, in buckets."""

    def __init__(self) -> None:
        # group -> peer -> [[bucket start, sum, largest move, latest move]]
        self._moves: dict[str, OrderedDict[str, deque[list[float]]]] = {}

    def record(self, group: str, peer: str, moved: float, now: float) -> None:
        """A committed exchange of `group` with `peer` moved our model by `moved` (a norm)."""
        if not math.isfinite(moved) or moved <= 0.0:
            return
        peers = self._moves.setdefault(group, OrderedDict())
        buckets = peers.pop(peer, None) or deque()
        if buckets and now - buckets[-1][0] < SHARE_BUCKET_S:
            buckets[-1][1] += moved
            buckets[-1][2] = max(buckets[-1][2], moved)
            buckets[-1][3] = moved
        else:
            buckets.append([now, moved, moved, moved])
        _drain(buckets, now)
        peers[peer] = buckets  # most recently touched last
        while len(peers) > MAX_PARTNERS:
            peers.popitem(last=False)

    def share(self, group: str, peer: str, now: float) -> float:
        """How far `peer` moved us in the window."""
        return sum(b[1] for b in self._window(group, peer, now))

    def floor(self, group: str, peer: str, now: float) -> float:
        """SHARE_FLOOR_MOVES x `peer`'s largest move of us in the window if it is closing in (its only move, or
        its latest at most CLOSING of its largest), else 0 (module docstring)."""
        buckets = self._window(group, peer, now)
        if not buckets:
            return 0.0
        largest = max(b[2] for b in buckets)
        one_move = len(buckets) == 1 and buckets[0][1] == buckets[0][2]
        latest = buckets[-1][3]
        return SHARE_FLOOR_MOVES * largest if one_move or latest <= CLOSING * largest else 0.0

    def _window(self, group: str, peer: str, now: float) -> deque[list[float]]:
        peers = self._moves.get(group)
        buckets = peers.get(peer) if peers is not None else None
        if not buckets:
            return deque()
        _drain(buckets, now)
        return buckets

    def over(self, group: str, peer: str, now: float) -> str | None:
        """Why `peer` may not average `group` with us now (it moved us past its share), or None."""
        mine = self.share(group, peer, now)
        if mine <= 0.0:
            return None
        partners = list(self._moves.get(group) or ())
        others = sorted(s for p in partners if p != peer and (s := self.share(group, p, now)) > 0.0)
        if not others:
            return None
        median = others[len(others) // 2]
        ref = max(median, self.floor(group, peer, now))
        if mine <= SHARE_MARGIN * ref:
            return None
        return (f"moved our {group!r} {mine / median:.3g}x as far as our other partners' median in the last "
                f"{SHARE_WINDOW_S:g} s (at most {SHARE_MARGIN:g}x)")

    def forget(self, group: str) -> None:
        self._moves.pop(group, None)


def _drain(buckets: deque[list[float]], now: float) -> None:
    while buckets and now - buckets[0][0] >= SHARE_WINDOW_S:
        buckets.popleft()

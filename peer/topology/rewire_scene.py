"""What the rewiring planner reads off its view of the graph: a `Scene` of the view's figures that every
candidate evaluation reuses (link times, a peer's onward time, the noise margin, the score of a
hypothetical graph), the candidates for a new link, and the orders the planner tries them in.

Its own module because it is how moves are judged, not which moves exist: those, and the rules they
follow, are `peer.topology.rewire`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from peer.topology.graph import GraphView, LinkEstimate
from peer.topology.mixing import graph_spectral_gap, predicted_round_time

if TYPE_CHECKING:  # the planner's knobs: rewire.py imports this module
    from peer.topology.rewire import RewireConfig


@dataclass(frozen=True)
class Scene:
    """Everything about the current view that every candidate evaluation reuses."""

    view: GraphView
    me: str
    cfg: RewireConfig
    round_time: float
    typical_time: float  # median predicted time of the view's edges (0 with none)
    gap: float
    components: int
    _edge_times: dict[tuple[str, str | None], list[float]] = field(default_factory=dict, compare=False)

    def time(self, link: LinkEstimate) -> float:
        c = self.cfg
        return link.transfer_time(c.shard_bytes, c.default_bandwidth_bps, c.default_rtt_s)

    @property
    def straggler_time(self) -> float:
        """Link time above which a link is slow: `straggler_factor` times the view's median edge (0 with
        no edges). Above min_degree no add may be this slow, and relink looks for peers behind it."""
        return self.cfg.straggler_factor * self.typical_time

    def onward(self, node: str, exclude: str | None = None) -> float:
        """Median predicted time of `node`'s edges (but the one to `exclude`): how fast what reaches it
        travels on. A peer behind a slow link of its own passes things on slowly whatever edge they
        came by, so an edge to it is worth less than an equally fast-looking edge to a well-linked
        peer; two slow hosts linked to each other mix with the swarm only through their other edges.
        A peer with no other edge passes nothing on: inf (so an unlinked newcomer is never taken for
        the best-linked peer; it links itself, with its own urgent adds)."""
        ts = self._times_of(node, exclude)
        return float(np.median(ts)) if ts else math.inf

    def fastest(self, node: str, exclude: str | None = None) -> float:
        """Predicted time of `node`'s fastest edge (but the one to `exclude`; inf with none). A peer
        whose fastest edge is slow sits behind a slow link of its own; a well-linked peer with a few
        slow neighbours has a slow median edge, but not a slow fastest one."""
        return min(self._times_of(node, exclude), default=math.inf)

    def _times_of(self, node: str, exclude: str | None) -> list[float]:
        """Predicted times of `node`'s edges but the one to `exclude` (memoized: the view never changes)."""
        key = (node, exclude)
        if key not in self._edge_times:
            self._edge_times[key] = [self.time(self.view.link(node, m))
                                     for m in self.view.neighbours(node) if m != exclude]
        return self._edge_times[key]

    def margin(self, link: LinkEstimate) -> float:
        """Factor by which `link`'s time may be off, at the configured confidence (1: exact)."""
        return math.exp(self.cfg.confidence * link.log_se)

    def score(self, after: GraphView) -> tuple[float, float] | None:
        """(round time, gap) of a hypothetical view, or None if it splits the graph."""
        if after.component_count() > self.components:
            return None
        c = self.cfg
        rt = predicted_round_time(after, c.shard_bytes, c.default_bandwidth_bps, c.default_rtt_s)
        return rt, graph_spectral_gap(after)


class Candidate(NamedTuple):
    """A peer I could link to: the link's estimate, its predicted time, and the peer's hop distance."""

    node: str
    link: LinkEstimate
    time: float
    hops: int


def _bucket(t: float, step: float) -> float:
    """Log-scale bucket: link times within about `step` (relative) count as ties."""
    if math.isinf(t):
        return math.inf
    return -math.inf if t <= 0 else math.floor(math.log(t) / math.log1p(step))


def shuffled(items: list, rng: np.random.Generator) -> list:
    """`items` in the caller's random order, before a stable sort: peers with identical views break ties
    differently instead of all chasing the same candidate."""
    return [items[i] for i in rng.permutation(len(items))]


def candidates(
    s: Scene, candidates_measured: Mapping[str, LinkEstimate] | None
) -> list[Candidate]:
    """Peers I could link to, with the estimate, link time and hop distance.

    With `candidates_measured` (my fresh probes), only those peers are candidates:
    a peer I have not reached may well be unreachable. Without it, every
    non-neighbour in the view is, with the view's estimate or the defaults. Peers
    unknown to the view or already at `max_degree` are skipped.
    """
    view, me = s.view, s.me
    mine = view.neighbours(me)
    if candidates_measured is None:
        pool = {n: view.link(me, n) for n in view.nodes if n != me}
    else:
        pool = {n: est for n, est in candidates_measured.items() if n in view.nodes}
    dist = view.hop_distances(me)
    far = len(view.nodes) + 1  # unreachable: linking there merges components
    out: list[Candidate] = []
    urgent = view.degree(me) < s.cfg.min_degree
    # peers accept up to target + 1 (one slot of slack for swaps), beyond that only urgent adds
    cap = s.cfg.max_degree if urgent else min(s.cfg.max_degree, s.cfg.target_degree + 1)
    for n in sorted(pool):
        if n == me or n in mine or view.degree(n) >= cap:
            continue
        out.append(Candidate(n, pool[n], s.time(pool[n]), dist.get(n, far)))
    return out


def by_speed_then_far(
    s: Scene, cands: list[Candidate], rng: np.random.Generator, *, onward: bool = False
) -> list[Candidate]:
    """Fastest first; among similar speeds the farthest, then the least connected.

    Far peers shorten paths (raising the gap); low-degree peers keep degrees
    balanced, since every swap moves one edge end from the dropped peer to them.
    With `onward`, speed is the link's time plus the candidate's `onward` time.
    """
    step = s.cfg.min_improvement
    return sorted(
        shuffled(cands, rng),
        key=lambda c: (_bucket(c.time + (s.onward(c.node) if onward else 0.0), step), -c.hops,
                       s.view.degree(c.node)),
    )


def my_edges_slowest_first(
    s: Scene, rng: np.random.Generator, *, onward: bool = False
) -> list[tuple[str, float]]:
    """My edges with their link times, the slowest first; with `onward`, the costliest first (link time
    plus the other end's `onward` time)."""
    edges = [(m, s.time(s.view.link(s.me, m))) for m in sorted(s.view.neighbours(s.me))]
    extra = (lambda m: s.onward(m, exclude=s.me)) if onward else (lambda m: 0.0)
    return sorted(shuffled(edges, rng), key=lambda e: -(e[1] + extra(e[0])))

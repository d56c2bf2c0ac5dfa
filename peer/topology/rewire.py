"""Local rewiring: one peer plans one edge move on its own view of the graph.

Each peer periodically calls `plan_move`; the result is only a plan, which the
daemon carries out with propose -> accept -> commit so the other endpoint(s) can
refuse (their view may differ). Moves, in priority order:

  * drop  -- my degree is above `max_degree`: drop my slowest droppable edge;
  * add   -- my degree is below `target_degree`: link to the best candidate;
  * swap  -- otherwise replace one edge by an edge to a better candidate, either
             for speed (the replaced link gets >= `speed_improvement` faster, beyond
             the noise of both estimates: see `confidence`) or for
             mixing (the spectral gap grows by >= `min_improvement`, relative, and
             the new link is no slower than the old one, nor its peer's onward
             time: see `Scene.onward`);
  * relink -- (a swap) I sit behind a slow link of my own and so does a
             neighbour: replace that edge by one to a well-linked peer, even if the
             neighbour falls one below `min_degree` (see `_plan_relink`);
  * shed  -- (a drop) no swap helps, yet my slowest link is far slower than the
             rest (over `shed_factor` times the median edge): drop it while both
             ends stay above `min_degree`. Without it a peer whose every fast
             candidate is taken kept a 20 Mbit/s edge among 2 Gbit/s ones just to
             stay at the target degree, and every exchange over it took 100x longer.

Why speed is judged on the replaced link and not on the global round time: the
round time is the *maximum* edge time, a plateau. With k equally slow links, the
first k - 1 swaps leave it unchanged, so a rule that looks only at the maximum
never starts. Judging the replaced link makes every swap progress, never raises
the global round time (the new link is faster than one that was counted in the
maximum), and gives a potential -- (sum of edge times, -gap) lexicographically --
that strictly decreases with every swap, so rewiring on a fixed view terminates
instead of oscillating.

The gap rule (`gap_acceptable`): a move never takes the gap below
min(gap_floor, current gap), i.e. never below the floor and never makes an already
poor graph worse; and it may lower the gap by more than a factor `gap_keep_ratio`
only when the replaced link gets >= `big_improvement` faster. Marginal speed-ups
therefore cannot erode mixing, while real stragglers can always be removed as long
as the floor holds.

Invariants of every planned move: the number of connected components does not
grow, no endpoint of a dropped edge falls below `min_degree` (a relink's dropped
neighbour: below it by one at most, never to zero), and no added peer
goes above `max_degree`. Candidate order is shuffled with the caller's rng before a
stable sort, so peers with identical views break ties differently and do not all
chase the same candidate in lockstep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from peer.topology.graph import GraphView, LinkEstimate
from peer.topology.mixing import graph_spectral_gap, predicted_round_time
from peer.topology.rewire_scene import Candidate, Scene, by_speed_then_far, candidates, my_edges_slowest_first, shuffled

MoveKind = Literal["add", "drop", "swap"]


@dataclass(frozen=True, kw_only=True)
class RewireConfig:
    """Knobs for `plan_move`. `shard_bytes` is what one exchange sends each way."""

    shard_bytes: int
    target_degree: int = 4
    min_degree: int = 2
    max_degree: int = 8
    gap_floor: float = 0.05
    gap_keep_ratio: float = 0.97
    big_improvement: float = 0.7
    """A swap may cost more than 3% of the gap only if the replaced link gets this much faster (about
    3x): a real straggler qualifies, measurement noise between two fast links does not. At 0.2 (below
    speed_improvement, so every speed swap qualified) noise-driven swaps wandered the graph's gap down:
    in a simulation of `peer bench gossip --netns --slow-pairs 0.4` (8 peers, estimates +-40% noisy)
    the settled gap was 0.39 after 104 moves; at 0.7 it is 0.42 after 17, with no slow edge in either."""
    min_improvement: float = 0.05
    speed_improvement: float = 0.3
    """A speed swap must make the replaced link this much faster: estimates are noisy."""
    confidence: float = 1.5
    """Standard errors (each link's `log_se`) by which a speed swap or a shed judges the replaced link
    optimistically and the new one pessimistically, so a speed-up inside the measurement noise is no
    speed-up. Links measured steadily (a shaped slow path, a quiet host) keep their real contrast;
    noisy equal links stop trading places. 0 compares bare estimates. In a simulation of the planner
    alone (8 peers, equal links, probes scattered by e^N(0, 1.2), 16 seeds, 40 rounds) the worst final
    gap was 0.40 at 0, 0.517 (a random 4-regular graph's median) at 1 and above, in 164 / 42 / 22
    moves at 0 / 1 / 2; with 36% of pairs 50x slower, no slow edge was kept at any setting."""
    straggler_factor: float = 3.0
    """Above min_degree, no add of a link slower than this times the median edge time: a slow host
    stays at min_degree instead of every fast peer waiting on it."""
    shed_factor: float = 10.0
    """No swap helps and a link is this many times slower than the median edge: drop it (above
    min_degree). Far above straggler_factor: bandwidth estimates of fast links on a busy host easily
    vary 3x, and shedding those only cost degree and gap."""
    default_bandwidth_bps: float = 100e6
    default_rtt_s: float = 0.005
    max_evaluations: int = 64
    """Cap on hypothetical graphs scored per call (each costs an eigensolve)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_degree <= self.target_degree <= self.max_degree:
            raise ValueError(
                "need 1 <= min_degree <= target_degree <= max_degree, got "
                f"{self.min_degree}, {self.target_degree}, {self.max_degree}"
            )
        if self.shard_bytes < 0:
            raise ValueError(f"shard_bytes must be >= 0, got {self.shard_bytes}")
        if not 0.0 <= self.gap_floor < 1.0:
            raise ValueError(f"gap_floor must be in [0, 1), got {self.gap_floor}")
        if not 0.0 < self.gap_keep_ratio <= 1.0:
            raise ValueError(f"gap_keep_ratio must be in (0, 1], got {self.gap_keep_ratio}")
        if not 0.0 < self.min_improvement <= self.big_improvement < 1.0:
            raise ValueError(
                "need 0 < min_improvement <= big_improvement < 1, got "
                f"{self.min_improvement}, {self.big_improvement}"
            )
        if not (self.default_bandwidth_bps > 0 and self.default_rtt_s >= 0):
            raise ValueError("default bandwidth must be > 0 and default rtt >= 0")
        if not self.confidence >= 0:
            raise ValueError(f"confidence must be >= 0, got {self.confidence}")
        if self.max_evaluations < 1:
            raise ValueError(f"max_evaluations must be >= 1, got {self.max_evaluations}")


@dataclass(frozen=True)
class Move:
    """A planned edge change for peer `me` (who is implicit: the planner)."""

    kind: MoveKind
    drop: str | None
    add: str | None
    predicted_round_time_before: float
    predicted_round_time_after: float
    gap_before: float
    gap_after: float
    reason: str
    add_link: LinkEstimate | None = None
    """The estimate the plan assumed for the new link (attach it when applying)."""
    drop_below_min: bool = False
    """A relink: the dropped neighbour may fall one below min_degree (it re-adds at once)."""


def gap_acceptable(gap_before: float, gap_after: float, link_gain: float, cfg: RewireConfig) -> bool:
    """The floor/keep-ratio rule described in the module docstring.

    `link_gain` is the fractional speed-up of the replaced link (0 for none).
    """
    if gap_after < min(cfg.gap_floor, gap_before):
        return False
    if gap_after >= cfg.gap_keep_ratio * gap_before:
        return True
    return link_gain >= cfg.big_improvement


def apply_move(view: GraphView, me: str, move: Move) -> GraphView:
    """The view after `move` commits (what both endpoints will do)."""
    out = view
    if move.drop is not None:
        out = out.without_edge(me, move.drop)
    if move.add is not None:
        out = out.with_edge(me, move.add, move.add_link)
    return out


def _move(s: Scene, kind: MoveKind, drop: str | None, add: str | None, scored: tuple[float, float], reason: str,
          link: LinkEstimate | None = None, drop_below_min: bool = False) -> Move:
    """The move, with the scene's round time and gap before it and `scored` (round time, gap) after."""
    return Move(kind, drop, add, s.round_time, scored[0], s.gap, scored[1], reason, link, drop_below_min)


def _drop_slowest(s: Scene, rng: np.random.Generator, *, keep: int, why: str,
                  slower_than: float = -math.inf) -> Move | None:
    """Drop my costliest edge (see `my_edges_slowest_first`) that is slower than `slower_than`
    seconds even at its best, within its margin, and whose other end keeps more than `keep`
    neighbours, if the gap rule allows."""
    view, cfg = s.view, s.cfg
    for other, t in my_edges_slowest_first(s, rng, onward=True):
        if t / s.margin(view.link(s.me, other)) <= slower_than:
            continue  # not slow enough, or not beyond its noise
        if view.degree(other) <= keep:
            continue
        scored = s.score(view.without_edge(s.me, other))
        if scored is None or scored[1] < min(cfg.gap_floor, s.gap):
            continue
        return _move(s, "drop", other, None, scored, f"{why}: drop {other} ({t:.3g} s)")
    return None


def _plan_drop(s: Scene, rng: np.random.Generator) -> Move | None:
    """Above max: drop an edge whose other end stays at or above min_degree."""
    return _drop_slowest(s, rng, keep=s.cfg.min_degree, why=f"degree {s.view.degree(s.me)} > max {s.cfg.max_degree}")


def _plan_trim(s: Scene, rng: np.random.Generator) -> Move | None:
    """Above target: drop my costliest edge to a neighbour also above target (both move towards it).

    Without this, swaps and below-target adds ratchet degrees up to max_degree, and MH weights
    1/(1 + max degree) shrink with them: every D-PSGD exchange then mixes less (one-neighbour
    exchanges use a fixed pairwise weight, but more edges also mean more links to keep measured).
    """
    cfg = s.cfg
    return _drop_slowest(s, rng, keep=max(cfg.target_degree, cfg.min_degree),
                         why=f"degree {s.view.degree(s.me)} > target {cfg.target_degree}")


def _plan_add(s: Scene, cands: list[Candidate], rng: np.random.Generator) -> Move | None:
    """Add the fastest (then farthest) candidate, counting its `onward` time as well.

    Below `min_degree` robustness comes first and any candidate will do. Between
    min and target, an add must not create a new straggler (link time above the
    current round time) nor take the gap below min(floor, current gap).
    """
    view, cfg = s.view, s.cfg
    urgent = view.degree(s.me) < cfg.min_degree
    for n, est, t, _ in by_speed_then_far(s, cands, rng, onward=True)[: cfg.max_evaluations]:
        if not urgent and s.round_time > 0 and t > min(s.round_time, s.straggler_time):
            continue  # above min_degree a link much slower than the usual one costs more than it mixes
        scored = s.score(view.with_edge(s.me, n, est))
        if scored is None:
            continue
        if not urgent and scored[1] < min(cfg.gap_floor, s.gap):
            continue
        why = "below min" if urgent else "below target"
        return _move(s, "add", None, n, scored,
                     f"degree {view.degree(s.me)} {why}: add {n} ({t:.3g} s)", est)
    return None


def _plan_swap(s: Scene, cands: list[Candidate], rng: np.random.Generator) -> Move | None:
    view, cfg, me = s.view, s.cfg, s.me
    mine = my_edges_slowest_first(s, rng)
    droppable = [(m, t) for m, t in mine if view.degree(m) - 1 >= cfg.min_degree]
    budget = cfg.max_evaluations
    if not droppable or not cands:
        return None

    # Speed: replace one of my slowest links (within min_improvement of my slowest).
    slowest = mine[0][1]
    fast_first = by_speed_then_far(s, cands, rng)
    for other, t_old in droppable:
        if t_old < (1 - cfg.min_improvement) * slowest:
            break
        best_old = t_old / s.margin(view.link(me, other))  # the old link at its best, the new at its worst
        for n, est, t_new, _ in fast_first:
            worst_new = t_new * s.margin(est)
            if worst_new > (1 - cfg.speed_improvement) * best_old:
                continue
            if budget <= 0:
                return None
            budget -= 1
            scored = s.score(view.without_edge(me, other).with_edge(me, n, est))
            gain = 1.0 - worst_new / best_old if best_old > 0 else 0.0
            if scored is None or not gap_acceptable(s.gap, scored[1], gain, cfg):
                continue
            return _move(s, "swap", other, n, scored,
                         f"speed: {other} ({t_old:.3g} s) -> {n} ({t_new:.3g} s), {gain:.0%} faster", est)

    # Mixing: a link no costlier than the one it replaces (its time plus the peer's onward time: else
    # the gap, which favours linking the two least-linked peers, pairs up slow hosts), to a far peer,
    # raising the gap.
    far_first = sorted(shuffled(cands, rng), key=lambda c: (-c.hops, view.degree(c.node)))
    for other, t_old in droppable:
        cost_old = t_old + s.onward(other, exclude=me)
        for n, est, t_new, _ in far_first:
            if t_new > t_old or t_new + s.onward(n) > cost_old:
                continue
            if budget <= 0:
                return None
            budget -= 1
            scored = s.score(view.without_edge(me, other).with_edge(me, n, est))
            if scored is None:
                continue
            g1 = scored[1]
            if g1 >= (1 + cfg.min_improvement) * s.gap and g1 > s.gap + 1e-12:
                return _move(s, "swap", other, n, scored,
                             f"mixing: {other} -> {n}, gap {s.gap:.3f} -> {g1:.3f}", est)
    return None


def _plan_relink(s: Scene, cands: list[Candidate], rng: np.random.Generator) -> Move | None:
    """Replace my edge to a neighbour that, like me, sits behind a slow link of its own.

    Such an edge carries nothing either end can pass on quickly: in `peer bench gossip --netns
    --slow-links 2` two slow hosts kept at min_degree that way mix with the swarm through one fast
    peer each, a path fast - slow - slow - fast; in a model of the averaging, that structure took
    1.6x as long to consensus as each slow host linked to two fast peers. Sheds and swaps cannot
    remove it when both ends sit at min_degree, since a drop must leave the other end there. A
    relink may leave it one below (never without neighbours): a peer below min_degree plans an add
    at once, and `_plan_add` ranks candidates by `onward` time, so it picks a well-linked peer.
    Slow means over `straggler_factor` times the median edge of the view: my fastest edge, the
    neighbour's fastest other edge and my link to it must all be slow (a well-linked peer with slow
    neighbours has a slow median edge, and relinking from it only took edges from slow hosts), and
    the new neighbour's `onward` time must not be.
    """
    view, cfg, me = s.view, s.cfg, s.me
    if s.typical_time <= 0 or not cands:
        return None
    slow = s.straggler_time
    if s.fastest(me) < slow:
        return None  # I am well linked: my slow edges are for sheds and swaps
    ranked = by_speed_then_far(s, cands, rng, onward=True)
    budget = cfg.max_evaluations
    for other in shuffled(sorted(view.neighbours(me)), rng):
        link_old = view.link(me, other)
        t_old, old_margin = s.time(link_old), s.margin(link_old)
        if (view.degree(other) < max(2, cfg.min_degree) or s.fastest(other, exclude=me) < slow
                or t_old / old_margin < slow):
            continue
        # Every slow neighbour of `other` (me included) may plan the same relink on the same view at
        # the same time: only if `other` keeps an edge when all of them do may any of them.
        if view.degree(other) - sum(1 for x in view.neighbours(other) if s.fastest(x) >= slow) < 1:
            continue
        for n, est, t_new, _ in ranked:
            if s.onward(n) >= slow or t_new > t_old * old_margin * s.margin(est):
                continue  # another slow peer (or an unlinked one), or a link slower beyond the noise
            if budget <= 0:
                return None
            budget -= 1
            scored = s.score(view.without_edge(me, other).with_edge(me, n, est))
            if scored is None or scored[1] < min(cfg.gap_floor, s.gap):
                continue
            return _move(s, "swap", other, n, scored,
                         f"relink: {other} is behind a slow link too ({s.onward(other, exclude=me):.3g} s "
                         f"onward) -> {n} ({s.onward(n):.3g} s onward)", est, drop_below_min=True)
    return None


def _plan_shed(s: Scene, rng: np.random.Generator) -> Move | None:
    """Drop a link far slower than the usual one (the costliest such), keeping both ends above min_degree
    (like `_plan_add`'s straggler bar: above min_degree such a link costs more than it mixes)."""
    cfg = s.cfg
    if s.view.degree(s.me) <= cfg.min_degree or s.typical_time <= 0:
        return None
    return _drop_slowest(s, rng, keep=cfg.min_degree, slower_than=cfg.shed_factor * s.typical_time,
                         why=f"straggler over {cfg.shed_factor:g}x the median edge ({s.typical_time:.3g} s)")


def plan_move(
    view: GraphView,
    me: str,
    cfg: RewireConfig,
    rng: np.random.Generator,
    candidates_measured: dict[str, LinkEstimate] | None = None,
) -> Move | None:
    """Plan at most one move for `me`, or None when nothing helps.

    `candidates_measured` holds my own fresh probes of non-neighbours (they win
    over the view's older estimates); see `candidates` for who is a candidate.
    """
    if me not in view.nodes:
        raise ValueError(f"planner {me!r} is not in the view")
    s = Scene(
        view=view,
        me=me,
        cfg=cfg,
        round_time=predicted_round_time(view, cfg.shard_bytes, cfg.default_bandwidth_bps, cfg.default_rtt_s),
        typical_time=float(np.median([view.link(*tuple(e)).transfer_time(
            cfg.shard_bytes, cfg.default_bandwidth_bps, cfg.default_rtt_s) for e in view.edges])) if view.edges else 0.0,
        gap=graph_spectral_gap(view),
        components=view.component_count(),
    )
    degree = view.degree(me)
    if degree > cfg.max_degree and (m := _plan_drop(s, rng)) is not None:
        return m
    if degree > cfg.target_degree and (m := _plan_trim(s, rng)) is not None:
        return m
    cands = candidates(s, candidates_measured)
    if degree < cfg.target_degree and (m := _plan_add(s, cands, rng)) is not None:
        return m
    if (m := _plan_relink(s, cands, rng)) is not None:
        return m
    if (m := _plan_swap(s, cands, rng)) is not None:
        return m
    return _plan_shed(s, rng)

"""Rewiring without the graph: which of my edges to give up, judged on what I can know locally.

With partial views no peer holds the graph, so the planner of peer/topology/rewire.py (which scores
hypothetical graphs by their spectral gap) cannot run. What a peer does know: the bandwidth it measured
on each of its links, its neighbours' degrees and fastest links (their `Status`), and the swarm's gap
against a random regular graph (its `GapReading`, peer/topology/local_gap.py). Every move here is a
*degree-preserving swap* with a random peer of the passive view (peer/membership/views.py carries it
out): my edge a-b and the candidate's edge c-d become a-c and b-d. Such swaps are the Markov chain
whose stationary graphs are uniform random graphs with the given degrees, so a graph rewired by them
stays as good an expander as a random regular graph, unless the choice of *which* edges to give up
biases it. That choice is the whole planner:

  * speed -- my slowest link is over `shed_factor` times my median one, and the neighbour has a link far
             faster than ours (so the slowness is this pair's path, not the neighbour's own host):
             re-roll it. The new edge is random, and a slow one is re-rolled in turn, so edges settle on
             fast paths while the graph stays random. A link to a slow *host* is kept: every edge of that
             host is slow, and re-rolling only moves its slowness around the swarm.
  * mix   -- the swarm's gap reads below `gap_keep` of a random regular graph's (speed moves are then
             paused and mixes are `GUARD_MIX` times likelier: the fast paths cluster, e.g. by region),
             or an edge was made by a local repair
             (after a failure a peer links to its lost neighbour's other neighbours, 2-hop shortcuts that
             can close off small islands): re-roll one of my slower edges at random.
  * a background mix, with probability `mix_probability` per interval: the safety net that keeps the graph
    a random one (and joins any island a repair closed off) whatever the estimates say.

The bandwidth-aware goal of the full-view planner stays (slow paths are routed around), and so does its
spectral one (the gap guard), with the gap judged against its yardstick instead of scored per move.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from peer.topology.graph import LinkEstimate
from peer.topology.local_gap import GapReading

GUARD_MIX = 4.0
"""Under the gap guard, mix moves are this many times likelier than the background's (one in five intervals
at the defaults), not certain: one peer's reading is within ~+-15% of the swarm's, so ~15% of peers read
below 0.9 on a graph at 1.0, and a certain mix every interval until the next epoch churned their edges."""


@dataclass(frozen=True, kw_only=True)
class LocalRewireConfig:
    shard_bytes: int = 16 << 20
    """Bytes one averaging exchange moves each way: what a link's time is judged on (the topology service's)."""
    interval: float = 30.0
    """Mean seconds between a peer's rewiring decisions. Every move is a swap of two edges, and a new edge is
    a session and a link to measure: in `peer bench scale --peers 10000` (1% churn a minute, 20% slow paths)
    an edge lived about 5 minutes (6382 speed swaps and 13349 mixes in 10 minutes, on 20,000 edges)."""
    shed_factor: float = 4.0
    """Re-roll my slowest link when it is this many times slower than my median link. Below ~3 the
    estimates' noise between equally fast links would keep re-rolling them (the full planner's
    `straggler_factor` is 3 for the same reason)."""
    host_factor: float = 3.0
    """...unless the neighbour's own fastest link is within this factor of ours: then it is a slow host."""
    gap_keep: float = 0.9
    """Below this ratio of a random regular graph's gap (the issue's goal), speed moves pause and mix moves
    run, until the next reading."""
    mix_probability: float = 0.05
    default_bandwidth_bps: float = 100e6  # a link not yet measured (as RewireConfig)
    default_rtt_s: float = 0.005

    def __post_init__(self) -> None:
        if self.shard_bytes < 0:
            raise ValueError(f"shard_bytes must be >= 0, got {self.shard_bytes}")
        if not self.interval > 0:
            raise ValueError(f"interval must be > 0, got {self.interval}")
        if not (self.shed_factor > 1 and self.host_factor >= 1):
            raise ValueError(f"need shed_factor > 1 and host_factor >= 1, got {self.shed_factor}, {self.host_factor}")
        if not 0 < self.gap_keep <= 1:
            raise ValueError(f"gap_keep must be in (0, 1], got {self.gap_keep}")
        if not 0 <= self.mix_probability <= 1:
            raise ValueError(f"mix_probability must be in [0, 1], got {self.mix_probability}")
        if not (self.default_bandwidth_bps > 0 and self.default_rtt_s >= 0):
            raise ValueError("default bandwidth must be > 0 and default rtt >= 0")


@dataclass(frozen=True, slots=True)
class NeighbourFacts:
    """What I know of one neighbour: its degree, our link (None: not measured yet), its fastest link's
    bandwidth (from its Status), and whether a local repair made our edge."""

    degree: int
    link: LinkEstimate | None
    fastest_bps: float | None
    local: bool = False


@dataclass(frozen=True, slots=True)
class LocalMove:
    kind: Literal["speed", "mix"]
    drop: str
    reason: str


def link_time(link: LinkEstimate | None, cfg: LocalRewireConfig) -> float | None:
    """Predicted seconds of one exchange over `link` (None: not measured)."""
    if link is None or link.bandwidth_bps is None:
        return None
    return link.transfer_time(cfg.shard_bytes, cfg.default_bandwidth_bps, cfg.default_rtt_s)


def slower_half(facts: Mapping[str, NeighbourFacts], cfg: LocalRewireConfig) -> list[str]:
    """My neighbours whose links are at or above my median link time (unmeasured ones count as median):
    a mix gives up one of these, so it never costs a fast link."""
    times = {p: link_time(f.link, cfg) for p, f in facts.items()}
    known = [t for t in times.values() if t is not None]
    if not known:
        return sorted(facts)
    median = statistics.median(known)
    return sorted(p for p, t in times.items() if t is None or t >= median)


def plan_local_move(facts: Mapping[str, NeighbourFacts], gap: GapReading | None, cfg: LocalRewireConfig,
                    rng: random.Random, *, min_degree: int) -> LocalMove | None:
    """At most one move for this interval (see the module docstring), or None. `facts` are my neighbours'.

    A swap leaves every degree as it was, so no move can leave anyone below `min_degree`; a peer with
    fewer than two neighbours has nothing to trade (it is being repaired) and plans nothing."""
    if len(facts) < max(2, min_degree):
        return None
    local = sorted(p for p, f in facts.items() if f.local)
    if local:
        return LocalMove("mix", rng.choice(local), "an edge made by a local repair")
    guarded = gap is not None and gap.ratio < cfg.gap_keep
    times = {p: t for p, f in facts.items() if (t := link_time(f.link, cfg)) is not None}
    if not guarded and len(times) >= 2:
        slow = max(sorted(times), key=lambda p: times[p])
        median = statistics.median(t for p, t in times.items() if p != slow)
        theirs = facts[slow].fastest_bps
        their_best = None if theirs is None else link_time(LinkEstimate(bandwidth_bps=theirs,
                                                                        rtt_s=facts[slow].link.rtt_s), cfg)
        if times[slow] > cfg.shed_factor * median and (their_best is None or
                                                        times[slow] > cfg.host_factor * their_best):
            return LocalMove("speed", slow, f"link {times[slow]:.3g} s, {times[slow] / median:.1f}x my median")
    if rng.random() < cfg.mix_probability * (GUARD_MIX if guarded else 1.0):
        why = f"gap {gap.ratio:.2f}x a random regular graph's < {cfg.gap_keep}" if guarded else "background mix"
        return LocalMove("mix", rng.choice(slower_half(facts, cfg)), why)
    return None

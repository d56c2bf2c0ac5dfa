"""Where a peer sits in a pipeline: which cut of the model it agrees to, and which stage it serves.

Every peer profiles the blocks and plans a cut, but measured times differ a little between peers, so plans can
differ, and peers that cut the model differently cannot serve each other. The rule: a peer adopts the cut
announced by the smallest peer ID among those serving the pipeline (its own plan when nobody serves yet); peers
that start together announce their own plans first and converge within a record interval or two, before any
microbatch moves.

The stage: a launcher that numbered the peers (`PEERTRAIN_RANK`) gives peer r stage r for r < stages, so every
stage is covered at once, and further numbered peers to the stages with the least planned capacity
(`numbered_stage`); any other peer takes the stage with the least capacity (sum of its peers' measured
throughput, an empty stage first), as the issue asks, breaking ties at random so peers starting together
spread out. `settle` then moves a peer off a crowded stage onto an empty one.
"""

from __future__ import annotations

import random

from peer.pipeline.directory import bottleneck
from peertrain.pipeline import PipelineKey, StagePeer


def adopted_cut(name: str, own: tuple[int, ...], announcements: dict, me: str) -> tuple[int, ...]:
    """The cut to use: the smallest announcing peer ID's for pipeline `name` (ours counts), else `own`."""
    serving = {pid: tuple(a.cuts) for pid, a in announcements.items() if a.pipeline == name}
    if not serving:
        return own
    return serving[min(serving)]


def initial_stage(key: PipelineKey, smap: dict[int, list[StagePeer]], rank: int | None, rng: random.Random,
                  stage_seconds: list[float] | None = None, fits: list[bool] | None = None) -> int:
    """The stage to start on (module docstring), among those this peer can hold (`fits`, per stage: its memory
    budget, trainers/pipeline/memory.py); ValueError if it can hold none."""
    ok = fits if fits is not None else [True] * key.stages
    if not any(ok):
        raise ValueError("this peer's memory budget holds no stage of the cut: it can only drive")
    if rank is not None and rank < key.stages and ok[rank]:
        return rank
    if rank is not None and stage_seconds:
        numbered = numbered_stage(rank, stage_seconds)
        if ok[numbered]:
            return numbered
    others = {s: [p for p in peers if not p.me] for s, peers in smap.items() if ok[s]}
    empty = [s for s, peers in others.items() if not peers]
    if empty:
        return rng.choice(empty)
    best = bottleneck(others)
    assert best is not None
    return best


def better_stage(smap: dict[int, list[StagePeer]], mine: int, me: str, fits: list[bool] | None = None) -> int | None:
    """A stage nobody serves and we can hold (`fits`), if we may leave ours for it: ours keeps another peer, and
    of the peers of ours we have the largest ID (so two peers of one stage never both leave it). None: stay."""
    empty = sorted(s for s, peers in smap.items() if not peers and (fits is None or fits[s]))
    if not empty:
        return None
    ours = smap.get(mine, [])
    if len(ours) < 2 or max(p.peer_id for p in ours) != me:
        return None
    return empty[0]


def numbered_stage(rank: int, stage_seconds: list[float]) -> int:
    """The stage of numbered peer `rank` >= stages: ranks 0..stages-1 hold one stage each, and each further
    rank in turn joins the stage whose peers carry the most planned seconds per microbatch each (the lowest
    capacity). Every peer computes the same sequence, so peers starting together need not wait to see each
    other (near-equal stage times measured differently by two peers may still send both to one stage; the
    settle step and, later, rebalancing even that out)."""
    counts = [1] * len(stage_seconds)
    stage = 0
    for _ in range(len(stage_seconds), rank + 1):
        stage = max(range(len(counts)), key=lambda s: (stage_seconds[s] / counts[s], -s))
        counts[stage] += 1
    return stage

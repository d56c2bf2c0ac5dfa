"""When a peer should move to another stage, and where a stage's state comes from: pure rules over the stage map,
which the daemon applies (peer/pipeline/seating.py).

A pipeline runs at its slowest stage's pace, and which stage that is changes as peers join, die or slow down.
Every peer reads the same stage records (peer/pipeline/directory.py) and applies the same rules, so peers agree
on who moves without a coordinator; the records also carry the moves under way (`moving_to`) and the stages
left lately (`moved_from`), which is how the rules keep moves one at a time per stage.

Throughput model. A peer's speed factor is its measured samples/s on its stage times that stage's cost (this
peer's profiled seconds per sample of each stage: `stage_cost`); on stage s it would do speed / cost[s]. A
stage's capacity is the sum over its peers; the pipeline's throughput is the smallest capacity (the bottleneck).
A peer not measured yet counts with the typical speed of those measured. A peer announcing a move counts in
the stage it is moving to (the move is as good as made), so two peers never both fill one gap.

Rebalancing (`plan_move`): consider moving each peer of every stage that keeps another peer to the bottleneck
stage; a move qualifies when it does not lower the predicted throughput and, alone or followed by one more
such move, raises it by `min_gain` (hysteresis above the noise of the measured rates, so peers do not
oscillate; the look-ahead fills two stages about as slow one after the other, where neither move alone
gains much). Of those, the best reachable throughput wins (ties: the best right after the move, then the
smallest peer ID). Only the peer the plan names acts. A stage some peer is leaving or left lately
(`moved_from`, announced for a cool-down) gives no further peer until its rates are measured again: at most
one peer moves out of a stage at a time.

An empty stage (`takeover_order`) is urgent: the peers that could leave their stage without emptying it are
ranked (a holder of the freshest copy of the empty stage first, then the best predicted throughput, then peer
ID); the first moves at once, the k-th only if the stage is still empty and nobody is moving there after k
grace periods (the caller's clock).

`may_switch` is the last check before a mover stops serving its old stage: its old stage keeps a peer that is
not itself leaving, and no peer of that stage with a smaller ID is leaving too (both saw each other: the smaller
ID goes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from peertrain.pipeline import StagePeer, StateSource
from protocol.schema.pipeline import StageAnnouncement

StageMap = dict[int, list[StagePeer]]
Fits = Callable[[str, int], bool]  # (peer, stage) -> whether that peer can hold that stage


@dataclass(frozen=True)
class Move:
    peer_id: str
    from_stage: int
    to_stage: int
    before: float  # predicted samples/s today
    after: float  # predicted samples/s with the move made
    reason: str


def _speeds(smap: StageMap, cost: list[float]) -> dict[str, float]:
    """Peer -> speed factor (samples/s x seconds per sample of its stage); unmeasured peers get the typical one."""
    measured = {p.peer_id: p.samples_per_s * cost[p.stage] for peers in smap.values() for p in peers
                if p.samples_per_s > 0}
    typical = sum(measured.values()) / len(measured) if measured else 1.0
    return {p.peer_id: measured.get(p.peer_id, typical) for peers in smap.values() for p in peers}


def _placement(smap: StageMap) -> dict[str, int]:
    """Peer -> the stage it counts in: where it is moving if it announces a move, else where it serves."""
    return {p.peer_id: (p.moving_to if 0 <= p.moving_to < len(smap) else p.stage)
            for peers in smap.values() for p in peers}


def throughput(placement: dict[str, int], speeds: dict[str, float], cost: list[float]) -> tuple[float, list[float]]:
    """(the slowest stage's capacity, every stage's capacity) for `placement` (peer -> stage)."""
    caps = [0.0] * len(cost)
    for pid, s in placement.items():
        caps[s] += speeds[pid] / cost[s]
    return min(caps), caps


def _movers(smap: StageMap) -> set[str]:
    """Peers announcing a move: busy with it, so never named for another one."""
    return {p.peer_id for peers in smap.values() for p in peers if p.moving_to >= 0}


def _cooling(smap: StageMap) -> set[int]:
    """Stages a peer is leaving now or left lately: none more may leave them until that settles."""
    out = set()
    for peers in smap.values():
        for p in peers:
            if p.moving_to >= 0:
                out.add(p.stage)
            if 0 <= p.moved_from < len(smap):
                out.add(p.moved_from)
    return out


def predicted_throughput(smap: StageMap, cost: list[float]) -> float:
    """Today's predicted samples/s of the pipeline (0 with a stage empty)."""
    return throughput(_placement(smap), _speeds(smap, cost), cost)[0]


def settling(smap: StageMap) -> bool:
    """A peer is moving or lately moved: rates are being re-measured, so no further move is weighed yet."""
    return any(p.moving_to >= 0 or p.moved_from >= 0 for peers in smap.values() for p in peers)


def _moves_to_bottleneck(where: dict[str, int], speeds, cost, skip: set[str], fits: Fits | None = None):
    """(peer, from, to, throughput after, capacities after) for each move of one peer to today's bottleneck
    from a stage that keeps a peer, that does not lower the throughput."""
    before, caps = throughput(where, speeds, cost)
    target = min(range(len(caps)), key=lambda s: (caps[s], s))
    counts = [0] * len(cost)
    for s in where.values():
        counts[s] += 1
    for pid in sorted(where):
        src = where[pid]
        if src == target or counts[src] < 2 or pid in skip or (fits is not None and not fits(pid, target)):
            continue
        after, new = throughput({**where, pid: target}, speeds, cost)
        if after >= before:
            yield pid, src, target, after, new


def plan_move(smap: StageMap, cost: list[float], *, min_gain: float, fits: Fits | None = None) -> Move | None:
    """The move to the bottleneck stage worth making now, if any (module docstring).

    A move qualifies when it does not lower the predicted throughput and, on its own or followed by one
    more such move, raises it by `min_gain` at least: with two stages about as slow, filling one lifts the
    pipeline only to the other, and the next move fills that; a move that only shuffles which stage is
    slowest is not made. Among qualifying moves: the best throughput reachable, then the best right after
    this move, then the smallest peer ID. `fits(peer, stage)`: whether that peer can hold that stage (its
    announced memory, trainers/pipeline/memory.py); a move to a stage it cannot hold is never planned."""
    if len(cost) != len(smap) or any(c <= 0 for c in cost):
        raise ValueError(f"stage costs must be {len(smap)} positive numbers, got {cost}")
    speeds = _speeds(smap, cost)
    where = _placement(smap)
    before, caps = throughput(where, speeds, cost)
    if before <= 0:
        return None  # a stage is empty or moving-to: takeover_order's case
    skip = {p.peer_id for peers in smap.values() for p in peers if p.stage in _cooling(smap)} | _movers(smap)
    best: tuple | None = None
    for pid, src, target, after, new in _moves_to_bottleneck(where, speeds, cost, skip, fits):
        moved = {**where, pid: target}
        then = max((a for *_, a, _ in _moves_to_bottleneck(moved, speeds, cost, set(), fits)), default=after)
        reach = max(after, then)
        if reach < before * (1.0 + min_gain):
            continue
        key = (-reach, -after, pid)
        if best is None or key < best[0]:
            best = (key, Move(pid, src, target, before, after,
                              f"stage {target} is the bottleneck ({caps[target]:.1f} samples/s); stage {src} has "
                              f"{caps[src]:.1f}: predicted {before:.1f} -> {after:.1f} samples/s"
                              + (f" (-> {reach:.1f} with one more move)" if reach > after else "")))
    return best[1] if best else None


def empty_stages(smap: StageMap) -> list[int]:
    """Stages with no peer, counting peers moving there as there."""
    where = _placement(smap)
    return [s for s in range(len(smap)) if s not in where.values()]


def takeover_order(smap: StageMap, cost: list[float], empty: int, copies: dict[str, int],
                   fits: Fits | None = None) -> list[Move]:
    """Who should take over `empty` stage, best first: peers whose stage keeps another peer (not leaving) and
    that can hold it (`fits`, as in plan_move).
    `copies`: peer -> the step of the copy of `empty` it holds (absent: none); only peers on `smap` count."""
    speeds = _speeds(smap, cost)
    where = _placement(smap)
    copies = {pid: step for pid, step in copies.items() if pid in where}
    counts = [0] * len(cost)
    for s in where.values():
        counts[s] += 1
    movers = _movers(smap)
    freshest = max(copies.values(), default=None)
    ranked = []
    for pid, src in where.items():
        if src == empty or counts[src] < 2 or pid in movers or (fits is not None and not fits(pid, empty)):
            continue
        moved = {**where, pid: empty}
        _, caps = throughput(moved, speeds, cost)
        after = min(caps[s] for s in set(moved.values()))  # other empty stages get their own takers
        holds = freshest is not None and copies.get(pid) == freshest
        ranked.append((not holds, -after, pid, Move(pid, src, empty, 0.0, after,
                                                    f"stage {empty} has no peer"
                                                    + (f"; this peer holds its freshest copy (step {freshest})"
                                                       if holds else ""))))
    ranked.sort(key=lambda r: r[:3])
    return [r[3] for r in ranked]


def may_switch(smap: StageMap, me: str, from_stage: int) -> str | None:
    """None if `me` may stop serving `from_stage` now; else why not."""
    others = [p for p in smap.get(from_stage, []) if p.peer_id != me]
    staying = [p for p in others if p.moving_to < 0]
    if not staying:
        return f"stage {from_stage} would have no peer left"
    leaving_first = [p.peer_id for p in others if p.moving_to >= 0 and p.peer_id < me]
    if leaving_first:
        return f"{leaving_first[0][:8]} is leaving stage {from_stage} too (the smaller peer ID goes)"
    return None


def state_sources(announcements: dict[str, StageAnnouncement], live: set[str], key_of, stage: int,
                  me: str) -> list[StateSource]:
    """Peers that can hand out `stage`'s state, freshest first (serving it or keeping a copy; a live server
    before a copy of the same step). `key_of(ann)` says if an announcement is of our pipeline and cut."""
    out = []
    for pid, ann in announcements.items():
        if pid == me or pid not in live or not key_of(ann):
            continue
        if ann.stage == stage:
            out.append(StateSource(pid, ann.step, True))
        for c in ann.copies:
            if c.stage == stage:
                out.append(StateSource(pid, c.step, False))
    out.sort(key=lambda s: (-s.step, not s.live, s.peer_id))
    return out

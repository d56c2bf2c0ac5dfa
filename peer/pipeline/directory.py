"""Who serves which stage of a pipeline, as far as this daemon knows.

A server says which stage it serves in its signed topology record (protocol/schema/pipeline.py,
StageAnnouncement), so the directory is a reading of the records the topology service already holds, fresh
ones only, joined with membership: a peer counts as live for a stage only while we have a session with it
(a driver can only call peers it is connected to; a dead one drops out within `[membership] dead_after`).
"""

from __future__ import annotations

from peertrain.pipeline import PipelineKey as PipelineKey, StagePeer as StagePeer  # the leaf types (re-exported)
from protocol.schema.pipeline import StageAnnouncement


def stage_map(key: PipelineKey, announcements: dict[str, StageAnnouncement], live: set[str],
              me: str) -> dict[int, list[StagePeer]]:
    """Live peers of each stage of the pipeline `key` (an empty list for a stage nobody serves).

    `announcements` maps a peer to what its freshest record announces (ours included under `me`); records
    of another pipeline or another cut are not this pipeline's peers and are left out."""
    out: dict[int, list[StagePeer]] = {s: [] for s in range(key.stages)}
    for pid, ann in announcements.items():
        if PipelineKey.of(ann) != key or (pid != me and pid not in live):
            continue
        out[ann.stage].append(StagePeer(pid, ann.stage, ann.samples_per_s, ann.queue, me=pid == me, step=ann.step,
                                        moving_to=ann.moving_to, moved_from=ann.moved_from,
                                        memory_mib=ann.memory_mib, stage_room_mib=ann.stage_room_mib,
                                        memory_used_mib=ann.memory_used_mib))
    for peers in out.values():
        peers.sort(key=lambda p: p.peer_id)
    return out


def capacity(peers: list[StagePeer], unmeasured: float = 1.0) -> float:
    """A stage's capacity: the sum of its peers' throughput; a peer not measured yet counts as `unmeasured`
    samples/s (so a stage with an unmeasured peer is not mistaken for an empty one)."""
    return sum(p.samples_per_s if p.samples_per_s > 0 else unmeasured for p in peers)


def bottleneck(stages: dict[int, list[StagePeer]]) -> int | None:
    """The stage with the least capacity (an empty stage first), or None when there are no stages."""
    if not stages:
        return None
    measured = [p.samples_per_s for peers in stages.values() for p in peers if p.samples_per_s > 0]
    typical = sum(measured) / len(measured) if measured else 1.0
    return min(stages, key=lambda s: (capacity(stages[s], typical), s))

"""Topology-plane messages: signed neighbour records, two-phase edge changes, bandwidth probes.

Every peer gossips a `TopologyRecord` (its neighbours and measured links), signed with its identity key
so it can be forwarded by others without trusting them; from these each peer assembles an approximate
view of the whole graph. Edges change only through propose → accept → commit, so both endpoints agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from protocol.bounds import check_peer_id
from protocol.identity import KEY_SIZE, SIGNATURE_SIZE
from protocol.messages import Message
from protocol.schema.pipeline import StageAnnouncement
from protocol.schema.training import TrainingFigures, training_figures_signing_list

# Bounds on what one record may say. They are checked when a message is decoded (a record that breaks one
# closes the sending session: an honest peer only sends and forwards records that passed them), and they
# bound one record's wire size to ~12 KiB, so a batch of records can always be split into messages.
MAX_RECORD_NEIGHBOURS = 64
"""Neighbours one record lists: eight times `[topology] max_degree`'s default of 8."""
MAX_RECORD_LINKS = 128
"""Link reports in one record: one per peer measured, twice `[membership] max_connections`' default of 64."""
MAX_BANDWIDTH_BPS = 1e13
"""10 Tbit/s, beyond any network interface: a larger figure is a lie that would dominate rewiring."""
MAX_RTT_S = 600.0
"""Ten minutes: a link slower than that to answer is dead (`[membership] dead_after` is seconds)."""
MAX_RECORD_GROUPS = 16
"""Averaging groups one record lists: a hosted trainer's model plus attached processes' (8 each at most)."""
MAX_GROUP_CHARS = 64
"""Characters of a group name in a record: 16 of them add at most ~1 KiB to a record."""
MAX_RECORDS_PER_MESSAGE = 512
"""Records in one TopologyRecords message, the size of a receiver's view (`peer.topology.records`)."""



__all__ = ["LinkReport", "TopologyRecord", "TopologyRecords", "EdgePropose", "EdgeAccept", "EdgeReject",
           "EdgeCommit", "EdgeDrop", "ProbeRequest", "ProbeReply", "topology_record_signing_bytes"]


@dataclass(frozen=True, slots=True)
class LinkReport:
    """What the record's owner measured towards `peer` (None: not measured)."""

    peer: str
    bandwidth_bps: float | None = None
    rtt_s: float | None = None

    def __post_init__(self) -> None:
        check_peer_id("link peer", self.peer)
        # (the decoder already refuses NaN and infinities)
        if self.bandwidth_bps is not None and not 0 < self.bandwidth_bps <= MAX_BANDWIDTH_BPS:
            raise ValueError(f"bandwidth_bps must be in (0, {MAX_BANDWIDTH_BPS:g}], got {self.bandwidth_bps!r}")
        if self.rtt_s is not None and not 0 <= self.rtt_s <= MAX_RTT_S:
            raise ValueError(f"rtt_s must be in [0, {MAX_RTT_S:g}], got {self.rtt_s!r}")


@dataclass(frozen=True, slots=True)
class TopologyRecord(Message):
    """Peer `peer_id`'s neighbours and link measurements, version `version` (newer wins)."""

    TYPE = "topo_record"
    peer_id: str
    public_key: bytes
    version: int
    issued: float
    neighbours: list[str]
    links: list[LinkReport]
    signature: bytes
    stage: StageAnnouncement | None = None  # the pipeline stage the owner serves (protocol/schema/pipeline.py)
    # the averaging groups the owner shares: a peer averages a group with neighbours that list it (an offer
    # to one that does not would only be refused), and a process waits for peers holding its group
    groups: list[str] = field(default_factory=list)
    training: TrainingFigures | None = None  # the owner's latest training figures (protocol/schema/training.py)

    def __post_init__(self) -> None:
        check_peer_id("peer_id", self.peer_id)
        if len(self.public_key) != KEY_SIZE:
            raise ValueError(f"public_key must have {KEY_SIZE} bytes, got {len(self.public_key)}")
        if len(self.signature) > SIGNATURE_SIZE:  # empty while a record is being built, before it is signed
            raise ValueError(f"signature must have at most {SIGNATURE_SIZE} bytes, got {len(self.signature)}")
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")
        if len(self.neighbours) > MAX_RECORD_NEIGHBOURS:
            raise ValueError(f"{len(self.neighbours)} neighbours (at most {MAX_RECORD_NEIGHBOURS})")
        if len(self.links) > MAX_RECORD_LINKS:
            raise ValueError(f"{len(self.links)} link reports (at most {MAX_RECORD_LINKS})")
        for n in self.neighbours:
            check_peer_id("neighbour", n)
        if len(self.groups) > MAX_RECORD_GROUPS:
            raise ValueError(f"{len(self.groups)} groups (at most {MAX_RECORD_GROUPS})")
        for g in self.groups:
            if not 0 < len(g) <= MAX_GROUP_CHARS:
                raise ValueError(f"a group name must have 1..{MAX_GROUP_CHARS} characters, got {len(g)}")


_DOMAIN = "peertrain/topology_record/v1"


def topology_record_signing_bytes(r: TopologyRecord) -> bytes:
    """The bytes a TopologyRecord's signature covers (every field but the signature, in fixed order)."""
    return msgpack.packb([_DOMAIN, r.peer_id, bytes(r.public_key), int(r.version), float(r.issued),
                          list(r.neighbours),
                          [[lr.peer, lr.bandwidth_bps, lr.rtt_s] for lr in r.links]]
                         # appended only when present, so a record without a stage (groups, training) signs as before
                         + ([] if r.stage is None else [_stage_signing_list(r.stage)])
                         + ([] if not r.groups else [["groups", list(r.groups)]])
                         + ([] if r.training is None else [training_figures_signing_list(r.training)]),
                         use_bin_type=True)


def _stage_signing_list(a: StageAnnouncement) -> list:
    # appended only when present, so an announcement without them signs as before
    return [a.pipeline, a.stage, a.stages, float(a.samples_per_s), a.queue, list(a.cuts), a.step, a.moving_to,
            a.moved_from, [[c.stage, c.step] for c in a.copies]] \
        + ([] if not a.profiles else [["profiles", [[b.block, float(b.seconds), b.out_bytes, b.param_bytes]
                                                    for b in a.profiles]]]) \
        + ([] if not (a.memory_mib or a.stage_room_mib or a.memory_used_mib)
           else [["memory", a.memory_mib, a.stage_room_mib, a.memory_used_mib]]) \
        + ([] if not a.addresses else [["addresses", list(a.addresses)]])


@dataclass(frozen=True, slots=True)
class TopologyRecords(Message):
    """A batch of records, flooded: a receiver keeps (and later forwards) those newer than its own copy."""

    TYPE = "topo_records"
    records: list[TopologyRecord]

    def __post_init__(self) -> None:
        if len(self.records) > MAX_RECORDS_PER_MESSAGE:
            raise ValueError(f"{len(self.records)} records (at most {MAX_RECORDS_PER_MESSAGE})")


@dataclass(frozen=True, slots=True)
class EdgePropose(Message):
    """Phase 1: "let us be neighbours". The receiver reserves a slot and accepts, or rejects."""

    TYPE = "edge_propose"
    degree: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class EdgeAccept(Message):
    TYPE = "edge_accept"
    degree: int


@dataclass(frozen=True, slots=True)
class EdgeReject(Message):
    TYPE = "edge_reject"
    reason: str


@dataclass(frozen=True, slots=True)
class EdgeCommit(Message):
    """Phase 3: the proposer made the edge; `proposal` is the rid of its EdgePropose."""

    TYPE = "edge_commit"
    proposal: int


@dataclass(frozen=True, slots=True)
class EdgeDrop(Message):
    """The sender removed the edge; the receiver removes it too."""

    TYPE = "edge_drop"
    reason: str


@dataclass(frozen=True, slots=True)
class ProbeRequest(Message):
    """Ask for `nbytes` of filler to measure throughput to a peer we are not yet neighbours with."""

    TYPE = "probe"
    nbytes: int


@dataclass(frozen=True, slots=True)
class ProbeReply(Message):
    TYPE = "probe_reply"
    payload: bytes

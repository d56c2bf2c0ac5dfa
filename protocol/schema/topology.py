"""Topology-plane messages: signed neighbour records, two-phase edge changes, bandwidth probes.

Every peer gossips a `TopologyRecord` (its neighbours and measured links), signed with its identity key
so it can be forwarded by others without trusting them; from these each peer assembles an approximate
view of the whole graph. Edges change only through propose → accept → commit, so both endpoints agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from protocol.messages import Message

__all__ = ["LinkReport", "TopologyRecord", "TopologyRecords", "EdgePropose", "EdgeAccept", "EdgeReject",
           "EdgeCommit", "EdgeDrop", "ProbeRequest", "ProbeReply", "topology_record_signing_bytes"]


@dataclass(frozen=True, slots=True)
class LinkReport:
    """What the record's owner measured towards `peer` (None: not measured)."""

    peer: str
    bandwidth_bps: float | None = None
    rtt_s: float | None = None


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


_DOMAIN = "peertrain/topology_record/v1"


def topology_record_signing_bytes(r: TopologyRecord) -> bytes:
    """The bytes a TopologyRecord's signature covers (every field but the signature, in fixed order)."""
    return msgpack.packb([_DOMAIN, r.peer_id, bytes(r.public_key), int(r.version), float(r.issued),
                          list(r.neighbours),
                          [[lr.peer, lr.bandwidth_bps, lr.rtt_s] for lr in r.links]], use_bin_type=True)


@dataclass(frozen=True, slots=True)
class TopologyRecords(Message):
    """A batch of records, flooded: a receiver keeps (and later forwards) those newer than its own copy."""

    TYPE = "topo_records"
    records: list[TopologyRecord]


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

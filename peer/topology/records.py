"""Topology records: ours, signed and flooded to every session; others', admitted to the view only from an
origin we know or through a neighbour that vouches for it, bounded in number, and read into the `GraphView`.

`signed_record` makes ours; a `RecordBook` holds others' and makes the view. The topology service
(peer/topology/service.py) owns the book, floods the records on its schedule and tells the book whom we
met; the book asks it only whether a sender is a neighbour. The records' fields and sizes are bounded
when they are decoded (protocol/schema/topology.py); this module bounds what a daemon holds of them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from peer.topology.graph import GraphView, LinkEstimate, edge_key
from peer.topology.links import LinkStats
from protocol import identity as ident
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.pipeline import StageAnnouncement
from protocol.schema.topology import (
    MAX_BANDWIDTH_BPS, MAX_RECORD_GROUPS, MAX_RECORD_LINKS, MAX_RECORD_NEIGHBOURS, MAX_RECORDS_PER_MESSAGE, MAX_RTT_S,
    LinkReport, TopologyRecord, TopologyRecords, topology_record_signing_bytes)
from protocol.schema.training import TrainingFigures

log = logging.getLogger("peertrain.topology")

RECORD_TTL = 60.0  # a record not refreshed for this long leaves the view
MAX_VIEW_RECORDS = 512
"""Others' records a daemon holds (one per origin; the stalest are forgotten first): a full view is meant
for tens to hundreds of peers (partial views are for thousands). With records of at most ~12 KiB (the schema's
bounds) this caps the view's memory and a broadcast at ~6 MiB, sent in messages under the frame limit.
It also bounds the spectral work (peer/topology/spectral.py, in a worker thread): one gap of a 513-node view
took 5-20 ms here (numpy eigvalsh on a loaded 2-core machine) and a whole rewiring plan of one 45 ms; a plan
solves at most `RewireConfig.max_evaluations` = 64 gaps, so under a second of a worker thread at worst."""
MAX_MET_PEERS = MAX_VIEW_RECORDS
"""Identities we had a session with, remembered (the oldest forgotten) so their records are admitted to the
view: no more than the view can hold. Each costs a peer a real handshake, so it is no way to flood the view."""


def signed_record(identity: Ed25519PrivateKey, me: str, *, version: int, neighbours: Iterable[str],
                  links: Mapping[str, LinkStats], stage: StageAnnouncement | None, groups: list[str],
                  training: TrainingFigures | None = None) -> TopologyRecord:
    """Our signed record: neighbours, measured links (clamped to the schema's ranges), stage, groups and
    training figures, each list cut to the schema's bound."""
    reports = [LinkReport(peer=p, bandwidth_bps=None if s.bandwidth_bps is None else min(s.bandwidth_bps, MAX_BANDWIDTH_BPS),
                          rtt_s=None if s.rtt_s is None else min(s.rtt_s, MAX_RTT_S))
               for p, s in sorted(links.items()) if s.bandwidth_bps is not None or s.rtt_s is not None]
    rec = TopologyRecord(peer_id=me, public_key=ident.public_key_bytes(identity), version=version,
                         issued=time.time(), neighbours=sorted(neighbours)[:MAX_RECORD_NEIGHBOURS],
                         links=reports[:MAX_RECORD_LINKS], signature=b"", stage=stage,
                         groups=groups[:MAX_RECORD_GROUPS], training=training)
    sig = ident.sign(identity, topology_record_signing_bytes(rec))
    return dataclasses.replace(rec, signature=sig)


class RecordBook:
    """Others' records: which are admitted, the latest of each origin (at most MAX_VIEW_RECORDS), the
    view they make with my own edges and links, and the batches a broadcast sends them in.

    Its one question to its owner is `is_neighbour(peer_id)` (a neighbour vouches for what it relays)."""

    def __init__(self, me: str, *, is_neighbour: Callable[[str], bool]):
        self.me = me
        self._is_neighbour = is_neighbour
        self.records: dict[str, TopologyRecord] = {}  # the latest of each origin
        self.seen: dict[str, float] = {}  # trio clock when each was last refreshed
        self.wire_bytes: dict[str, int] = {}  # encoded size of each, to split broadcasts
        self.met: dict[str, None] = {}  # peers we have or had a session with, oldest first (MAX_MET_PEERS)
        self.unvouched = 0  # records refused: unknown origin from a sender that is no neighbour

    def met_session(self, peer_id: str) -> None:
        """We have a session with `peer_id`: its records are admitted (the oldest acquaintance is forgotten first)."""
        self.met.pop(peer_id, None)  # most recent last
        self.met[peer_id] = None
        while len(self.met) > MAX_MET_PEERS:
            del self.met[next(iter(self.met))]

    def get(self, peer_id: str) -> TopologyRecord | None:
        return self.records.get(peer_id)

    def holds(self, peer_id: str, group: str) -> bool | None:
        """Does `peer_id`'s latest record list averaging group `group`? None: no record of it yet."""
        rec = self.records.get(peer_id)
        return None if rec is None else group in rec.groups

    def fresh(self) -> list[TopologyRecord]:
        """Records refreshed within RECORD_TTL (a peer that stopped refreshing is gone)."""
        now = trio.current_time()
        return [r for pid, r in self.records.items() if now - self.seen.get(pid, -1e9) < RECORD_TTL]

    def view(self, connected: Iterable[str], my_neighbours: Iterable[str],
             my_links: Mapping[str, LinkStats]) -> GraphView:
        """The graph as far as I know it: my edges for sure, others' from their fresh records (and the
        records of peers I have a session with, however old)."""
        now = trio.current_time()
        live = set(connected) | {self.me}
        nodes = set(live)
        claims: dict[str, set[str]] = {self.me: set(my_neighbours)}
        for pid, rec in self.records.items():
            if now - self.seen.get(pid, -1e9) > RECORD_TTL and pid not in live:
                continue
            nodes.add(pid)
            claims[pid] = set(rec.neighbours)
        edges = set()
        for a, nbrs in claims.items():
            for b in nbrs:
                if b == a or b not in nodes:
                    continue
                # an edge counts if both ends claim it, or the other end's record is unknown
                if b in claims and a not in claims[b]:
                    continue
                edges.add(edge_key(a, b))
        reports: dict[str, dict[str, LinkEstimate]] = {}
        for pid, rec in self.records.items():
            if pid in nodes:
                reports[pid] = {lr.peer: LinkEstimate(lr.bandwidth_bps, lr.rtt_s) for lr in rec.links if lr.peer in nodes and lr.peer != pid}
        reports[self.me] = {p: s.estimate() for p, s in my_links.items() if p in nodes and p != self.me}
        return GraphView.from_reports(nodes, edges, reports)

    def broadcast_messages(self, own: TopologyRecord, max_message_bytes: int,
                           only: Callable[[TopologyRecord], bool] | None = None) -> list[TopologyRecords]:
        """Our record and the fresh ones we hold (those `only` passes, if given), split into messages under
        the message limit.

        A record's size is that of a message holding it alone, an upper bound on what it adds to a
        batch, so no batch can exceed the limit whatever records we hold."""
        now = trio.current_time()
        fresh = [(own, _wire_bytes(own))] + [(r, self.wire_bytes[pid]) for pid, r in self.records.items()
                                             if now - self.seen.get(pid, -1e9) < RECORD_TTL
                                             and (only is None or only(r))]
        batches: list[list[TopologyRecord]] = [[]]
        size = 0
        for rec, n in fresh:
            if n > max_message_bytes:  # only a tiny configured message limit can make one record too big
                log.warning("topology record of %s (%d bytes) exceeds max_message_bytes; not sent",
                            ident.short_id(rec.peer_id), n)
                continue
            if batches[-1] and (size + n > max_message_bytes or len(batches[-1]) >= MAX_RECORDS_PER_MESSAGE):
                batches.append([])
                size = 0
            batches[-1].append(rec)
            size += n
        return [TopologyRecords(records=b) for b in batches if b]

    def admits(self, origin: str, sender: str) -> bool:
        """Whether a record of `origin` relayed by `sender` may enter the view: we have (or recently had)
        a session with its origin, the sender is a topology neighbour (a neighbour relaying it vouches
        for it: honest records flood along neighbour edges, so every peer still hears of every other), or
        the view holds the origin already (a newer signed record of it adds nothing to hold). So a peer
        that is no neighbour of ours cannot fill the view with throwaway identities."""
        return origin in self.met or self._is_neighbour(sender) or origin in self.records

    def receive(self, records: Iterable[TopologyRecord], sender: str) -> list[TopologyRecord]:
        """Hold the admitted, newer, authentic ones of `records` relayed by `sender`; return those."""
        # the schema bounded each record's fields and size at decode time (a bad one closed the session)
        taken: list[TopologyRecord] = []
        refused = 0
        for rec in records:
            if rec.peer_id == self.me:
                continue
            if not self.admits(rec.peer_id, sender):
                # not a protocol error: an honest peer floods records of peers we have not met
                refused += 1
                continue
            old = self.records.get(rec.peer_id)
            if old is not None and (old.version, old.issued) >= (rec.version, rec.issued):
                continue
            if ident.peer_id_from_public_bytes(rec.public_key) != rec.peer_id or not ident.verify(
                    rec.public_key, rec.signature, topology_record_signing_bytes(rec)):
                log.debug("dropping topology record for %s relayed by %s: bad signature", ident.short_id(rec.peer_id),
                          ident.short_id(sender))
                continue
            self.records[rec.peer_id] = rec
            self.seen[rec.peer_id] = trio.current_time()
            self.wire_bytes[rec.peer_id] = _wire_bytes(rec)
            taken.append(rec)
        if refused:
            self.unvouched += refused
            log.debug("%d topology records from %s refused: origins unknown to us and it is no neighbour",
                      refused, ident.short_id(sender))
        if len(self.records) > MAX_VIEW_RECORDS:  # bound memory: forget the stalest
            for pid in sorted(self.records, key=lambda p: self.seen.get(p, 0))[:len(self.records) - MAX_VIEW_RECORDS]:
                self.records.pop(pid, None)
                self.seen.pop(pid, None)
                self.wire_bytes.pop(pid, None)
        return taken


def _wire_bytes(rec: TopologyRecord) -> int:
    """Encoded bytes of a message holding just this record (an upper bound on its share of a batch)."""
    return len(DEFAULT_REGISTRY.encode(TopologyRecords(records=[rec])))

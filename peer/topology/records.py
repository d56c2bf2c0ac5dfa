"""Topology records: ours, signed and flooded to every session; others', admitted to the view only from an
origin we know or through a neighbour that vouches for it, bounded in number, and read into the `GraphView`.

A part of the topology service (TopologyService inherits it), as the averaging engine's download.py is of
the engine: it shares the service's neighbours, links and membership (see peer/topology/service.py for the
attributes it uses). The records' fields and sizes are bounded when they are decoded
(protocol/schema/topology.py); this module bounds what a daemon holds of them.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import trio

from peer.topology.graph import GraphView, LinkEstimate, edge_key
from protocol import identity as ident
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.topology import (
    MAX_BANDWIDTH_BPS, MAX_RECORD_GROUPS, MAX_RECORD_LINKS, MAX_RECORD_NEIGHBOURS, MAX_RECORDS_PER_MESSAGE, MAX_RTT_S,
    LinkReport, TopologyRecord, TopologyRecords, topology_record_signing_bytes)

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


class RecordFlooding:
    """The records half of TopologyService (see peer/topology/service.py for the attributes it uses)."""

    def holds(self, peer_id: str, group: str) -> bool | None:
        """Does `peer_id`'s latest record list averaging group `group`? None: no record of it yet."""
        rec = self.records.get(peer_id)
        return None if rec is None else group in rec.groups

    def fresh_records(self) -> list[TopologyRecord]:
        """Others' records refreshed within RECORD_TTL (a peer that stopped refreshing is gone)."""
        now = trio.current_time()
        return [r for pid, r in self.records.items() if now - self.record_seen.get(pid, -1e9) < RECORD_TTL]

    def view(self) -> GraphView:
        """The graph as far as I know it: my edges for sure, others' from their fresh records."""
        now = trio.current_time()
        live = set(self.membership.connected()) | {self.me}
        nodes = set(live)
        claims: dict[str, set[str]] = {self.me: set(self.neighbours)}
        for pid, rec in self.records.items():
            if now - self.record_seen.get(pid, -1e9) > RECORD_TTL and pid not in live:
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
        reports[self.me] = {p: s.estimate() for p, s in self.links.items() if p in nodes and p != self.me}
        return GraphView.from_reports(nodes, edges, reports)

    def own_record(self) -> TopologyRecord:
        links = [LinkReport(peer=p, bandwidth_bps=None if s.bandwidth_bps is None else min(s.bandwidth_bps, MAX_BANDWIDTH_BPS),
                            rtt_s=None if s.rtt_s is None else min(s.rtt_s, MAX_RTT_S))
                 for p, s in sorted(self.links.items()) if s.bandwidth_bps is not None or s.rtt_s is not None]
        rec = TopologyRecord(peer_id=self.me, public_key=ident.public_key_bytes(self.identity), version=self.version,
                             issued=time.time(), neighbours=sorted(self.neighbours)[:MAX_RECORD_NEIGHBOURS],
                             links=links[:MAX_RECORD_LINKS], signature=b"", stage=self.announce_stage(),
                             groups=self.announce_groups()[:MAX_RECORD_GROUPS])
        sig = ident.sign(self.identity, topology_record_signing_bytes(rec))
        return dataclasses.replace(rec, signature=sig)

    async def _record_loop(self) -> None:
        while True:
            # refresh RTTs from membership's heartbeats
            for pid, info in self.membership.peers.items():
                if info.rtt is not None and info.state == "connected":
                    self.link(pid).rtt_s = info.rtt
            self._changed = trio.Event()  # changes from here on trigger the next broadcast early
            try:
                await self._broadcast()
            except Exception:  # a bug here must not end the daemon: the next round tries again
                log.exception("topology record broadcast failed; retrying next round")
            with trio.move_on_after(self.cfg.record_interval * random.uniform(0.8, 1.2)):
                await self._changed.wait()
                await trio.sleep(0.05)  # coalesce bursts of changes

    def broadcast_messages(self) -> list[TopologyRecords]:
        """Our record and the fresh ones we hold, split into messages under the message limit.

        A record's size is that of a message holding it alone, an upper bound on what it adds to a
        batch, so no batch can exceed the limit whatever records we hold."""
        own = self.own_record()
        now = trio.current_time()
        fresh = [(own, _wire_bytes(own))] + [(r, self.record_bytes[pid]) for pid, r in self.records.items()
                                             if now - self.record_seen.get(pid, -1e9) < RECORD_TTL]
        budget = self.daemon.transport.limits.max_message_bytes
        batches: list[list[TopologyRecord]] = [[]]
        size = 0
        for rec, n in fresh:
            if n > budget:  # only a tiny configured message limit can make one record too big
                log.warning("topology record of %s (%d bytes) exceeds max_message_bytes; not sent",
                            ident.short_id(rec.peer_id), n)
                continue
            if batches[-1] and (size + n > budget or len(batches[-1]) >= MAX_RECORDS_PER_MESSAGE):
                batches.append([])
                size = 0
            batches[-1].append(rec)
            size += n
        return [TopologyRecords(records=b) for b in batches if b]

    async def _broadcast(self) -> None:
        # to every session at once, waiting on none: a peer that stops reading delays only itself (Fanout)
        self._fanout.send(self._nursery, list(self.membership.connected().values()), *self.broadcast_messages())

    def admits(self, origin: str, sender: str) -> bool:
        """Whether a record of `origin` relayed by `sender` may enter the view: we have (or recently had)
        a session with its origin, the sender is a topology neighbour (a neighbour relaying it vouches
        for it: honest records flood along neighbour edges, so every peer still hears of every other), or
        the view holds the origin already (a newer signed record of it adds nothing to hold). So a peer
        that is no neighbour of ours cannot fill the view with throwaway identities."""
        return origin in self.met or sender in self.neighbours or origin in self.records

    async def _on_records(self, session, env) -> None:
        # the schema bounded each record's fields and size at decode time (a bad one closed the session)
        refused = 0
        for rec in env.message.records:
            if rec.peer_id == self.me:
                continue
            if not self.admits(rec.peer_id, session.peer_id):
                # not a protocol error: an honest peer floods records of peers we have not met
                refused += 1
                continue
            old = self.records.get(rec.peer_id)
            if old is not None and (old.version, old.issued) >= (rec.version, rec.issued):
                continue
            if ident.peer_id_from_public_bytes(rec.public_key) != rec.peer_id or not ident.verify(
                    rec.public_key, rec.signature, topology_record_signing_bytes(rec)):
                log.debug("dropping topology record for %s relayed by %s: bad signature", ident.short_id(rec.peer_id), session.short)
                continue
            self.records[rec.peer_id] = rec
            self.record_seen[rec.peer_id] = trio.current_time()
            self.record_bytes[rec.peer_id] = _wire_bytes(rec)
            if rec.peer_id in self.neighbours:
                self.neighbours[rec.peer_id].degree = len(rec.neighbours)
        if refused:
            self.records_unvouched += refused
            log.debug("%d topology records from %s refused: origins unknown to us and it is no neighbour",
                      refused, session.short)
        if len(self.records) > MAX_VIEW_RECORDS:  # bound memory: forget the stalest
            for pid in sorted(self.records, key=lambda p: self.record_seen.get(p, 0))[:len(self.records) - MAX_VIEW_RECORDS]:
                self.records.pop(pid, None)
                self.record_seen.pop(pid, None)
                self.record_bytes.pop(pid, None)


def _wire_bytes(rec: TopologyRecord) -> int:
    """Encoded bytes of a message holding just this record (an upper bound on its share of a batch)."""
    return len(DEFAULT_REGISTRY.encode(TopologyRecords(records=[rec])))

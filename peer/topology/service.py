"""The topology service: which peers are my gossip neighbours, and how the graph improves over time.

Edges are agreed by both endpoints with propose → accept → commit (an `Edges`, edges.py). Every peer
floods a signed `TopologyRecord` (neighbours + measured links); the latest records (a `RecordBook`,
records.py) form the local `GraphView` from which mixing weights, the spectral gap and rewiring moves
are computed. Fixed kinds (ring, exponential, random_regular, full) derive the wanted edges from the
sorted IDs of known peers; `rewired` asks `plan_move` for one randomized, rate-limited move at a time.

Link figures come from real averaging transfers (`record_transfer`) and, for candidates we are not yet
neighbours with, small probes within a byte budget.

What our record carries besides edges and links (the stage we serve, the groups we share, our training
figures) the services that have it give when the record is built (`HasRecordFields`, peer/services.py);
this service keeps the sessions with its neighbours (`KeepsSessions`), gives the partial views its link
figures (`MeasuresLinks`) and follows the edges they choose (`FollowsViewEdges`). Which view mode runs it
asks `membership.views` (peer/membership/view_mode.py).
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import TYPE_CHECKING

import numpy as np
import trio

from peer.topology.edges import Edges, Neighbour
from peer.topology.fixed import build_fixed
from peer.topology.graph import GraphView
from peer.topology.links import LinkStats
from peer.topology.mixing import metropolis_weight
from peer.topology.records import RecordBook, signed_record
from peer.topology.rewire import RewireConfig, plan_move
from peer.topology.spectral import SpectralWorker
from peer.peer_curves import PeerCurves
from peer.session.fanout import Fanout
from peer.session.transport import SessionClosed
from peer.services import HasRecordFields
from protocol import identity as ident
from protocol.schema.topology import (
    EdgeCommit, EdgeDrop, EdgePropose, ProbeReply, ProbeRequest, TopologyRecord, TopologyRecords)

if TYPE_CHECKING:
    from peer.services import DaemonContext
    from peer.topology.graph import LinkEstimate

log = logging.getLogger("peertrain.topology")

PROBE_BYTES = 256 * 1024
PROBE_EVERY = 10.0  # seconds between probes of one peer (neighbours too: estimates must be comparable)
SHARD_BYTES = 16 << 20
"""What the rewiring plans an exchange at until a group is shared (then: the largest group's bytes): a
mid-sized model's, so link figures weigh as they will once training starts."""


class TopologyService:
    """Owns my `Edges` and the `RecordBook` of others' records, and decides which edges to want."""

    name = "topology"

    def __init__(self, daemon: DaemonContext):
        self.daemon = daemon
        self.cfg = daemon.config.topology
        self.me = daemon.peer_id
        self.identity = daemon.identity
        self.membership = daemon.membership
        # partial views (`[membership] views = "partial"`, or "auto" once switched): the views choose the edges
        # (peer/membership/views.py); this service takes them as they come, proposes none itself (accepts a
        # full-view peer's), and sends records to neighbours only (ours, and the stage records pipelines use)
        self.views = self.membership.views
        self.edges = Edges(self.cfg, sessions=self.membership.connected, wanted_fixed=self._wanted_fixed,
                           changed=self._bump, dropped_by_them=lambda: self._others_moved.set(),
                           set_by_views=lambda: self.views.chooses_edges)
        self.records = RecordBook(self.me, is_neighbour=self.is_neighbour)
        self.peer_training = PeerCurves()  # others' loss curves, from their records' training figures
        self.links: dict[str, LinkStats] = {}
        self.spectral = SpectralWorker()
        self._gap_stale = trio.Event()  # status saw a view whose gap is not computed yet
        # Records are ordered by version: start from the wall clock in ms, so a restarted daemon (same identity)
        # issues records newer than its previous life's, and peers that still hold those believe the new ones.
        self.version = time.time_ns() // 1_000_000
        self._shard_bytes = SHARD_BYTES  # the last contributed figure stays when the groups go
        self.last_move = ""
        self.moves = 0
        self.rng = np.random.default_rng(int.from_bytes(self.me.encode()[:8], "little") ^ (time.time_ns() & 0xFFFF))
        self._changed = trio.Event()  # our record changed: broadcast it early
        self._nursery: trio.Nursery | None = None  # run()'s, once started
        self._fanout = Fanout()  # record broadcasts: one in flight per session
        self._others_moved = trio.Event()  # a peer came or went, or dropped our edge: maintain early
        r = daemon.router
        r.register(EdgePropose, self.edges.on_propose)
        r.register(EdgeCommit, self.edges.on_commit)
        r.register(EdgeDrop, self.edges.on_drop)
        r.register(TopologyRecords, self._on_records)
        r.register(ProbeRequest, self._on_probe)
        self.membership.watch(self._on_peer)

    # ---- queries used by the gossip engine and status -----------------------------------------------
    @property
    def neighbours(self) -> dict[str, Neighbour]:
        return self.edges.neighbours

    @property
    def degree(self) -> int:
        return self.edges.degree

    def is_neighbour(self, peer_id: str) -> bool:
        return peer_id in self.neighbours

    def keeps_session(self, peer_id: str) -> bool:
        """KeepsSessions: a neighbour's session is never closed as idle."""
        return self.is_neighbour(peer_id)

    def link_estimate(self, peer_id: str) -> LinkEstimate | None:
        """MeasuresLinks: our figures for the link to `peer_id` (the partial views' rewiring reads them)."""
        st = self.links.get(peer_id)
        return None if st is None else st.estimate()

    @property
    def shard_bytes(self) -> int:
        """What one averaging exchange sends each way: the largest contribution (the gossip engine's groups)."""
        sizes = [b for f in self._fields() if (b := f.shard_bytes) is not None]
        if sizes:
            self._shard_bytes = max(sizes)
        return self._shard_bytes

    def link(self, peer_id: str) -> LinkStats:
        st = self.links.get(peer_id)
        if st is None:
            st = self.links[peer_id] = LinkStats()
        return st

    def announce_soon(self) -> None:
        """Our record changed in a way others should hear of now (say, the stage we serve)."""
        self._changed.set()

    def record_transfer(self, peer_id: str, nbytes: int, seconds: float) -> None:
        self.link(peer_id).add_transfer(nbytes, seconds, trio.current_time())

    def holds(self, peer_id: str, group: str) -> bool | None:
        """Does `peer_id`'s latest record list averaging group `group`? None: no record of it yet."""
        return self.records.holds(peer_id, group)

    def fresh_records(self) -> list[TopologyRecord]:
        """Others' records refreshed within RECORD_TTL (a peer that stopped refreshing is gone)."""
        return self.records.fresh()

    def view(self) -> GraphView:
        """The graph as far as I know it: my edges for sure, others' from their fresh records."""
        return self.records.view(self.membership.connected(), self.neighbours, self.links)

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n  # owns the record sends (Fanout)
            n.start_soon(self._record_loop)
            n.start_soon(self._maintain_loop)
            n.start_soon(self._probe_loop)
            n.start_soon(self._gap_loop)
            task_status.started()

    def _on_peer(self, peer_id: str, session) -> None:
        if session is None:
            self.edges.session_ended(peer_id)
        else:
            self.records.met_session(peer_id)
            self.link(peer_id)
            self._changed.set()
        self._others_moved.set()

    def view_edge(self, peer_id: str, up: bool, reason: str, degree: int) -> None:
        """FollowsViewEdges: the partial views made `peer_id` a gossip neighbour, or no longer one."""
        if up:
            self.edges.set_neighbour(peer_id, degree)
        else:
            self.edges.unset_neighbour(peer_id, reason)

    def _bump(self) -> None:
        """Our edges changed: issue a newer record, and broadcast it early."""
        self.version += 1
        self._changed.set()

    # ---- records ------------------------------------------------------------------------------------
    def _fields(self) -> list:
        return [s.record_fields() for s in self.daemon.services.providing(HasRecordFields)]

    def own_record(self) -> TopologyRecord:
        """Our signed record: our edges and links, and what the services contribute (HasRecordFields): the
        groups of all of them, and the stage and the training figures of the first that has any."""
        fields = self._fields()
        return signed_record(self.identity, self.me, version=self.version, neighbours=self.neighbours, links=self.links,
                             stage=next((f.stage for f in fields if f.stage is not None), None),
                             groups=sorted({g for f in fields for g in f.groups}),
                             training=next((f.training for f in fields if f.training is not None), None))

    def broadcast_messages(self) -> list[TopologyRecords]:
        """Our record and the fresh ones we hold (under partial views, those that announce a pipeline
        stage), in messages under the message limit."""
        only = (lambda rec: rec.stage is not None) if self.views.chooses_edges else None
        return self.records.broadcast_messages(self.own_record(), self.daemon.transport.limits.max_message_bytes,
                                               only=only)

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

    async def _broadcast(self) -> None:
        # to every session at once, waiting on none: a peer that stops reading delays only itself (Fanout)
        sessions = self.membership.connected()
        if self.views.chooses_edges:  # partial views: along gossip edges only (bounded fan-out)
            sessions = {p: s for p, s in sessions.items() if p in self.neighbours}
        self._fanout.send(self._nursery, list(sessions.values()), *self.broadcast_messages())

    async def _on_records(self, session, env) -> None:
        now = time.time()
        for rec in self.records.receive(env.message.records, session.peer_id):
            if rec.peer_id in self.neighbours:
                self.neighbours[rec.peer_id].degree = len(rec.neighbours)
            self.peer_training.heard(rec.peer_id, rec.training, now)
        self.peer_training.retain(self.records.records)  # a forgotten record's curve goes with it

    # ---- keeping the graph good ---------------------------------------------------------------------
    def _wanted_fixed(self) -> set[str]:
        ids = sorted(set(self.membership.connected()) | {self.me})
        edges = build_fixed(self.cfg.kind, ids, degree=self.cfg.target_degree, seed=self.cfg.seed)
        return {next(iter(e - {self.me})) for e in edges if self.me in e}

    def rewire_config(self) -> RewireConfig:
        return RewireConfig(shard_bytes=self.shard_bytes, target_degree=self.cfg.target_degree,
                            min_degree=self.cfg.min_degree, max_degree=self.cfg.max_degree,
                            gap_floor=self.cfg.gap_floor, confidence=self.cfg.confidence)

    async def _maintain_loop(self) -> None:
        while True:
            self.edges.expire_reservations(trio.current_time())
            if self.views.chooses_edges:
                await self._leave_proposed_edges()
                return  # the partial views keep the edges (and their rewiring rule moves them)
            try:
                if self.cfg.kind == "rewired":
                    await self._rewire_once()
                else:
                    await self._reconcile_fixed()
                await self._reconcile_with_records()
            except Exception:
                log.exception("topology maintenance failed; retrying next round")
            fast = self.degree < self.cfg.min_degree
            await self._pause((0.3 if fast else self.cfg.rewire_interval) * random.uniform(0.5, 1.5))

    async def _leave_proposed_edges(self) -> None:
        """Partial views took over from the full view ("auto"): once they hold min_degree edges, drop the
        full view's proposed ones, once (a full-view peer's later proposals are accepted: the bridge of a
        mixed swarm). A daemon that ran partial views from the start holds none."""
        while any(not n.by_views for n in self.neighbours.values()):
            if sum(n.by_views for n in self.neighbours.values()) >= self.cfg.min_degree:
                for pid in [p for p, n in self.neighbours.items() if not n.by_views]:
                    await self.edges.drop(pid, "partial views took over")
                return
            await trio.sleep(self.cfg.rewire_interval)

    async def _pause(self, seconds: float) -> None:
        """Sleep between maintenance rounds, but wake early when others changed the graph under us and
        there is something to repair: a fixed topology's edges follow membership at once (its rounds
        are cheap), and a peer below min_degree looks for edges at once. Rewiring moves of a healthy
        peer stay on their randomized, rate-limited schedule."""
        with trio.move_on_after(seconds):
            while True:
                await self._others_moved.wait()
                self._others_moved = trio.Event()
                if self.cfg.kind != "rewired" or self.degree < self.cfg.min_degree:
                    await trio.sleep(0.05)  # coalesce a burst (several peers arriving together)
                    return

    async def _reconcile_fixed(self) -> None:
        wanted = self._wanted_fixed()
        for pid in list(self.neighbours):
            if pid not in wanted:
                await self.edges.drop(pid, f"not in the {self.cfg.kind} topology")
        for pid in sorted(wanted - set(self.neighbours)):
            if self.me < pid:  # one side proposes, so fixed edges are not proposed twice
                await self.edges.add(pid, f"{self.cfg.kind} topology")

    async def _rewire_once(self) -> None:
        view = self.view()
        if len(view.nodes) < 2:
            return
        cands = {p: s.estimate() for p, s in self.links.items()
                 if p not in self.neighbours and p in self.membership.connected()}
        # in the worker thread: up to max_evaluations eigensolves of a view of up to MAX_VIEW_RECORDS nodes
        move = await self.spectral.run(plan_move, view, self.me, self.rewire_config(), self.rng, cands or None)
        if move is None:
            return
        ok = True
        if move.add is not None:
            ok = await self.edges.add(move.add, move.reason)
        if ok and move.drop is not None:
            # never drop an edge that would leave the neighbour below min degree as far as we know
            # (a relink: below it by one at most, never without neighbours)
            nd = self.neighbours.get(move.drop)
            keep = max(1, self.cfg.min_degree - 1) if move.drop_below_min else self.cfg.min_degree
            if nd is None or view.degree(move.drop) > keep:
                await self.edges.drop(move.drop, move.reason)
        if ok:
            self.moves += 1
            self.last_move = (f"{move.kind}: " + (f"+{ident.short_id(move.add)} " if move.add else "")
                              + (f"-{ident.short_id(move.drop)} " if move.drop else "")
                              + f"({move.reason}; gap {move.gap_before:.3f}→{move.gap_after:.3f}, "
                              f"round {move.predicted_round_time_before * 1000:.0f}→{move.predicted_round_time_after * 1000:.0f} ms)")
            log.info("rewired %s", self.last_move)

    async def _reconcile_with_records(self) -> None:
        """An edge the other end's fresh record does not list (and we did not just add) is dropped."""
        now = time.time()
        for pid, nb in list(self.neighbours.items()):
            rec = self.records.get(pid)
            if rec is None or rec.issued < nb.since + 2 * self.cfg.record_interval or now - nb.since < 3 * self.cfg.record_interval:
                continue
            if self.me not in rec.neighbours:
                self.edges.remove_unlisted(pid)

    # ---- probes -------------------------------------------------------------------------------------
    async def _probe_loop(self) -> None:
        """Measure throughput to candidates we have no figure for, one small probe at a time."""
        if self.cfg.kind != "rewired":
            return
        while True:
            await trio.sleep(random.uniform(0.5, 1.5))
            if self.views.chooses_edges:
                return  # (partial views measure links by the averaging transfers over their edges)
            now = trio.current_time()
            conn = self.membership.connected()
            todo = [p for p in conn if now - self.link(p).probed > PROBE_EVERY]
            if not todo:
                continue
            pid = random.choice(todo)
            st = self.link(pid)
            st.probed = now
            t0 = trio.current_time()
            try:
                env = await conn[pid].request(ProbeRequest(nbytes=PROBE_BYTES), timeout=20.0)
            except (trio.TooSlowError, SessionClosed):
                continue
            if isinstance(env.message, ProbeReply):
                st.add_probe(len(env.message.payload), trio.current_time() - t0, trio.current_time())

    async def _on_probe(self, session, env) -> None:
        n = max(0, min(env.message.nbytes, PROBE_BYTES))
        await session.reply(env, ProbeReply(payload=bytes(n)))

    # ---- status -------------------------------------------------------------------------------------
    async def _gap_loop(self) -> None:
        """Solve the view's gap when status found it stale (in the worker thread; `peer status` never waits)."""
        while True:
            await self._gap_stale.wait()
            self._gap_stale = trio.Event()
            await self.spectral.view_gap(self.view())

    def status(self) -> dict:
        view = self.view()
        gap_current = self.spectral.is_current(view)
        if not gap_current:
            self._gap_stale.set()  # report the last gap now, the current one on a later call
        gap = self.spectral.gap
        nbrs = []
        for pid in sorted(self.neighbours):
            # the neighbour's own record may not list us yet; it has at least this edge
            d = max(1, view.degree(pid) if pid in view.nodes else self.neighbours[pid].degree)
            st = self.link(pid)
            nbrs.append({"peer_id": pid, "weight": round(metropolis_weight(self.degree, d), 4), "degree": d,
                         "bandwidth_bps": st.bandwidth_bps, "rtt_s": st.rtt_s,
                         # the bandwidth is good to within this factor (one standard error) either way
                         "bandwidth_spread": round(math.exp(st.log_se), 3) if st.bandwidth_bps else None})
        return {"kind": self.cfg.kind, "degree": self.degree, "neighbours": nbrs,
                "self_weight": round(1 - sum(n["weight"] for n in nbrs), 4),
                "view_nodes": len(view.nodes), "view_edges": len(view.edges), "spectral_gap": round(gap, 4),
                "spectral_gap_current": gap_current, "records_unvouched": self.records.unvouched,
                "connected_view": view.is_connected(), "moves": self.moves, "last_move": self.last_move,
                "version": self.version, "peer_training": self.peer_training.status(),
                **self.views.status_fields()}

    async def topology(self) -> dict:
        view = self.view()
        gap = await self.spectral.view_gap(view)
        return {"me": self.me, "nodes": sorted(view.nodes),
                "edges": sorted(sorted(e) for e in view.edges),
                "links": [{"a": min(e), "b": max(e), "bandwidth_bps": v.bandwidth_bps, "rtt_s": v.rtt_s}
                          for e, v in view.links.items() if e in view.edges],
                "spectral_gap": round(gap, 4), "status": self.status()}

    def commands(self) -> dict:
        async def topology(args):
            return await self.topology()
        return {"topology": topology}

"""The pipeline service: serves this daemon's stage, runs its drivers, and says what the pipeline looks like.

Always loaded (like the averaging engine): a daemon that serves no stage refuses stage calls with a reason.
A trainer (trainers/swarm_pipeline.py) tells it what to serve through the Swarm handle (`serve_stage`),
opens drivers (`open_driver`) and reads the stage map. The stage a server holds travels in its topology
record; the stage map is the fresh records' announcements joined with the sessions we have. Under
`[membership] views = "partial"` a server also announces where to dial it, the map counts the servers we
have no session with as well, and a driver that picks one reaches it through membership (`reach`: one bounded
lookup, peer/membership/reach.py); a session stays up while a call is out on it, either way (`KeepsSessions`).
Which view mode runs, it asks membership's `views` (peer/membership/view_mode.py); its stage goes into our
topology record as `HasRecordFields` (peer/services.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from peer.averaging.bans import BanList
from peer.pipeline.directory import bottleneck, capacity, stage_map
from peer.pipeline.driver import Driver, DriverHandle
from peer.pipeline import memory_budget
from peer.pipeline.kept import SWEEP_S
from peer.pipeline.placement import adopted_cut
from peer.pipeline.stage_moves import state_sources
from peer.pipeline.seating import Seating
from peer.pipeline.server import ServedStage, StageServer
from peer.pipeline.state_transfer import KeptCopy, SpecCheck, StageStates
from peer.services import RecordFields
from peertrain.pipeline import FetchedState, PipelineKey, StageHandler, StagePeer, StateSource, StateUnavailable
from protocol.bounds import MAX_ADDRESS_CHARS
from protocol.schema.pipeline import (MAX_BLOCKS, MAX_MEMORY_MIB, MAX_PROFILED_BLOCKS, MAX_QUEUE, MAX_SAMPLES_PER_S,
                                      MAX_STEP, BlockProfile, StageAck, StageAnnouncement, StageCall,
                                      StageStateRequest)

if TYPE_CHECKING:
    from peer.services import DaemonContext
    from peer.topology.service import TopologyService

log = logging.getLogger("peertrain.pipeline")

MOVES_KEPT = 10  # moves `peer status` lists: enough to see a rebalancing settle, short enough to read
DIALED_KEPT = 16  # servers reached by a lookup that `peer status` names (the latest; the count is of all)


class PipelineService:
    name = "pipeline"

    def __init__(self, daemon: DaemonContext, topology: TopologyService):
        self.daemon = daemon
        self.cfg = daemon.config.pipeline
        self.me = daemon.peer_id
        self.topology = topology
        self.server = StageServer(self.cfg)
        self.drivers: dict[str, Driver] = {}
        self.loss: dict[str, Any] = {}  # the trainer's latest figures for the stage map (publish_pipeline)
        self.states = StageStates(self, self.cfg, daemon.home.stage_copies)
        self.moving_to = -1  # the stage we are moving to (downloading its state), announced while it lasts
        # where we serve: decided here from the records, the job's figures and a record interval's patience
        self.seating = Seating(self, self.me, confirm_s=daemon.config.topology.record_interval)
        self.moves: deque[dict] = deque(maxlen=MOVES_KEPT)
        self.budget = memory_budget.budget(self.cfg.memory_mib)  # read once, at start (memory_budget.py says why)
        self.profiles: list[BlockProfile] = []  # our measured blocks, announced (trainers/pipeline/profiles.py)
        self.memory_mib = memory_budget.mib(self.budget.bytes)  # the budget we announce (the trainer's, on a GPU)
        self.stage_room_mib = 0  # of which a stage may use
        # Peers our drivers' checks found lying (peer/pipeline/verify.py): no call goes to them, our stage does not
        # average with them nor fetch its state from them, while banned. One list for all our drivers.
        self.bans = BanList()
        self._nursery: trio.Nursery | None = None
        # partial views: servers we reach by a lookup (their announcement's addresses)
        self.views = daemon.membership.views
        self.dialed_servers = 0  # sessions with stage servers our drivers' lookups made
        self.dialed: deque[str] = deque(maxlen=DIALED_KEPT)
        daemon.router.register(StageCall, self._on_call)
        daemon.router.register(StageAck, self._on_ack)
        daemon.router.register(StageStateRequest, self._on_state_request)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n  # owns the calls we serve and the microbatches our drivers move
            n.start_soon(self.server.release_dropped)
            n.start_soon(self.seating.run)
            task_status.started()
            while True:  # gradients nobody acknowledged go even when no call comes (they hold memory)
                await trio.sleep(SWEEP_S)
                self.server.kept.expire(trio.current_time())
                self.server.poke()

    async def _on_call(self, session, env) -> None:
        await self.server.on_call(session, env, self._nursery)

    async def _on_ack(self, session, env) -> None:
        await self.server.on_ack(session, env, self._nursery)

    async def _on_state_request(self, session, env) -> None:
        await self.states.on_request(session, env, self._nursery)

    # ---- serving ------------------------------------------------------------------------------------
    def serve(self, key: PipelineKey, stage: int, max_batch: int, handler: StageHandler, *, ready: bool = True) -> None:
        """Serve `stage` of pipeline `key` from now on (replacing what we served) and tell the swarm at once.
        Calls held for the stage we served before are handed back (server.py, `moved`). Not `ready`: we are a
        member of the stage (we may fetch its state) but refuse calls until `set_ready`."""
        StageAnnouncement(key.name, stage, key.stages, cuts=list(key.cuts))  # a receiver's checks: a clear error here
        self.server.switch(ServedStage(key, stage, max_batch, handler, ready))
        self.moving_to = -1
        log.info("serving stage %d of %d of pipeline %r (cut at blocks %s)", stage, key.stages, key.name, list(key.cuts))
        self.topology.announce_soon()

    def set_ready(self) -> None:
        if self.server.stage is not None:
            self.server.stage.ready = True

    def announce_move(self, moving_to: int) -> None:
        """Say in our record that we are moving to a stage (-1: not any more). The stage we left lately is
        seating's to announce (its cool-down)."""
        self.moving_to = moving_to
        self.topology.announce_soon()

    def announce_soon(self) -> None:
        self.topology.announce_soon()

    def announce_profile(self, profiles: list[BlockProfile], memory_bytes: int, stage_room_bytes: int) -> None:
        """Announce our measured blocks and our memory (budget, and what a stage may use of it): planners and
        movers elsewhere read them (trainers/pipeline/profiles.py, memory.py)."""
        self.profiles = list(profiles)[:MAX_PROFILED_BLOCKS]
        self.memory_mib, self.stage_room_mib = memory_budget.mib(max(0, memory_bytes)), memory_budget.mib(max(0, stage_room_bytes))
        self.topology.announce_soon()

    def note_move(self, move: dict) -> None:
        """Remember one of our moves for `peer status` (what, when, why, how long the state took); the stage
        left cools down (seating)."""
        self.moves.append({"at": time.time(), **move})
        if isinstance(move.get("from"), int) and isinstance(move.get("to"), int):
            self.seating.moved(move["from"], move["to"])

    async def fetch_state(self, key: PipelineKey, stage: int, peer_id: str, check: SpecCheck) -> FetchedState:
        if why := self.banned(peer_id):
            raise StateUnavailable(f"not asked: {why}")
        return await self.states.fetch(key, stage, peer_id, check)

    async def keep_copy(self, key: PipelineKey, stage: int, tensors: list, step: int, samples: int, *,
                        in_memory: bool = False) -> None:
        """Keep a copy of `stage`'s state: on disk (written in a worker thread), or in memory if `in_memory`."""
        await self.states.keep(key, stage, tensors, step, samples, in_memory=in_memory)
        self.topology.announce_soon()

    def copy_of(self, key: PipelineKey, stage: int) -> KeptCopy | None:
        """Our copy of `stage` (its tensors come with `load()`, off the trio thread), or None."""
        return self.states.get(key, stage)

    async def drop_copy(self, key: PipelineKey, stage: int) -> None:
        await self.states.drop(key, stage)
        self.topology.announce_soon()

    def stop_serving(self) -> None:
        if self.server.stage is not None:
            log.info("no longer serving stage %d of pipeline %r", self.server.stage.stage, self.server.stage.key.name)
        self.server.switch(None)
        self.topology.announce_soon()

    def record_fields(self) -> RecordFields:
        """HasRecordFields: our record says what we serve of a pipeline (None: nothing)."""
        return RecordFields(stage=self.announcement())

    def announcement(self) -> StageAnnouncement | None:
        st = self.server.stage
        if st is None:
            return None
        rate = st.handler.samples_per_s()
        rate = min(MAX_SAMPLES_PER_S, rate) if rate == rate and rate > 0 else 0.0  # NaN / negative: not measured
        def other(s: int) -> int:  # a stale value (we moved since) must not make our record invalid
            return s if 0 <= s < st.key.stages and s != st.stage else -1

        return StageAnnouncement(st.key.name, st.stage, st.key.stages, samples_per_s=rate,
                                 queue=min(MAX_QUEUE, self.server.stats.queue), cuts=list(st.key.cuts),
                                 step=min(MAX_STEP, max(0, int(getattr(st.handler, "steps", 0)))),
                                 moving_to=other(self.moving_to), moved_from=other(self.seating.cooling_from),
                                 copies=self.states.announced(st.key, st.stage),
                                 profiles=[p for p in self.profiles if p.block < MAX_BLOCKS],
                                 memory_mib=min(MAX_MEMORY_MIB, self.memory_mib),
                                 stage_room_mib=min(MAX_MEMORY_MIB, self.stage_room_mib),
                                 memory_used_mib=min(MAX_MEMORY_MIB, memory_budget.mib(memory_budget.rss_bytes())),
                                 addresses=self._my_addresses())

    def _my_addresses(self) -> list[str]:
        """Where a driver without a session dials us: our view entry's addresses (direct, then up to two relayed),
        under partial views only (a full view dials every peer it hears of anyway); none too long for the schema."""
        return [a for a in self.views.dial_addresses() if len(a) <= MAX_ADDRESS_CHARS]

    # ---- who serves what ------------------------------------------------------------------------------
    def announcements(self) -> dict[str, StageAnnouncement]:
        """What every peer we hear of (and we) announce serving, by peer."""
        out = {r.peer_id: r.stage for r in self.topology.fresh_records() if r.stage is not None}
        own = self.announcement()
        if own is not None:
            out[self.me] = own
        return out

    def stage_map(self, key: PipelineKey) -> dict[int, list[StagePeer]]:
        """Live peers of each stage: those we have a session with and, under partial views, those whose fresh
        announcement says where to dial them (a driver that picks one reaches it: `reach`)."""
        anns = self.announcements()
        live = set(self.daemon.membership.connected())
        live |= {p for p, a in anns.items() if self.views.can_reach(a.addresses)}
        return stage_map(key, anns, live, self.me)

    def stage_partners(self) -> set[str]:
        """Live peers serving the same stage as we do, that we have a session with: who averages that stage's
        parameters with us (under partial views, the stage's peers we were brought a session with)."""
        st = self.server.stage
        if st is None:
            return set()
        connected = self.daemon.membership.connected()
        return {p.peer_id for p in self.stage_map(st.key)[st.stage]
                if not p.me and p.peer_id in connected and not self.banned(p.peer_id)}

    def state_sources(self, key: PipelineKey, stage: int) -> list[StateSource]:
        """Live peers of `key` that can hand out `stage`'s state, freshest first (stage_moves.state_sources)."""
        live = {p.peer_id for peers in self.stage_map(key).values() for p in peers}
        return state_sources(self.announcements(), live, lambda a: PipelineKey.of(a) == key, stage, self.me)

    def own_copy_step(self, key: PipelineKey, stage: int) -> int | None:
        """The step of our copy of `stage`, or None."""
        copy = self.states.get(key, stage)
        return copy.step if copy is not None else None

    def adopted_cut(self, name: str, own: tuple[int, ...]) -> tuple[int, ...]:
        """The cut of pipeline `name` to serve (placement.adopted_cut): the smallest announcing peer ID's."""
        return adopted_cut(name, own, self.announcements(), self.me)

    def banned(self, peer_id: str) -> str | None:
        """Why our drivers banned `peer_id` for lying in its stage's answers, or None."""
        return self.bans.banned(peer_id, trio.current_time())

    def session_of(self, peer_id: str):
        if peer_id == self.me:
            return None  # a call to ourselves goes nowhere: our own stage is served to others only
        return self.daemon.membership.connected().get(peer_id)

    async def reach(self, peer_id: str):
        """The session with `peer_id`, dialed through membership if we have none (partial views: at the addresses
        its fresh announcement names; one bounded lookup, peer/membership/reach.py). None under full views or
        with no announced address; raises `Unreachable` (`ReachBusy`: too many lookups pending) otherwise."""
        session = self.session_of(peer_id)
        if session is not None or peer_id == self.me:
            return session
        ann = self.announcements().get(peer_id)
        if ann is None or not self.views.can_reach(ann.addresses):
            return None

        def reached() -> None:
            self.dialed_servers += 1
            self.dialed.append(peer_id)
            log.info("reached stage %d server %s by its announcement's addresses", ann.stage, peer_id[:8])

        return await self.views.reach_session(peer_id, list(ann.addresses), on_reached=reached)

    def keeps_session(self, peer_id: str) -> bool:
        """KeepsSessions: whether a call is out between us and `peer_id`: one of our drivers' at it, or its at our
        stage (its session stays up meanwhile, however long the compute; once none is, the view driver closes it
        after SESSION_IDLE_S without a message, as any idle session)."""
        return self.server.per_peer.get(peer_id, 0) > 0 or any(d.calling(peer_id) for d in self.drivers.values())

    # ---- driving ------------------------------------------------------------------------------------
    def open_driver(self, key: PipelineKey, *, reply_shapes, in_flight: int, token, stopped,
                    forward_codec: str = "raw", backward_codec: str = "raw") -> DriverHandle:
        driver = Driver(self, key, reply_shapes=reply_shapes, forward_codec=forward_codec,
                        backward_codec=backward_codec, stopped=stopped, bans=self.bans)
        self.drivers[key.name] = driver
        return DriverHandle(driver, self._nursery, token, in_flight, stopped)

    # ---- status -------------------------------------------------------------------------------------
    def status(self) -> dict:
        st = self.server.stage
        driver = next(iter(self.drivers.values()), None)
        key = st.key if st else (driver.key if driver else None)
        if key is None:
            return {}
        now = trio.current_time()
        smap = self.stage_map(key)
        out: dict[str, Any] = {
            "pipeline": key.name, "stages": key.stages, "cuts": list(key.cuts), "my_stage": st.stage if st else None,
            "role": "+".join(r for r, on in (("server", st is not None), ("driver", driver is not None)) if on),
            "bottleneck": bottleneck(smap),
            "stage_map": [{"stage": s, "capacity": round(capacity(peers), 2),
                           "peers": [{"peer_id": p.peer_id, "samples_per_s": round(p.samples_per_s, 2),
                                      "queue": p.queue, "me": p.me, "step": p.step, "moving_to": p.moving_to,
                                      "memory_mib": p.memory_mib, "memory_used_mib": p.memory_used_mib,
                                      "avoided": driver.balancers[s].avoided(p.peer_id, now) if driver else None}
                                     for p in peers]} for s, peers in smap.items()],
            "memory": {"budget_mib": self.memory_mib, "stage_room_mib": self.stage_room_mib,
                       "used_mib": memory_budget.mib(memory_budget.rss_bytes()), "source": self.budget.source},
            "moving_to": self.moving_to if self.moving_to >= 0 else None,
            "moves": list(self.moves),
            "seating": self.seating.status(),
            "state_transfers": self.states.status(),
            "server": {"served": self.server.stats.served, "refused": dict(self.server.stats.refused),
                       "failed": self.server.stats.failed, "handed_back": self.server.stats.handed_back,
                       "queue": self.server.stats.queue,
                       "queue_remote": sum(self.server.per_peer.values()),  # of which other drivers' calls
                       "compute_s": round(self.server.stats.compute_s, 3), "last_error": self.server.stats.last_error,
                       "accumulated_samples": self.server.stats.accumulated_samples,
                       "accumulated_by_stage": {str(s): n for s, n in sorted(self.server.stats.accumulated_by_stage.items())},
                       **self.server.kept.status()},
            **self.loss,
        }
        if driver is not None:
            d = driver.stats
            out["driver"] = {
                "done": d.done, "failed": d.failed, "retried": d.retried, "resent": d.resent, "busy": d.busy,
                "in_flight": d.in_flight,
                "evaluated": d.evaluated, "samples": d.samples, "loss": d.last_loss,
                "waiting": [{"stage": s, "for_s": round(now - since, 1)} for s, since in sorted(d.waiting.items())],
                "calls": dict(d.calls), "failures": [{"microbatch": m, "reason": r} for m, r in d.failures],
                "deadline_s": round(sorted(d.deadlines)[len(d.deadlines) // 2], 3) if d.deadlines else None,
                "acked": d.acked, "acked_samples": [d.acked_samples.get(s, 0) for s in range(driver.key.stages)],
                "ack_lost": d.ack_lost, "ack_moved": d.ack_moved, "dropped": d.dropped, "struck": dict(d.struck),
                "verify": driver.verifier.status(),
            }
        wall = time.time()
        if (lookups := self.views.reach_status()) is not None:  # partial views make lookups
            out["reach"] = {"dialed_servers": self.dialed_servers, "dialed": list(self.dialed), **lookups}
        out["bans"] = [{"peer": p, "until": round(wall + left, 1), "reason": reason}
                       for p, left, reason in self.bans.active(now)]
        return out

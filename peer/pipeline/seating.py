"""Where this peer serves in its pipeline: the daemon decides, the job moves.

The job (trainers/swarm_pipeline.py) holds the model, so only it can say what each stage of its cut costs in
compute and memory; it gives those figures (`SeatFigures`, peertrain/pipeline.py) whenever they change. The
rest (who serves which stage, how fast, what memory they announce, who keeps copies) is in the records this
daemon already holds, so the decisions are made here, every TICK_S, by the pure rules of placement.py and
stage_moves.py:

- placement: the stage to start on (`first_order`), and while peers starting together spread out
  (`settling`), a peer of a crowded stage takes an empty one (`placement.better_stage`) once it has stayed
  empty for a record interval: a peer starting beside us announces its stage within one, and moving to a stage
  about to be served leaves ours short (the start-up race tests met);
- takeover: a stage with no peer is taken by the best-placed peer (`stage_moves.takeover_order`); the k-th in
  that order steps in only after k grace periods with the stage still empty;
- measuring: while no peer moves or cools down from a move, the predicted throughput is sampled every tick;
  its spread over the last `rebalance_every` seconds is the noise a move must beat;
- rebalancing: every `rebalance_every` seconds (drawn between half and one and a half times that, so peers
  do not decide in lockstep), once measured for at least half that long, `plan_move` may name this peer;
- a peer that moved stays at least MIN_STAY_EVALS intervals (hysteresis), and announces the stage it left
  (`cooling_from`) for a cool-down this module ends.

A decision is a `MoveOrder` the job waits for (`next_order`); one is out at a time, and none is made while the
job is busy with the last one. The job builds the new stage and fetches its state, asks `may_switch` last
(the records may have changed during the download), and reports the switch (`moved`).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio

from peer.pipeline import memory_budget, placement, stage_moves
from peer.pipeline.stage_moves import StageMap
from peertrain.pipeline import MoveOrder, PipelineKey, SeatFigures, StateSource
from protocol.limits import MiB

TICK_S = 0.5  # how often the records are read for an empty stage: a driver waits at most about this long for a taker
TAKEOVER_GRACE_S = 6.0  # the next peer in the takeover order steps in after this long: a move with a download of
#                         a few MB and the claim's settle time fits in it
CLAIM_SETTLE_S = 4.0  # a mover announces its move at least this long before it switches: two record intervals (the
#                       default 2 s; announce_soon floods at once), so peers that decided at the same moment see each other
TAKEOVER_SETTLE_S = 1.0  # an empty stage cannot wait for the full claim settle: the takeover order already keeps
#                          the next taker a grace period behind, so one record interval (at the tests' 1 s) is enough
MIN_STAY_EVALS = 3  # rebalance intervals a peer stays after a move before it may move again
ORDER_TTL_S = 4 * TICK_S  # an order the job has not taken by then is dropped (decided again if still right): the
#                           job only listens between moves and once its stage has joined, and the records move on


class SeatRecords(Protocol):
    """What seating reads of the daemon's pipeline service (peer/pipeline/service.py)."""

    def stage_map(self, key: PipelineKey) -> StageMap: ...

    def state_sources(self, key: PipelineKey, stage: int) -> list[StateSource]: ...

    def own_copy_step(self, key: PipelineKey, stage: int) -> int | None: ...

    def announce_soon(self) -> None: ...


class Seating:
    def __init__(self, records: SeatRecords, me: str, *, confirm_s: float, rng: random.Random | None = None,
                 clock: Callable[[], float] = trio.current_time):
        self.records, self.me = records, me
        self.confirm_s = confirm_s  # how long an empty stage stays empty before a settling peer moves to it
        self.rng = rng if rng is not None else random.Random(me)
        self.clock = clock
        self.figures: SeatFigures | None = None
        self.order: MoveOrder | None = None  # decided, not yet taken by the job
        self.order_at = 0.0
        self._order_ready = trio.Event()
        self.busy = False  # the job took an order and has not asked for the next one yet
        self.moved_at = float("-inf")
        self.cooling_from = -1  # the stage we left, announced until `cool_until`
        self.cool_until = 0.0
        self._settle_s = 0.0  # the settle time of the order out (its cool-down lasts at least that long)
        self.predictions: deque[tuple[float, float]] = deque()  # (when, predicted samples/s), last rebalance_every s
        self.empty_since: dict[int, float] = {}
        self.next_plan = float("inf")

    # ---- what the job says ------------------------------------------------------------------------
    def set_figures(self, figures: SeatFigures) -> None:
        """The job's figures for the cut it serves (from now on). A new cut drops what was measured and decided
        for the old one; rebalancing waits 1-2 intervals for rates to be measured first."""
        old = self.figures
        self.figures = figures
        if old is None or old.key != figures.key:
            self._withdraw()
            self.predictions.clear()
            self.empty_since.clear()
        if figures.rebalance_every > 0 and (old is None or old.rebalance_every <= 0 or old.settling):
            self.next_plan = self.clock() + figures.rebalance_every * self.rng.uniform(1.0, 2.0)

    async def next_order(self, timeout: float) -> MoveOrder | None:
        """The next move the job should make, waiting at most `timeout`; asking means the last one is over."""
        self.busy = False
        with trio.move_on_after(timeout):
            await self._order_ready.wait()
        self._drop_stale(self.clock())
        order = self.order
        if order is not None:
            self._withdraw()
            self.busy = True
        return order

    def first_order(self, figures: SeatFigures, rank: int | None) -> MoveOrder:
        """The stage to start on (placement.initial_stage), and whether the pipeline has not trained yet
        (`starting`: the stage is taken fresh; else the joiner fetches its state). A numbered peer's `rank`
        counts only in a pipeline that has not started. ValueError if this peer can hold no stage."""
        smap = self.records.stage_map(figures.key)
        running = any(p.step > 0 for peers in smap.values() for p in peers)
        stage = placement.initial_stage(figures.key, smap, None if running else rank, self.rng,
                                        list(figures.stage_seconds), self._own_fits(figures))
        why = "the stage that needs us most" if running else "spreading over the stages with the peers starting"
        return MoveOrder(stage, why, 0.0, starting=not running)

    def may_switch(self, from_stage: int) -> str | None:
        """None if we may stop serving `from_stage` now (stage_moves.may_switch); else why not."""
        if self.figures is None:
            return "no figures for our cut"
        return stage_moves.may_switch(self.records.stage_map(self.figures.key), self.me, from_stage)

    def moved(self, from_stage: int, to_stage: int) -> None:
        """The job switched from `from_stage` to `to_stage`: the stage left cools down (announced), and this
        peer stays a while."""
        self.moved_at = self.clock()
        every = self.figures.rebalance_every if self.figures is not None else 0.0
        self.cooling_from, self.cool_until = from_stage, self.moved_at + max(every, self._settle_s)
        self.predictions.clear()
        self.empty_since.clear()
        self.records.announce_soon()

    # ---- deciding -----------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await trio.sleep(TICK_S)
            self.tick()

    def tick(self) -> None:
        now = self.clock()
        if self.cooling_from >= 0 and now >= self.cool_until:
            self.cooling_from = -1
            self.records.announce_soon()
        self._drop_stale(now)
        f = self.figures
        if f is None or self.order is not None or self.busy:
            return
        smap = self.records.stage_map(f.key)
        if f.settling:
            if not f.pinned:
                self._settle(now, f, smap)
            return
        if f.rebalance_every <= 0:
            return
        if self._takeover(now, f, smap):
            return
        self._measure(now, f, smap)
        if now >= self.next_plan:
            self.next_plan = now + f.rebalance_every * self.rng.uniform(0.5, 1.5)
            self._rebalance(now, f, smap)

    def _decide(self, order: MoveOrder) -> None:
        self.order, self.order_at, self._settle_s = order, self.clock(), order.settle_s
        self._order_ready.set()

    def _drop_stale(self, now: float) -> None:
        """An order the job has not taken within ORDER_TTL_S goes (the next tick decides afresh)."""
        if self.order is not None and now - self.order_at > ORDER_TTL_S:
            self._withdraw()

    def _withdraw(self) -> None:
        self.order = None
        self._order_ready = trio.Event()

    def _track_empty(self, now: float, empty: list[int]) -> None:
        for s in list(self.empty_since):
            if s not in empty:
                del self.empty_since[s]
        for s in empty:
            self.empty_since.setdefault(s, now)

    def _settle(self, now: float, f: SeatFigures, smap: StageMap) -> None:
        mine = next((p.stage for peers in smap.values() for p in peers if p.me), None)
        if mine is None:
            return
        self._track_empty(now, [s for s, peers in smap.items() if not peers])
        confirmed = [ok and (bool(smap[s]) or now - self.empty_since[s] >= self.confirm_s)
                     for s, ok in enumerate(self._own_fits(f))]
        move = placement.better_stage(smap, mine, self.me, confirmed)
        if move is not None:
            self._decide(MoveOrder(move, f"stage {move} has no peer: moving there from stage {mine}", 0.0,
                                   starting=True))

    def _takeover(self, now: float, f: SeatFigures, smap: StageMap) -> bool:
        empty = stage_moves.empty_stages(smap)
        self._track_empty(now, empty)
        for e in empty:
            copies = {src.peer_id: src.step for src in self.records.state_sources(f.key, e) if not src.live}
            own = self.records.own_copy_step(f.key, e)
            if own is not None:
                copies[self.me] = own
            order = stage_moves.takeover_order(smap, list(f.stage_seconds), e, copies, fits=self._peer_fits(f, smap))
            mine = next((i for i, m in enumerate(order) if m.peer_id == self.me), None)
            if mine is None or now - self.empty_since[e] < mine * TAKEOVER_GRACE_S:
                continue
            waited = f" (waited {now - self.empty_since[e]:.0f}s for {mine} better-placed peers)" if mine else ""
            self._decide(MoveOrder(e, order[mine].reason + waited, TAKEOVER_SETTLE_S))
            return True
        return False

    def _measure(self, now: float, f: SeatFigures, smap: StageMap) -> None:
        """Sample today's predicted throughput while nothing moves; a move (anyone's) starts the window afresh."""
        if stage_moves.settling(smap) or stage_moves.empty_stages(smap):
            self.predictions.clear()
            return
        self.predictions.append((now, stage_moves.predicted_throughput(smap, list(f.stage_seconds))))
        while self.predictions and self.predictions[0][0] < now - f.rebalance_every:
            self.predictions.popleft()

    def _rebalance(self, now: float, f: SeatFigures, smap: StageMap) -> None:
        measured_for = now - self.predictions[0][0] if self.predictions else 0.0
        if measured_for < f.rebalance_every / 2 or now - self.moved_at < MIN_STAY_EVALS * f.rebalance_every:
            return
        threshold = max(f.min_gain, self.noise())
        plan = stage_moves.plan_move(smap, list(f.stage_seconds), min_gain=threshold, fits=self._peer_fits(f, smap))
        if plan is None or plan.peer_id != self.me:
            return
        self._decide(MoveOrder(plan.to_stage, plan.reason + f" (noise {threshold:.0%})", CLAIM_SETTLE_S))
        self.predictions.clear()

    def noise(self) -> float:
        """The spread of today's throughput as predicted over the last `rebalance_every` seconds, relative to
        its mean: a move must promise more than the prediction itself wavers."""
        values = [v for _, v in self.predictions]
        mean = sum(values) / len(values) if values else 0.0
        return (max(values) - min(values)) / mean if mean > 0 else 0.0

    def status(self) -> dict:
        """For `peer status`: the order out, the cool-down, the noise a rebalancing move must beat."""
        return {"order": {"to_stage": self.order.to_stage, "reason": self.order.reason} if self.order else None,
                "moving": self.busy, "cooling_from": self.cooling_from if self.cooling_from >= 0 else None,
                "noise": round(self.noise(), 4), "settling": bool(self.figures and self.figures.settling)}

    # ---- memory -------------------------------------------------------------------------------------
    @staticmethod
    def _own_fits(f: SeatFigures) -> list[bool]:
        """Per stage: whether this peer can hold it (an unknown room holds anything)."""
        return [memory_budget.fits(need, f.room_bytes, 0) for need in f.stage_bytes]

    def _peer_fits(self, f: SeatFigures, smap: StageMap) -> stage_moves.Fits:
        """(peer, stage) -> whether that peer can hold the stage, by the room it announced (none: it can)."""
        rooms = {p.peer_id: p.stage_room_mib for peers in smap.values() for p in peers}
        own = self._own_fits(f)

        def fits(peer_id: str, stage: int) -> bool:
            if peer_id == self.me:
                return own[stage]
            return memory_budget.fits(f.stage_bytes[stage], rooms.get(peer_id, 0) * MiB, 0)

        return fits

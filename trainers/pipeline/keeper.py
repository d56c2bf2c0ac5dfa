"""The seat's keeper: a background thread that moves this peer where the pipeline needs it, and keeps copies.

Beside the trainer's own thread (which drives microbatches), the keeper looks at the stage map every TICK_S:
- a stage with no peer is taken over at once by the best-placed peer (trainers/pipeline/rebalance.py,
  `takeover_order`); the k-th in that order steps in only after k grace periods with the stage still empty;
- every tick it predicts today's throughput from the records, while no peer is moving or cooling down from a
  move (a move's effect must be measured before the next is weighed); the spread of those predictions over the
  last `rebalance_every` seconds is the measurement noise;
- every `rebalance_every` seconds (randomized between half and one and a half times that, so peers do not
  decide in lockstep), once it has predicted for at least half that long, it asks `plan_move` whether one move
  would raise the predicted throughput by more than the noise (and by `min_gain` at least); if the move names
  this peer, it makes it;
- a peer that moved stays at least MIN_STAY_EVALS intervals before it may move again (hysteresis);
- every `copy_every` seconds it backs up the next stage's state, every `checkpoint_every` seconds it writes a
  checkpoint, and it ends the cool-down of a stage it left.

Every wait is bounded and checks for the daemon stopping; a failure in one round is logged and the next round
goes on (the trainer must not die because a peer refused a download).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque

from peertrain.swarm import TrainerStopped
from trainers.pipeline.rebalance import (empty_stages, may_switch, plan_move, predicted_throughput, settling,
                                         takeover_order)
from trainers.pipeline.seat import StageSeat

log = logging.getLogger("peertrain.trainer")

TICK_S = 0.5  # how often the keeper looks for an empty stage: a driver waits at most about this long for a taker
TAKEOVER_GRACE_S = 6.0  # the next peer in the takeover order steps in after this long: a move with a download of
#                         a few MB and the claim's settle time fits in it
CLAIM_SETTLE_S = 4.0  # a mover announces its move at least this long before it switches: two record intervals (the
#                       default 2 s; announce_soon floods at once), so peers that decided at the same moment see each other
TAKEOVER_SETTLE_S = 1.0  # an empty stage cannot wait for the full claim settle: the takeover order already keeps
#                          the next taker a grace period behind, so one record interval (at the tests' 1 s) is enough
MIN_STAY_EVALS = 3  # rebalance intervals a peer stays after a move before it may move again


class SeatKeeper:
    def __init__(self, seat: StageSeat, rng: random.Random):
        self.seat, self.swarm, self.o = seat, seat.swarm, seat.o
        self.rng = rng
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeline-keeper", daemon=True)
        self.predictions: deque[tuple[float, float]] = deque()  # (when, predicted samples/s), last rebalance_every s
        self.empty_since: dict[int, float] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _done(self) -> bool:
        return self._stop.is_set() or self.swarm.should_stop()

    def _run(self) -> None:
        now = time.monotonic()
        next_plan = now + self.o.rebalance_every * self.rng.uniform(1.0, 2.0)  # let the rates be measured first
        next_copy = now + self.o.copy_every * self.rng.uniform(0.3, 1.0) if self.o.copy_every else float("inf")
        next_ckpt = now + self.o.checkpoint_every if self.o.checkpoint_every else float("inf")
        while not self._done():
            try:
                self.seat.cool_down()
                now = time.monotonic()
                smap = self.swarm.stage_map(self.seat.key)
                if self.o.rebalance and self._takeover(now, smap):
                    continue
                if self.o.rebalance:
                    self._measure(now, smap)
                if self.o.rebalance and now >= next_plan:
                    next_plan = now + self.o.rebalance_every * self.rng.uniform(0.5, 1.5)
                    self._rebalance(now)
                if now >= next_copy:
                    next_copy = now + self.o.copy_every
                    self.seat.backup()
                if now >= next_ckpt:
                    next_ckpt = now + self.o.checkpoint_every
                    self.seat.save()
            except TrainerStopped:
                return
            except Exception:  # one failed round must not end the peer's training; the next one tries again
                log.exception("pipeline keeper round failed")
            self._stop.wait(TICK_S)

    def _may_switch(self, from_stage: int) -> str | None:
        return may_switch(self.swarm.stage_map(self.seat.key), self.swarm.peer_id, from_stage)

    def _takeover(self, now: float, smap) -> bool:
        seat = self.seat
        empty = empty_stages(smap)
        for s in list(self.empty_since):
            if s not in empty:
                del self.empty_since[s]
        for e in empty:
            since = self.empty_since.setdefault(e, now)
            copies = {src.peer_id: src.step for src in seat.sources(e) if not src.live}
            own = self.swarm.stage_copy(seat.key, e)
            if own is not None:
                copies[self.swarm.peer_id] = own.step
            order = takeover_order(smap, seat.stage_seconds(seat.key), e, copies, fits=seat.peer_fits)
            mine = next((i for i, m in enumerate(order) if m.peer_id == self.swarm.peer_id), None)
            if mine is None or now - since < mine * TAKEOVER_GRACE_S:
                continue
            reason = order[mine].reason + (f" (waited {now - since:.0f}s for {mine} better-placed peers)" if mine else "")
            seat.move(e, reason, may_switch=self._may_switch, settle_s=TAKEOVER_SETTLE_S)
            self.empty_since.clear()
            return True
        return False

    def _measure(self, now: float, smap) -> None:
        """Sample today's predicted throughput while nothing moves; a move (anyone's) starts the window afresh."""
        if settling(smap) or empty_stages(smap):
            self.predictions.clear()
            return
        self.predictions.append((now, predicted_throughput(smap, self.seat.stage_seconds(self.seat.key))))
        while self.predictions and self.predictions[0][0] < now - self.o.rebalance_every:
            self.predictions.popleft()

    def _rebalance(self, now: float) -> None:
        seat = self.seat
        measured_for = now - self.predictions[0][0] if self.predictions else 0.0
        if measured_for < self.o.rebalance_every / 2 or now - seat.moved_at < MIN_STAY_EVALS * self.o.rebalance_every:
            return
        threshold = max(self.o.min_gain, self.noise())
        plan = plan_move(self.swarm.stage_map(seat.key), seat.stage_seconds(seat.key), min_gain=threshold,
                         fits=seat.peer_fits)
        if plan is None or plan.peer_id != self.swarm.peer_id:
            return
        seat.move(plan.to_stage, plan.reason + f" (noise {threshold:.0%})",
                  may_switch=self._may_switch, settle_s=CLAIM_SETTLE_S)
        self.predictions.clear()

    def noise(self) -> float:
        """The spread of today's throughput as predicted over the last `rebalance_every` seconds, relative to
        its mean: a move must promise more than the prediction itself wavers."""
        values = [v for _, v in self.predictions]
        mean = sum(values) / len(values) if values else 0.0
        return (max(values) - min(values)) / mean if mean > 0 else 0.0

"""The seat's mover: a background thread that makes the moves the daemon orders, and keeps copies.

Beside the trainer's own thread (which drives microbatches), the mover waits for the daemon's next move
(peer/pipeline/seating.py decides takeovers and rebalancing from the records; `next_move` waits at most
TICK_S) and makes it (`StageSeat.move`: build the stage, fetch its state, switch). Between moves it tells the
daemon our figures when they change (block costs get measured), every FIGURES_EVERY_S; every `copy_every`
seconds it backs up the next stage's state, and every `checkpoint_every` seconds it writes a checkpoint.

Every wait is bounded and checks for the daemon stopping; a failure in one round is logged and the next round
goes on (the trainer must not die because a peer refused a download).
"""

from __future__ import annotations

import logging
import random
import threading
import time

from peertrain.swarm import TrainerStopped
from trainers.pipeline.seat import StageSeat

log = logging.getLogger("peertrain.trainer")

TICK_S = 0.5  # the longest a round waits for the daemon's next move before it sees to copies and checkpoints
FIGURES_EVERY_S = 2.0  # how often our figures are refreshed: block costs arrive in records, one per record interval


class SeatMover:
    def __init__(self, seat: StageSeat, rng: random.Random):
        self.seat, self.swarm, self.o = seat, seat.swarm, seat.o
        self.rng = rng
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipeline-mover", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _done(self) -> bool:
        return self._stop.is_set() or self.swarm.should_stop()

    def _run(self) -> None:
        now = time.monotonic()
        next_figures = now
        next_copy = now + self.o.copy_every * self.rng.uniform(0.3, 1.0) if self.o.copy_every else float("inf")
        next_ckpt = now + self.o.checkpoint_every if self.o.checkpoint_every else float("inf")
        while not self._done():
            try:
                order = self.swarm.next_move(timeout=TICK_S)
                if order is not None and not self._done():
                    self.seat.move(order.to_stage, order.reason, settle_s=order.settle_s)
                now = time.monotonic()
                if now >= next_figures:
                    next_figures = now + FIGURES_EVERY_S
                    self.seat.tell_daemon()
                if now >= next_copy:
                    next_copy = now + self.o.copy_every
                    self.seat.backup()
                if now >= next_ckpt:
                    next_ckpt = now + self.o.checkpoint_every
                    self.seat.save()
            except TrainerStopped:
                return
            except Exception:  # one failed round must not end the peer's training; the next one tries again
                log.exception("pipeline mover round failed")
                self._stop.wait(TICK_S)

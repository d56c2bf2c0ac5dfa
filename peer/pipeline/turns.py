"""Whose call a stage computes next: calls that finish a microbatch's work here before calls that start one.

A stage computes one call at a time (peer/pipeline/server.py). With a FIFO lock, a backward waits behind every
forward queued before it, while each of those forwards adds a backward to come: the queue fills with new work and
the work that would finish microbatches (and free what they hold) starves. Pipeline schedules from GPipe's
successors on (1F1B, PipeDream) run a ready backward first for that reason; so does this lock. Every forward that
goes first also lets the stage step once more before the backward's gradient enters: an older gradient.

Ties go in arrival order. A waiter cancelled while waiting leaves no trace; one cancelled just as the turn came to
it passes the turn on.
"""

from __future__ import annotations

import heapq
import itertools
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

import trio

FIRST = 0  # backward and loss calls: they finish a microbatch's work at this stage
NEXT = 1  # forward and evaluate calls: they start one (or only read)


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    event: trio.Event = field(compare=False, default_factory=trio.Event)
    gone: bool = field(compare=False, default=False)  # cancelled while waiting: skipped


class ComputeTurns:
    """A lock handed to the waiter of the lowest priority value first (FIRST before NEXT), FIFO within one."""

    def __init__(self) -> None:
        self._held = False
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiting if not w.gone)

    @asynccontextmanager
    async def turn(self, priority: int) -> AsyncIterator[None]:
        """Hold the lock for the block, once every waiter of a lower priority value (and earlier ones of the same)
        has had its turn."""
        if not self._held and not self._waiting:  # as trio.Lock: a cancel point first, then a yield that cannot fail
            await trio.lowlevel.checkpoint_if_cancelled()
            self._held = True
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            waiter = _Waiter(priority, next(self._seq))
            heapq.heappush(self._waiting, waiter)
            try:
                await waiter.event.wait()
            except BaseException:
                if waiter.event.is_set():  # the turn was ours already: hand it on
                    self._release()
                else:
                    waiter.gone = True
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            waiter = heapq.heappop(self._waiting)
            if not waiter.gone:
                waiter.event.set()  # the lock passes to it still held
                return
        self._held = False

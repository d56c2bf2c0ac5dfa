"""A stage computes finishing calls (backward, loss) before calls that start work, and keeps them a share of
its queue (peer/pipeline/turns.py, peer/pipeline/server.py)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from peer.pipeline.server import room
from peer.pipeline.turns import FIRST, NEXT, ComputeTurns

pytestmark = pytest.mark.unit


def run_calls(order: list[str], body):
    """Run `body(turns, call)` under a mock clock; `call(name, priority)` holds a turn for a second, noting it."""
    async def main():
        turns = ComputeTurns()

        async def call(name: str, priority: int, task_status=trio.TASK_STATUS_IGNORED):
            task_status.started()
            async with turns.turn(priority):
                order.append(name)
                await trio.sleep(1)

        await body(turns, call)
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_waiting_backwards_go_before_waiting_forwards_in_arrival_order():
    order: list[str] = []

    async def body(turns, call):
        async with trio.open_nursery() as n:
            await n.start(call, "f0", NEXT)  # holds the lock
            await trio.testing.wait_all_tasks_blocked()
            for name, prio in [("f1", NEXT), ("b1", FIRST), ("f2", NEXT), ("b2", FIRST)]:
                await n.start(call, name, prio)
                await trio.testing.wait_all_tasks_blocked()
            assert turns.waiting == 4
    run_calls(order, body)
    assert order == ["f0", "b1", "b2", "f1", "f2"]


def test_a_waiter_cancelled_leaves_the_lock_usable():
    order: list[str] = []

    async def body(turns, call):
        async with trio.open_nursery() as n:
            await n.start(call, "f0", NEXT)
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as scope:
                scope.cancel()
                async with turns.turn(FIRST):  # cancelled while waiting: never runs, leaves no trace
                    order.append("never")
            await n.start(call, "f1", NEXT)
        async with turns.turn(NEXT):  # free again
            order.append("after")
    run_calls(order, body)
    assert order == ["f0", "f1", "after"]


def test_calls_that_start_work_leave_a_share_of_the_queue_to_backwards():
    assert room(16, True) == 16 and room(16, False) == 12  # the defaults: 4 places only backwards take
    assert room(8, True) == 8 and room(8, False) == 6
    assert room(2, False) == 1 and room(1, False) == 1  # a forward always has a place when the limit has one

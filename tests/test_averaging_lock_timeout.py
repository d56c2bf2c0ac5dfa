"""A group's lock that times out (an attached process's segment lock, peer/attach/shm.py) never leaves an
exchange half-applied: before the commit it fails the exchange on both sides, after it the update is owed
and added when the lock is next had, so the pair's sum is kept either way (peer/averaging/shared.py)."""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest
import trio

from peer.attach.shm import SegmentLock
from peer.averaging.shared import SharedTensors
from tests.test_gossip_engine import exchange_and_wait, run_pair, total

WAIT_S = 0.2  # the daemon's bound on the lock here (LOCK_WAIT_S is 10 s)


class SegmentLocks:
    """The two holders of one memfd segment's lock, as the daemon (bounded) and an attached process see it."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("test-segment", os.MFD_CLOEXEC)
        self.daemon = SegmentLock(os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC), wait_s=WAIT_S)
        self.process = SegmentLock(self.fd)

    def close(self) -> None:
        if self.process._thread_lock.locked():  # a failed test left the process holding it
            self.process.release()
        self.daemon.close()
        self.process.close()


class TimesOutAfter:
    """A lock whose acquire raises TimeoutError (as LockTimeout is) after `n` successful ones."""

    def __init__(self, n: int):
        self.left = n
        self._lock = threading.Lock()

    def __enter__(self):
        if self.left == 0:
            raise TimeoutError("held by the other process")
        self.left -= 1
        self._lock.acquire()

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_an_apply_whose_lock_times_out_part_way_owes_the_rest_and_adds_it_at_the_next_snapshot(monkeypatch):
    import peer.averaging.shared

    monkeypatch.setattr(peer.averaging.shared, "APPLY_BLOCK_BYTES", 4 * 1000)  # 1000 floats a block: 4 blocks
    rng = np.random.default_rng(5)
    start, other = rng.standard_normal(3500).astype(np.float32), rng.standard_normal(3500).astype(np.float32)
    x = start.copy()
    group = SharedTensors("g", {"x": x}, lock=TimesOutAfter(2))  # 2 blocks added, then the lock times out
    group.apply(0.25, [other.copy()], [start.copy()])
    expected = start + 0.25 * (other - start)
    np.testing.assert_allclose(x[:2000], expected[:2000], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(x[2000:], start[2000:])  # not waited for block by block: owed
    assert group.owing
    group.lock = threading.Lock()  # the other process let go
    snap = group.snapshot()  # settles first, under the lock: the snapshot sees the whole update
    np.testing.assert_allclose(x, expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(snap[0], x)
    assert not group.owing


def test_owed_updates_add_up_and_a_load_drops_them():
    x = np.zeros(10, np.float32)
    group = SharedTensors("g", {"x": x}, lock=TimesOutAfter(0))
    group.apply(0.5, [np.full(10, 2.0, np.float32)], [np.zeros(10, np.float32)])
    group.apply(0.5, [np.full(10, 4.0, np.float32)], [np.zeros(10, np.float32)])
    np.testing.assert_array_equal(x, 0.0)
    group.lock = threading.Lock()
    group.release(group.snapshot())
    np.testing.assert_array_equal(x, 3.0)  # 0.5 * 2 + 0.5 * 4, one buffer for both
    group.lock = TimesOutAfter(0)
    group.apply(0.5, [np.full(10, 2.0, np.float32)], [np.zeros(10, np.float32)])
    group.lock = threading.Lock()
    group.load([np.full(10, 7.0, np.float32)])  # adopting a neighbour's values: what was owed went with ours
    group.release(group.snapshot())
    np.testing.assert_array_equal(x, 7.0)


def test_a_torch_group_owes_its_whole_update_when_the_lock_times_out():
    import torch

    x = torch.arange(12, dtype=torch.bfloat16)  # bfloat16: the whole-tensor torch update
    start = x.clone()
    group = SharedTensors("g", {"w": x}, lock=TimesOutAfter(0))
    group.apply(0.5, [torch.full((12,), 4.0, dtype=torch.bfloat16)], [start.clone()])
    torch.testing.assert_close(x, start)
    group.lock = threading.Lock()
    group.release(group.snapshot())
    torch.testing.assert_close(x, (start.float() + 0.5 * (4.0 - start.float())).to(torch.bfloat16))


@pytest.mark.parametrize("locked", ["server", "initiator"])
def test_a_segment_lock_held_past_its_bound_after_the_snapshot_keeps_the_pairs_sum(locked):
    """The attached process takes its lock after the engine's snapshot and holds it past the engine's bound,
    through the commit: the locked side's update is owed, not half-applied or lost, and lands once the
    process lets go. (Before, the lock's timeout escaped the apply and the pair's sum changed.)"""
    locks = SegmentLocks()

    async def body(a, b):
        side = b if locked == "server" else a
        group = side.groups["params"]
        group.lock = locks.daemon
        real_as_sent = group.as_sent

        def as_sent_then_the_process_steps(own, codec):  # runs after the snapshot, before the offer/accept
            out = real_as_sent(own, codec)
            locks.process.acquire()
            return out

        group.as_sent = as_sent_then_the_process_steps
        before = total(a) + total(b)
        result = await exchange_and_wait(a, b)
        assert result.ok, result.reason
        assert group.owing
        other = a if side is b else b
        np.testing.assert_allclose(other.groups["params"].tensors["w"], 3 - 2 / 3 if other is b else 1 + 2 / 3,
                                   rtol=1e-6)
        np.testing.assert_array_equal(group.tensors["w"], 3.0 if side is b else 1.0)  # owed, untouched
        locks.process.release()
        group.as_sent = real_as_sent
        await trio.to_thread.run_sync(lambda: group.release(group.snapshot()))
        assert not group.owing
        assert abs(total(a) + total(b) - before) < 1e-6 * before
        np.testing.assert_allclose(a.groups["params"].tensors["w"], 1 + 2 / 3, rtol=1e-6)
        np.testing.assert_allclose(b.groups["params"].tensors["w"], 3 - 2 / 3, rtol=1e-6)
        result = await exchange_and_wait(a, b)  # and the pair goes on exchanging
        assert result.ok, result.reason

    try:
        trio.run(run_pair, body)
    finally:
        locks.close()


@pytest.mark.parametrize("locked", ["server", "initiator"])
def test_a_segment_lock_held_before_the_snapshot_fails_the_exchange_with_nothing_applied(locked):
    """Before the commit a lock that cannot be had only fails the exchange, as a handled failure (it used to
    escape as an unexpected error); the initiator's 1 s deadline ends its wait for a server that could not
    snapshot."""
    locks = SegmentLocks()

    async def body(a, b):
        side = b if locked == "server" else a
        side.groups["params"].lock = locks.daemon
        a.cfg = dataclasses.replace(a.cfg, exchange_timeout=1.0)
        before_a, before_b = total(a), total(b)
        locks.process.acquire()
        try:
            result = await a.exchange(b.me, "params")
            assert not result.ok
            if side is a:
                assert "held its tensors' lock" in result.reason, result
            else:
                await trio.sleep(WAIT_S * 3)
                assert "held its tensors' lock" in b.stats.last_error, b.stats.last_error
        finally:
            locks.process.release()
        assert (total(a), total(b)) == (before_a, before_b)
        assert not a.budget.initiating
        with trio.fail_after(5):
            while b.budget.serving:
                await trio.sleep(0.01)

    try:
        trio.run(run_pair, body)
    finally:
        locks.close()

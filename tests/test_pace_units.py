"""The suite's time bounds (peer/testing/pace.py, `wait_for` in peer/testing/process.py): a bound sized on the
reference machine scales with the measured slowdown, and a wait on work that advances is bounded by the time
without progress, up to a cap, so a loaded machine is not failed for being slow while the work still moves."""

from __future__ import annotations

import pytest

from peer.testing import pace, process


class VirtualClock:
    """`time.monotonic` and `time.sleep` of peer/testing/process.py, advanced only by its sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> VirtualClock:
    c = VirtualClock()
    monkeypatch.setattr(process.time, "monotonic", c.monotonic)
    monkeypatch.setattr(process.time, "sleep", c.sleep)
    monkeypatch.setenv(pace.SLOWDOWN_ENV, "1")
    return c


def test_the_slowdown_scales_bounds_never_shrinks_them_and_is_capped(monkeypatch):
    for raw, want in (("2.5", 2.5), ("0.5", 1.0), ("nan", 1.0), ("-3", 1.0), ("junk", 1.0), ("1e9", pace.MAX_SLOWDOWN)):
        monkeypatch.setenv(pace.SLOWDOWN_ENV, raw)
        assert pace.slowdown() == want, raw
    monkeypatch.setenv(pace.SLOWDOWN_ENV, "2")
    assert pace.scaled(30) == 60
    monkeypatch.delenv(pace.SLOWDOWN_ENV)
    assert pace.scaled(30) == 30


def test_a_plain_wait_ends_at_its_scaled_timeout(clock, monkeypatch):
    monkeypatch.setenv(pace.SLOWDOWN_ENV, "2")
    with pytest.raises(TimeoutError, match="timed out after 20s waiting for nothing"):
        process.wait_for(lambda: False, timeout=10, what="nothing", interval=1.0)
    assert clock.now == pytest.approx(20, abs=1.0)


def test_a_wait_that_progresses_outlives_its_timeout_and_one_that_stalls_does_not(clock):
    done = [0]

    def advancing() -> bool:  # one sample every 2 s, 100 wanted: 200 s, against a 60 s timeout
        done[0] = int(clock.now // 2)
        return done[0] >= 100
    assert process.wait_for(advancing, timeout=60, what="samples", interval=1.0, progress=lambda: done[0])
    assert clock.now == pytest.approx(200, abs=1.0)

    clock.now = 0.0
    stuck = [0]

    def stalls() -> bool:  # moves for 30 s, then never again
        stuck[0] = min(int(clock.now), 30)
        return False
    with pytest.raises(TimeoutError, match=r"no progress for 10s; last reading 30"):
        process.wait_for(stalls, timeout=60, stall=10, what="samples", interval=1.0, progress=lambda: stuck[0])
    assert clock.now == pytest.approx(40, abs=1.5)


def test_a_crawl_still_ends_at_the_cap(clock):
    with pytest.raises(TimeoutError):
        process.wait_for(lambda: False, timeout=10, what="a crawl", interval=1.0, progress=lambda: clock.now)
    assert clock.now == pytest.approx(process.PROGRESS_CAP * 10, abs=1.0)


def test_the_workload_takes_a_measurable_time():
    assert 0.01 < pace.workload() < 30
    assert 1.0 <= pace.measure() <= pace.MAX_SLOWDOWN

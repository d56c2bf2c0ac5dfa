"""Memory caps (peer/bench/memory_caps.py) and the RSS sampler (peer/testing/rss.py).

The cgroup tests need root and a memory controller (v1 or v2): they cap two child processes at 200 MiB
each, one allocating 400 MiB (killed, or refused its memory), one 60 MiB (finishes), and check the peaks
the caps report and that no cap directory outlives its context.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from peer.bench.memory_caps import MIN_CAP_MIB, PREFIX, MemoryCaps, MemorySupport, parse_keyed
from peer.testing.rss import MAX_INTERVAL_S, RssSampler

CAP_MIB = 200.0  # small enough to hit in well under a second, large enough for an interpreter plus headroom
OVER_MIB = 400  # twice the cap: no reclaim can save it (there is nothing but anonymous memory to reclaim)
UNDER_MIB = 60  # well under the cap, with room for the interpreter's own ~10 MiB
STEP_MIB = 20  # allocated a step at a time, each byte written, so every page is resident and charged
CHILD_TIMEOUT_S = 20.0  # each child runs well under a second; this only bounds a hung one
NO_SUCH_PID = (1 << 22) + 1  # above the largest pid_max Linux allows: never a live process

# A child that waits for a line on stdin (so the test can move it into a cap first), then allocates
# `mib` MiB in STEP_MIB steps, writing every byte, and says "done".
CHILD = """
import sys
sys.stdin.readline()
held = [b"\\x01" * ({step} << 20) for _ in range({mib} // {step})]
print("done", flush=True)
sys.stdin.readline()
"""


def child_argv(mib: int) -> list[str]:
    return [sys.executable, "-c", CHILD.format(mib=mib, step=STEP_MIB)]


def start(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def allocated(proc: subprocess.Popen[str]) -> None:
    """Let the child allocate, and wait until it holds its memory (it stays until `finish`)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], CHILD_TIMEOUT_S)
    assert ready, f"the child did not allocate within {CHILD_TIMEOUT_S} s"
    assert proc.stdout.readline().strip() == "done"


def finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """Let the child allocate (if it has not yet), then exit; its stdout and stderr."""
    return proc.communicate("go\nexit\n", timeout=CHILD_TIMEOUT_S)


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts, killed and reaped whatever the test's outcome."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=CHILD_TIMEOUT_S)


@pytest.fixture
def support() -> MemorySupport:
    s = MemoryCaps.probe()
    if s.mechanism is None:
        pytest.skip(f"no memory caps on this host: {s.reason}")
    return s


def leftovers(s: MemorySupport) -> list[str]:
    assert s.root is not None
    return sorted(d.name for d in s.root.glob(f"{PREFIX}-{os.getpid()}-*"))


# --- unit ---------------------------------------------------------------------------------------------------

def test_keyed_files_are_read_by_name() -> None:
    assert parse_keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == {
        "oom_kill_disable": 0, "under_oom": 0, "oom_kill": 3}
    assert parse_keyed("low 0\nhigh 2\nmax 17\noom 1\noom_kill 1\noom_group_kill 0\n")["max"] == 17
    assert parse_keyed("garbage\nname value\n") == {}


def test_no_mechanism_refuses_with_its_reason() -> None:
    with pytest.raises(RuntimeError, match="not root"):
        with MemoryCaps(1, CAP_MIB, MemorySupport(None, None, "not root: cgroups cannot be created")):
            pass


def test_a_cap_below_an_interpreter_is_refused_before_anything_is_made(tmp_path) -> None:
    fake = MemorySupport("cgroup1 memory.limit_in_bytes", tmp_path, "test")
    with pytest.raises(ValueError, match="at least"):
        with MemoryCaps(2, MIN_CAP_MIB / 2, fake):
            pass
    assert list(tmp_path.iterdir()) == []


def test_the_sampler_sees_this_process_grow() -> None:
    sampler = RssSampler([os.getpid()])  # not entered: sampled by hand, no thread, no real seconds
    before = sampler.peaks()[os.getpid()]
    # 160 MiB against a growth of 120: in CI's parallel tier this worker's own leftovers (an earlier test's
    # threads and garbage) may be freed between the two reads; with 40 against 30 such a free failed the test once
    held = b"\x01" * (160 << 20)
    sampler.sample()
    after = sampler.peaks()[os.getpid()]
    del held
    assert after.alive and after.samples == before.samples + 1
    assert after.max_rss_mib - before.max_rss_mib >= 120, (before, after)
    assert after.hwm_mib >= after.max_rss_mib >= after.max_anon_mib > 0


def test_the_sampler_keeps_a_missing_pid_as_gone() -> None:
    sampler = RssSampler([NO_SUCH_PID])
    sampler.sample()
    assert sampler.peaks()[NO_SUCH_PID].alive is False
    assert sampler.peaks()[NO_SUCH_PID].samples == 0
    with pytest.raises(ValueError, match="interval"):
        RssSampler(interval_s=MAX_INTERVAL_S * 2)


# --- processes ----------------------------------------------------------------------------------------------

@pytest.mark.process
def test_the_sampler_outlives_a_child_and_keeps_its_peak(children) -> None:
    proc = start(child_argv(UNDER_MIB))
    children.append(proc)
    with RssSampler([proc.pid], interval_s=0.02) as sampler:
        allocated(proc)
        sampler.sample()  # one read sure to see the child at its peak; the thread's own reads may not
        assert proc.stdin is not None
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        proc.wait(CHILD_TIMEOUT_S)
        sampler.sample()  # and one after it exited, which must not fail
    peak = sampler.peaks()[proc.pid]
    assert not peak.alive
    assert UNDER_MIB <= peak.hwm_mib < UNDER_MIB + 100
    assert peak.max_anon_mib >= UNDER_MIB * 0.9  # private: its own bytes, less what a step had not touched yet


@pytest.mark.process
def test_a_child_over_its_cap_is_stopped_and_one_under_it_finishes(support, children) -> None:
    with MemoryCaps(2, CAP_MIB, support) as caps:
        dirs = list(caps.dirs)
        assert leftovers(support) == [d.name for d in dirs]
        over = start(child_argv(OVER_MIB))
        children.append(over)
        caps.add(0, over.pid)  # before it allocates: it waits for a line on stdin
        under = start(caps.command(1, child_argv(UNDER_MIB)))  # capped from its first page
        children.append(under)

        out, err = finish(over)
        if over.returncode == -signal.SIGKILL:
            assert caps.oom_kills(0) in (None, 1), "the OOM killer killed elsewhere than in cap 0"
        else:  # the kernel refused the memory instead of killing
            assert over.returncode != 0 and "MemoryError" in err, (over.returncode, err)
        assert "done" not in out
        assert caps.limit_hits(0) is not None  # a count, but no floor: v1 does not count memsw refusals (6.x)
        peak = caps.peak_mib(0)
        assert peak is not None and CAP_MIB * 0.5 <= peak <= CAP_MIB * 1.01

        out, err = finish(under)
        assert under.returncode == 0 and out.strip() == "done", err
        assert caps.oom_kills(1) in (None, 0)
        peak = caps.peak_mib(1)
        assert peak is not None and UNDER_MIB <= peak < CAP_MIB
    assert not any(d.exists() for d in dirs)
    assert leftovers(support) == []
    assert caps.peak_mib(0) is not None and caps.peak_mib(1) is not None  # kept from the moment of removal


@pytest.mark.process
def test_caps_are_removed_when_the_body_fails_with_a_process_inside(support, children) -> None:
    with pytest.raises(KeyError):
        with MemoryCaps(1, CAP_MIB, support) as caps:
            dirs = list(caps.dirs)
            proc = start(caps.command(0, child_argv(UNDER_MIB)))  # waits on stdin: still inside at exit
            children.append(proc)
            raise KeyError("the body failed")
    assert not any(d.exists() for d in dirs)
    assert leftovers(support) == []


@pytest.mark.process
def test_caps_left_by_a_dead_run_are_swept(support) -> None:
    assert support.root is not None
    stale = support.root / f"{PREFIX}-{NO_SUCH_PID}-0"
    stale.mkdir()
    try:
        with MemoryCaps(1, CAP_MIB, support):
            assert not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()

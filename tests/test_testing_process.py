"""peer.testing's process handling: one stop path (SIGTERM, bounded wait, SIGKILL), failures that carry
the log, and the one bounded polling loop."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from peer.control import ControlError
from peer.testing.process import ManagedProcess, ProcessExited, stop_all, wait_for

IGNORES_SIGTERM = ("import signal, sys, time\n"
                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                   "print('ready', flush=True)\n"
                   "time.sleep(60)\n")


def python(tmp_path, name: str, code: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", code], log_path=tmp_path / f"{name}.log").start()


def test_stop_is_graceful_when_the_process_honours_sigterm(tmp_path):
    p = python(tmp_path, "sleeper", "import time; time.sleep(60)")
    assert p.running
    assert p.stop(timeout=10) == -signal.SIGTERM
    assert not p.running


def test_stop_escalates_to_sigkill_after_the_deadline(tmp_path):
    p = python(tmp_path, "stubborn", IGNORES_SIGTERM)
    wait_for(lambda: "ready" in p.log_path.read_text(), timeout=20, what="the child to ignore SIGTERM")
    t0 = time.monotonic()
    assert p.stop(timeout=0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 10


def test_stop_all_shares_one_deadline(tmp_path):
    ps = [python(tmp_path, f"s{i}", IGNORES_SIGTERM) for i in range(3)]
    for p in ps:
        wait_for(lambda p=p: "ready" in p.log_path.read_text(), timeout=20, what=f"{p.name} to start")
    t0 = time.monotonic()
    assert stop_all(ps, timeout=1.0) == [-signal.SIGKILL] * 3
    assert time.monotonic() - t0 < 10  # not 3 deadlines one after another


def test_an_exited_process_fails_with_its_exit_code_and_log(tmp_path):
    p = python(tmp_path, "crasher", "import sys; print('boom: no config'); sys.exit(3)")
    wait_for(lambda: not p.running, timeout=20, what="the child to exit")
    with pytest.raises(ProcessExited, match=r"crasher exited with code 3(.|\n)*boom: no config"):
        p.check_alive()


def test_echo_streams_output_lines_and_keeps_the_log(tmp_path):
    lines: list[str] = []
    p = ManagedProcess("echoer", [sys.executable, "-c", "print('one'); print('two')"],
                       log_path=tmp_path / "e.log", echo=lines.append).start()
    assert p.wait_stopped(20) == 0
    wait_for(lambda: lines == ["one", "two"], timeout=5, what="both lines echoed")
    wait_for(lambda: p.log_path.read_text() == "one\ntwo\n", timeout=5, what="both lines logged")


def test_wait_for_retries_transient_errors_and_names_what_it_waited_for():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ControlError("not up yet")
        return "up"
    assert wait_for(flaky, timeout=5, what="x", interval=0.01) == "up"
    with pytest.raises(TimeoutError, match=r"waiting for the moon \(last error: not up yet\)"):
        wait_for(lambda: (_ for _ in ()).throw(ControlError("not up yet")), timeout=0.1, what="the moon", interval=0.01)
    shown = []
    with pytest.raises(TimeoutError):
        wait_for(lambda: False, timeout=0.05, what="never", interval=0.01, on_fail=lambda: shown.append(1))
    assert shown == [1]

"""A child process we own: started once, its output in a log file, stopped on one escalation path.

Every process the project spawns for a swarm (daemons, the all-reduce baseline's ranks) is a
`ManagedProcess`, so there is one place that knows how to start one (optionally inside a network
namespace), where its output goes, how to wait on it without hanging, and how to stop it: SIGTERM, a
bounded wait, then SIGKILL. `wait_for` is the one bounded polling loop: waits poll for state, never
sleep for a guessed time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from peer.control import ControlError
from peer.testing.pace import scaled

T = TypeVar("T")

STOP_TIMEOUT = 20.0  # a daemon's graceful stop: goodbyes, a checkpoint and the peer cache, well under this
KILL_TIMEOUT = 5.0  # after SIGKILL only the kernel is left to wait for
PROGRESS_CAP = 4.0  # a wait that keeps progressing still ends after 4x its timeout: a crawl is a failure too
LOG_TAIL_LINES = 80  # enough to show a traceback and the lines before it


class ProcessExited(RuntimeError):
    """A process we waited on exited; the message carries its exit code and the tail of its log."""


def wait_for(predicate: Callable[[], T], *, timeout: float, what: str, interval: float = 0.1,
             retry_on: tuple[type[BaseException], ...] = (ControlError, OSError, KeyError),
             on_fail: Callable[[], None] | None = None, progress: Callable[[], Any] | None = None,
             stall: float | None = None) -> T:
    """Poll `predicate` until it returns something truthy, and return that; after `timeout` seconds (sized on
    the reference machine, scaled to this one: peer/testing/pace.py) raise TimeoutError naming `what` (and the
    last error `retry_on` swallowed: a daemon that does not answer yet, a status without the key yet).
    `on_fail` runs first, to show logs.

    A wait on work that advances (drivers finishing their samples) may pass `progress`, a reading of how far
    it got (samples done): then `timeout` bounds the time without progress (`stall` seconds if given), not the
    whole wait, so a machine loaded by other tests is not failed for being slow while the work still moves, and
    the whole wait is capped at `PROGRESS_CAP` times the timeout so a crawl still ends."""
    timeout = scaled(timeout)
    window = scaled(stall) if stall is not None else timeout
    start = time.monotonic()
    deadline = start + (window if progress is not None else timeout)
    cap = start + PROGRESS_CAP * timeout
    last_exc: BaseException | None = None
    seen: Any = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except retry_on as exc:
            last_exc = exc
        now = time.monotonic()
        if progress is not None:
            try:
                reading = progress()
            except retry_on:
                reading = seen
            if reading != seen:  # it moved: the stall bound starts again
                seen, deadline = reading, min(cap, now + window)
        if now >= deadline:
            break
        time.sleep(interval)
    if on_fail is not None:
        on_fail()
    waited = time.monotonic() - start
    raise TimeoutError(f"timed out after {waited:.0f}s waiting for {what}"
                       + (f" (no progress for {window:g}s; last reading {seen!r})" if progress is not None else "")
                       + (f" (last error: {last_exc})" if last_exc else ""))


def proc_status_mb(pid: int, name: str) -> float | None:
    """A memory figure of a process from /proc/PID/status, in MB: VmRSS (resident now), VmHWM (peak)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def module_json(module: str, args: list[str], *, timeout: float, what: str) -> Any:
    """Run `python -m module args` and parse the last line it printed as JSON (how benches ask a trainers/ module
    for a figure: peer/ does not import trainers); RuntimeError naming `what` and the end of its stderr if it
    fails."""
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pump(stream, log, echo: Callable[[str], None]) -> None:
    """Copy a child's output to its log file and, line by line, to `echo` (e.g. print with a prefix)."""
    for raw in iter(stream.readline, b""):
        log.write(raw)
        try:
            echo(raw.decode(errors="replace").rstrip("\n"))
        except (ValueError, OSError):  # the console went away: keep logging to the file
            pass
    log.close()


@dataclass
class ManagedProcess:
    """One child process: `argv` run with `env` added to ours, stdout and stderr appended to `log_path`.

    `host` is a `peer.testing.netns.Host` to run it inside that network namespace. `echo`, if set, also
    receives each output line (`peer local` streams its daemons' logs that way)."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    host: Any = None
    cwd: Path | None = None
    echo: Callable[[str], None] | None = None
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    def start(self) -> "ManagedProcess":
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        log = open(self.log_path, "ab", buffering=0)
        out = subprocess.PIPE if self.echo is not None else log
        kw = dict(stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
        try:
            if self.host is not None:
                self.proc = self.host.popen(self.argv, **kw)
            else:  # its own session: a Ctrl-C meant for us does not reach it before we stop it in order
                self.proc = subprocess.Popen(self.argv, start_new_session=True, preexec_fn=_end_with_parent, **kw)
        except BaseException:
            log.close()
            raise
        if self.echo is not None:
            threading.Thread(target=_pump, args=(self.proc.stdout, log, self.echo), daemon=True,
                             name=f"log-{self.name}").start()
        else:
            log.close()  # the child holds its own descriptor
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check_alive(self) -> None:
        """Raise ProcessExited (with the log's tail) if the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ProcessExited(f"{self.name} exited with code {self.proc.returncode}; "
                                f"last lines of {self.log_path}:\n{self.log_tail()}")

    # ---- stopping: one path (terminate_all) ---------------------------------------------------------------
    def signal_stop(self) -> None:
        """Ask it to stop (SIGTERM) without waiting."""
        if self.running:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float = STOP_TIMEOUT) -> int:
        """Wait for it to exit by itself; past `timeout`, SIGKILL. Returns the exit code (negative: the
        signal that ended it, so -9 says it had to be killed)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return terminate_all([self.proc], timeout, signal_first=False)[0]

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, wait up to `timeout`, then SIGKILL: the exit code (0 for a graceful stop)."""
        return stop_all([self], timeout)[0]

    def kill(self) -> int:
        """SIGKILL at once (a crash, as far as its peers can tell); the exit code."""
        return terminate_all([self.proc], 0.0, signal_first=False)[0]

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def terminate_all(procs: list[subprocess.Popen], timeout: float, *, signal_first: bool = True) -> list[int]:
    """The one stop path for child processes: SIGTERM to each (unless `signal_first` is False), one
    shared deadline for all of them, then SIGKILL for any still running. Their exit codes, in order."""
    if signal_first:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait(KILL_TIMEOUT))
    return codes


def stop_all(processes: list[ManagedProcess], timeout: float = STOP_TIMEOUT) -> list[int | None]:
    """Stop many at once, side by side (SIGTERM, one deadline, SIGKILL). Exit codes in order (None for
    one never started)."""
    started = [p.proc for p in processes if p.proc is not None]
    codes = iter(terminate_all(started, timeout))
    return [next(codes) if p.proc is not None else None for p in processes]


def _end_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the process that started it dies (Linux prctl
    PR_SET_PDEATHSIG), so a launcher or benchmark killed on a timeout (SIGKILL: no cleanup runs) leaves no
    daemons behind to load the machine for the rest of a test run. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

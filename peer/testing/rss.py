"""Per-process resident memory over a run: a background thread samples /proc/PID/status for a set of pids.

Why not just read VmHWM at the end: a process that has exited (or been OOM-killed) has no status left to
read, and a bench wants the figure of every daemon it ran, the dead ones too. So the sampler reads each
pid every `interval_s` and keeps, per pid, the largest VmRSS and RssAnon it saw and the last VmHWM (the
kernel's own peak of VmRSS, exact between samples). A pid that exits keeps its last figures; a pid reused
by a new process (its start time changed) is not read any more, so a stranger's memory never counts.

Which figure is which (see also peer/bench/memory_caps.py): VmHWM / VmRSS count every resident page a
process maps, shared libraries included (torch's libraries count again in each daemon); RssAnon is the
process's private memory (heap, tensors, buffers), the part that grows with what it does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from protocol.limits import KiB, MiB

SAMPLE_INTERVAL_S = 0.2  # five reads a second per pid: a few microseconds each, fine enough for allocation phases
MIN_INTERVAL_S = 0.01  # below this the thread would mostly compete with the processes it measures
MAX_INTERVAL_S = 5.0  # above this a short-lived process could come and go unseen
STOP_TIMEOUT_S = 5.0  # the thread wakes at least every interval, so joining it takes one interval at most
KIB_PER_MIB = MiB // KiB  # /proc/PID/status counts in kB (KiB)


@dataclass(frozen=True)
class RssPeak:
    """What the sampler saw of one pid, in MiB (0.0 for a figure never read)."""

    pid: int
    max_rss_mib: float  # the largest VmRSS sampled
    hwm_mib: float  # VmHWM at the last read: the kernel's peak of VmRSS, between samples too
    max_anon_mib: float  # the largest RssAnon sampled: private memory, no shared library pages
    samples: int  # successful reads
    alive: bool  # still running (and still the same process) at the last sample


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: count fields after its last ')'
    return stat.rsplit(")", 1)[1].split()[19]


def read_status_kib(pid: int) -> dict[str, int] | None:
    """The kB figures of /proc/PID/status (VmRSS, VmHWM, RssAnon...); None when the process is gone.
    A zombie still has a status file but no memory lines: that is an empty dict."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name] = int(parts[0])
    return out


class RssSampler:
    """`with RssSampler([pid, ...]) as s: ...; s.peaks()`: a thread owned by the context samples every pid
    each `interval_s`; `watch(pid)` adds one while it runs; a last sample is taken on exit."""

    def __init__(self, pids: Iterable[int] = (), interval_s: float = SAMPLE_INTERVAL_S) -> None:
        if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
            raise ValueError(f"RssSampler interval {interval_s} s is outside [{MIN_INTERVAL_S}, {MAX_INTERVAL_S}] s")
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._peaks: dict[int, RssPeak] = {}
        self._starts: dict[int, str | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for pid in pids:
            self.watch(pid)

    def watch(self, pid: int) -> None:
        """Sample `pid` from now on (read once at once, so even a process that exits soon is seen)."""
        with self._lock:
            if pid in self._peaks:
                return
            self._peaks[pid] = RssPeak(pid, 0.0, 0.0, 0.0, 0, True)
            self._starts[pid] = _start_time(pid)
        self._sample_one(pid)

    def sample(self) -> None:
        """One pass over every pid still alive (the thread calls this; tests may too)."""
        with self._lock:
            pids = [pid for pid, p in self._peaks.items() if p.alive]
        for pid in pids:
            self._sample_one(pid)

    def _sample_one(self, pid: int) -> None:
        status = read_status_kib(pid)
        same = status is not None and _start_time(pid) == self._starts.get(pid)
        with self._lock:
            p = self._peaks[pid]
            if status is None or not same or "VmRSS" not in status:  # gone, reused, a zombie: keep the last figures
                self._peaks[pid] = replace(p, alive=False)
                return
            self._peaks[pid] = RssPeak(
                pid,
                max(p.max_rss_mib, status["VmRSS"] / KIB_PER_MIB),
                max(p.hwm_mib, status.get("VmHWM", 0) / KIB_PER_MIB),
                max(p.max_anon_mib, status.get("RssAnon", 0) / KIB_PER_MIB),
                p.samples + 1,
                True,
            )

    def peaks(self) -> dict[int, RssPeak]:
        """Per pid, what was seen so far."""
        with self._lock:
            return dict(self._peaks)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "RssSampler":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
            if self._thread.is_alive():
                raise RuntimeError(f"RssSampler thread did not stop within {STOP_TIMEOUT_S} s")
            self._thread = None
        self.sample()

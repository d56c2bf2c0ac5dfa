"""Hard memory caps per benchmark process, so N daemons on one host each run as if on a small machine of their own.

The memory analogue of peer/bench/cpu_caps.py: one cgroup per process index, capped at `mib_each` MiB,
swap shut off so the cap cannot be dodged by swapping. A process that needs more than its cap gets what the
kernel can reclaim from its own page cache, then the OOM killer (only processes of that cgroup are
candidates), as on a machine with that much RAM and no swap. The cap is cgroup v2 `memory.max` (with
`memory.swap.max` = 0) where the memory controller is on the v2 hierarchy; many hosts (this development VM
among them) still bind it to cgroup v1, where it is `memory.limit_in_bytes` (with
`memory.memsw.limit_in_bytes`, memory plus swap, at the same size where the kernel accounts swap, else
`memory.swappiness` = 0). `MemoryCaps.probe()` says which one this host allows, or why neither.

On v1 the caps are made inside the memory cgroup this process already runs in (where that directory can be
reached and written), so capped processes stay inside whatever limit the host set for us and are counted
there too; on v2, as in cpu_caps, at the hierarchy's root, the one cgroup that may hold processes and give
controllers to children at once.

v1 charges a page to the cgroup of the process that first touched it, and moving a process does not move
its charges: memory a process allocated before `add(i, pid)` stays counted outside the cap. For the
whole of a process in the cap, start it inside: `command(i, argv)` is an argv that enters cap i and then
execs `argv`. (v2 does not move charges either.)

Which figure is the honest "daemon memory": the cgroup charge (`peak_mib`) counts the process's anonymous
memory, kernel memory on its behalf (socket buffers, page tables) and the page cache of every file it read
or wrote (checkpoints, logs, the dataset); page cache is reclaimable, so the cgroup peak is an upper bound
that grows with I/O even where the daemon needs none of it, and the kernel reclaims it before any OOM kill.
The daemon's own memory is its resident set: peak RSS (VmHWM, peer/testing/rss.py `RssSampler`), of
which RssAnon is private (VmHWM also counts shared library pages, torch's among them, once per daemon).
Benches report both: max RSS as what a daemon uses, the cgroup peak as what the cap saw; the cap itself is
what makes a too-small machine fail.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from peer.testing.netns import pid_alive
from protocol.limits import MiB

MIN_CAP_MIB = 16.0  # a Python interpreter needs ~10 MiB to start: a smaller cap only ever kills at once
PREFIX = "peertrain-mem"  # cap directories are PREFIX-<our pid>-<index>, so leftovers name their owner
CURRENT_SAMPLE_S = 0.2  # sampling of memory.current, where v2 has no memory.peak (kernels before 5.19)
RMDIR_TRIES = 50  # a cgroup whose last process is still exiting (an OOM kill) is busy for a moment:
RMDIR_WAIT_S = 0.02  # retry its removal for up to 1 s in all
STOP_TIMEOUT_S = 5.0  # the sampler thread wakes every CURRENT_SAMPLE_S, so it stops well within this


@dataclass(frozen=True)
class MemorySupport:
    """Where caps can be made: `mechanism` is "cgroup2 memory.max", "cgroup1 memory.limit_in_bytes" or None."""

    mechanism: str | None
    root: Path | None
    reason: str  # why this one (or why none)

    @property
    def v2(self) -> bool:
        return self.mechanism is not None and self.mechanism.startswith("cgroup2")


def _v2_root() -> Path | None:
    """A cgroup v2 directory whose children may get the memory controller (we must be able to enable it).
    Only the true root may both hold processes and hand controllers down; the root of a container's cgroup
    namespace (it has a cgroup.type, the true root none) may do so only while it holds no process."""
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        try:
            if "memory" not in (root / "cgroup.controllers").read_text().split() or not os.access(root, os.W_OK):
                continue
            if (root / "cgroup.type").exists() and (root / "cgroup.procs").read_text().split():
                continue
            return root
        except OSError:
            continue
    return None


def _v1_mount() -> Path | None:
    """Where the cgroup v1 hierarchy with the memory controller is mounted (usually /sys/fs/cgroup/memory)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup" and "memory" in parts[3].split(","):
            return Path(parts[1])
    return None


def _v1_own(mount: Path) -> Path | None:
    """Our own v1 memory cgroup's directory, if it can be reached under `mount` (it cannot from inside a
    container whose mount shows only its own subtree: /proc/self/cgroup then names a path from the host's root)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            own = mount / parts[2].lstrip("/")
            return own if (own / "memory.limit_in_bytes").exists() else None
    return None


def parse_keyed(text: str) -> dict[str, int]:
    """`name value` lines (memory.events, memory.oom_control, memory.stat) as a dict; other lines skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _write(path: Path, value: str) -> None:
    """Write one cgroup file (cgroupfs takes no temp-file-and-rename, so no atomic_write here); a refusal
    names the file and the value."""
    try:
        path.write_text(value)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {value!r} to {path}: {exc.strerror or exc}") from exc


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _host_swaps() -> bool:
    """Whether any swap device or file is on (/proc/swaps has a header line, then one line each)."""
    try:
        return len(Path("/proc/swaps").read_text().splitlines()) > 1
    except OSError:
        return False


@dataclass
class MemoryCaps:
    """One cgroup per process index, each capped at `mib_each` MiB (or cap i at `per_index[i]`); a context
    manager that removes them. `set(i, mib)` resizes one while it runs. Figures read after exit are those of
    the moment the caps were removed."""

    n: int
    mib_each: float
    support: MemorySupport
    per_index: list[float] | None = None
    dirs: list[Path] = field(default_factory=list)
    swap_rule: str = ""  # how swap is kept out of the cap on this host, for a bench's JSON
    # v2 without memory.peak: the largest memory.current sampled, per index
    _current_max: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    # (peak, oom kills, limit hits) per index, read as the caps were removed
    _final: dict[int, tuple[float | None, int | None, int | None]] = field(default_factory=dict, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)  # over _current_max
    _sampler: threading.Thread | None = field(default=None, init=False, repr=False)

    @staticmethod
    def probe() -> MemorySupport:
        if os.geteuid() != 0:
            return MemorySupport(None, None, "not root: cgroups cannot be created")
        v2 = _v2_root()
        if v2 is not None:
            return MemorySupport("cgroup2 memory.max", v2, f"memory controller on the v2 hierarchy at {v2}")
        mount = _v1_mount()
        if mount is None:
            return MemorySupport(None, None, "no cgroup that can take a memory cap: no writable v2 root with the "
                                             "memory controller free to hand down, and no v1 memory hierarchy")
        own = _v1_own(mount)
        for root, where in ((own, "inside our own memory cgroup"), (mount, "at the hierarchy's root")):
            if root is not None and (root / "memory.limit_in_bytes").exists() and os.access(root, os.W_OK):
                return MemorySupport("cgroup1 memory.limit_in_bytes", root,
                                     "memory.max unavailable: the memory controller is bound to cgroup v1 on this "
                                     f"host, so the cap is memory.limit_in_bytes, made {where} ({root})")
        return MemorySupport(None, None, f"the v1 memory hierarchy at {mount} is not writable here")

    def __enter__(self) -> "MemoryCaps":
        s = self.support
        if s.mechanism is None or s.root is None:
            raise RuntimeError(f"cannot cap memory: {s.reason}")
        caps = self.per_index if self.per_index is not None else [self.mib_each] * self.n
        if len(caps) != self.n:
            raise ValueError(f"{len(caps)} per-index memory caps for {self.n} processes")
        if min(caps, default=MIN_CAP_MIB) < MIN_CAP_MIB:
            raise ValueError(f"memory caps {caps} MiB: each must be at least {MIN_CAP_MIB} MiB")
        self._final, self._current_max = {}, {}
        try:
            self._sweep_stale()
            if s.v2:
                sub = s.root / "cgroup.subtree_control"
                if "memory" not in sub.read_text().split():
                    _write(sub, "+memory")
            for i, mib in enumerate(caps):
                d = s.root / f"{PREFIX}-{os.getpid()}-{i}"
                d.mkdir()
                self.dirs.append(d)
                self._no_swap(d)
                self.set(i, mib)
            if s.v2 and not (self.dirs[0] / "memory.peak").exists():
                self._stop.clear()
                self._sampler = threading.Thread(target=self._sample_current, name="memory-caps", daemon=True)
                self._sampler.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _no_swap(self, d: Path) -> None:
        if self.support.v2:
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
                self.swap_rule = "memory.swap.max=0"
            elif _host_swaps():
                self.swap_rule = "none: memory.swap.max absent (no swap accounting), capped processes may swap"
            else:
                self.swap_rule = "none needed: no swap on this host"
        elif (d / "memory.memsw.limit_in_bytes").exists():
            self.swap_rule = "memory.memsw.limit_in_bytes=cap"  # set with the limit, in set()
        else:
            _write(d / "memory.swappiness", "0")
            self.swap_rule = "memory.swappiness=0 (no memsw accounting on this kernel)"

    def set(self, i: int, mib: float) -> None:
        """Cap i at `mib` MiB from now on (its processes stay in it; lowering it below what they use reclaims
        or OOM-kills, or on v1 may be refused with EBUSY)."""
        if mib < MIN_CAP_MIB:
            raise ValueError(f"memory cap {mib} MiB for index {i} is below {MIN_CAP_MIB} MiB")
        limit = int(mib * MiB)
        d = self.dirs[i]
        if self.support.v2:
            _write(d / "memory.max", str(limit))
            return
        memsw = d / "memory.memsw.limit_in_bytes"
        if not memsw.exists():
            _write(d / "memory.limit_in_bytes", str(limit))
            return
        # memory+swap may never be below memory alone: raise memsw first when growing, last when shrinking
        old = _read_int(d / "memory.limit_in_bytes") or 0
        order = [memsw, d / "memory.limit_in_bytes"] if limit > old else [d / "memory.limit_in_bytes", memsw]
        for path in order:
            _write(path, str(limit))

    def add(self, i: int, pid: int) -> None:
        """Move process `pid` (all its threads, and what it starts later) into cap i; what it allocated before
        stays charged where it was (module docstring: use `command` to cap a process from its start)."""
        _write(self.dirs[i] / "cgroup.procs", str(pid))

    def command(self, i: int, argv: list[str]) -> list[str]:
        """An argv that moves itself into cap i, then execs `argv`: the process is capped from its first page."""
        # sh -c SCRIPT $0 $@...: $0 is the cgroup.procs file, "$@" the command; `exec` keeps the pid
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.dirs[i] / "cgroup.procs"), *argv]

    def peak_mib(self, i: int) -> float | None:
        """The most memory charged to cap i so far (page cache included: module docstring), in MiB."""
        if i in self._final:
            return self._final[i][0]
        d = self.dirs[i]
        if not self.support.v2:
            peak = _read_int(d / "memory.max_usage_in_bytes")
        elif (d / "memory.peak").exists():
            peak = _read_int(d / "memory.peak")
        else:
            self._sample_once()
            peak = self._current_max.get(i)
        return None if peak is None else peak / MiB

    def oom_kills(self, i: int) -> int | None:
        """Processes the OOM killer killed in cap i (None where the kernel does not count them: v1 before 4.13)."""
        if i in self._final:
            return self._final[i][1]
        d = self.dirs[i]
        try:
            keyed = parse_keyed((d / ("memory.events" if self.support.v2 else "memory.oom_control")).read_text())
        except OSError:
            return None
        return keyed.get("oom_kill")

    def limit_hits(self, i: int) -> int | None:
        """How often cap i's usage reached the cap (v1 memory.failcnt + memory.memsw.failcnt, v2 memory.events
        `max`); a hit is reclaim or a refused charge, not necessarily a kill. A lower bound only: Linux 6.x on v1
        counts no refusal of memory+swap (memsw.failcnt stays 0), and with memsw at the cap those come first."""
        if i in self._final:
            return self._final[i][2]
        d = self.dirs[i]
        if not self.support.v2:
            # a charge is tried against memory+swap first, then memory: a refusal counts in one of them at most
            counts = [_read_int(d / name) for name in ("memory.failcnt", "memory.memsw.failcnt")]
            known = [c for c in counts if c is not None]
            return sum(known) if known else None
        try:
            return parse_keyed((d / "memory.events").read_text()).get("max")
        except OSError:
            return None

    def _sample_once(self) -> None:
        for i, d in enumerate(list(self.dirs)):
            cur = _read_int(d / "memory.current")
            if cur is not None:
                with self._lock:
                    self._current_max[i] = max(self._current_max.get(i, 0), cur)

    def _sample_current(self) -> None:
        while not self._stop.wait(CURRENT_SAMPLE_S):
            self._sample_once()

    def _sweep_stale(self) -> None:
        """Remove caps left by a run that died without its __exit__ (SIGKILL): theirs is the pid in the name,
        no longer alive, and they hold no process."""
        root = self.support.root
        assert root is not None
        for d in root.glob(f"{PREFIX}-*-*"):
            try:
                owner = int(d.name[len(PREFIX) + 1:].split("-")[0])
            except ValueError:
                continue
            if owner == os.getpid() or pid_alive(owner):
                continue
            try:
                if not (d / "cgroup.procs").read_text().split():
                    d.rmdir()
            except OSError:
                pass  # busy, or raced by another run's sweep: the next run tries again

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(STOP_TIMEOUT_S)
            self._sampler = None
        if self.dirs:
            self._final = {}  # read the files, not a previous run's figures
            self._final = {i: (self.peak_mib(i), self.oom_kills(i), self.limit_hits(i)) for i in range(len(self.dirs))}
        left: list[str] = []
        for d in self.dirs:
            why = self._remove(d)
            if why:
                left.append(f"{d}: {why}")
        self.dirs.clear()
        if left:
            raise RuntimeError("memory caps left behind: " + "; ".join(left))

    @staticmethod
    def _remove(d: Path) -> str | None:
        """Move d's processes back to its parent and remove d, retrying while the kernel still holds it;
        the last error if it would not go."""
        last = ""
        for _ in range(RMDIR_TRIES):
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        (d.parent / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # exited meanwhile
                d.rmdir()
                return None
            except FileNotFoundError:
                return None
            except OSError as exc:
                last = str(exc)
            time.sleep(RMDIR_WAIT_S)
        return last or "not removed"

"""Hard CPU caps per benchmark process, so N daemons on one host each run as if on a small machine of their own.

On one shared host the CPU a slow or dead peer gives up would otherwise speed the others up, which peers on
machines of their own never see. The cap is cgroup v2 `cpu.max` where the cpu controller is on the v2
hierarchy; many hosts (this development VM among them) still bind the cpu controller to cgroup v1, where
the same quota is `cpu.cfs_quota_us` / `cpu.cfs_period_us`. `CpuCaps.probe()` says which one this host
allows, or why neither (then the bench runs uncapped and says so in its JSON).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PERIOD_US = 100_000  # the kernel's default CFS period: quotas are a fraction of 100 ms
MIN_QUOTA_US = 1_000  # the smallest quota the kernel accepts
# The period for benches that read a peer's measured speed (the pipeline's stage capacities): with the kernel's
# 100 ms, a peer busy only now and then computes a whole quota at full speed (a 0.5-CPU peer busy ~20% of the
# time measured 97 samples/s on a stage where its speed measured on a busy stage predicted 52; a 1/3-CPU peer of
# `peer bench pipeline` ~35 on a stage it measured ~20 on when saturated), so its measured speed would depend on
# how busy its stage keeps it. In 10 ms periods a call of ~60 ms CPU is throttled all along, so speeds follow the
# caps whatever the load.
SPEED_PERIOD_US = 10_000


@dataclass(frozen=True)
class CapSupport:
    """Where caps can be made: `mechanism` is "cgroup2 cpu.max", "cgroup1 cpu.cfs_quota_us" or None."""

    mechanism: str | None
    root: Path | None
    reason: str  # why this one (or why none)


def _v2_root() -> Path | None:
    """A cgroup v2 directory whose children may get the cpu controller (we must be able to enable it)."""
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        ctl = root / "cgroup.controllers"
        try:
            if "cpu" in ctl.read_text().split() and os.access(root, os.W_OK):
                return root
        except OSError:
            continue
    return None


@dataclass
class CpuCaps:
    """One cgroup per process index, each capped at `cpus_each` CPUs (or cap i at `per_index[i]`, for caps of
    different sizes); a context manager that removes them. `set(i, cpus)` resizes one while it runs."""

    n: int
    cpus_each: float
    support: CapSupport
    per_index: list[float] | None = None
    period_us: int = PERIOD_US  # shorter: a process busy only now and then no longer runs a whole quota at full speed
    priority: float = 1.0  # x the default CPU weight (v1 cpu.shares 1024, v2 cpu.weight 100) against other work
    dirs: list[Path] = field(default_factory=list)

    @staticmethod
    def probe() -> CapSupport:
        if os.geteuid() != 0:
            return CapSupport(None, None, "not root: cgroups cannot be created")
        v2 = _v2_root()
        if v2 is not None:
            return CapSupport("cgroup2 cpu.max", v2, f"cpu controller on the v2 hierarchy at {v2}")
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
            return CapSupport("cgroup1 cpu.cfs_quota_us", v1,
                              "cpu.max unavailable: the cpu controller is bound to cgroup v1 on this host, "
                              "so the same quota is set as cpu.cfs_quota_us/cpu.cfs_period_us")
        return CapSupport(None, None, "no writable cgroup with a cpu controller (neither v2 cpu.max nor v1 cpu)")

    def __enter__(self) -> "CpuCaps":
        s = self.support
        if s.mechanism is None:
            raise RuntimeError(f"cannot cap CPU: {s.reason}")
        if self.per_index is not None and len(self.per_index) != self.n:
            raise ValueError(f"{len(self.per_index)} per-index caps for {self.n} processes")
        try:
            if s.mechanism.startswith("cgroup2"):
                sub = (s.root / "cgroup.subtree_control")
                if "cpu" not in sub.read_text().split():
                    sub.write_text("+cpu")
            for i in range(self.n):
                d = s.root / f"ptbench{os.getpid()}p{i}"
                d.mkdir()
                self.dirs.append(d)
                if not s.mechanism.startswith("cgroup2"):
                    (d / "cpu.cfs_period_us").write_text(str(self.period_us))
                if self.priority != 1.0:
                    if s.mechanism.startswith("cgroup2"):
                        (d / "cpu.weight").write_text(str(max(1, min(10_000, round(100 * self.priority)))))
                    else:
                        (d / "cpu.shares").write_text(str(max(2, round(1024 * self.priority))))
                self.set(i, self.per_index[i] if self.per_index is not None else self.cpus_each)
        except BaseException:
            self.__exit__()
            raise
        return self

    def set(self, i: int, cpus: float) -> None:
        """Cap i at `cpus` CPUs from now on (its processes stay in it)."""
        quota = max(MIN_QUOTA_US, int(cpus * self.period_us))
        d = self.dirs[i]
        if self.support.mechanism.startswith("cgroup2"):
            (d / "cpu.max").write_text(f"{quota} {self.period_us}")
        else:
            (d / "cpu.cfs_quota_us").write_text(str(quota))

    def add(self, i: int, pid: int) -> None:
        """Move process `pid` (all its threads, and what it starts later) into cap i."""
        (self.dirs[i] / "cgroup.procs").write_text(str(pid))

    def throttled_s(self, i: int) -> float | None:
        """Seconds cap i has held its processes back so far (None if the kernel does not say)."""
        try:
            stat = dict(line.split() for line in (self.dirs[i] / "cpu.stat").read_text().splitlines())
        except (OSError, ValueError, IndexError):
            return None
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"]) / 1e6
        if "throttled_time" in stat:
            return int(stat["throttled_time"]) / 1e9
        return None

    def __exit__(self, *exc) -> None:
        root = self.support.root
        for d in self.dirs:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        (root / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # exited meanwhile
                d.rmdir()
            except OSError:
                pass
        self.dirs.clear()

"""This daemon's memory budget for a pipeline stage, and what it holds now (no torch: the daemon's side).

The budget is `[pipeline] memory_mib` when set; else what this process may use at start: the memory cgroup's
limit when it has one (a container, a CI job, the benches' caps), else the host's available memory plus what
we already hold, less AUTO_MARGIN of it (the page cache, other processes, the estimate's error). A GPU stage's
budget is the GPU's, which the trainer reads from torch (trainers/swarm_pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocol.limits import MiB
AUTO_MARGIN = 0.10
"""Of an automatic budget, the share left unplanned: the stage's memory is an estimate from shapes, and the
kernel, the page cache and other processes need room too."""
UNLIMITED = 1 << 60  # cgroup v1 writes a huge number for "no limit"; anything above this is none


@dataclass(frozen=True)
class Budget:
    bytes: int
    source: str  # where the figure came from, for the log and `peer status`


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (0 if it cannot be read)."""
    return _status_bytes(pid, "VmRSS")


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The largest resident set size a process has had (VmHWM; 0 if it cannot be read)."""
    return _status_bytes(pid, "VmHWM")


def _status_bytes(pid: int | str, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_limit(proc_cgroup: Path = Path("/proc/self/cgroup"),
                  root: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """The memory limit of this process's cgroup (v2 memory.max, or v1 memory.limit_in_bytes), if any.
    `proc_cgroup` and `root` are where the kernel shows them (parameters so tests can point at a fake tree)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":
            candidates = [root / rel / "memory.max", root / "unified" / rel / "memory.max"]
        elif "memory" in controllers.split(","):
            candidates = [root / "memory" / rel / "memory.limit_in_bytes"]
        else:
            continue
        for f in candidates:
            try:
                raw = f.read_text().strip()
            except OSError:
                continue
            if raw != "max" and raw.isdigit() and int(raw) < UNLIMITED:
                return int(raw), f"the memory cgroup's limit ({f})"
    return None


def _available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def budget(configured_mib: int) -> Budget:
    """The budget (module docstring); 0 bytes when nothing can be read (then no constraint applies)."""
    if configured_mib > 0:
        return Budget(configured_mib * MiB, "[pipeline] memory_mib")
    limited = _cgroup_limit()
    if limited is not None:
        return Budget(int(limited[0] * (1 - AUTO_MARGIN)), f"{limited[1]}, less {AUTO_MARGIN:.0%}")
    avail = _available()
    if avail is not None:
        return Budget(int((avail + rss_bytes()) * (1 - AUTO_MARGIN)),
                      f"available memory at start plus ours, less {AUTO_MARGIN:.0%}")
    return Budget(0, "unknown (no /proc): no memory constraint")


def fits(need_bytes: int, budget_bytes: int, baseline_bytes: int) -> bool:
    """Whether a stage needing `need_bytes` fits a peer with this budget and baseline (0 budget: unknown, fits).
    The one rule for the job's plan (trainers/pipeline/memory.py) and the daemon's seating."""
    return budget_bytes <= 0 or baseline_bytes + need_bytes <= budget_bytes


def mib(n: float) -> int:
    """Bytes as whole MiB, rounded up (a budget or a use is never shown smaller than it is)."""
    return -(-int(n) // MiB)

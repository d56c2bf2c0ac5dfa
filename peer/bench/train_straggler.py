"""`peer bench train --straggler F`: do the other peers slow down when one peer is F times slower?

One peer (the last) sleeps after each step, in every mode; each mode runs a fixed number of steps without
and with it, and the other peers' steps/s are compared. Where cgroups allow it, every peer is capped at
cpus/n CPUs (`CpuCaps` says why).
"""

from __future__ import annotations

import os
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from peer.bench.hosts import Net, cpu_probe_ms
from peer.bench.train_allreduce import run_allreduce
from peer.bench.train_gossip import run_gossip
from peer.bench.train_plan import Plan


class CpuCaps:
    """One cgroup (v1 `cpu` controller) per peer, each capped at cpus/n CPUs, for --straggler runs.

    On one shared host the CPU a sleeping straggler gives up would otherwise speed the others up, which peers
    on machines of their own would never see; with a hard cap every peer runs as if on its own small machine.
    """

    ROOT = Path("/sys/fs/cgroup/cpu")

    def __init__(self, n: int, cpus_each: float):
        self.n, self.cpus_each = n, cpus_each
        self.dirs: list[Path] = []

    @classmethod
    def available(cls) -> bool:
        return os.geteuid() == 0 and (cls.ROOT / "cpu.cfs_quota_us").exists() and os.access(cls.ROOT, os.W_OK)

    def __enter__(self) -> "CpuCaps":
        try:
            for i in range(self.n):
                d = self.ROOT / f"ptbench{os.getpid()}p{i}"
                d.mkdir()
                self.dirs.append(d)
                (d / "cpu.cfs_period_us").write_text("100000")
                (d / "cpu.cfs_quota_us").write_text(str(max(1000, int(self.cpus_each * 100000))))
        except BaseException:
            self.__exit__()
            raise
        return self

    def add(self, i: int, pid: int) -> None:
        """Move process `pid` (all its threads, and children it starts later) into peer i's group."""
        (self.dirs[i] / "cgroup.procs").write_text(str(pid))

    def __exit__(self, *exc) -> None:
        for d in self.dirs:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        (self.ROOT / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # exited meanwhile
                d.rmdir()
            except OSError:
                pass
        self.dirs.clear()


def straggler(a, plan: Plan, net: Net, root: Path, modes: list[str]) -> dict:
    """Other peers' steps/s without and with one peer slowed `a.straggler`-fold (a fixed run length, no target)."""
    slow = a.n - 1
    others = [i for i in range(a.n) if i != slow]
    steps = a.straggler_steps
    ar_steps = max(plan.eval_every, steps // 4)
    opts = {**plan.options, "target_accuracy": 0.0, "max_steps": steps}  # fixed length: rates, not targets
    ar_args = [*plan.allreduce_args, "--target", "0", "--max-steps", str(ar_steps)]
    cap = None if a.no_caps or not CpuCaps.available() else round((os.cpu_count() or 1) / a.n, 3)
    out: dict[str, Any] = {"cpu_cap_per_peer": cap}
    delay = None
    ordered = sorted(modes, key=lambda m: m != "adpsgd")  # the first mode's step time sets the delay
    for mode in ordered:
        res, probes = {}, {}
        for label in ("without", "with"):
            d = root / f"{mode}-{label}"
            d.mkdir(parents=True)
            probes[label] = cpu_probe_ms()
            with ExitStack() as stack:
                caps = stack.enter_context(CpuCaps(a.n, cap)) if cap else None
                if mode == "allreduce":
                    extra = ["--step-delay", str(delay), "--straggler-rank", str(slow)] if label == "with" else []
                    rates = run_allreduce(a, net, d, args=[*ar_args, *extra], caps=caps)["steps_per_s_per_worker"]
                else:
                    raw = run_gossip(mode, a, net, d, plan, options=opts,
                                     delays={slow: delay} if label == "with" else {}, wait_for_peers=others,
                                     target=0.0, caps=caps)
                    rates = [p["steps_per_s"] if p.get("started") else None for p in raw["peers"]]
            if delay is None:
                step_s = 1.0 / rates[slow]
                delay = round((a.straggler - 1) * step_s, 5)
                out["measured_step_s"] = {"mode": mode, "seconds": round(step_s, 5)}
            res[label] = rates
        w = statistics.mean(res["without"][i] for i in others)
        s = statistics.mean(res["with"][i] for i in others)
        out[mode] = {
            "others_steps_per_s_without": round(w, 2), "others_steps_per_s_with": round(s, 2),
            "ratio": round(s / w, 3),
            "straggler_steps_per_s_without": round(res["without"][slow], 2),
            "straggler_steps_per_s_with": round(res["with"][slow], 2) if res["with"][slow] else None,
            "straggler_slowdown": round(res["without"][slow] / res["with"][slow], 2) if res["with"][slow] else None,
            "steps": ar_steps if mode == "allreduce" else steps,
            "cpu_probe_ms_before": probes,
        }
    out["step_delay_s"] = delay
    out["straggler_peer"] = slow
    return out

"""`peer bench train --straggler F`: do the other peers slow down when one peer is F times slower?

One peer (the last) sleeps after each step, in every mode; each mode runs a fixed number of steps without
and with it, and the other peers' steps/s are compared. Where cgroups allow it, every peer is capped at
cpus/n CPUs (peer/bench/cpu_caps.py says how, or why not).
"""

from __future__ import annotations

import os
import statistics
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from peer.bench.cpu_caps import CpuCaps
from peer.bench.hosts import Net, cpu_probe_ms
from peer.bench.train_allreduce import run_allreduce
from peer.bench.train_gossip import run_gossip
from peer.bench.train_plan import Plan


def straggler(a, plan: Plan, net: Net, root: Path, modes: list[str]) -> dict:
    """Other peers' steps/s without and with one peer slowed `a.straggler`-fold (a fixed run length, no target)."""
    slow = a.n - 1
    others = [i for i in range(a.n) if i != slow]
    steps = a.straggler_steps
    ar_steps = max(plan.eval_every, steps // 4)
    opts = {**plan.options, "target_accuracy": 0.0, "max_steps": steps}  # fixed length: rates, not targets
    ar_args = [*plan.allreduce_args, "--target", "0", "--max-steps", str(ar_steps)]
    support = CpuCaps.probe()
    cap = None if a.no_caps or support.mechanism is None else round((os.cpu_count() or 1) / a.n, 3)
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
                caps = stack.enter_context(CpuCaps(a.n, cap, support)) if cap else None
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

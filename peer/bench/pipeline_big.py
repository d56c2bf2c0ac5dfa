"""`peer bench pipeline --big`: a model bigger than any one daemon, trained across daemons in memory cgroups.

`--daemons` daemons (default 6), one stage each, each in a memory cgroup of `--memory-mib` MiB (cgroup v2
`memory.max` or v1 `memory.limit_in_bytes`: peer/bench/memory_caps.py) with `[pipeline] memory_mib` the same,
train `--big-model` (default `trainers.pipeline.wide:big_bench`: 42 residual blocks of 3072², 397 M
parameters: 5.9 GiB with gradients and Adam's moments, the bench's `model_mib`) on the digits. Every daemon drives `--samples` samples, `--in-flight`
microbatches at once; the throughput is measured from the moment every driver has finished a microbatch until
the first driver is done, against the slowest stage's bound (the stage map's announced, measured samples/s).

Reported: `model_mib`, `memory_cap_mib`, `max_daemon_rss_mib` (the largest VmHWM of any daemon: its peak
resident memory, shared library pages included; the cgroups' own peaks, page cache included, are listed too),
`samples_per_s`, `efficiency`, `lost` (failed microbatches), and `duplicate_gradients`: for every stage, the
samples its servers accumulated beyond what the drivers had acknowledged there (peer/pipeline/kept.py's books;
0 means no gradient entered a stage twice), in microbatches.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import ExitStack

from peer.bench.hosts import run_root
from peer.bench.memory_caps import MemoryCaps
from peer.bench.pipeline import POLL_S, START_TIMEOUT_S, Poller
from peer.bench.pipeline_figures import capacities_over, driver_of, rate
from peer.testing.rss import RssSampler
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm

DATA = "trainers.pipeline.wide:digits"
MICROBATCH, BATCH = 8, 32
LR = 3e-5  # 1e-4 and above diverge on 32 wide residual blocks in 160 samples (trainers/pipeline/wide.py)
DRIVE_TIMEOUT_S = 1800.0  # the drivers' samples at a few samples/s, with room


def _options(a, i: int) -> dict:
    return {"model_factory": a.big_model, "dataset_factory": DATA, "stages": a.daemons, "initial_stage": i,
            "microbatch": MICROBATCH, "batch_size": BATCH, "lr": LR, "samples": a.samples, "in_flight": a.in_flight,
            "rebalance": False, "copy_every": 0.0, "checkpoint_every": 0.0, "eval_batches": 2, "threads": 1,
            "join_wait": 300.0, "seed": a.seed}


def _books(statuses: list[dict | None], stages: int) -> tuple[int, list[int], list[int]]:
    """(duplicate microbatches, samples accumulated per stage by its servers, samples acknowledged per stage by
    the drivers): a stage that accumulated more than was acknowledged there took a gradient twice."""
    accumulated, acked = [0] * stages, [0] * stages
    for st in statuses:
        pipe = (st or {}).get("pipeline") or {}
        for s, n in (pipe.get("server", {}).get("accumulated_by_stage") or {}).items():
            if 0 <= int(s) < stages:
                accumulated[int(s)] += n
        for s, n in enumerate(driver_of(st).get("acked_samples") or []):
            if s < stages:
                acked[s] += n
    extra = max((a - b for a, b in zip(accumulated, acked)), default=0)
    return max(0, -(-extra // MICROBATCH)), accumulated, acked


def run(a) -> int:
    if a.daemons < 2 or a.memory_mib < 256 or a.samples < MICROBATCH or a.in_flight < 1:
        print("--big needs --daemons >= 2, --memory-mib >= 256, --samples >= 8 and --in-flight >= 1", file=sys.stderr)
        return 2
    support = MemoryCaps.probe()
    if support.mechanism is None:
        print(f"peer bench pipeline --big: no memory cgroups here ({support.reason}); run it as root on Linux",
              file=sys.stderr)
        return 2
    t_start, load0 = time.monotonic(), os.getloadavg()[0]
    name = unique_swarm("big")
    with ExitStack() as stack:
        root = run_root(stack, a.logs, "peertrain-big-")
        caps = stack.enter_context(MemoryCaps(a.daemons, a.memory_mib, support))
        rss = stack.enter_context(RssSampler())
        swarm = stack.enter_context(LocalSwarm(root))
        for i in range(a.daemons):
            cfg = swarm_config(swarm=name, trainer="trainers.swarm_pipeline", topology={"record_interval": 1.0},
                               pipeline={"memory_mib": a.memory_mib}, options=_options(a, i))
            d = swarm.start(f"b{i}", config=cfg, env={**rank_env(i, a.daemons), "OMP_NUM_THREADS": "1"})
            caps.add(i, d.pid)
            rss.watch(d.pid)
        poller = Poller(swarm, time.monotonic())
        everyone = list(range(a.daemons))
        try:
            t_ready = t_first_done = None
            while True:
                p = poller.poll()
                sts = p.statuses
                for st in sts:
                    if ((st or {}).get("trainer") or {}).get("state", "").startswith("failed"):
                        raise RuntimeError(f"a trainer failed: {st['trainer'].get('state')}")
                if t_ready is None and all(driver_of(st).get("done", 0) > 0 for st in sts):
                    t_ready = p.t
                if t_ready is not None and t_first_done is None and \
                        any(((st or {}).get("trainer") or {}).get("driving_done") for st in sts):
                    t_first_done = p.t
                if all(((st or {}).get("trainer") or {}).get("driving_done") for st in sts):
                    break
                limit = START_TIMEOUT_S if t_ready is None else DRIVE_TIMEOUT_S
                if p.t > limit:
                    raise TimeoutError(f"the drivers did not finish within {limit:.0f}s (ready: {t_ready})")
                time.sleep(POLL_S)
            end = poller.poll()
        finally:
            poller.close()
        t0 = t_ready + 0.1 * (t_first_done - t_ready)
        t1 = t_first_done
        throughput = rate(poller.polls, everyone, t0, t1)
        caps_seen = capacities_over(poller.polls, 0, a.daemons, t0, t1)
        bound = min(caps_seen) if caps_seen else None
        duplicates, accumulated, acked = _books(end.statuses, a.daemons)
        trainer0 = end.statuses[0]["trainer"]
        peaks = rss.peaks()
        pids = [d.pid for d in swarm.daemons]
        drivers = [driver_of(st) for st in end.statuses]
        memory = [((st or {}).get("pipeline") or {}).get("memory") for st in end.statuses]
        cgroup_peaks = [caps.peak_mib(i) for i in everyone]
        oom = [caps.oom_kills(i) for i in everyone]
    max_rss = max(peaks[pid].hwm_mib for pid in pids)
    model_mib = trainer0.get("model_mib")
    out = {
        "model_mib": model_mib, "memory_cap_mib": a.memory_mib, "max_daemon_rss_mib": round(max_rss, 1),
        "samples_per_s": None if throughput is None else round(throughput, 3),
        "slowest_stage_bound_samples_per_s": None if bound is None else round(bound, 3),
        "efficiency": round(throughput / bound, 3) if throughput and bound else None,
        "lost": sum(d.get("failed", 0) for d in drivers), "duplicate_gradients": duplicates,
        "done": sum(d.get("done", 0) for d in drivers), "ack_lost": sum(d.get("ack_lost", 0) for d in drivers),
        "accumulated_by_stage": accumulated, "acked_by_stage": acked,
        "val_loss": [((st or {}).get("trainer") or {}).get("val_loss") for st in end.statuses],
        "daemon_rss_mib": [round(peaks[pid].hwm_mib, 1) for pid in pids],
        "daemon_anon_mib": [round(peaks[pid].max_anon_mib, 1) for pid in pids],
        "cgroup_peak_mib": [None if c is None else round(c, 1) for c in cgroup_peaks], "oom_kills": oom,
        "stage_memory": memory, "cuts": end.statuses[0]["pipeline"]["cuts"],
        "daemons": a.daemons, "stages": a.daemons, "samples_per_driver": a.samples, "in_flight_per_driver": a.in_flight,
        "memory_cap": {"mechanism": support.mechanism, "swap": caps.swap_rule},
        "model": {"factory": a.big_model, "data": DATA, "microbatch": MICROBATCH, "batch_size": BATCH, "lr": LR},
        "window_s": [round(t0, 1), round(t1, 1)],
        "goals": {"model_at_least_3x_cap": model_mib is not None and model_mib >= 3 * a.memory_mib,
                  "rss_within_cap": max_rss <= a.memory_mib,
                  "efficiency_at_least_0.8": None if throughput is None or not bound else throughput / bound >= 0.8,
                  "zero_lost": sum(d.get("failed", 0) for d in drivers) == 0, "zero_duplicates": duplicates == 0},
        "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "wall_s": round(time.monotonic() - t_start, 1),
    }
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
    return 0 if out["samples_per_s"] is not None else 1

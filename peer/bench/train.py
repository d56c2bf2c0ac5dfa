"""`peer bench train`: time to a target accuracy (or a language model's loss) for AD-PSGD, D-PSGD, local steps and
a gloo all-reduce baseline.

One invocation trains the same model, data shards, per-worker batch, optimizer and lr several ways: our
daemons hosting `trainers.gossip_sgd` in `adpsgd`, `dpsgd` and `local` mode (`local_q8`: 8-bit outer exchanges),
and `trainers.allreduce_baseline` (torch.distributed, one process per rank, started as `python -m ...`: `peer/`
never imports `trainers`).

Clocks exclude start-up: for our modes each peer's training clock starts after its daemon has found the
swarm (the trainer's own `elapsed_s`), for all-reduce after process-group init and a barrier.
`seconds_to_target` is, for our modes, the wall time from the first peer's training start until the LAST
peer's local model reached the target (every peer evaluates its own model on the held-out set every
`eval_every` steps); for all-reduce, until rank 0's (shared) model reached it. `--netns` runs every peer
and every rank in its own network namespace and can throttle one host's link (`--slow-link MBIT`) or every
host's (`--link-mbit MBIT`);
`--straggler F` slows one peer's steps F-fold and reports the other peers' steps/s with and without it.

This module runs the experiments and reports; one run of our modes is train_gossip.py, one of the
baseline train_allreduce.py, the straggler experiment train_straggler.py, the shared choices train_plan.py,
the language model's figures (issue 20) train_lm.py.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from peer.bench.args import LM_MODEL, TRAIN_MODES
from peer.bench.hosts import Net, cpu_probe_ms, run_root
from peer.bench.train_allreduce import run_allreduce, summarise_allreduce
from peer.bench.train_gossip import run_gossip, summarise_gossip
from peer.bench.train_lm import lm_figures
from peer.bench.train_plan import Plan, default_modes, make_plan
from peer.bench.train_straggler import straggler
from peer.testing.netns import netns_available, virtual_lan


def _median(values: list) -> Any:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals and len(vals) == len(values) else None


def time_to_target(a, plan: Plan, net: Net, root: Path, modes: list[str]) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(plan.repeats):
        for mode in modes:
            d = root / f"r{rep}-{mode}"
            d.mkdir(parents=True)
            probe = cpu_probe_ms()
            try:  # one broken run is reported, not allowed to hide the others
                if mode == "allreduce":
                    runs[mode].append(summarise_allreduce(run_allreduce(a, net, d, args=plan.allreduce_args)))
                else:
                    raw = run_gossip(mode, a, net, d, plan, options=plan.options, delays={},
                                     wait_for_peers=list(range(a.n)), target=plan.target)
                    runs[mode].append(summarise_gossip(raw, a.n))
            except (RuntimeError, TimeoutError, OSError) as exc:
                runs[mode].append({"reached_target": False, "seconds_to_target": None, "epochs_to_target": None,
                                   "samples_per_s_per_peer": None, "samples_per_s_total": None,
                                   "bytes_sent_per_peer": None, "error": f"{type(exc).__name__}: {str(exc)[-600:]}"})
            runs[mode][-1]["cpu_probe_ms_before"] = probe
    out = {}
    for mode, rs in runs.items():
        best = dict(rs[0]) if len(rs) == 1 else {
            "seconds_to_target": _median([r["seconds_to_target"] for r in rs]),
            "epochs_to_target": _median([r["epochs_to_target"] for r in rs]),
            "samples_per_s_per_peer": _median([r["samples_per_s_per_peer"] for r in rs]),
            "samples_per_s_total": _median([r["samples_per_s_total"] for r in rs]),
            "bytes_sent_per_peer": _median([r["bytes_sent_per_peer"] for r in rs]),
            "bytes_sent_training_per_peer": _median([r.get("bytes_sent_training_per_peer") for r in rs]),
            "bytes_sent_after_joins_per_peer": _median([r.get("bytes_sent_after_joins_per_peer") for r in rs]),
            "steps_to_target": _median([r.get("steps_to_target") for r in rs]),
            "bytes_sent_estimate_ring": _median([r.get("bytes_sent_estimate_ring") for r in rs]),
            "reached_target": all(r["reached_target"] for r in rs),
            "trials_seconds_to_target": [r["seconds_to_target"] for r in rs],
            "trials_cpu_probe_ms": [r.get("cpu_probe_ms_before") for r in rs],
            "parameters": rs[0].get("parameters"), "hyperparams": rs[0].get("hyperparams"),
            "trials": rs,
        }
        if mode != "allreduce":
            best["seconds_to_target_median_peer"] = _median([r.get("seconds_to_target_median_peer") for r in rs])
        out[mode] = best
    base = runs.get("allreduce")
    for mode in ("adpsgd", "dpsgd"):
        if base and mode in runs and plan.repeats > 1:
            pairs = [r["seconds_to_target"] / b["seconds_to_target"] for r, b in zip(runs[mode], base)
                     if r.get("seconds_to_target") and b.get("seconds_to_target")]
            out[mode]["trials_ratio_to_allreduce"] = [round(x, 3) for x in pairs]
    return out


def run(args) -> int:
    a = args
    if a.n < 2:
        raise ValueError("--n must be at least 2")
    if (a.slow_link or a.link_mbit) and not a.netns:
        raise ValueError("--slow-link and --link-mbit need --netns (the limit is a tbf qdisc on a host's link)")
    if a.straggler and a.straggler <= 1:
        raise ValueError("--straggler F needs F > 1")
    if a.inner_steps < 1:
        raise ValueError("--inner-steps must be at least 1")
    plan = make_plan(a)
    modes = [m.strip() for m in (a.modes or default_modes(plan.model)).split(",") if m.strip()]
    bad = [m for m in modes if m not in TRAIN_MODES]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {bad}; choose from {', '.join(TRAIN_MODES)}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.monotonic()
    with ExitStack() as stack:
        root = run_root(stack, a.keep, "peertrain-bench-train-")
        net = Net()
        if a.netns:
            if not netns_available():
                raise RuntimeError("--netns needs root and permission to create network namespaces")
            rates = {i: a.link_mbit for i in range(a.n)} if a.link_mbit else {}
            if a.slow_link:
                rates[a.n - 1] = a.slow_link
            lan = virtual_lan(a.n, prefix="ptb", subnet="10.78.0", rate_mbit=rates or None)
            net = Net(lan=stack.enter_context(lan))
        if a.straggler:
            body = {"straggler": straggler(a, plan, net, root, modes)}
        else:
            body = {"modes": time_to_target(a, plan, net, root, modes)}
    result = {
        "bench": "train", "n": a.n, "model": plan.model,
        **({"target_accuracy": plan.target} if plan.metric == "accuracy" else {"target_test_loss": plan.target}),
        "eval_every": plan.eval_every, "epoch_budget": plan.epochs or None, "step_budget": plan.max_steps or None,
        **({"model_options": plan.options["model_options"]} if "model_options" in plan.options else {}),
        "network": ({"netns": True, "slow_link_mbit": a.slow_link or None,
                     "slow_host": (a.n - 1) if a.slow_link else None,
                     **({"link_mbit_every_host": a.link_mbit} if a.link_mbit else {})} if a.netns else "127.0.0.1"),
        "topology": plan.topology,
        "gossip": plan.gossip, **body,
    }
    if not a.straggler:
        m = body["modes"]
        base = (m.get("allreduce") or {}).get("seconds_to_target")
        for mode in ("adpsgd", "dpsgd"):
            mine = (m.get(mode) or {}).get("seconds_to_target")
            key = "ratio_to_allreduce" if mode == "adpsgd" else "ratio_dpsgd_to_allreduce"
            result[key] = round(mine / base, 3) if mine and base else None
        found = [v for v in m.values() if v.get("parameters")]
        result["parameters"] = found[0]["parameters"] if found else None
        result["model_mb"] = round(found[0]["parameters"] * 4 / 1e6, 2) if found else None
        result["hyperparams"] = next((v["hyperparams"] for v in m.values() if v.get("hyperparams")), None)
        if plan.model == LM_MODEL or plan.metric == "test_loss":
            result.update(lm_figures(m, plan, a))
        else:
            result["goal"] = ("adpsgd time-to-target <= 0.5x all-reduce with one slow link" if a.slow_link
                              else "adpsgd time-to-target <= 1.3x all-reduce on even links")
        result.setdefault("notes", []).extend([
            "seconds_to_target, ours: wall time from the first peer's training start (after discovery) until the "
            "LAST peer's local model reached the target on the held-out set (checked every eval_every steps); "
            "_first_peer and _median_peer are given too",
            "seconds_to_target, all-reduce: from after process-group init + barrier until rank 0's model reached it",
            "epochs = passes over a peer's own shard (= passes over the whole data set by all peers together); "
            "ours: the epoch at which the last peer reached the target",
            "samples_per_s_total: sum of every peer's own average rate over its run",
            "same model, seeded init, shard per rank, per-worker batch, optimizer and lr in every mode",
            ("each peer stopped at its own target (gossip_sgd target_accuracy)" if a.stop_at_target else
             "every peer trains until all have reached the target (then the bench stops them); "
             "--stop-at-target lets each stop at its own"),
        ])
    else:
        result["goal"] = "adpsgd: others' steps/s with the straggler >= 0.85x without"
        result["notes"] = [
            f"the last peer sleeps step_delay_s = ({a.straggler:g} - 1) x its measured adpsgd step time after "
            "each step, in every mode (gossip_sgd step_delay / allreduce_baseline --step-delay)",
            "steps/s are each peer's steps / its own training elapsed_s; fixed run length, no target",
            (f"every peer/rank process was capped at {body['straggler']['cpu_cap_per_peer']} CPUs (cgroup cpu quota), "
             "so the CPU a sleeping straggler frees cannot speed up the others as it would not across machines"
             if body["straggler"]["cpu_cap_per_peer"] else
             "no CPU caps: the CPU the sleeping straggler frees speeds up the others on this shared host, "
             "which can push the ratio above 1"),
        ]
    result["loadavg_before"] = load_before
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    result["cpus"] = os.cpu_count()
    result["bench_wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result) if a.json else json.dumps(result, indent=2))
    if a.straggler:
        return 0
    return 0 if all((v or {}).get("reached_target") for v in body["modes"].values()) else 1

"""`peer bench pipeline --liar`: a stage server that lies, against the drivers' checks (peer/pipeline/verify.py).

For an honest run and then each attacker named (default: a 1.05x scale, noise of 0.3x the outputs' size, the
input gradient's sign flipped, the weights it started with), a fresh swarm of 6 daemons: stage 1 has three
peers, the others one (rank r serves stage STAGES_OF[r]; rebalancing off, so nobody moves), and in the liar runs
its third peer lies (it only serves, in the honest run too). The other five drive `--samples` samples each at `[pipeline] verify_fraction`
(`--verify-fraction`, default the config's), then the first driver's validation loss through the pipeline is
asked for. Reported per run, from every driver's `peer status`: whether each driver banned the liar and after how
many of its own microbatches, the share of the verdicts on the liar's answers that found it the outlier, the
honest peers struck or banned (false bans), the checks' compute seconds over the calls' (the overhead), the
validation loss and its gap to the honest run's, failed and re-run microbatches.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

from peer.bench.cpu_caps import CapSupport, CpuCaps
from peer.bench.hosts import netns_refused, run_root
from peer.bench.pipeline import START_TIMEOUT_S, STAGES, Model, Poller, daemon_config
from peer.bench.pipeline_codecs import CODEC_MODEL, TINY_CODEC, final_val_loss, trainer_of, wait_polls
from peer.bench.pipeline_figures import driver_of
from peer.config import PipelineSection
from peer.testing.netns import virtual_lan
from peer.testing.swarm import LocalSwarm, rank_env, unique_swarm
from peer.testing import lying_stage

ATTACKERS = "scale:1.05,noise:0.3,flip,stale"  # the four, `--liar` alone
STAGES_OF = [0, 1, 1, 1, 2, 3]  # stage 1 has three peers: a mismatch has a third opinion
LIAR = 3  # the daemon that lies (stage 1's third peer), a server only
EVAL_BATCHES = 16  # validation microbatches (x8 samples), as the codec comparison's
RUN_TIMEOUT_S = 1200.0  # most seconds one run may drive after start-up


def attackers_of(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ValueError(f"--liar: expected a comma list of attackers ({ATTACKERS}), got {text!r}")
    for m in modes:
        lying_stage.parse(m)  # a ValueError naming what is wrong
    return list(dict.fromkeys(modes))


def one_run(a, mode: str | None, model: Model, root: Path, netns: bool, support: CapSupport | None) -> dict:
    """A fresh swarm, stage 1's third peer lying as `mode` says (None: honest); the run's figures."""
    n = len(STAGES_OF)
    drivers = [i for i in range(n) if i != LIAR]  # the liar's daemon only serves, in the honest run too
    options = {**asdict(model), "stages": STAGES, "samples": a.samples, "in_flight": a.in_flight, "seed": a.seed,
               "eval_batches": EVAL_BATCHES, "rebalance": False}
    pipeline = {} if a.verify_fraction is None else {"verify_fraction": a.verify_fraction}
    with ExitStack() as stack:
        lan = stack.enter_context(virtual_lan(n, prefix="ptl", subnet="10.77.20")) if netns else None
        caps = stack.enter_context(CpuCaps(n, a.cpus / n, support)) if support else None
        swarm = stack.enter_context(LocalSwarm(root / (mode or "honest").replace(":", "-")))
        name = unique_swarm("bl")
        t_launch = time.monotonic()
        for i, stage in enumerate(STAGES_OF):
            opts = dict(options, initial_stage=stage, role="server" if i == LIAR else "auto")
            if mode and i == LIAR:
                opts.update(lying_stage.options(mode))
            cfg = daemon_config(name, i, lan, opts)
            if pipeline:
                cfg = cfg.replace(pipeline=pipeline)
            d = swarm.start(f"p{i}", config=cfg, host=lan.hosts[i] if lan else None,
                            env={**rank_env(i, n), "OMP_NUM_THREADS": "1"})
            if caps is not None:
                caps.add(i, d.pid)
        poller = Poller(swarm, t_launch)
        stack.callback(poller.close)
        going = wait_polls(poller, drivers, lambda p: all(driver_of(p.statuses[i]).get("done", 0) > 0 for i in drivers),
                      START_TIMEOUT_S, "not every driver finished a microbatch")
        finished = wait_polls(poller, drivers, lambda p: all(trainer_of(p.statuses[i]).get("driving_done") for i in drivers),
                         going.t + RUN_TIMEOUT_S, f"not every driver drove {a.samples} samples")
        liar = finished.statuses[LIAR]["peer_id"] if mode else None
        val = final_val_loss(swarm.daemons[drivers[0]])
        final = [swarm.daemons[i].try_status() or finished.statuses[i] for i in drivers]
        return figures(mode, liar, final, val, drive_s=finished.t - going.t, startup_s=going.t)


def figures(mode: str | None, liar: str | None, statuses: list[dict], val_loss: float | None, *, drive_s: float,
            startup_s: float) -> dict:
    """One run's figures from its drivers' final statuses (pure: tests feed it statuses)."""
    vs = [driver_of(st).get("verify") or {} for st in statuses]
    bans = [set(v.get("banned") or {}) for v in vs]  # every peer each driver banned, its ban in force or over
    now = [{b["peer"] for b in ((st or {}).get("pipeline") or {}).get("bans", [])} for st in statuses]
    trs = [trainer_of(st) for st in statuses]
    check_s = sum(v.get("check_compute_s", 0.0) for v in vs)
    call_s = sum(v.get("call_compute_s", 0.0) for v in vs)
    compared = sum((v.get("compared") or {}).get(liar, 0) for v in vs) if liar else 0
    found = sum((v.get("outliers") or {}).get(liar, 0) for v in vs) if liar else 0
    until = [v.get("first_ban_at") if liar in b else None for v, b in zip(vs, bans)] if liar else []
    return {
        "attacker": mode or "none",
        "liar_banned_by": sum(liar in b for b in bans) if liar else None,
        "liar_banned_at_end_by": sum(liar in b for b in now) if liar else None,
        "liar_bans": sum((v.get("banned") or {}).get(liar, 0) for v in vs) if liar else None,
        "drivers": len(statuses),
        "microbatches_until_banned": until,
        "detection_rate": round(found / compared, 3) if compared else None,
        "liar_verdicts": compared,
        "false_bans": sum(len(b - {liar}) for b in bans),
        "false_strikes": sum(n for v in vs for p, n in (v.get("strikes") or {}).items() if p != liar),
        "verify_overhead": round(check_s / call_s, 4) if call_s else None,
        "checks": sum(v.get("checks", 0) for v in vs),
        "mismatches": sum(v.get("mismatches", 0) for v in vs),
        "unresolved": sum(v.get("unresolved", 0) for v in vs),
        "reruns": sum(v.get("reruns", 0) for v in vs),
        "val_loss": val_loss,
        "failed": sum(t.get("microbatches_failed", 0) for t in trs),
        "done": sum(t.get("microbatches_done", 0) for t in trs),
        "samples_per_s": round(sum(t.get("samples_per_s", 0) for t in trs), 2),
        "startup_s": round(startup_s, 1), "drive_s": round(drive_s, 1),
    }


def summary(runs: list[dict]) -> dict:
    """The top-level figures: over the liar runs, whether every driver banned the liar, the most microbatches a
    driver took to ban it, false bans in every run, the honest run's overhead, and each run's loss gap."""
    honest = runs[0]
    liars = runs[1:]
    for r in liars:
        r["val_loss_gap"] = (None if r["val_loss"] is None or honest["val_loss"] is None
                             else float(f"{(r['val_loss'] - honest['val_loss']) / honest['val_loss']:.3g}"))
    until = [u for r in liars for u in r["microbatches_until_banned"]]
    return {
        "liar_banned": bool(liars) and all(r["liar_banned_by"] == r["drivers"] for r in liars),
        "microbatches_until_banned": max(until) if until and None not in until else None,
        "false_bans": sum(r["false_bans"] for r in runs),
        "verify_overhead": honest["verify_overhead"],
        "detection_rate": {r["attacker"]: r["detection_rate"] for r in liars},
        "banned_by": {r["attacker"]: f"{r['liar_banned_by']}/{r['drivers']}" for r in liars},
        "until_banned": {r["attacker"]: r["microbatches_until_banned"] for r in liars},
        "val_loss_gap": {r["attacker"]: r["val_loss_gap"] for r in liars},
    }


def run(a) -> int:
    try:
        modes = attackers_of(a.liar)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if a.samples < 1 or a.in_flight < 1 or a.cpus <= 0 or not (a.verify_fraction is None
                                                                  or 0 <= a.verify_fraction <= 1):
        print("--samples and --in-flight must be at least 1, --cpus positive, --verify-fraction in [0, 1]",
              file=sys.stderr)
        return 2
    netns = not a.no_netns
    if netns_refused(netns):
        return 2
    model = TINY_CODEC if a.tiny else CODEC_MODEL
    support = CpuCaps.probe()
    use_caps = support.mechanism is not None and not a.no_caps
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    runs = []
    with ExitStack() as stack:
        root = run_root(stack, a.logs, "peertrain-liar-")
        for mode in [None, *modes]:
            runs.append(one_run(a, mode, model, root, netns, support if use_caps else None))
            r = runs[-1]
            print(f"{r['attacker']}: banned by {r['liar_banned_by']}/{r['drivers']} after {r['microbatches_until_banned']} "
                  f"microbatches, false bans {r['false_bans']}, overhead {r['verify_overhead']}, val loss "
                  f"{r['val_loss']}", file=sys.stderr)
    out = {
        **summary(runs),
        "runs": runs,
        "config": {"stages": STAGES, "daemons": len(STAGES_OF), "stage_of_daemon": STAGES_OF, "liar_daemon": LIAR,
                   "drivers": len(STAGES_OF) - 1, "samples_per_driver": a.samples, "in_flight_per_driver": a.in_flight,
                   "verify_fraction": PipelineSection().verify_fraction if a.verify_fraction is None
                   else a.verify_fraction, "seed": a.seed, "netns": netns,
                   "cpu_cap_each": round(a.cpus / len(STAGES_OF), 3) if use_caps else None,
                   "cpu_cap_note": ("off (--no-caps)" if a.no_caps else support.reason) if use_caps or a.no_caps
                   else f"UNCAPPED: {support.reason}",
                   "model": {"name": "built-in char transformer (Shakespeare)", **asdict(model)}},
        "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
    return 0 if all(r["val_loss"] is not None and r["failed"] == 0 for r in runs) else 1

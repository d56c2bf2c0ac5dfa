"""`peer bench pipeline --uneven` / `--churn`: does the pipeline find and keep the best assignment of peers of
different speeds to its stages? (issue 17). The figures are pure functions in peer/bench/pipeline_rebalance.py.

Speeds. Each daemon gets its own CPU cap, shares 2 : 2 : 1.5 : 1 : 1 : 0.5 of `--cpus` (with 2 CPUs: 0.5, 0.5,
0.375, 0.25, 0.25, 0.125; `--shares` changes them). Why these: they add up to 4 x the largest, so the best
assignment can give every one of the 4 stages the same CPU ({2}, {2}, {1.5, 0.5}, {1, 1}), but only with peers
paired across stages by their speeds; a speed-blind layout lands far from it; and the slowest peer is a quarter
of the fastest, as volunteers' machines differ. Start-up (imports, profiling, planning) runs under equal caps of
`--cpus`/N each, so the slowest peer does not hold every run's start back for minutes; the uneven caps are set
once every driver has finished a microbatch, before the warm-up. A restarted peer starts under its own cap.
A cap is an upper bound: on a host busy with other work the peers get less, and unevenly, and the runs
compared are minutes apart (on this shared VM at load 5-12 two runs of one layout differed by 1.6x). Each
run reports the CPU each peer used of its cap (`cpu_used_of_cap`) and `warnings` flags a starved slowest
stage; `--cpu-priority 8` weighs the daemons' cgroups above other work so they get their caps (with
`--cpus 1.5`, others keep half a core): then two runs of one layout agreed within 2%.

Runs, each a fresh swarm (daemon i always has cap i):
  a. static: peer i pinned to stage i mod 4 (`initial_stage`), `rebalance` off: the layout a config written
     without knowing the speeds gives (ranks dealt round-robin), and the fastest peers land together on
     stages 0 and 1 while stage 3 is left to one quarter-speed peer. Its throughput after `--warmup`, over
     `--measure` seconds; from its stage maps, every peer's speed factor (pipeline_rebalance.py).
  b. best: the brute-force best assignment for those speeds (ties: fewest peers moved from static), pinned,
     `rebalance` off: "run for reference". Its measured throughput is the denominator of every fraction.
  c. rebalanced: static's pinned start with `rebalance` on, for `--rebalance-for` seconds: throughput per
     `--window`; the figure is the last `--measure` seconds (after the moves settle); the stage changes seen
     in the statuses and the rebalancer's own `pipeline.moves`.
  d. churn (`--churn`), in run c's swarm right after it: every `--churn-every` seconds a random live peer is
     killed (-9) and, `--churn-pause` seconds later, restarted on its own home (same identity, checkpoint and
     cap; unpinned: the placement rule and the rebalancer decide its stage). Recovery of each event: seconds
     until the throughput over `--window` is back to 90% of the `--window` before the event (of the level
     the last event interrupted, if the swarm had not got back to it) (null if not before the next event;
     the trace is in the JSON). Lost: microbatches the drivers report failed, over all
     incarnations; the microbatches a killed driver had in flight die with it and are counted apart
     (`lost_with_killed_drivers`, from its last status before the kill).
With `--churn` alone: equal caps, one swarm placed by the default rule with `rebalance` on; its throughput
over `--measure` after `--warmup` is the reference (no reference run), then the churn phase.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict

from peer.bench.hosts import netns_refused, run_root
from peer.bench import pipeline as base
from peer.bench import pipeline_rebalance as pr
from peer.bench.cpu_caps import SPEED_PERIOD_US, CpuCaps
from peer.bench.pipeline_figures import driver_of
from peer.bench.pipeline_runs import Swarm, lost, window
from peer.testing.netns import virtual_lan

STAGES = base.STAGES
DEFAULT_SHARES = (2.0, 2.0, 1.5, 1.0, 1.0, 0.5)
CAP_PERIOD_US = SPEED_PERIOD_US  # measured speeds that follow the caps, not the load (cpu_caps.py)


def _measure(s: Swarm, a) -> dict:
    """Warm-up, then `--measure` seconds: throughput, and every peer's measured samples/s on its stage."""
    return {**window(s, a.warmup, a.warmup + a.measure), "startup_s": s.startup_s,
            "lost": lost(s, a.warmup, a.warmup + a.measure)}


def _plan(statuses: list[dict | None]) -> tuple[list[float], int]:
    """The planned ms per stage of the daemon with the smallest peer ID (its cut is the one every peer
    adopted: peer/pipeline/placement.py), and that daemon."""
    have = [(st["peer_id"], i, st["trainer"]["plan_ms"]) for i, st in enumerate(statuses)
            if st and (st.get("trainer") or {}).get("plan_ms")]
    if not have:
        raise RuntimeError("no daemon published plan_ms (trainers.swarm_pipeline publishes it when it starts)")
    _, i, plan = min(have)
    return list(plan), i


def _speeds(s: Swarm, m: dict) -> dict:
    statuses = [s.last(i) for i in range(s.a.daemons)]
    plan_ms, planner = _plan(statuses)
    plan = pr.shares(plan_ms)
    stage_of = m["assignment"]
    if None in stage_of or None in m["peer_samples_per_s"]:
        raise RuntimeError(f"static run: a peer has no stage or no measured speed: stages {stage_of}, "
                           f"samples/s {m['peer_samples_per_s']}")
    v = pr.speed_factors(m["peer_samples_per_s"], stage_of, plan)
    return {"plan_ms": plan_ms, "plan_share": [round(x, 4) for x in plan], "plan_from_daemon": planner,
            "per_daemon": [{"daemon": i, "cpus": s.cpus[i], "stage": stage_of[i],
                            "samples_per_s": round(m["peer_samples_per_s"][i], 2), "speed": round(v[i], 3),
                            "speed_per_cpu": round(v[i] / s.cpus[i], 2)} for i in range(s.a.daemons)],
            "_v": v, "_plan": plan}


def _rebalanced(s: Swarm, a) -> dict:
    t1 = a.rebalance_for
    t0 = max(0.0, t1 - a.measure)
    w = window(s, t0, t1)
    series = s.series()
    return {**{k: v for k, v in w.items() if k not in ("window_s", "assignment")},
            "settled_window_s": [t0, t1], "series": pr.windowed(series, 0.0, t1, a.window),
            "assignment_at_end": w["assignment"],
            "stage_changes": pr.stage_changes(s.polls, s.t_ready),
            "moves": pr.reported_moves([s.last(i) for i in range(a.daemons)]),
            "startup_s": s.startup_s, "lost": lost(s, 0.0, t1)}


def _churn(s: Swarm, a, t_start: float, rng: random.Random) -> dict:
    """Kill and restart a random live peer every `--churn-every` seconds from `t_start` (module doc)."""
    events = []
    failed0 = s.series("failed")[-1][1]
    killed0 = s.killed_in_flight
    for k in range(a.churn_events):
        t_ev = t_start + k * a.churn_every
        s.until(t_ev)
        latest = s.poller.latest().statuses
        live = [i for i in range(a.daemons) if driver_of(latest[i]).get("done", 0) > 0]
        if not live:
            events.append({"at_s": round(s.now() - t_start, 1), "skipped": "no peer up to kill"})
            continue
        vi = rng.choice(live)
        in_flight = driver_of(s.last(vi)).get("in_flight")
        stage = pr.my_stage(s.last(vi))
        t_kill = s.now()
        s.kill(vi)
        s.until(t_kill + a.churn_pause)
        s.restart(vi)
        events.append({"daemon": vi, "stage": stage, "cpus": s.cpus[vi], "t": t_kill,
                       "killed_driver_in_flight": in_flight, "restarted_after_s": round(s.now() - t_kill, 1)})
    t_end = t_start + a.churn_events * a.churn_every
    s.until(t_end)
    series = s.series()
    reference, ev_recovered = None, True
    for k, ev in enumerate(events):
        if "t" not in ev:
            continue
        t = ev.pop("t")
        nxt = t_start + (k + 1) * a.churn_every
        pre = pr.series_rate(series, t - a.window, t)
        if reference is None or pre is None or ev_recovered:  # else still short of the level before the last event
            reference = pre
        rec, trace = pr.recovery(series, t, reference, a.window, nxt)
        ev_recovered = rec is not None
        back = next((round(p.t - s.t_ready - t, 1) for p in s.polls if p.t - s.t_ready > t
                     and driver_of(p.statuses[ev["daemon"]]).get("done", 0) > 0), None)
        ev.update(at_s=round(t - t_start, 1), pre_event_samples_per_s=_r(pre), reference_samples_per_s=_r(reference),
                  recovery_s=rec, victim_driving_again_after_s=back, trace=trace)
    failed = s.series("failed")[-1][1] - failed0
    return {"samples_per_s": pr.series_rate(series, t_start, t_end), "window_s": [t_start, t_end],
            "every_s": a.churn_every, "pause_s": a.churn_pause, "events": events,
            "recovery_s": [ev.get("recovery_s") for ev in events if "daemon" in ev],
            "lost": int(failed), "lost_with_killed_drivers": s.killed_in_flight - killed0,
            "series": pr.windowed(series, t_start, t_end, a.window),
            "stage_changes": [c for c in pr.stage_changes(s.polls, s.t_ready) if c["at_s"] >= t_start],
            "moves": pr.reported_moves([s.last(i) for i in range(a.daemons)])}


def _cpus(a) -> list[float]:
    if not a.uneven:
        return [round(a.cpus / a.daemons, 4)] * a.daemons
    weights = ([float(x) for x in a.shares.split(",")] if a.shares
               else [DEFAULT_SHARES[i % len(DEFAULT_SHARES)] for i in range(a.daemons)])
    if len(weights) != a.daemons:
        raise ValueError(f"--shares has {len(weights)} values for {a.daemons} daemons")
    return pr.cpu_caps_from_shares(weights, a.cpus)


def contention(run: str, w: dict) -> str | None:
    """A warning when the peers of a run's slowest stage used under 85% of their caps over its window: then
    other work on the host (or too few microbatches in flight), not the caps, set the speeds compared."""
    caps = w.get("stage_capacity_samples_per_s")
    used = w.get("cpu_used_of_cap")
    if not caps or not used or not any(caps):
        return None
    slow = min(range(len(caps)), key=lambda st: caps[st] if caps[st] else float("inf"))
    stages = w.get("assignment") or w.get("assignment_at_end") or []
    mine = [u for st, u in zip(stages, used) if st == slow and u is not None]
    if not mine or min(mine) >= 0.85:
        return None
    return (f"{run}: the peers of the slowest stage ({slow}) used {min(mine):.0%} of their CPU caps (load "
            f"{w['load_1m'][1]}): other work on the host, not the caps, set their speed; "
            f"--cpu-priority 8 with --cpus 1.5 gives them their caps")


def _public(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def _r(x, nd: int = 2):
    return None if x is None else round(x, nd)


def run(a) -> int:
    if a.daemons < STAGES:
        print(f"--daemons must be at least {STAGES}", file=sys.stderr)
        return 2
    if min(a.warmup, a.churn_pause) < 0 or min(a.measure, a.window, a.cpus, a.churn_every) <= 0 \
            or a.rebalance_for < a.measure or a.churn_events < 1:
        print("--measure, --window, --cpus and --churn-every must be positive, --warmup and --churn-pause at least "
              "0, --rebalance-for at least --measure, --churn-events at least 1", file=sys.stderr)
        return 2
    try:
        cpus = _cpus(a)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    netns = not a.no_netns
    if netns_refused(netns):
        return 2
    model = base.TINY if a.tiny else base.Model()
    options = base._options(model, a)
    support = CpuCaps.probe()
    use_caps = support.mechanism is not None and not a.no_caps
    rng = random.Random(a.seed)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    out: dict = {"mode": "+".join(m for m, on in (("uneven", a.uneven), ("churn", a.churn)) if on)}
    with ExitStack() as stack:
        root = run_root(stack, a.logs, "peertrain-uneven-")
        lan = stack.enter_context(virtual_lan(a.daemons, prefix="ptu", subnet="10.77.17")) if netns else None
        caps = stack.enter_context(CpuCaps(a.daemons, a.cpus / a.daemons, support, period_us=CAP_PERIOD_US,
                                                   priority=a.cpu_priority)) \
            if use_caps else None

        if a.uneven:
            static_assignment = pr.round_robin(a.daemons, STAGES)
            with ExitStack() as one:
                s = Swarm(one, a, root, lan, caps, cpus, "static", options, static_assignment, False)
                static = _measure(s, a)
                speeds = _speeds(s, static)
            v, plan = speeds["_v"], speeds["_plan"]
            best_assignment, best_pred = pr.best_assignment(v, plan, start=static_assignment)
            with ExitStack() as one:
                best = _measure(Swarm(one, a, root, lan, caps, cpus, "best", options, best_assignment, False), a)
            denominator = best["samples_per_s"]
            out.update(
                static={**static, "pinned": list(static_assignment),
                        "why": "peer i on stage i mod 4: speed-blind ranks dealt round-robin",
                        "predicted_samples_per_s": _r(pr.predicted(static_assignment, v, plan)),
                        "predicted_stage_samples_per_s": [_r(x) for x in pr.stage_rates(static_assignment, v, plan)]},
                speeds=_public(speeds),
                best={**best, "pinned": list(best_assignment), "predicted_samples_per_s": _r(best_pred),
                      "predicted_stage_samples_per_s": [_r(x) for x in pr.stage_rates(best_assignment, v, plan)],
                      "peers_moved_from_static": pr.moved(static_assignment, best_assignment)})
            with ExitStack() as one:
                s = Swarm(one, a, root, lan, caps, cpus, "rebalanced", options, static_assignment, True)
                reb = _rebalanced(s, a)
                out["rebalanced"] = reb
                if a.churn:
                    out["churn"] = _churn(s, a, a.rebalance_for, rng)
            out["fraction_of_best_static"] = pr.fraction(static["samples_per_s"], denominator)
            out["fraction_of_best_rebalanced"] = pr.fraction(reb["samples_per_s"], denominator)
            out["fraction_of_predicted_best"] = {
                "static": pr.fraction(static["samples_per_s"], best_pred),
                "best": pr.fraction(denominator, best_pred),
                "rebalanced": pr.fraction(reb["samples_per_s"], best_pred)}
            best_source = "measured: run b (the brute-force best assignment, pinned, rebalance off)"
        else:  # --churn alone: the swarm's own throughput before the churn is the reference
            with ExitStack() as one:
                s = Swarm(one, a, root, lan, caps, cpus, "churn", options, None, True)
                pre = _measure(s, a)
                speeds = _speeds(s, pre)
                v, plan = speeds["_v"], speeds["_plan"]
                best_assignment, best_pred = pr.best_assignment(v, plan, start=pre["assignment"])
                out["before_churn"] = {**pre, "predicted_samples_per_s": _r(pr.predicted(pre["assignment"], v, plan))}
                out["speeds"] = _public(speeds)
                out["best"] = {"pinned": None, "predicted_samples_per_s": _r(best_pred),
                               "predicted_assignment": list(best_assignment)}
                out["churn"] = _churn(s, a, a.warmup + a.measure, rng)
            denominator = pre["samples_per_s"]
            best_source = "measured: this swarm before the churn (default placement, equal caps; no reference run)"
            out["fraction_of_best_static"] = out["fraction_of_best_rebalanced"] = None
        out["best"]["measured_samples_per_s"] = _r(denominator)
        out["best"]["source"] = best_source
    out["warnings"] = [w for run in ("static", "best", "rebalanced", "before_churn") if run in out
                       if (w := contention(run, out[run]))]
    churn = out.get("churn")
    out["fraction_of_best_churn"] = pr.fraction(churn["samples_per_s"], denominator) if churn else None
    out["recovery_s"] = churn["recovery_s"] if churn else []
    out["lost"] = churn["lost"] if churn else out["rebalanced"]["lost"]
    out["lost_with_killed_drivers"] = churn["lost_with_killed_drivers"] if churn else 0
    out["goals"] = {
        "rebalanced_at_least_0.95_of_best": None if out["fraction_of_best_rebalanced"] is None
        else out["fraction_of_best_rebalanced"] >= 0.95,
        "churn_at_least_0.85_of_best": None if out["fraction_of_best_churn"] is None
        else out["fraction_of_best_churn"] >= 0.85,
        "zero_lost": out["lost"] == 0}
    out["caps"] = {"mechanism": support.mechanism if use_caps else None, "cpus": cpus if use_caps else None,
                   "period_us": CAP_PERIOD_US if use_caps else None, "priority": a.cpu_priority if use_caps else None,
                   "shares": a.shares or (",".join(f"{x:g}" for x in DEFAULT_SHARES) if a.uneven else "equal"),
                   "startup_cpus_each": round(a.cpus / a.daemons, 4) if use_caps else None,
                   "note": ("off (--no-caps)" if a.no_caps else support.reason) if use_caps or a.no_caps
                   else f"UNCAPPED: {support.reason}"}
    out["durations_s"] = {"warmup": a.warmup, "measure": a.measure, "rebalance_for": a.rebalance_for if a.uneven else None,
                          "window": a.window, "churn_every": a.churn_every if a.churn else None,
                          "churn_events": a.churn_events if a.churn else None}
    out.update(daemons=a.daemons, stages=STAGES, in_flight_per_driver=a.in_flight, netns=netns,
               model={"name": "built-in char transformer (Shakespeare)", **asdict(model)},
               command="peer " + " ".join(sys.argv[1:]),
               load_1m=[round(load0, 2), round(os.getloadavg()[0], 2)], wall_s=round(time.monotonic() - t0, 1))
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
    return 0 if out["fraction_of_best_churn"] is not None or out["fraction_of_best_rebalanced"] is not None else 1

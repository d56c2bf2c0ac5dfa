"""`peer bench byzantine`: honest training swarms with lying peers in them (issue 29), and what the defence
of the averaging (docs/design.md, "Robust averaging") makes of each attack.

For every topology (the rewired one; two_cliques, where trimming or a median over neighbours fails with no
attack at all) and every share of liars (`--fractions`, of `--n` daemons), one swarm runs with no liar (the
honest peers alone: the reference) and one per attack of peer.testing.byzantine.ATTACKS. Honest daemons host
trainers.gossip_sgd (digits CNN, AD-PSGD) for `--steps` steps each; a peer's held-out accuracy at that step is
its figure. Per attack the bench reports the worst and mean honest accuracy and their drop in points from
the reference, how many exchanges each honest peer had with a liar before banning it (a sleeper's counted
from when it began to attack), and every honest peer banned by an honest one (a false positive, in any run).

Then the defence's cost without attack: the same no-liar swarms with every daemon's defence switched off
(`no_attack_cost_points`, the accuracy it costs), and the 64 MiB exchange time of `peer bench average` with
the defence on ÷ off, swarms interleaved (`no_attack_exchange_time_ratio`). `--lm` adds the char transformer
with local steps (held-out loss instead of accuracy) at the smallest share on the first topology.

A honest peer whose trainer failed (its loss went non-finite) counts as accuracy 0. Every run is a fresh
swarm of real daemons on 127.0.0.1; the figures are as noisy as one run is (the test set is 360 digits:
one digit is 0.28 points).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import ExitStack
from fractions import Fraction
from pathlib import Path

from peer.bench.args import LM_BATCH, LM_EVAL_SAMPLES, LM_INNER_STEPS, LM_MODEL, LM_MODEL_OPTIONS, parse_size
from peer.bench.hosts import run_root
from peer.testing.byzantine import ATTACKS, SwarmPlan, run_swarm
from peer.testing.swarm import unique_swarm

MODEL = "digits_cnn"  # the issue's: small enough that 8 daemons train it on 2 cores in ~40 s
GOAL_EIGHTH_POINTS = 2.0  # worst honest accuracy within this of no attack, every attack at 1/8 (the issue's)
GOAL_QUARTER_POINTS = 5.0  # ... at 1/4
GOAL_COST_POINTS = 0.5  # no-attack accuracy the defence may cost
GOAL_EXCHANGE_RATIO = 1.05  # ... and exchange time (64 MiB)
LM_SLEEP_EXCHANGES = 5  # the LM sleeper's: local-steps peers exchange once a round, ~10x fewer than the digits ones
GOSSIP = {"exchange_timeout": 5.0}  # as the training tests: a loaded 2-core host still finishes a small exchange


def _fractions(text: str, n: int) -> list[tuple[str, int]]:
    """'1/8,1/4' -> [('1/8', 1), ('1/4', 2)] for n = 8: at least one liar, at most n - 2."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        f = Fraction(part)
        if not 0 < f < 1:
            raise ValueError(f"--fractions: {part} is not in (0, 1)")
        liars = max(1, round(f * n))
        if n - liars < 2:
            raise ValueError(f"--fractions: {part} of {n} leaves fewer than 2 honest peers")
        out.append((part, liars))
    return out


def _topology(kind: str, degree: int) -> dict:
    if kind == "rewired":
        return {"kind": "rewired", "target_degree": degree, "min_degree": 2, "max_degree": degree + 1}
    return {"kind": kind}


def _honest_options(a, *, lm: bool) -> dict:
    if lm:
        return {"model": LM_MODEL, "model_options": dict(LM_MODEL_OPTIONS), "mode": "local",
                "inner_steps": LM_INNER_STEPS, "outer_codec": "raw", "batch_size": LM_BATCH,
                "eval_samples": LM_EVAL_SAMPLES, "max_steps": a.lm_steps, "eval_every": LM_INNER_STEPS,
                "seed": a.seed}
    return {"model": MODEL, "mode": "adpsgd", "max_steps": a.steps, "eval_every": a.eval_every, "seed": a.seed}


def _one(a, root: Path, tag: str, plan: SwarmPlan) -> dict:
    """One swarm's figures; an error is reported in place of figures, never allowed to hide the other runs."""
    d = root / tag
    d.mkdir(parents=True)
    try:
        return run_swarm(plan, d, unique_swarm("bz"), timeout=a.timeout)
    except (TimeoutError, RuntimeError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[-500:]}"}


def _score(run: dict, metric: str) -> dict:
    """Worst and mean of the honest peers' figure; a failed trainer scores accuracy 0 (loss: none)."""
    if "error" in run:
        return {"error": run["error"]}
    vals = []
    for p in run["peers"]:
        v = p.get(metric)
        if str(p.get("state", "")).startswith("failed") or v is None:
            v = 0.0 if metric == "accuracy" else float("inf")
        vals.append(v)
    worst = min(vals) if metric == "accuracy" else max(vals)
    return {"worst": _r(worst), "mean": _r(statistics.mean(vals)), "per_peer": [_r(v) for v in vals],
            "failed_peers": sum(str(p.get("state", "")).startswith("failed") for p in run["peers"])}


def _figures(run: dict, ref: dict, attack: str | None, metric: str) -> dict:
    s, r = _score(run, metric), _score(ref, metric)
    out: dict = {**s, "wall_s": run.get("wall_s"), "defence": run.get("defence")}
    if "error" in s:
        return out
    sign = 100.0 if metric == "accuracy" else -1.0  # accuracy: points lost; loss: how much higher
    for k in ("worst", "mean"):  # (None: a loss that went non-finite)
        if r.get(k) is not None and s.get(k) is not None:
            out[f"{k}_drop"] = _r(sign * (r[k] - s[k]), 2)
    w = run["watch"]
    out["honest_banned"] = w["honest_banned"]
    radius, ref_radius = w.get("radius_max") or {}, (ref.get("watch") or {}).get("radius_max") or {}
    out["radius_max_to_honest"] = radius.get("to_honest")
    if attack is not None and radius.get("to_honest") and ref_radius.get("to_honest"):
        out["radius_ratio_vs_none"] = _r(radius["to_honest"] / ref_radius["to_honest"], 2)
    if w["false_positives"]:
        out["false_positives"] = w["false_positives"]
    if attack is not None:
        liars = list(w["liars"].values())
        until = [x["exchanges_until_ban_max"] for x in liars]
        out.update({
            "detectable": ATTACKS[attack].detectable,
            "liars_banned": sum(1 for x in liars if x["banned_by"] > 0),
            "liars": len(liars),
            "banned_by_of_partners": [[x["banned_by"], x["honest_partners"]] for x in liars],
            "exchanges_until_ban": max(until) if all(u is not None for u in until) else None,
            "seconds_until_ban": max((x["seconds_until_first_ban"] or 0) for x in liars)
                                  if all(x["seconds_until_first_ban"] is not None for x in liars) else None,
            "liar_exchanges_with_honest": [x["exchanges_with_honest"] for x in liars],
            "ban_reason": next((x["ban_reason"] for x in liars if x["ban_reason"]), None),
            **_clipping(run),
            "liar_status": run.get("liars"),
        })
    return out


def _clipping(run: dict) -> dict:
    """How the honest peers' averaging met the liars: exchanges with them, and the share clipped (a defence
    that reports clips: peer status's per-partner `clipped`)."""
    seen = [e for p in run["peers"] for e in (p.get("liars_seen") or {}).values()]
    n = sum(e.get("exchanges", 0) for e in seen)
    if not seen or "clipped" not in seen[0]:
        return {}
    return {"liar_exchanges_clipped": sum(e.get("clipped") or 0 for e in seen),
            "liar_exchanges_clipped_share": _r(sum(e.get("clipped") or 0 for e in seen) / n, 3) if n else None}


def _exchange_times(a) -> dict:
    """Seconds per 64 MiB exchange (peer bench average's swarm of 2), defence on and off, interleaved."""
    from peer.bench.average import BenchFailed, run_swarm as average_swarm

    elements = max(1, parse_size(a.exchange_size) // 4)
    rounds = min(max(1, a.exchange_rounds), 19)
    times: dict[bool, list[float]] = {True: [], False: []}
    errors = []
    for _ in range(max(1, a.exchange_repeat)):
        for on in (True, False):
            ns = argparse.Namespace(peers=2, settle=2.0, timeout=180.0, chunk="1MiB", codec="raw", cipher="auto",
                                    no_defence=not on)
            try:
                got = average_swarm(ns, elements, "one", rounds + 1)
            except BenchFailed as exc:
                errors.append(str(exc)[-300:])
                continue
            g = got["status0"]["gossip"]
            times[on].append(statistics.median(g["recent_s"][-rounds:]))
            if "defence" in g and g["defence"] is not on:
                errors.append(f"asked for the defence {'on' if on else 'off'}, node 0 reports defence={g['defence']}")
    on, off = times[True], times[False]
    return {"seconds_defence_on": [_r(x) for x in on], "seconds_defence_off": [_r(x) for x in off],
            "ratio": _r(statistics.median(on) / statistics.median(off)) if on and off else None,
            "payload_bytes": elements * 4, "rounds": rounds, **({"errors": errors} if errors else {})}


def run(args) -> int:
    a = args
    t_start = time.monotonic()
    load_before = os.getloadavg()[0]
    if a.n < 3:
        raise ValueError("--n must be at least 3 (2 honest peers and a liar)")
    fractions = _fractions(a.fractions, a.n)
    attacks = [x.strip() for x in a.attacks.split(",") if x.strip()] if a.attacks else list(ATTACKS)
    unknown = [x for x in attacks if x not in ATTACKS]
    if unknown:
        raise ValueError(f"--attacks: unknown {unknown}; known: {', '.join(ATTACKS)}")
    topologies = [t.strip() for t in a.topologies.split(",") if t.strip()]
    defence = not a.no_defence
    result: dict = {"bench": "byzantine", "n": a.n, "model": MODEL, "steps": a.steps, "defence": defence,
                    "fractions": {f: liars for f, liars in fractions}, "topologies": topologies}
    attacks_out: dict = {x: {} for x in attacks}
    baselines: dict = {}
    cost: dict = {}
    with ExitStack() as stack:
        root = run_root(stack, a.logs, "peertrain-bench-byzantine-")
        for topo in topologies:
            topology = _topology(topo, a.degree)
            for frac, liars in fractions:
                honest = a.n - liars
                key = f"{topo}/{frac}"

                def plan(attack: str | None, k: int, *, on: bool = defence) -> SwarmPlan:
                    return SwarmPlan(honest=honest, liars=k, attack=attack, topology=topology,
                                     honest_options=_honest_options(a, lm=False), gossip=GOSSIP, defence=on)

                ref = _one(a, root, f"{topo}-{honest}-none", plan(None, 0))
                baselines[key] = _figures(ref, ref, None, "accuracy")
                if defence and not a.no_cost and frac == fractions[0][0]:
                    off = _one(a, root, f"{topo}-{honest}-none-off", plan(None, 0, on=False))
                    s_on, s_off = _score(ref, "accuracy"), _score(off, "accuracy")
                    cost[topo] = {"mean_accuracy_on": s_on.get("mean"), "mean_accuracy_off": s_off.get("mean"),
                                  "worst_accuracy_on": s_on.get("worst"), "worst_accuracy_off": s_off.get("worst"),
                                  "honest_banned_off": off.get("watch", {}).get("honest_banned"),
                                  "points": (_r(100.0 * (s_off["mean"] - s_on["mean"]), 2)
                                             if "mean" in s_on and "mean" in s_off else None)}
                for x in attacks:
                    run_ = _one(a, root, f"{topo}-{honest}-{x}", plan(x, liars))
                    attacks_out[x].setdefault(frac, {})[topo] = _figures(run_, ref, x, "accuracy")
        if a.lm:
            topo, (frac, liars) = topologies[0], fractions[0]
            lm_plan = lambda x, k: SwarmPlan(  # noqa: E731
                honest=a.n - liars, liars=k, attack=x, topology=_topology(topo, a.degree),
                honest_options=_honest_options(a, lm=True), gossip=GOSSIP, defence=defence,
                liar_options={"sleep_exchanges": LM_SLEEP_EXCHANGES} if x == "sleeper" else {})
            ref = _one(a, root, "lm-none", lm_plan(None, 0))
            lm_out = {"model": LM_MODEL, "steps": a.lm_steps, "topology": topo, "fraction": frac,
                      "none": _figures(ref, ref, None, "test_loss"), "attacks": {}}
            for x in (x for x in attacks if not ATTACKS[x].digits_only):
                lm_out["attacks"][x] = _figures(_one(a, root, f"lm-{x}", lm_plan(x, liars)), ref, x, "test_loss")
            result["lm"] = lm_out
    exchange = _exchange_times(a) if parse_size(a.exchange_size) > 0 and defence else None

    def worst_drop(frac: str) -> float | None:
        drops = [f.get("worst_drop") for x in attacks_out.values() for f in (x.get(frac) or {}).values()]
        return max(drops) if drops and None not in drops else None

    runs = [f for x in attacks_out.values() for per in x.values() for f in per.values()] + list(baselines.values())
    eighth = "1/8" if "1/8" in dict(fractions) else fractions[0][0]
    quarter = "1/4" if "1/4" in dict(fractions) else fractions[-1][0]
    result.update({
        "worst_drop_points_eighth": worst_drop(eighth),
        "worst_drop_points_quarter": worst_drop(quarter),
        "honest_banned": sum(f.get("honest_banned", 0) for f in runs) + sum(
            c.get("honest_banned_off") or 0 for c in cost.values()),
        "no_attack_cost_points": max((c["points"] for c in cost.values() if c["points"] is not None), default=None),
        "no_attack_exchange_time_ratio": exchange["ratio"] if exchange else None,
        "attacks": attacks_out, "no_attack": baselines, "no_attack_cost": cost, "exchange_time": exchange,
        "errors": sum(1 for f in runs if "error" in f),
        # issue 40's ratchet among real daemons (peer bench sybil simulates it): the worst attack's ratio
        "radius_max_ratio": max((f["radius_ratio_vs_none"] for f in runs if f.get("radius_ratio_vs_none")),
                                default=None),
    })
    detect = [(x, frac, topo, f) for x, per in attacks_out.items() for frac, t in per.items() for topo, f in t.items()
              if ATTACKS[x].detectable]
    result["defence_reported"] = sorted({str(f.get("defence")) for f in runs if "error" not in f})
    result["goals"] = {
        "worst_drop_points_eighth": f"<= {GOAL_EIGHTH_POINTS}", "worst_drop_points_quarter": f"<= {GOAL_QUARTER_POINTS}",
        "honest_banned": 0, "no_attack_cost_points": f"<= {GOAL_COST_POINTS}",
        "no_attack_exchange_time_ratio": f"<= {GOAL_EXCHANGE_RATIO}",
        "detectable_attacks_banned": "every liar of sign_flip, scaled, ipm_10 and sleeper banned by an honest peer",
    }
    result["met"] = {
        "worst_drop_points_eighth": _le(result["worst_drop_points_eighth"], GOAL_EIGHTH_POINTS),
        "worst_drop_points_quarter": _le(result["worst_drop_points_quarter"], GOAL_QUARTER_POINTS),
        "honest_banned": result["honest_banned"] == 0,
        "no_attack_cost_points": _le(result["no_attack_cost_points"], GOAL_COST_POINTS),
        "no_attack_exchange_time_ratio": _le(result["no_attack_exchange_time_ratio"], GOAL_EXCHANGE_RATIO),
        "detectable_attacks_banned": all(f.get("liars_banned") == f.get("liars") for *_, f in detect) if detect else None,
    }
    result["notes"] = {
        "accuracy": f"each honest peer's local model on the 360 held-out digits after {a.steps} steps of its own "
                    "(AD-PSGD, digits CNN, its shard of the honest peers' data); worst and mean over honest peers",
        "worst_drop": "the no-attack swarm's worst honest accuracy (the same honest peers, shards and topology, "
                      "no liar) minus this run's, in points; mean_drop likewise for the mean; negative: better",
        "exchanges_until_ban": "the most committed exchanges any honest peer had with a liar before it banned "
                               "it (the sleeper's counted from when it began to attack); null: some liar was "
                               "never banned by anyone",
        "banned_by_of_partners": "per liar: [honest peers that banned it, honest peers that exchanged with it]",
        "honest_banned": "bans of an honest peer by an honest peer, in every run (false positives)",
        "radius_max_ratio": "the largest radius an honest peer announced to an honest partner (its status, read "
                            "every 0.5 s) under an attack, over the same swarm's without one; the worst attack's",
        "no_attack_cost_points": "mean honest accuracy with the defence off minus with it on, no liar, per "
                                 "topology at the first fraction's honest count; the largest",
        "no_attack_exchange_time_ratio": "median seconds of a 64 MiB exchange (peer bench average, 2 daemons) "
                                         "with the defence on / off, swarms interleaved",
        "liars": "stock daemons whose trainer (peer/testing/byzantine_trainer.py) learns its neighbours' models by download "
                 "and sends the attack's model; label_flip is the honest trainer on labels 9 - y; allies are "
                 "known to each other; their own daemons never judge partners",
        "rewired": f"target degree {a.degree}; two_cliques: the sorted peer IDs in two complete halves joined by "
                   "one edge (liars fall where their IDs do)",
    }
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["host"] = {"cpus": len(os.sched_getaffinity(0)), "load_1m_before": round(load_before, 2),
                      "load_1m_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result) if a.json else json.dumps(result, indent=2))
    return 1 if result["errors"] else 0


def _le(x: float | None, bound: float) -> bool | None:
    return None if x is None else x <= bound


def _r(x: float | None, nd: int = 4) -> float | None:
    if x is None or x != x or x in (float("inf"), float("-inf")):
        return None
    return round(x, nd) + 0.0  # (no -0.0)

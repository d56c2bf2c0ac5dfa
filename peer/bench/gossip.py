"""`peer bench gossip`: seconds until N real daemons reach consensus, per topology.

For every topology kind, N fresh daemons (new homes, a swarm name of their own) run the
`trainers.consensus` job with `rounds = 0`: each holds a random float32 vector and gossip-averages
until stopped. The job waits `--settle` seconds before its first round so the graph (and, for
`rewired`, its probes) exists; fixed kinds get the same delay so all start alike. The bench polls the
control sockets every 0.1 s and stops the clock when the published consensus error
sum(err_num) / sum(err_den) first drops to `--target`. The clock starts when the earliest peer began
its rounds (ts - elapsed_s in its published metrics), or when all peers were connected if that came
later (a loaded machine can take longer to start 8 daemons than the settle delay).

A second clock (`--exact-every`, on by default with --netns) takes group_stats cuts and computes the
error from sums of squares: a peer publishes err_num only between its own rounds, so while it waits
on a slow exchange its figure is stale, which inflates the published clock where slow edges exist.

Alongside the time it reports the graph really used (the union of the neighbour lists every daemon
reports; its Metropolis-Hastings W is checked to be doubly stochastic and every edge to be listed by
both ends), bytes sent per peer, and whether the swarm-wide sum survived. The rewired gap is set against
two yardsticks (peer/topology/yardsticks.py): random regular graphs of the target degree, and random
graphs with the rewired graph's own degree sequence (`same_degree_gap`), the fair one where rewiring
keeps slow hosts at low degree. With `--netns` every daemon gets its own network namespace on one
virtual LAN (slow_paths.py); `--slow-links K` puts K hosts behind a tbf-limited link (every edge of a
slow host is slow, so no topology can avoid it), `--slow-pairs F` gives a random fraction of host pairs
a slow path of their own (which a topology can route around).

Why the sum check takes the best of several cuts: with rounds = 0 exchanges never pause, and a cut
taken while an exchange is applied at one end but not yet at the other is off by w * sum(b - a);
behind a slow link that state can last seconds. Such errors come and go between cuts; a leak stays.
`load_1m` records the machine's load average, since other work on it slows every daemon.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from peer.bench.args import parse_size
from peer.bench.hosts import DAEMON_PORT, run_root
from peer.bench.slow_paths import SlowEdges, link_summary, shape_pairs, slow_share
from peer.control import ControlError
from peer.testing.daemon import DaemonProcess
from peer.testing.netns import netns_available, tc_available, virtual_lan
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm
from peer.topology.fixed import FIXED_KINDS, build_fixed
from peer.topology.mixing import mixing_matrix, spectral_gap
from peer.topology.yardsticks import checked_gap, graph_of, random_regular_gap, same_degree_gap

KINDS = ("rewired", *FIXED_KINDS)
SUM_TOL = 1e-5  # relative to |sum of initial sums|
SUM_CUTS = 10  # cuts the sum check may take before calling a drift a leak (see "best of several cuts")
EXACT_GRACE_S = 15.0  # after the published error hits the target, how long exact cuts may still try


@dataclass(frozen=True)
class Plan:
    """Everything one topology run needs, fixed before the first daemon starts."""

    n: int
    size_bytes: int
    elements: int
    degree: int
    target: float
    timeout: float
    settle: float
    mode: str
    seed: int
    rewire_interval: float | None
    netns: bool
    slow: frozenset[int]  # host indices behind slow links
    slow_pairs: frozenset[frozenset[int]]  # host index pairs with a slow path
    trace: bool
    exact_every: float  # 0: off


# ---------------------------------------------------------------------------------------------- swarm

def neighbour_lists(statuses: list[dict]) -> dict[str, set[str]]:
    """peer ID -> the neighbours its status lists."""
    return {s["peer_id"]: {nb["peer_id"] for nb in s["topology"]["neighbours"]} for s in statuses}

def consensus_error(statuses: list[dict | None], n: int) -> float | None:
    """sum(err_num) / sum(err_den) once all n peers have published, else None."""
    trs = [(s or {}).get("trainer") or {} for s in statuses]
    if len(trs) < n or any(t.get("err_num") is None or not t.get("err_den") for t in trs):
        return None
    return sum(t["err_num"] for t in trs) / sum(t["err_den"] for t in trs)


class RoundStarts:
    """Wall-clock second each peer began its rounds: ts - elapsed_s of its first published round. A
    peer's start never changes, so its metrics are read only until it is known."""

    def __init__(self, daemons: list[DaemonProcess]):
        self.daemons = daemons
        self.known: dict[str, float] = {}

    def __call__(self) -> list[float]:
        """The starts known so far (peers that have not begun are left out)."""
        for d in self.daemons:
            if d.name not in self.known:
                start = next((m["ts"] - m["elapsed_s"] for m in d.metrics()
                              if m.get("elapsed_s") is not None and m.get("ts") is not None), None)
                if start is not None:
                    self.known[d.name] = start
        return list(self.known.values())


def settled(kind: str, statuses: list[dict | None], plan: Plan) -> bool:
    """Fixed kinds: exactly the graph the kind prescribes. Rewired: symmetric, connected, degree >= target."""
    if any(s is None or "topology" not in s for s in statuses):
        return False
    lists = neighbour_lists(statuses)
    ids, adj, one_sided = graph_of(lists)
    if one_sided:
        return False
    if kind in FIXED_KINDS:
        have = {frozenset((ids[i], ids[j])) for i in range(len(ids)) for j in range(i + 1, len(ids)) if adj[i, j]}
        return have == set(build_fixed(kind, ids, degree=plan.degree, seed=plan.seed))
    deg = adj.sum(axis=1)
    return bool(deg.min() >= min(plan.degree, plan.n - 1)) and checked_gap(adj) > 0


def group_cut(daemons: list[DaemonProcess]) -> list[dict]:
    """group_stats of every daemon, asked concurrently so the cut is as narrow as it can be."""
    with ThreadPoolExecutor(len(daemons)) as pool:
        return list(pool.map(lambda d: d.command("group_stats", timeout=30)["vector"], daemons))


def wire_bytes_out(statuses: list[dict]) -> int:
    return sum(p["bytes_out"] for s in statuses for p in s.get("peers", []))


def exact_error(daemons: list[DaemonProcess], statuses: list[dict], plan: Plan, mean_sq: float) -> float:
    """sum_i ||x_i - mean||^2 / sum(err_den) from one group_stats cut: the trainers' published
    err_num is only refreshed between their own rounds, so it lags while a peer waits on a slow exchange."""
    cut = group_cut(daemons)
    return (sum(c["sumsq"] for c in cut) - plan.n * mean_sq) / sum(s["trainer"]["err_den"] for s in statuses)


def mean_norm_sq(statuses: list[dict]) -> float:
    """||mean of the start vectors||^2, as the consensus job published it (the same on every peer)."""
    return float(next(s["trainer"]["mean_norm_sq"] for s in statuses if s and s.get("trainer", {}).get("mean_norm_sq") is not None))


def start_daemons(swarm: LocalSwarm, kind: str, plan: Plan, lan) -> None:
    """n daemons running the consensus job on one topology kind: on 127.0.0.1 (mDNS on loopback), or
    one per host of `lan`, each told the others' addresses."""
    topo = {"kind": kind, "target_degree": plan.degree, "min_degree": min(2, plan.degree),
            "max_degree": max(8, plan.degree + 2)}
    if plan.rewire_interval is not None:
        topo["rewire_interval"] = plan.rewire_interval
    options = {"size": plan.elements, "rounds": 0, "mode": plan.mode, "start_delay": plan.settle,
               "world": plan.n, "seed": plan.seed}
    swarm_name = unique_swarm(f"gb{kind[:3]}")
    for i in range(plan.n):
        if lan is None:
            cfg = swarm_config(swarm=swarm_name, topology=topo, trainer="trainers.consensus", options=options)
            host = None
        else:
            host = lan.hosts[i]
            join = [f"{h.ip}:{DAEMON_PORT}" for h in lan.hosts if h is not host]
            cfg = swarm_config(swarm=swarm_name, listen=f"0.0.0.0:{DAEMON_PORT}", mdns=False, interfaces=[],
                               join=join, topology=topo, trainer="trainers.consensus", options=options)
        swarm.start(f"n{i}", config=cfg, host=host, env=rank_env(i, plan.n))


def run_topology(kind: str, plan: Plan, root: Path, lan) -> dict:
    """One topology: start the swarm, wait for the target error, measure, verify, stop."""
    t_launch = time.time()
    load0 = os.getloadavg()[0]
    with LocalSwarm(root / kind) as swarm:
        start_daemons(swarm, kind, plan, lan)
        round_starts = RoundStarts(swarm.daemons)
        # ---- one loop from launch: connected, settled, averaging started, target reached
        connect_s = settle_s = base_wire = hit_at = exact_hit = err = err_hit = final = None
        trace: list[tuple[float, float]] = []
        exact_trace: list[tuple[float, float]] = []
        gaps, shares = [], []
        last_sample = last_cut = 0.0
        slow = SlowEdges()
        sts: list = []
        deadline = time.monotonic() + 60 + 5 * plan.n + plan.settle + plan.timeout
        while time.monotonic() < deadline:
            for d in swarm.daemons:
                d.check_alive()
            polled = swarm.statuses()
            now = time.time()
            if any(s is None for s in polled):
                time.sleep(0.1)
                continue
            sts = polled
            if connect_s is None:
                if not all(s["connected"] >= plan.n - 1 for s in sts):
                    time.sleep(0.1)
                    continue
                connect_s = now - t_launch
                pid = [s["peer_id"] for s in sts]
                slow = SlowEdges(frozenset(pid[i] for i in plan.slow),
                                 frozenset(frozenset(pid[i] for i in p) for p in plan.slow_pairs))
            if settle_s is None and settled(kind, sts, plan):
                settle_s = now - t_launch
            started = any(s["gossip"]["exchanges"] > 0 for s in sts)
            if not started:
                base_wire = wire_bytes_out(sts)
            err = consensus_error(sts, plan.n)
            if started and hit_at is None and now - last_sample >= 0.5:
                last_sample = now
                ids, adj, _ = graph_of(neighbour_lists(sts))
                gaps.append(checked_gap(adj))
                share = slow_share(ids, adj, slow)
                if share is not None:
                    shares.append(share)
                if err is not None:
                    trace.append((now, err))
            if plan.exact_every and started and err is not None and exact_hit is None and now - last_cut >= plan.exact_every:
                last_cut = now
                ex = exact_error(swarm.daemons, sts, plan, mean_norm_sq(sts))
                exact_trace.append((now, ex))
                if ex <= plan.target:
                    exact_hit = now
            if hit_at is None and started and err is not None and err <= plan.target:
                hit_at, final, err_hit = now, sts, err
            if hit_at is not None and (not plan.exact_every or exact_hit is not None or now - hit_at > EXACT_GRACE_S):
                break
            known = round_starts() if started else []
            if known and now - min(known) > plan.timeout:
                break
            time.sleep(0.1)
        if connect_s is None:
            raise TimeoutError(f"{plan.n} daemons did not all connect")
        final = final or sts
        known = round_starts()
        # the clock starts with the first round, or once all are connected if that came later (slow starts)
        t0 = max(min(known), t_launch + connect_s) if known else None

        # ---- the graph at the finish, and the checks
        lists = neighbour_lists(final)
        ids, adj, one_sided = graph_of(lists)
        for _ in range(16):  # maybe a two-phase change in flight: look again before calling it broken
            if not one_sided:
                break
            time.sleep(0.5)
            again = swarm.statuses()
            if all(again):
                one_sided = min(one_sided, graph_of(neighbour_lists(again))[2])
        try:
            gap, ds_ok = checked_gap(adj), True
        except ValueError:
            gap, ds_ok = spectral_gap(mixing_matrix(adj)), False
        degs = adj.sum(axis=1)
        links = link_summary(swarm.daemons[0], slow) if kind == "rewired" or slow else None

        trainers = [s.get("trainer") or {} for s in final]
        if any(t.get("initial_sum") is None or not t.get("err_den") for t in trainers):
            raise RuntimeError(f"not every consensus job started: {[t.get('state') for t in trainers]}")
        initial_sum = sum(t["initial_sum"] for t in trainers)
        err_den = sum(t["err_den"] for t in trainers)
        drifts, exact = [], []
        for _ in range(SUM_CUTS):  # spaced out: a commit queued behind a slow link keeps one cut off for seconds
            cut = group_cut(swarm.daemons)
            drifts.append(abs(sum(c["sum"] for c in cut) - initial_sum) / max(1.0, abs(initial_sum)))
            exact.append((sum(c["sumsq"] for c in cut) - plan.n * mean_norm_sq(final)) / err_den)
            if drifts[-1] <= SUM_TOL:
                break
            time.sleep(0.5)
        after = swarm.statuses()
        recent = [x for s in after if s for x in s["gossip"]["recent_s"]]

    result = {
        "seconds_to_target": round(hit_at - t0, 3) if hit_at is not None and t0 is not None else None,
        "error_reached": float(f"{err_hit if err_hit is not None else err:.4g}") if err is not None else None,
        "error_exact_after": float(f"{exact[0]:.4g}"),
        "spectral_gap": round(gap, 4),
        "spectral_gap_mean": round(statistics.mean(gaps), 4) if gaps else None,
        "bytes_sent_per_peer": int(statistics.mean(s["gossip"]["bytes_sent"] for s in final)),
        "wire_bytes_out_per_peer": int((wire_bytes_out(final) - (base_wire or 0)) / plan.n),
        "degree": round(float(degs.mean()), 2),
        "degree_range": [int(degs.min()), int(degs.max())],
        "edges": int(adj.sum() // 2),
        "exchanges_per_peer": round(statistics.mean(s["gossip"]["exchanges"] for s in final), 1),
        "exchange_s_median": round(statistics.median(recent), 4) if recent else None,
        "failed_exchanges": sum(s["gossip"]["failed"] for s in final),
        "connect_s": round(connect_s, 2),
        "settle_s": round(settle_s, 2) if settle_s is not None else None,
        "start_delay_s": plan.settle,
        "start_spread_s": round(max(known) - min(known), 2) if len(known) > 1 else None,
        "rounds_before_connected_s": round(max(0.0, t_launch + connect_s - min(known)), 2) if known else None,
        "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "checks": {
            "doubly_stochastic": ds_ok,
            "one_sided_edges": one_sided,
            "sum_rel_drift_best_cut": float(f"{min(drifts):.3g}"),
            "sum_rel_drift_worst_cut": float(f"{max(drifts):.3g}"),
            "sum_cuts": len(drifts),
            "sum_preserved": min(drifts) <= SUM_TOL,
        },
    }
    if plan.exact_every:
        result["seconds_to_target_exact"] = round(exact_hit - t0, 3) if exact_hit is not None and t0 is not None else None
    if kind == "rewired":
        result["moves"] = sum(s["topology"]["moves"] for s in final)
        same = same_degree_gap(adj)
        result["same_degree_gap"] = round(same, 4) if same is not None else None
    if slow:
        result["slow_edge_share"] = round(slow_share(ids, adj, slow), 3)
        result["slow_edge_share_mean"] = round(statistics.mean(shares), 3) if shares else None
    if links is not None:
        result["links"] = links
    if plan.trace and t0 is not None:
        result["trace"] = [[round(t - t0, 2), float(f"{e:.3g}")] for t, e in trace]
        if exact_trace:
            result["trace_exact"] = [[round(t - t0, 2), float(f"{e:.3g}")] for t, e in exact_trace]
    return result


# ---------------------------------------------------------------------------------------------- entry

def per_run(result: dict, key: str) -> list:
    """`key` of every run of a topology: its `_runs` list, or the one run's value if it ran once."""
    return result.get(f"{key}_runs", [result.get(key)])


def median_run(rs: list[dict]) -> dict:
    """The run with the median (lower median) seconds to target, plus every run's seconds; a failed run
    counts as slowest."""
    if len(rs) == 1:
        return rs[0]
    key = lambda r: r.get("seconds_to_target") if r.get("seconds_to_target") is not None else math.inf  # noqa: E731
    chosen = dict(sorted(rs, key=key)[(len(rs) - 1) // 2])
    chosen["seconds_to_target_runs"] = [r.get("seconds_to_target") for r in rs]
    chosen["seconds_to_target_exact_runs"] = [r.get("seconds_to_target_exact") for r in rs]
    chosen["slow_edge_share_runs"] = [r.get("slow_edge_share") for r in rs]
    chosen["spectral_gap_runs"] = [r.get("spectral_gap") for r in rs]
    if any("same_degree_gap" in r for r in rs):
        chosen["same_degree_gap_runs"] = [r.get("same_degree_gap") for r in rs]
    return chosen


def run(args) -> int:
    kinds = [k.strip() for k in args.topologies.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        print(f"unknown topologies {bad}; choose from {', '.join(KINDS)}", file=sys.stderr)
        return 2
    size = parse_size(args.size or ("2MiB" if args.netns else "16MiB"))
    k_slow = (args.slow_links if args.slow_links is not None else (0 if args.slow_pairs else 2)) if args.netns else 0
    if args.n < 3 or not 0 <= k_slow < args.n or not 0 <= args.slow_pairs <= 1 or args.repeat < 1:
        print("need --n >= 3, 0 <= --slow-links < n, 0 <= --slow-pairs <= 1 and --repeat >= 1", file=sys.stderr)
        return 2
    pairs_rng = np.random.default_rng([args.seed, 7])
    slow_pairs = frozenset(frozenset((i, j)) for i in range(args.n) for j in range(i + 1, args.n)
                           if args.netns and pairs_rng.random() < args.slow_pairs)
    plan = Plan(n=args.n, size_bytes=size, elements=max(1, size // 4), degree=args.degree, target=args.target,
                timeout=args.timeout, settle=args.settle if args.settle is not None else (25.0 if args.netns else 6.0),
                mode=args.mode, seed=args.seed, rewire_interval=args.rewire_interval, netns=args.netns,
                slow=frozenset(range(args.n - k_slow, args.n)), slow_pairs=slow_pairs, trace=args.trace,
                exact_every=args.exact_every if args.exact_every is not None else (0.5 if args.netns else 0.0))
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    with ExitStack() as stack:
        root = run_root(stack, args.logs, "peertrain-gossip-")
        lan = None
        if args.netns:
            if not (netns_available() and tc_available()):
                print("--netns needs root, iproute2 (ip, tc) and network namespaces", file=sys.stderr)
                return 2
            lan = stack.enter_context(virtual_lan(args.n, prefix="ptg", subnet="10.77.9",
                                                  rate_mbit={i: args.slow_mbit for i in plan.slow}))
            shape_pairs(lan, plan.slow_pairs, args.slow_mbit)
        for r in range(args.repeat):
            for kind in kinds:
                run_dir = root / f"run{r}" if args.repeat > 1 else root
                run_dir.mkdir(parents=True, exist_ok=True)
                try:
                    runs[kind].append(run_topology(kind, plan, run_dir, lan))
                except (RuntimeError, TimeoutError, OSError, ControlError, KeyError, ValueError) as exc:
                    runs[kind].append({"error": f"{type(exc).__name__}: {exc}"[:2000]})
    results = {kind: median_run(rs) for kind, rs in runs.items()}

    def speedup(key: str) -> tuple[str | None, float | None]:
        """(best fixed kind, its seconds / rewired seconds) on one of the two clocks."""
        fixed = {k: results[k].get(key) for k in kinds if k in FIXED_KINDS and results[k].get(key) is not None}
        best = min(fixed, key=fixed.get) if fixed else None
        rewired = results.get("rewired", {}).get(key)
        return best, (round(fixed[best] / rewired, 3) if best and rewired else None)

    best_fixed, speedup_published = speedup("seconds_to_target")
    best_fixed_exact, speedup_exact = speedup("seconds_to_target_exact")
    rr_gap = random_regular_gap(plan.n, plan.degree)
    rew = results.get("rewired", {})
    gap_runs = per_run(rew, "spectral_gap")
    out = {
        "n": plan.n, "payload_bytes": plan.size_bytes, "mode": plan.mode, "target": plan.target,
        "netns": plan.netns,
        **({"slow_hosts": len(plan.slow), "slow_pairs": len(plan.slow_pairs), "slow_mbit": args.slow_mbit}
           if plan.netns else {}),
        "topologies": results,
        "best_fixed": best_fixed,
        "speedup_vs_best_fixed": speedup_published,
        **({"best_fixed_exact": best_fixed_exact, "speedup_vs_best_fixed_exact": speedup_exact} if plan.exact_every else {}),
        "random_regular_gap_expected": round(rr_gap, 4),
        # medians over runs of the rewired graph's gap (the run with the median time may not have it),
        # against random regular graphs and against random graphs of its own degrees (see same_degree_gap)
        "rewired_gap_vs_random_regular": (round(statistics.median(g for g in gap_runs if g is not None) / rr_gap, 3)
                                          if any(g is not None for g in gap_runs) else None),
        "rewired_gap_vs_same_degrees": (round(statistics.median(ratios), 3) if (ratios := [
            g / same for g, same in zip(gap_runs, per_run(rew, "same_degree_gap")) if g is not None and same]) else None),
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    ok = all("error" not in r and r["seconds_to_target"] is not None for r in results.values())
    return 0 if ok else 1

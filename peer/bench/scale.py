"""`peer bench scale`: the membership, view and rewiring rules for N simulated peers (peer/bench/scale_sim.py).

Phases, in simulated time:
  1. build: peers join one by one through a random live peer, at a rate that grows with the swarm
     (`GROWTH` of its size per second: 10^4 peers in ~3 simulated minutes), then `SETTLE_S` of quiet.
  2. steady state, `--steady` seconds: background churn (`--churn` of the swarm per minute, half joining,
     a quarter leaving, a quarter crashing), one gap-estimate epoch at its start, and the rewiring rule
     running on what it reads. Control bytes are counted over this window; the joiners of it give
     `join_seconds` (until min_degree neighbours: averaging starts over the first edge) and the time
     until their first exchange is done (which a 16 MiB shard over a slow path makes tens of seconds).
  3. the graph at its end: the spectral gap of its mixing matrix, against a random regular graph of the
     same size and (rounded mean) degree; simulated averaging on both over the same links (the
     bandwidth-weighted consensus time); every peer's state bytes; the peers' own gap readings.
  4. half of the peers crash at once; after `--recover` seconds the survivors' largest component.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

import numpy as np

from peer.bench.scale_sim import SimConfig, Simulator, components, consensus_time
from peer.membership.gap_driver import estimator_state_bytes
from peer.membership.views import ViewConfig
from peer.topology.fixed import random_regular
from peer.topology.local_gap import GapConfig
from peer.topology.sparse_gap import sparse_spectral_gap

GROWTH = 0.05  # joins per second per live peer while building (at least MIN_JOIN_RATE)
MIN_JOIN_RATE = 2.0
SETTLE_S = 120.0  # quiet after the build: joins' last walks, splits and statuses done, first rewiring moves
SAMPLE_S = 2.0  # after the mass failure, the components are looked at this often
HEARTBEAT_S = 1.0  # [membership] heartbeat_interval's default: a Ping and a Pong each way per session per second
GOALS = {
    "state_bytes_per_peer": ("<=", 64 * 1024),
    "control_bits_per_s_per_peer": ("<=", 2000.0),
    "connected_after_half_failure": (">=", 1.0),
    "gap_ratio_vs_random_regular": (">=", 0.9),
    "join_seconds": ("<=", 10.0),
}


def _say(args, what: str) -> None:
    if not args.json:
        print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def build(sim: Simulator, n: int) -> None:
    """Grow the swarm to n peers, each joining through a random live one."""
    first = sim.spawn()
    sim.join(first, None, measure=False)
    while len(sim.alive) < n:
        rate = max(MIN_JOIN_RATE, GROWTH * len(sim.alive))
        sim.run_until(sim.now + sim.rng.expovariate(rate))
        p = sim.spawn()
        sim.join(p, sim.random_alive(exclude=p), measure=False)


def churn_step(sim: Simulator, dt: float, per_min: float, n: int, joiners: list) -> None:
    """`dt` seconds of churn at `per_min` of n peers a minute: half of it joins, a quarter leaves, a quarter
    crashes (Poisson arrivals)."""
    t_end = sim.now + dt
    rate = per_min * n / 60.0
    while rate > 0:
        step = sim.rng.expovariate(rate)
        if sim.now + step > t_end:
            break
        sim.run_until(sim.now + step)
        u = sim.rng.random()
        if u < 0.5 or len(sim.alive) < 2:
            p = sim.spawn()
            sim.join(p, sim.random_alive(exclude=p))
            joiners.append(p)
        else:
            victim = sim.random_alive()
            (sim.leave if u < 0.75 else sim.crash)(victim)
    sim.run_until(t_end)


def join_figures(joiners: list, now: float, *, grace: float) -> dict:
    """Over the joiners that joined at least `grace` seconds before `now` and still live: seconds from the
    join to min_degree neighbours (`join_seconds`, max and median: connected, and averaging, which starts
    over the first edge), to the end of the first exchange (a shard over the new links: what the links'
    speed adds), and how many never got there."""
    connected, exchanged, never = [], [], 0
    for p in joiners:
        if not p.alive or p.joined_at is None or now - p.joined_at < grace:
            continue
        if p.connected_at is None or p.first_exchange_at is None:
            never += 1
            continue
        connected.append(p.connected_at - p.joined_at)
        exchanged.append(p.first_exchange_at - p.joined_at)
    pick = lambda xs, f: _round(f(xs), 2) if xs else None  # noqa: E731
    return {"join_seconds": pick(connected, max), "join_seconds_median": pick(connected, statistics.median),
            "first_exchange_seconds_max": pick(exchanged, max),
            "first_exchange_seconds_median": pick(exchanged, statistics.median),
            "joiners_not_connected": never}


def _round(x, k=4):
    return None if x is None else round(float(x), k)


def run_sim(*, peers: int, steady: float, churn: float, recover: float, seed: int, consensus: bool = True,
            log=lambda what: None, sim_cfg: SimConfig | None = None) -> dict:
    """Every phase (module docstring); the result as the bench's JSON object. `sim_cfg`: the links (by
    default SimConfig's internet-like spread, with `seed`)."""
    view_cfg = ViewConfig()
    gap_cfg = GapConfig()
    sim_cfg = sim_cfg or SimConfig(seed=seed)
    sim = Simulator(view_cfg, gap_cfg, sim_cfg)
    wall0 = time.monotonic()

    build(sim, peers)
    log(f"built {len(sim.alive)} peers in {sim.now:.0f} simulated s ({time.monotonic() - wall0:.0f} s)")
    sim.run_until(sim.now + SETTLE_S)

    # steady state: counters from here
    for p in sim.alive:
        p.view_bytes = p.gap_bytes = 0
    sim.counters.by_type.clear()
    swaps0 = _moves(sim.alive)
    before = {p.pid for p in sim.alive}
    t0 = sim.now
    sim.gap_epoch(0)
    joiners: list = []
    while sim.now < t0 + steady:
        churn_step(sim, min(10.0, t0 + steady - sim.now), churn, peers, joiners)
    window = sim.now - t0
    stayed = [p for p in sim.alive if p.pid in before]
    bits = [8 * (p.view_bytes + p.gap_bytes) / window for p in stayed]
    view_bits = [8 * p.view_bytes / window for p in stayed]
    joins = join_figures(joiners, sim.now, grace=30.0)
    log(f"steady state: {window:.0f} simulated s, {len(joiners)} joiners ({time.monotonic() - wall0:.0f} s)")

    live, pairs, one_sided = sim.graph()
    n = len(live)
    degrees = np.bincount(pairs.ravel(), minlength=n)
    comps = components(n, pairs)
    gap = sparse_spectral_gap(n, pairs)
    d_rr = max(2, int(round(float(degrees.mean()))))
    ids = [p.pid for p in live]
    index = {pid: i for i, pid in enumerate(ids)}
    # sorted: a frozenset's order follows string hashing, and the simulated averaging follows the edge order
    rr = np.array(sorted(sorted(index[x] for x in e) for e in random_regular(ids, d_rr, seed)), dtype=np.int64)
    gap_rr = sparse_spectral_gap(n, rr)
    readings = [p.gap.reading for p in live if p.gap.reading is not None]
    state = [p.views.state_bytes() + estimator_state_bytes(p.gap) for p in live]
    log(f"gap {gap:.4f} vs random {d_rr}-regular {gap_rr:.4f} ({time.monotonic() - wall0:.0f} s)")

    result: dict = {
        "peers": peers,
        "state_bytes_per_peer": max(state),
        "state_bytes_mean": round(statistics.mean(state)),
        "state_bytes_views_only": max(p.views.state_bytes() for p in live),  # without the gap estimator's
        "control_bits_per_s_per_peer": round(statistics.mean(bits), 1),
        "control_bits_per_s_p99": round(float(np.percentile(bits, 99)), 1),
        "control_bits_per_s_views_only": round(statistics.mean(view_bits), 1),
        # not simulated, not in the figure above: what today's session heartbeats would add on the edges
        "heartbeat_bits_per_s_per_peer": round(float(degrees.mean()) * _heartbeat_bytes() * 8 / HEARTBEAT_S, 1),
        "connected_after_half_failure": None,
        "gap_ratio_vs_random_regular": round(gap / gap_rr, 4) if gap_rr > 0 else None,
        **joins,
        "joiners": len(joiners),
        "gap": round(gap, 4),
        "random_regular_gap": round(gap_rr, 4),
        "random_regular_degree": d_rr,
        "gap_estimate_ratio_median": _round(statistics.median(r.ratio for r in readings)) if readings else None,
        "gap_estimate_ratio_p10_p90": ([_round(float(np.percentile([r.ratio for r in readings], q))) for q in (10, 90)]
                                       if readings else None),
        "mean_degree": round(float(degrees.mean()), 3),
        "degree_min_max": [int(degrees.min()), int(degrees.max())],
        "degree_at_target": round(float(np.mean(degrees == view_cfg.target_degree)), 4),
        "components_before_failure": len(comps),
        "edges_one_sided": one_sided,
        "slow_edges": round(float(np.mean([sim.links.slow(live[a].host, live[b].host) for a, b in pairs.tolist()])), 4),
        "slow_edges_random_regular": round(float(np.mean([sim.links.slow(live[a].host, live[b].host)
                                                           for a, b in rr.tolist()])), 4),
        "rewiring_swaps_steady": {k: v - swaps0.get(k, 0) for k, v in _moves(live).items()},
        "steady_bytes_by_message": dict(sorted(sim.counters.by_type.items(), key=lambda kv: -kv[1])),
    }

    if consensus:
        hosts = [p.host for p in live]
        times = lambda a, b: sim.links.exchange_time(hosts[a], hosts[b])  # noqa: E731
        t_ours, rate_ours = consensus_time(n, pairs, times, seed=seed)
        t_rr, rate_rr = consensus_time(n, rr, times, seed=seed)
        result.update({
            "consensus_seconds": _round(t_ours, 1), "random_regular_consensus_seconds": _round(t_rr, 1),
            "consensus_time_ratio_vs_random_regular": _round(t_ours / t_rr, 3) if t_ours and t_rr else None,
            "consensus_rate_per_s": _round(rate_ours), "random_regular_consensus_rate_per_s": _round(rate_rr),
        })
        log(f"consensus {t_ours} s vs random regular {t_rr} s ({time.monotonic() - wall0:.0f} s)")

    # half of the swarm crashes at once
    victims = sim.rng.sample(sim.alive, len(sim.alive) // 2)
    for p in victims:
        sim.crash(p)
    t_fail = sim.now
    reconnected_at = None
    while sim.now < t_fail + recover:
        sim.run_until(sim.now + SAMPLE_S)
        live, pairs, _ = sim.graph()
        sizes = components(len(live), pairs)
        if reconnected_at is None and len(sizes) == 1:
            reconnected_at = sim.now - t_fail
    live, pairs, _ = sim.graph()
    sizes = components(len(live), pairs)
    degrees = np.bincount(pairs.ravel(), minlength=len(live))
    result.update({
        "connected_after_half_failure": round(sizes[0] / len(live), 6),
        "components_after_half_failure": len(sizes),
        "isolated_after_half_failure": int(np.sum(degrees == 0)),
        "seconds_to_one_component": _round(reconnected_at, 1),
        "mean_degree_after_half_failure": round(float(degrees.mean()), 3),
        "gap_after_half_failure": round(sparse_spectral_gap(len(live), pairs), 4),
        "recover_seconds": recover,
    })
    log(f"half failure: largest component {sizes[0]}/{len(live)} ({time.monotonic() - wall0:.0f} s)")
    result.update({
        "simulated_seconds": round(sim.now, 1),
        "messages": sim.counters.messages,
        "bad_messages": sim.counters.bad,
        "wall_seconds": round(time.monotonic() - wall0, 1),
        "seed": seed,
        "steady_seconds": steady,
        "churn_per_min": churn,
    })
    result["goals"] = {k: _met(result.get(k), op, v) for k, (op, v) in GOALS.items()}
    return result


def _heartbeat_bytes() -> int:
    """Bytes one side of a session sends per heartbeat interval: its Ping and its Pong to the other's, framed."""
    from protocol.cipher import TAG_SIZE
    from protocol.frames import HEADER_SIZE
    from protocol.schema import DEFAULT_REGISTRY, Ping, Pong

    frame = HEADER_SIZE + TAG_SIZE
    return (len(DEFAULT_REGISTRY.encode(Ping(sent=1.7e9), rid=1 << 31)) + frame
            + len(DEFAULT_REGISTRY.encode(Pong(echo=1.7e9), rid=1 << 31, reply_to=1 << 31)) + frame)


def _moves(peers) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in peers:
        for k, v in p.views.moves.items():
            out[k] = out.get(k, 0) + v
    return out


def _met(value, op: str, bound: float) -> bool | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value <= bound if op == "<=" else value >= bound


def run(args) -> int:
    if args.real:
        from peer.bench.scale_real import compare, real_figures

        real = real_figures(args)
        # the simulator at the same size over the same rules, as the real swarm runs: no churn, and links
        # like loopback's (all alike, no slow paths, sub-millisecond RTT, so no move is made for speed) and
        # one address per peer, as each daemon advertises there
        loopback = SimConfig(seed=args.seed, bandwidth_sigma=0.0, slow_pairs=0.0, rtt_min=0.0002, rtt_max=0.0002,
                             dual_stack=False)
        sim = run_sim(peers=args.real, steady=args.steady, churn=0.0, recover=args.recover, seed=args.seed,
                      consensus=False, sim_cfg=loopback)
        result = {"peers": args.real, "real": real, "simulated": sim, "real_over_simulated": compare(real, sim)}
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return 0
    result = run_sim(peers=args.peers, steady=args.steady, churn=args.churn, recover=args.recover, seed=args.seed,
                     consensus=not args.no_consensus, log=lambda what: _say(args, what))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0

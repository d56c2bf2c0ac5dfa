"""`peer bench average`: seconds for one pairwise average of a big tensor through the real engine.

N real daemons on 127.0.0.1 host `trainers.consensus` with a float32 vector of `--size` bytes. Only
node 0 initiates (the others only serve), so exchanges never collide and every figure is one clean
offer → accept → commit exchange: both sides stream their snapshot over the encrypted session at the
same time and apply `w * (other - own)`. The first exchange is a warm-up and is discarded; the
figure is the median of node 0's per-exchange seconds (its status `gossip.recent_s`) over `--rounds`.

The same run checks correctness: afterwards the swarm-wide sum (every daemon's `group_stats`) must
equal the sum of every daemon's published `initial_sum` (averaging preserves the sum).

`--no-defence` starts every daemon with `PEERTRAIN_BENCH_NO_DEFENCE=1` (peer/averaging/radius.py): no radius
announced, no clip and no judging, so the same figure with and without it is what the defence costs an
honest exchange (docs/design.md, "Robust averaging").

With more than two peers it also measures, in the same invocation: a round with all neighbours at once
(mode "all", a second swarm) and torch.distributed gloo `all_reduce` of a same-size tensor with N
processes — a different operation (an exact global mean, not one gossip step), reported for scale.
Nothing here runs concurrently with a measurement: swarms and gloo run one after another.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

from peer.averaging.radius import NO_DEFENCE_ENV
from peer.bench.args import parse_size
from peer.bench.hosts import free_port
from peer.control import ControlError
from peer.session.cipher_choice import seal_gbps
from peer.testing.process import proc_status_mb
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm


class BenchFailed(Exception):
    """A run that cannot give a figure (the swarm has printed its daemons' log tails to stderr)."""


# ---- one swarm ------------------------------------------------------------------------------------

def _configs(args, swarm: str, elements: int, mode: str, target: int) -> list:
    """Node 0 initiates `target` exchanges; the others only serve. Full graph, settled fast."""
    n = args.peers
    topology = {"kind": "full", "target_degree": n - 1, "min_degree": n - 1, "max_degree": max(8, n - 1)}
    gossip = {"exchange_timeout": 60.0, "chunk_kib": max(1, parse_size(args.chunk) // 1024),
              "max_concurrent_exchanges": max(4, n), "codec": args.codec}
    out = []
    for i in range(n):
        options = {"size": elements, "rounds": target, "initiate": i == 0, "mode": mode, "world": n,
                   "start_delay": args.settle if i == 0 else 0.0, "track_error": False, "seed": 0}
        cfg = swarm_config(swarm=swarm, trainer="trainers.consensus", options=options, topology=topology,
                          gossip=gossip, log_level="info")
        out.append(cfg.replace(security={"ciphers": [args.cipher]}))
    return out


def run_swarm(args, elements: int, mode: str, target: int) -> dict:
    """Start the swarm, wait for node 0's `target` exchanges, check the sum; stats of node 0 and all.
    On failure the swarm prints its daemons' log tails to stderr as it stops."""
    n = args.peers
    with tempfile.TemporaryDirectory(prefix="peertrain-bench-average-") as tmp, LocalSwarm(Path(tmp)) as swarm:
        name = unique_swarm("avg")
        switch = {NO_DEFENCE_ENV: "1"} if args.no_defence else {}
        for i, cfg in enumerate(_configs(args, name, elements, mode, target)):
            swarm.start(f"n{i}", config=cfg, env={**rank_env(i, n), **switch})
        t0 = time.monotonic()
        try:
            swarm.wait_connected(timeout=args.timeout)
            swarm.wait(lambda sts: all(s and s.get("topology", {}).get("degree") == n - 1 for s in sts),
                       timeout=max(5.0, args.timeout - (time.monotonic() - t0)), what="a full topology")
            settled_s = time.monotonic() - t0

            def node0_done(sts) -> bool:
                tr = (sts[0] or {}).get("trainer", {})
                if str(tr.get("state", "")).startswith("failed"):
                    raise BenchFailed(f"node 0's trainer {tr['state']}")
                return tr.get("exchanges", 0) >= target and tr.get("state") == "done"

            swarm.wait(node0_done, timeout=max(5.0, args.timeout - (time.monotonic() - t0)),
                       what=f"node 0 to finish {target} exchanges", interval=0.25)
            # the servers apply after the commit reaches them: wait until they have applied every exchange
            def all_applied(sts) -> bool:
                return (all(sts) and all(s["gossip"]["inflight"] == 0 for s in sts)
                        and sum(s["gossip"]["served"] for s in sts[1:]) >= sts[0]["gossip"]["exchanges"])

            swarm.wait(all_applied, timeout=30.0, what="the servers to apply the last exchange", interval=0.1)
            statuses = swarm.statuses()
            if not all(statuses):
                raise BenchFailed("a daemon stopped answering its control socket")
            stats = [d.command("group_stats", {"values": False}, timeout=60.0)["vector"] for d in swarm.daemons]
        except (TimeoutError, RuntimeError, BenchFailed, KeyError, ControlError, OSError) as exc:
            raise BenchFailed(f"{mode} swarm of {n}: {exc}") from None
        lines = swarm.daemons[0].metrics()
        peak = [proc_status_mb(d.pid, "VmHWM") for d in swarm.daemons]
    initial = sum(float(s["trainer"]["initial_sum"]) for s in statuses)
    final = sum(float(g["sum"]) for g in stats)
    rel = abs(final - initial) / max(abs(initial), 1.0)
    ciphers = sorted({p["cipher"] for p in statuses[0]["peers"] if p["state"] == "connected"})
    return {"status0": statuses[0], "statuses": statuses, "lines": lines, "settled_s": settled_s,
            "sum_initial": initial, "sum_final": final, "sum_rel_error": rel, "ciphers": ciphers,
            "peak_rss_mb": [p for p in peak if p is not None]}


def _per_round_seconds(lines: list[dict], per_round: int) -> list[float]:
    """Seconds of each all-neighbour round after the first, from node 0's published (exchanges, elapsed_s).

    The consensus job publishes after a round when 0.1 s have passed since its last line, so with a
    big tensor every round has its own line; a line spanning k whole rounds counts k rounds of its
    mean. A stretch that is not whole rounds (the topology was still filling in) is left out.
    """
    pts = [(int(m["exchanges"]), float(m["elapsed_s"])) for m in lines if "elapsed_s" in m and "exchanges" in m]
    out: list[float] = []
    for (e0, t0), (e1, t1) in zip(pts, pts[1:]):  # pts[0] ends the warm-up round: not measured
        d = e1 - e0
        if d > 0 and d % per_round == 0:
            k = d // per_round
            out += [(t1 - t0) / k] * k
    return out


# ---- gloo -----------------------------------------------------------------------------------------

def _gloo_worker(rank: int, world: int, port: int, elements: int, rounds: int, results) -> None:
    """One rank: warm-up, then `rounds` timed all_reduce(SUM) + divide; sends its times to the parent."""
    # torch only here, in the spawned ranks: the bench process never uses it, and importing it costs
    # seconds of start-up (and every `peer bench average` run would pay them, gloo or not)
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        x = torch.randn(elements, generator=torch.Generator().manual_seed(rank))
        times = []
        for i in range(rounds + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            x.div_(world)
            if i > 0:
                times.append(time.perf_counter() - t0)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, times, None))
    except Exception as exc:  # reported by the parent; a worker must never hang it
        results.put((rank, None, f"{type(exc).__name__}: {exc}"))


def _gloo(world: int, elements: int, rounds: int, timeout: float) -> list[float]:
    """Per-round seconds of gloo all_reduce across `world` processes: the slowest rank of each round."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, elements, rounds, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, list[float]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                raise BenchFailed(f"gloo all_reduce: no result after {timeout:.0f}s")
            try:
                rank, times, err = q.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise BenchFailed(f"gloo rank {dead[0]} exited with {procs[dead[0]].exitcode}") from None
                continue
            if err:
                raise BenchFailed(f"gloo rank {rank}: {err}")
            results[rank] = times
    finally:
        for p in procs:
            p.join(max(0.1, min(10.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(5)
    return [max(ts) for ts in zip(*results.values())]


# ---- the bench ------------------------------------------------------------------------------------

def _r(x: float | None, nd: int = 4) -> float | None:
    return round(x, nd) if x is not None else None


def run(args) -> int:
    if args.peers < 2:
        print("peer bench average: --peers must be at least 2", file=sys.stderr)
        return 1
    if args.rounds < 1:
        print("peer bench average: --rounds must be at least 1", file=sys.stderr)
        return 1
    payload = parse_size(args.size)
    elements = max(1, payload // 4)
    payload = elements * 4
    n = args.peers
    t_start = time.monotonic()
    load_before = os.getloadavg()[0]
    # recent_s keeps a daemon's last 20 exchanges; node 0 only initiates, so they are all ours
    measured = min(args.rounds, 19)
    try:
        one = run_swarm(args, elements, "one", measured + 1)
        recent = one["status0"]["gossip"]["recent_s"]
        samples = recent[-measured:]
        if len(samples) < measured:
            raise BenchFailed(f"node 0 reports {len(samples)} exchanges in recent_s, expected {measured}")
        per_exchange = statistics.median(samples)
        g0 = one["status0"]["gossip"]
        result: dict = {
            "peers": n, "payload_bytes": payload, "rounds": len(samples),
            "seconds_per_exchange": _r(per_exchange),
            "effective_gbps": round(payload / per_exchange / 1e9, 3),
            "exchange_samples_s": samples, "warmup_s": recent[-measured - 1] if len(recent) > measured else None,
            "sum_preserved": one["sum_rel_error"] <= 1e-5, "sum_rel_error": float(f"{one['sum_rel_error']:.3g}"),
            "sum_initial": round(one["sum_initial"], 4), "sum_final": round(one["sum_final"], 4),
            "cipher": "/".join(one["ciphers"]) or None, "codec": args.codec, "chunk_bytes": parse_size(args.chunk),
            "defence": g0.get("defence"),
            "failed_exchanges": g0["failed"], "rejected_exchanges": g0["rejected"],
            "daemon_peak_rss_mb": round(max(one["peak_rss_mb"]), 1) if one["peak_rss_mb"] else None,
            "topology_settled_s": round(one["settled_s"], 2),
        }
        ok = result["sum_preserved"]
        if n > 2 and not args.no_all:
            all_ = run_swarm(args, elements, "all", (measured + 1) * (n - 1))
            rounds_s = _per_round_seconds(all_["lines"], n - 1)
            result["seconds_per_round_all_neighbours"] = _r(statistics.median(rounds_s)) if rounds_s else None
            result["rounds_all_neighbours"] = len(rounds_s)
            result["sum_preserved_all_neighbours"] = all_["sum_rel_error"] <= 1e-5
            ok = ok and result["sum_preserved_all_neighbours"]
        if n > 2 and not args.no_gloo:
            gl = _gloo(n, elements, max(5, measured), timeout=args.timeout)
            result["gloo_allreduce_seconds"] = _r(statistics.median(gl))
            result["gloo_rounds"] = len(gl)
        cipher = one["ciphers"][0] if len(one["ciphers"]) == 1 else None
        if cipher:
            result["aead_seal_gbps"] = round(seal_gbps(cipher, parse_size(args.chunk), min_seconds=0.3), 3)
    except BenchFailed as exc:
        print(f"peer bench average failed: {exc}", file=sys.stderr)
        return 1
    result["notes"] = _notes(n, "gloo_allreduce_seconds" in result, "seconds_per_round_all_neighbours" in result)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    # other work on the host skews every figure: say how busy it was
    result["host"] = {"cpus": len(os.sched_getaffinity(0)), "load_1m_before": round(load_before, 2),
                      "load_1m_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    if not ok:
        print("peer bench average: the swarm-wide sum changed (averaging must preserve it)", file=sys.stderr)
    return 0 if ok else 1


def _notes(n: int, gloo: bool, all_rounds: bool) -> dict:
    notes = {
        "seconds_per_exchange": "median over `rounds` (after one warm-up) of node 0's own timing of one pairwise "
                                "exchange it initiated: snapshot, offer, both tensors streamed at once over the "
                                "encrypted session, commit, and its in-place update; one daemon per process, all "
                                "on this host, so both ends share its CPU cores",
        "effective_gbps": "payload_bytes / seconds_per_exchange / 1e9: tensor bytes averaged per second by one pair "
                          "(each side also sends and receives payload_bytes, so the wire carries twice that)",
        "sum_preserved": "sum over daemons of the vector after the exchanges equals the sum of their initial vectors "
                         "to 1e-5 relative (float64 sums of float32 data)",
        "defence": "node 0's status: false with --no-defence, when the daemons announced no clip radius and never "
                   "clipped (the cost of the defence is the difference in seconds_per_exchange)",
        "aead_seal_gbps": "one core sealing chunk-sized frames in memory with the session cipher: every exchange "
                          "seals and opens payload_bytes on each side, so 2 x payload / this is a CPU floor per side",
    }
    if n > 2:
        notes["seconds_per_exchange"] += f"; with {n} peers node 0 picks one of its {n - 1} neighbours per round"
    if all_rounds:
        notes["seconds_per_round_all_neighbours"] = (
            f"second swarm, mode 'all': median seconds of one round in which node 0 runs exchanges with all {n - 1} "
            "neighbours concurrently (from its published elapsed time), warm-up round excluded; each exchange moves "
            "node 0 only a Metropolis weight 1/n towards one neighbour, so this is one D-PSGD gossip step, not an "
            "exact global mean")
    if gloo:
        notes["gloo_allreduce_seconds"] = (
            f"torch.distributed gloo all_reduce(SUM) then divide, {n} processes on 127.0.0.1, unencrypted TCP, "
            "median of the slowest rank per round after a warm-up: every process ends with the exact mean. A "
            "pairwise gossip exchange is not an all-reduce: it averages two peers, and reaching consensus takes "
            "many exchanges, so compare the two only as the cost of moving the same bytes")
    return notes

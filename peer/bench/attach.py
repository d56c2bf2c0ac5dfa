"""`peer bench attach`: what attaching a training process costs, and what one peer per host saves.

1. Overhead. The same pairwise exchange of a `--size` float32 vector between two daemons on this host,
   started either by a hosted trainer (trainers.consensus, as `peer bench average` runs it) or by a process
   attached to its daemon (peer/bench/attach_worker.py), whose vector lives in a shared segment the daemon
   averages in place. Figures: the daemon's own seconds per exchange in both cases, and the attached
   process's wall-clock seconds per `swarm.average()` call (request, exchange, reply). Goal: attached
   ≤ 1.1× hosted. The swarms run one after another, `--repeat` times, alternating.
2. Bytes per host. Two "hosts" (groups of daemons on this machine) train the shipped example for `--steps`
   steps per process: once as a torchrun job of `--ranks` gloo ranks per host attached as one peer, once as
   `--ranks` single processes per host, each its own peer with its own daemon. Figure: bytes the host's
   daemons sent (all sessions) per step. Expected ratio one-peer / G-peers: 1/G.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from peer.bench.args import parse_size
from peer.bench.average import BenchFailed, run_swarm
from peer.bench.hosts import free_port
from peer.testing.process import ManagedProcess, stop_all, wait_for
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_digits.py"
OVERHEAD_GOAL = 1.10


def _gossip(args) -> dict:
    return {"exchange_timeout": 60.0, "chunk_kib": max(1, parse_size(args.chunk) // 1024), "codec": "raw",
            "max_concurrent_exchanges": 4}


def _hosted(args, elements: int) -> list[float]:
    """Daemon seconds of node 0's exchanges, started by a hosted trainer (peer bench average's swarm)."""
    ns = argparse.Namespace(peers=2, chunk=args.chunk, codec="raw", cipher=args.cipher, settle=2.0, timeout=args.timeout,
                            no_defence=False)
    run = run_swarm(ns, elements, "one", args.rounds + 1)
    if run["sum_rel_error"] > 1e-5:
        raise BenchFailed(f"hosted swarm changed the sum (relative error {run['sum_rel_error']:.3g})")
    return run["status0"]["gossip"]["recent_s"][-args.rounds:]


def _attached(args, elements: int, tmp: Path) -> dict:
    """Two daemons without a trainer, an attached process on each; process 0 times `rounds` averages."""
    topology = {"kind": "full", "target_degree": 1, "min_degree": 1, "max_degree": 8}
    with LocalSwarm(tmp / "attached") as swarm:
        name = unique_swarm("atb")
        for i in range(2):
            cfg = swarm_config(swarm=name, topology=topology, gossip=_gossip(args))
            swarm.start(f"n{i}", config=cfg.replace(security={"ciphers": [args.cipher]}))
        swarm.wait_connected(timeout=args.timeout)
        stop = tmp / "stop"
        worker = [sys.executable, "-m", "peer.bench.attach_worker", "--elements", str(elements), "--rounds", str(args.rounds)]
        server = ManagedProcess("server", worker + ["--home", str(swarm.daemons[1].home), "--rank", "1",
                                                     "--stop-file", str(stop)], tmp / "server.log", cwd=REPO).start()
        initiator = ManagedProcess("initiator", worker + ["--home", str(swarm.daemons[0].home), "--initiate"],
                                   tmp / "initiator.log", cwd=REPO).start()
        procs = [server, initiator]
        try:
            wait_for(lambda: not initiator.running, timeout=args.timeout, what="the attached process's averages")
            swarm.wait(lambda sts: all(s and s["gossip"]["inflight"] == 0 for s in sts), timeout=30,
                       what="the last exchange to be applied")
            stop.touch()
            wait_for(lambda: not server.running, timeout=30, what="the serving process to end")
            if initiator.returncode or server.returncode:
                raise BenchFailed(f"attached processes exited with {initiator.returncode}/{server.returncode}:\n"
                                  f"{initiator.log_tail()}\n{server.log_tail()}")
        except TimeoutError as exc:
            raise BenchFailed(f"attached swarm: {exc}\n{initiator.log_tail()}\n{server.log_tail()}") from None
        finally:
            stop_all(procs)
        out = [json.loads(p.log_path.read_text().strip().splitlines()[-1]) for p in (initiator, server)]
    rel = abs(sum(o["final_sum"] for o in out) - sum(o["initial_sum"] for o in out)) / max(1.0, abs(sum(o["initial_sum"] for o in out)))
    if rel > 1e-5 or len(out[0]["wall_s"]) < args.rounds:
        raise BenchFailed(f"attached swarm: {len(out[0]['wall_s'])} of {args.rounds} exchanges ({out[0]['failed']}), "
                          f"sum error {rel:.3g}")
    return {"wall_s": out[0]["wall_s"], "daemon_s": out[0]["daemon_s"], "sum_rel_error": rel, "failed": out[0]["failed"]}


def _bytes_per_host(args, tmp: Path, ranks_as_one_peer: bool) -> dict:
    """Two hosts train the example for `steps` steps per process; bytes each host's daemons sent per step."""
    g = args.ranks
    per_host = 1 if ranks_as_one_peer else g
    example = [str(EXAMPLE), "--threads", "1", "--target", "2", "--epochs", "100000", "--max-steps", str(args.steps),
               "--average-every", str(args.average_every), "--world", "2" if ranks_as_one_peer else str(2 * g)]
    with LocalSwarm(tmp / ("one-peer" if ranks_as_one_peer else "g-peers")) as swarm:
        cfg = swarm_config(swarm=unique_swarm("bph"), gossip=_gossip(args))
        swarm.start_nodes(2 * per_host, cfg)
        swarm.wait_connected(timeout=args.timeout)
        procs = []
        for i, d in enumerate(swarm.daemons):
            env = {**rank_env(i, 2 * per_host), "OMP_NUM_THREADS": "1"}
            launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={g}", "--master-addr=127.0.0.1",
                         f"--master-port={free_port()}"] if ranks_as_one_peer else [sys.executable])
            procs.append(ManagedProcess(f"train{i}", launcher + example + ["--home", str(d.home)], tmp / f"train{i}-{per_host}.log",
                                        env=env, cwd=REPO).start())
        try:
            wait_for(lambda: not any(p.running for p in procs), timeout=args.timeout, what="the training runs")
            bad = [p for p in procs if p.returncode]
            if bad:
                raise BenchFailed(f"{bad[0].name} exited with {bad[0].returncode}:\n{bad[0].log_tail()}")
            swarm.wait(lambda sts: all(s and s["gossip"]["inflight"] == 0 for s in sts), timeout=30, what="exchanges to end")
        except TimeoutError as exc:
            raise BenchFailed(f"bytes per host: {exc}") from None
        finally:
            stop_all(procs)
        sts = swarm.statuses()
    sent = [sum(p["bytes_out"] for p in s["peers"]) for s in sts]
    exchanged = [s["gossip"]["bytes_sent"] for s in sts]
    hosts = [sum(sent[h * per_host:(h + 1) * per_host]) for h in range(2)]
    hosts_avg = [sum(exchanged[h * per_host:(h + 1) * per_host]) for h in range(2)]
    return {"peers_per_host": per_host, "processes_per_host": g,
            "bytes_per_host_per_step": round(statistics.mean(hosts) / args.steps),
            "averaging_bytes_per_host_per_step": round(statistics.mean(hosts_avg) / args.steps),
            "exchanges": sum(s["gossip"]["exchanges"] for s in sts)}


def run(args) -> int:
    elements = max(1, parse_size(args.size) // 4)
    t_start, load_before = time.monotonic(), os.getloadavg()[0]
    hosted, attached_wall, attached_daemon = [], [], []
    result: dict = {"payload_bytes": elements * 4, "rounds": args.rounds, "repeat": args.repeat}
    try:
        with tempfile.TemporaryDirectory(prefix="peertrain-bench-attach-") as tmp:
            for r in range(args.repeat):
                first, second = ("hosted", "attached") if r % 2 == 0 else ("attached", "hosted")
                for kind in (first, second):
                    if kind == "hosted":
                        hosted += _hosted(args, elements)
                    else:
                        got = _attached(args, elements, Path(tmp) / f"r{r}")
                        attached_wall += got["wall_s"]
                        attached_daemon += got["daemon_s"]
                        result.setdefault("attached_failed_exchanges", []).extend(got["failed"])
            h, aw, ad = (statistics.median(v) for v in (hosted, attached_wall, attached_daemon))
            result.update({
                "hosted_exchange_s": round(h, 4), "attached_exchange_s": round(ad, 4), "attached_call_s": round(aw, 4),
                "overhead_ratio": round(aw / h, 3), "overhead_ratio_daemon_side": round(ad / h, 3),
                "goal_overhead_ratio": OVERHEAD_GOAL, "met": aw / h <= OVERHEAD_GOAL,
                "samples": {"hosted_s": [round(x, 4) for x in hosted], "attached_call_s": [round(x, 4) for x in attached_wall]}})
            if args.ranks > 1 and args.steps > 0:
                one = _bytes_per_host(args, Path(tmp), True)
                many = _bytes_per_host(args, Path(tmp), False)
                result["bytes_per_host"] = {
                    "ranks_as_one_peer": one, "ranks_as_peers": many,
                    "ratio": round(one["averaging_bytes_per_host_per_step"]
                                   / max(1, many["averaging_bytes_per_host_per_step"]), 3),
                    "ratio_all_traffic": round(one["bytes_per_host_per_step"] / max(1, many["bytes_per_host_per_step"]), 3),
                    "expected_ratio": round(1 / args.ranks, 3)}
    except BenchFailed as exc:
        print(f"peer bench attach failed: {exc}", file=sys.stderr)
        return 1
    result["notes"] = {
        "hosted_exchange_s": "median of node 0's own seconds per pairwise exchange it started from a hosted trainer "
                             "(trainers.consensus): snapshot, offer, both vectors streamed, commit, in-place update",
        "attached_exchange_s": "the same figure when the vector lives in an attached process's shared segment",
        "attached_call_s": "the attached process's wall-clock seconds per blocking swarm.average() (adds the local "
                           "request and reply); overhead_ratio = attached_call_s / hosted_exchange_s",
        "bytes_per_host": "two groups of daemons on this machine stand for two hosts, each process runs `steps` steps "
                          "of the shipped example; averaging_bytes_per_host_per_step: tensor bytes the host's daemons "
                          "sent in exchanges (ratio compares these); bytes_per_host_per_step: every session's bytes "
                          "out, heartbeats and records included (ratio_all_traffic), which grow with peers per host",
    }
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["host"] = {"cpus": len(os.sched_getaffinity(0)), "load_1m_before": round(load_before, 2),
                      "load_1m_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0

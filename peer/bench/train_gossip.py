"""Our modes in `peer bench train`: n daemons hosting `trainers.gossip_sgd` (AD-PSGD or D-PSGD), and how
one run is read from the metrics every peer publishes at each evaluation.

Each peer's training clock starts after its daemon has found the swarm (the trainer's own `elapsed_s`);
a run's `seconds_to_target` is from the first peer's start until the LAST peer's local model reached the
target on the held-out set.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from peer.bench.hosts import DAEMON_PORT, Net
from peer.bench.train_plan import Plan
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm


def peer_summary(lines: list[dict], target: float) -> dict:
    """One peer's run from its published metrics: when its clock started, when its model reached the target."""
    stepped = [m for m in lines if m.get("elapsed_s") is not None and m.get("step") is not None]
    if not stepped:
        return {"started": False}
    start = stepped[0]["ts"] - stepped[0]["elapsed_s"]
    last = stepped[-1]
    hit = next((m for m in stepped if target and (m.get("accuracy") or 0.0) >= target), None)
    return {
        "started": True, "start_wall": start, "steps": last["step"], "elapsed_s": last["elapsed_s"],
        "epochs": last.get("epoch"), "samples_per_s": last.get("samples_per_s"),
        "steps_per_s": last["step"] / max(last["elapsed_s"], 1e-9), "accuracy": last.get("accuracy"),
        "reached": hit is not None,
        "reach_wall": start + hit["elapsed_s"] if hit else None,
        "seconds_to_target": hit["elapsed_s"] if hit else None,
        "epochs_to_target": hit.get("epoch") if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "meta": next((m for m in lines if "parameters" in m), {}),
    }


def _trainer_state(st: dict | None) -> str:
    return ((st or {}).get("trainer") or {}).get("state", "")


def run_gossip(mode: str, a, net: Net, root: Path, plan: Plan, *, options: dict, delays: dict[int, float],
               wait_for_peers: list[int], target: float, caps: Any = None) -> dict:
    """Start n daemons hosting gossip_sgd and stop them once every peer's model has reached `target`
    (read from the metrics each peer appends at every evaluation), or, without a target, once the
    trainers of the peers in `wait_for_peers` are done."""
    swarm_name = unique_swarm(f"bt{mode}")
    tx0 = [net.tx_bytes(i) for i in range(a.n)]
    t_begin = time.monotonic()
    with LocalSwarm(root) as swarm:
        for i in range(a.n):
            cfg = swarm_config(
                swarm=swarm_name, listen=f"0.0.0.0:{DAEMON_PORT}" if net.lan else "127.0.0.1:0", mdns=True,
                interfaces=[] if net.lan else ["127.0.0.1"], topology=plan.topology,
                gossip=plan.gossip, membership=plan.membership, trainer=a.trainer,
                options={**options, "mode": mode, "step_delay": delays.get(i, 0.0)})
            daemon = swarm.start(f"{mode}{i}", config=cfg, host=net.host(i),
                                 env={**rank_env(i, a.n), "OMP_NUM_THREADS": "1"})
            if caps is not None:
                caps.add(i, daemon.pid)

        def finished(sts: list[dict | None]) -> bool:
            states = [_trainer_state(st) for st in sts]
            if any(s.startswith("failed") for s in states):
                raise RuntimeError(f"a trainer failed: {states}")
            if target:
                return all(states[i] == "done" or peer_summary(d.metrics(), target).get("reached")
                           for i, d in enumerate(swarm.daemons))
            return all(states[i] == "done" for i in wait_for_peers)

        swarm.wait(finished, timeout=a.timeout, what=f"{mode} peers to reach the target or finish", interval=0.25)
        statuses = swarm.statuses()
        tx1 = [net.tx_bytes(i) for i in range(a.n)]
    wall = time.monotonic() - t_begin
    peers = [peer_summary(d.metrics(), target) for d in swarm.daemons]
    wire = [sum(p["bytes_out"] for p in (st or {}).get("peers", [])) if st else None for st in statuses]
    payload = [((st or {}).get("gossip") or {}).get("bytes_sent") for st in statuses]
    exchanges = [((st or {}).get("gossip") or {}).get("exchanges") for st in statuses]
    recent = [x for st in statuses for x in (((st or {}).get("gossip") or {}).get("recent_s") or [])]
    failed = [((st or {}).get("gossip") or {}).get("failed") for st in statuses]
    rejected = [((st or {}).get("gossip") or {}).get("rejected") for st in statuses]
    degrees = [((st or {}).get("topology") or {}).get("degree") for st in statuses]
    measured = [b - a0 for a0, b in zip(tx0, tx1)] if None not in tx0 + tx1 else None
    return {"peers": peers, "wire_bytes_out": wire, "gossip_payload_bytes_sent": payload, "exchanges": exchanges,
            "failed_exchanges": failed, "rejected_offers": rejected, "degrees": degrees,
            "recent_exchange_s": recent, "netdev_tx_bytes": measured, "bench_wall_s": round(wall, 1)}


def summarise_gossip(run: dict, n: int) -> dict:
    peers = run["peers"]
    ok = [p for p in peers if p.get("started")]
    reached = [p for p in ok if p["reached"]]
    all_reached = len(reached) == n
    start = min((p["start_wall"] for p in ok), default=None)
    sps = [p["samples_per_s"] for p in ok if p.get("samples_per_s") is not None]
    tx = run["netdev_tx_bytes"]
    out = {
        "reached_target": all_reached, "peers_reached": len(reached),
        "seconds_to_target": round(max(p["reach_wall"] for p in reached) - start, 3) if all_reached else None,
        "seconds_to_target_first_peer": round(min(p["reach_wall"] for p in reached) - start, 3) if reached else None,
        "seconds_to_target_median_peer": (round(statistics.median(p["reach_wall"] for p in reached) - start, 3)
                                          if all_reached else None),
        "start_skew_s": round(max(p["start_wall"] for p in ok) - start, 3) if ok else None,
        "epochs_to_target": max(p["epochs_to_target"] for p in reached) if all_reached else None,
        "steps_to_target_per_peer": [p["steps_to_target"] for p in peers] if ok else None,
        "final_accuracy_per_peer": [round(p["accuracy"], 4) if p.get("accuracy") is not None else None for p in peers],
        "samples_per_s_per_peer": round(statistics.mean(sps), 1) if sps else None,
        "samples_per_s_each": [round(s, 1) for s in sps],
        "samples_per_s_total": round(sum(sps), 1) if sps else None,
        "bytes_sent_per_peer": (round(statistics.mean(tx)) if tx else
                                round(statistics.mean(b for b in run["wire_bytes_out"] if b is not None))),
        "bytes_sent_source": ("measured: eth0 tx_bytes of each peer's namespace, daemon start to the end"
                              if tx else "measured: the daemon's encrypted session bytes_out to all peers"),
        "gossip_payload_bytes_per_peer": round(statistics.mean(b for b in run["gossip_payload_bytes_sent"] if b is not None)),
        "exchanges_per_peer": run["exchanges"], "failed_exchanges_per_peer": run["failed_exchanges"],
        "rejected_offers_per_peer": run.get("rejected_offers"), "degree_at_end_per_peer": run.get("degrees"),
        "exchange_s_median": round(statistics.median(run["recent_exchange_s"]), 4) if run["recent_exchange_s"] else None,
        "steps_per_exchange": (round(sum(p["steps"] for p in ok) / max(1, sum(e or 0 for e in run["exchanges"])), 2)
                               if ok else None),
        "bench_wall_s": run["bench_wall_s"],
        "parameters": next((p["meta"].get("parameters") for p in ok if p["meta"]), None),
    }
    return out

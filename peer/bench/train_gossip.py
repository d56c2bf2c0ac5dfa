"""Our modes in `peer bench train`: n daemons hosting `trainers.gossip_sgd` (AD-PSGD or D-PSGD), and how
one run is read from the metrics every peer publishes at each evaluation.

Each peer's training clock starts after its daemon has found the swarm (the trainer's own `elapsed_s`);
a run's `seconds_to_target` is from the first peer's start until the LAST peer's local model reached the
target on the held-out set. Inside namespaces, bytes are counted from daemon start; as the all-reduce's are,
from each peer's training start (seen within a poll, 0.25 s): discovery and handshakes are not training; and from
when every peer trains ("after joins"): a peer that starts late first downloads a partner's state (float32, model
and, in local modes, outer momentum), which that partner sends inside its own training window.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from peer.bench.hosts import DAEMON_PORT, Net
from peer.bench.train_plan import Plan, reaches
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm


def peer_summary(lines: list[dict], target: float, metric: str = "accuracy") -> dict:
    """One peer's run from its published metrics: when its clock started, when its model reached the target
    (`metric`: held-out accuracy, or test_loss for a language model)."""
    stepped = [m for m in lines if m.get("elapsed_s") is not None and m.get("step") is not None]
    if not stepped:
        return {"started": False}
    start = stepped[0]["ts"] - stepped[0]["elapsed_s"]
    last = stepped[-1]
    hit = next((m for m in stepped if reaches(m, target, metric)), None)
    rounds = next((m for m in reversed(stepped) if "rounds" in m), {})  # local modes (not in the final line)
    loop = next((m for m in reversed(stepped) if "reached_target" not in m), last)
    return {
        "started": True, "start_wall": start, "steps": last["step"], "elapsed_s": last["elapsed_s"],
        "epochs": last.get("epoch"), "samples_per_s": last.get("samples_per_s"),
        "steps_per_s": last["step"] / max(last["elapsed_s"], 1e-9), "accuracy": last.get("accuracy"),
        "test_loss": last.get("test_loss"), "test_loss_at_target": hit.get("test_loss") if hit else None,
        "rounds": rounds.get("rounds"), "rounds_skipped": rounds.get("rounds_skipped"),
        "compute_s": last.get("compute_s"),  # forward, backward and inner updates (gossip_sgd)
        # the last line from inside the training loop: the final line's clock also holds the final checkpoint
        "loop_step": loop["step"], "loop_elapsed_s": loop["elapsed_s"], "eval_s": loop.get("eval_s"),
        "test_loss_curve": _evaluations(stepped),
        "reached": hit is not None,
        "reach_wall": start + hit["elapsed_s"] if hit else None,
        "seconds_to_target": hit["elapsed_s"] if hit else None,
        "epochs_to_target": hit.get("epoch") if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "meta": next((m for m in lines if "parameters" in m), {}),
    }


def _evaluations(stepped: list[dict]) -> list[list]:
    """[step, held-out loss] at each evaluation: a line repeats the last loss until the next one, so a point is
    where the loss changed."""
    out: list[list] = []
    for m in stepped:
        loss = m.get("test_loss")
        if loss is not None and (not out or out[-1][1] != loss):
            out.append([m["step"], loss])
    return out


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
                options={**options, **plan.mode_options(mode), "step_delay": delays.get(i, 0.0)})
            daemon = swarm.start(f"{mode}{i}", config=cfg, host=net.host(i),
                                 env={**rank_env(i, a.n), "OMP_NUM_THREADS": "1"})
            if caps is not None:
                caps.add(i, daemon.pid)

        tx_train: dict[int, int | None] = {}  # eth0 tx bytes of peer i when its training began
        tx_joined: list[int | None] = []  # every peer's, once all of them train

        def finished(sts: list[dict | None]) -> bool:
            states = [_trainer_state(st) for st in sts]
            if any(s.startswith("failed") for s in states):
                raise RuntimeError(f"a trainer failed: {states}")
            lines = [d.metrics() for d in swarm.daemons] if target or (net.lan and len(tx_train) < a.n) else []
            for i, ls in enumerate(lines if net.lan else []):
                if i not in tx_train and any(m.get("state") == "training" for m in ls):  # gossip_sgd's meta line
                    tx_train[i] = net.tx_bytes(i)
            if net.lan and len(tx_train) == a.n and not tx_joined:
                tx_joined.extend(net.tx_bytes(i) for i in range(a.n))
            if target:
                return all(states[i] == "done" or peer_summary(lines[i], target, plan.metric).get("reached")
                           for i in range(a.n))
            return all(states[i] == "done" for i in wait_for_peers)

        swarm.wait(finished, timeout=a.timeout, what=f"{mode} peers to reach the target or finish", interval=0.25)
        statuses = swarm.statuses()
        tx1 = [net.tx_bytes(i) for i in range(a.n)]
    wall = time.monotonic() - t_begin
    peers = [peer_summary(d.metrics(), target, plan.metric) for d in swarm.daemons]
    wire = [sum(p["bytes_out"] for p in (st or {}).get("peers", [])) if st else None for st in statuses]
    payload = [((st or {}).get("gossip") or {}).get("bytes_sent") for st in statuses]
    exchanges = [((st or {}).get("gossip") or {}).get("exchanges") for st in statuses]
    recent = [x for st in statuses for x in (((st or {}).get("gossip") or {}).get("recent_s") or [])]
    failed = [((st or {}).get("gossip") or {}).get("failed") for st in statuses]
    rejected = [((st or {}).get("gossip") or {}).get("rejected") for st in statuses]
    degrees = [((st or {}).get("topology") or {}).get("degree") for st in statuses]
    measured = [b - a0 for a0, b in zip(tx0, tx1)] if None not in tx0 + tx1 else None
    starts = [tx_train.get(i) for i in range(a.n)]
    training = [b - a0 for a0, b in zip(starts, tx1)] if None not in starts + tx1 else None
    joined = [b - a0 for a0, b in zip(tx_joined, tx1)] if tx_joined and None not in tx_joined + tx1 else None
    return {"peers": peers, "wire_bytes_out": wire, "gossip_payload_bytes_sent": payload, "exchanges": exchanges,
            "failed_exchanges": failed, "rejected_offers": rejected, "degrees": degrees,
            "recent_exchange_s": recent, "netdev_tx_bytes": measured, "netdev_tx_bytes_training": training,
            "netdev_tx_bytes_after_joins": joined,
            "bench_wall_s": round(wall, 1)}


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
        "final_accuracy_per_peer": [_r4(p.get("accuracy")) for p in peers],
        "final_test_loss_per_peer": [_r4(p.get("test_loss")) for p in peers],
        "test_loss_at_target_per_peer": [_r4(p.get("test_loss_at_target")) for p in peers],
        "samples_per_s_per_peer": round(statistics.mean(sps), 1) if sps else None,
        "samples_per_s_each": [round(s, 1) for s in sps],
        "samples_per_s_total": round(sum(sps), 1) if sps else None,
        "bytes_sent_per_peer": (round(statistics.mean(tx)) if tx else
                                round(statistics.mean(b for b in run["wire_bytes_out"] if b is not None))),
        "bytes_sent_source": ("measured: eth0 tx_bytes of each peer's namespace, daemon start to the end"
                              if tx else "measured: the daemon's encrypted session bytes_out to all peers"),
        "bytes_sent_training_per_peer": (round(statistics.mean(run["netdev_tx_bytes_training"]))
                                         if run.get("netdev_tx_bytes_training") else None),
        "bytes_sent_after_joins_per_peer": (round(statistics.mean(run["netdev_tx_bytes_after_joins"]))
                                            if run.get("netdev_tx_bytes_after_joins") else None),
        "gossip_payload_bytes_per_peer": round(statistics.mean(b for b in run["gossip_payload_bytes_sent"] if b is not None)),
        "exchanges_per_peer": run["exchanges"], "failed_exchanges_per_peer": run["failed_exchanges"],
        "rejected_offers_per_peer": run.get("rejected_offers"), "degree_at_end_per_peer": run.get("degrees"),
        "exchange_s_median": round(statistics.median(run["recent_exchange_s"]), 4) if run["recent_exchange_s"] else None,
        "steps_per_exchange": (round(sum(p["steps"] for p in ok) / max(1, sum(e or 0 for e in run["exchanges"])), 2)
                               if ok else None),
        "bench_wall_s": run["bench_wall_s"],
        "parameters": next((p["meta"].get("parameters") for p in ok if p["meta"]), None),
    }
    if any(p.get("rounds") is not None for p in ok):  # local modes: outer rounds, and those whose exchange was skipped
        out["rounds_per_peer"] = [p.get("rounds") for p in peers]
        out["rounds_skipped_per_peer"] = [p.get("rounds_skipped") for p in peers]
    return out


def _r4(x: float | None) -> float | None:
    return round(x, 4) if x is not None else None

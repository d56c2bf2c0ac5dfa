"""The synchronous baseline of `peer bench train`: torch.distributed all-reduce, one process per rank.

Each rank is `python -m trainers.allreduce_baseline` (peer/ never imports `trainers`), a `ManagedProcess`
on 127.0.0.1 or on its own host of the virtual LAN; rank 0 prints one JSON line for the whole job, and
that line is the run's result.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from peer.bench.hosts import Net
from peer.testing.process import ManagedProcess, stop_all, wait_for


def run_allreduce(a, net: Net, root: Path, *, args: list[str], caps: Any = None) -> dict:
    """One process per rank (`python -m trainers.allreduce_baseline`); rank 0's JSON line is the result."""
    master = net.master()
    t_begin = time.monotonic()
    # OMP_NUM_THREADS=1 as for our daemons; in a namespace gloo must use eth0, or it advertises the
    # address its hostname resolves to (127.0.0.1)
    env = {"OMP_NUM_THREADS": "1", **({"GLOO_SOCKET_IFNAME": "eth0"} if net.lan else {})}
    ranks = [ManagedProcess(name=f"allreduce{r}", log_path=root / f"allreduce{r}.out", env=env, host=net.host(r),
                            argv=[sys.executable, "-m", "trainers.allreduce_baseline", "--world", str(a.n),
                                  "--rank", str(r), "--master", master, "--timeout", str(int(a.timeout)), *args,
                                  *(["--net-dev", "eth0"] if net.lan else [])])
             for r in range(a.n)]
    try:
        for r, rank in enumerate(ranks):
            rank.start()
            if caps is not None:
                caps.add(r, rank.pid)
        wait_for(lambda: not any(rank.running for rank in ranks), timeout=a.timeout,
                 what=f"{a.n} all-reduce ranks to finish")
    finally:
        stop_all(ranks)
    text = ranks[0].log_path.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    if ranks[0].returncode != 0 or not lines:
        raise RuntimeError(f"all-reduce rank 0 failed (rc {ranks[0].returncode}):\n{text[-3000:]}")
    result = json.loads(lines[-1])
    result["bench_wall_s"] = round(time.monotonic() - t_begin, 1)
    return result


def summarise_allreduce(r: dict) -> dict:
    sps = r["samples_per_s_per_worker"]
    return {
        "reached_target": r["reached_target"], "seconds_to_target": r["seconds_to_target"],
        "epochs_to_target": r["epochs_to_target"], "steps_to_target": r["steps_to_target"],
        "final_accuracy": round(r["accuracy"], 4),
        "final_test_loss": round(r["test_loss"], 4) if r.get("test_loss") is not None else None,
        "test_loss_at_target": round(r["test_loss_at_target"], 4) if r.get("test_loss_at_target") is not None else None,
        "samples_per_s_per_peer": round(statistics.mean(sps), 1), "samples_per_s_each": sps,
        "samples_per_s_total": r["samples_per_s_total"],
        "bytes_sent_per_peer": r["bytes_sent_per_worker"], "bytes_sent_source": r["bytes_sent_source"],
        "bytes_sent_training_per_peer": (r["bytes_sent_per_worker"] if r.get("bytes_sent_per_worker_each")
                                         else None),  # measured in the training loop (in namespaces)
        "bytes_sent_estimate_ring": r["bytes_sent_estimate_ring"], "backend": r["backend"],
        "bench_wall_s": r["bench_wall_s"], "parameters": r["parameters"], "hyperparams": r["hyperparams"],
    }

"""`peer bench train`: how time-to-target is read from the peers' metrics, and one small end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.bench.train_gossip import peer_summary, summarise_gossip


def _lines(start: float, evals: list[tuple[int, float, float]]) -> list[dict]:
    """The metrics lines one peer publishes: the meta line, then (step, elapsed_s, accuracy) per evaluation."""
    out = [{"trainer": "trainers.gossip_sgd", "parameters": 10, "state": "training", "ts": start}]
    for step, elapsed, acc in evals:
        out.append({"step": step, "epoch": step / 10, "elapsed_s": elapsed, "accuracy": acc,
                    "samples_per_s": step * 32 / elapsed, "ts": start + elapsed + 0.001})
    return out


def test_time_to_target_is_until_the_last_peer_from_the_first_start() -> None:
    fast = peer_summary(_lines(100.0, [(10, 1.0, 0.5), (20, 2.0, 0.96), (30, 3.0, 0.94)]), 0.95)
    slow = peer_summary(_lines(100.5, [(10, 1.0, 0.5), (20, 2.0, 0.90), (30, 3.0, 0.951)]), 0.95)
    assert fast["reached"] and fast["seconds_to_target"] == 2.0 and fast["epochs_to_target"] == 2.0
    assert slow["steps_to_target"] == 30
    run = {"peers": [fast, slow], "wire_bytes_out": [100, 300], "gossip_payload_bytes_sent": [50, 150],
           "exchanges": [4, 4], "failed_exchanges": [0, 0], "recent_exchange_s": [0.1, 0.3], "netdev_tx_bytes": None,
           "bench_wall_s": 9.0}
    s = summarise_gossip(run, 2)
    assert s["reached_target"] and s["peers_reached"] == 2
    assert s["seconds_to_target"] == pytest.approx(3.5)  # 100.0 -> 100.5 + 3.0
    assert s["seconds_to_target_first_peer"] == pytest.approx(2.0)
    assert s["epochs_to_target"] == 3.0 and s["bytes_sent_per_peer"] == 200


def test_a_peer_that_never_reaches_the_target_means_no_time() -> None:
    a = peer_summary(_lines(0.0, [(10, 1.0, 0.97)]), 0.95)
    b = peer_summary(_lines(0.0, [(10, 1.0, 0.80)]), 0.95)
    run = {"peers": [a, b], "wire_bytes_out": [1, 1], "gossip_payload_bytes_sent": [1, 1], "exchanges": [1, 1],
           "failed_exchanges": [0, 0], "recent_exchange_s": [], "netdev_tx_bytes": None, "bench_wall_s": 1.0}
    s = summarise_gossip(run, 2)
    assert not s["reached_target"] and s["seconds_to_target"] is None and s["peers_reached"] == 1


@pytest.mark.slow
def test_bench_train_smoke() -> None:
    """Two daemons (AD-PSGD) and two gloo ranks reach an easy target; one JSON object comes out."""
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "bench", "train", "--n", "2", "--modes", "adpsgd,allreduce",
         "--target", "0.85", "--eval-every", "10", "--timeout", "70", "--json"],
        capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    modes = result["modes"]
    assert modes["adpsgd"]["reached_target"] and modes["allreduce"]["reached_target"], result
    assert modes["allreduce"]["backend"] in ("gloo", "nccl")
    assert modes["adpsgd"]["seconds_to_target"] > 0 and modes["adpsgd"]["bytes_sent_per_peer"] > 0
    assert result["ratio_to_allreduce"] == pytest.approx(
        modes["adpsgd"]["seconds_to_target"] / modes["allreduce"]["seconds_to_target"], rel=0.01)

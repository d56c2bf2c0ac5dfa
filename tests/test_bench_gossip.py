"""Smoke run of `peer bench gossip`: tiny swarm, loose target; the JSON has every field and the checks pass.

Speed is not asserted here (benchmarks measure it); only that the bench runs end to end and that its
invariant checks (W doubly stochastic, edges listed by both ends, sum preserved) hold on real daemons.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.bench.gossip import median_run
from peer.testing.pace import scaled

pytestmark = pytest.mark.slow


@pytest.mark.serial
def test_bench_gossip_small_swarm_reports_every_topology(tmp_path):
    argv = [sys.executable, "-m", "peer", "bench", "gossip", "--n", "4", "--size", "256KiB", "--target", "1e-2",
            "--topologies", "rewired,ring", "--settle", "2", "--timeout", f"{scaled(30):g}", "--logs", str(tmp_path), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=scaled(85))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["n"] == 4 and out["payload_bytes"] == 256 * 1024
    assert set(out["topologies"]) == {"rewired", "ring"}
    for kind, r in out["topologies"].items():
        assert r["seconds_to_target"] is not None and r["seconds_to_target"] > 0, (kind, r)
        assert r["error_reached"] <= 1e-2
        assert 0 < r["spectral_gap"] <= 1 and r["edges"] >= 3 and r["bytes_sent_per_peer"] > 0
        checks = r["checks"]
        assert checks["doubly_stochastic"] and checks["one_sided_edges"] == 0 and checks["sum_preserved"], (kind, checks)
    assert out["topologies"]["ring"]["degree"] == 2
    assert out["best_fixed"] == "ring" and out["speedup_vs_best_fixed"] > 0
    assert 0 < out["topologies"]["rewired"]["same_degree_gap"] <= 1 and out["rewired_gap_vs_same_degrees"] > 0


def test_repeated_runs_report_the_median_run_and_every_runs_seconds():
    runs = [{"seconds_to_target": 5.0, "tag": "a"}, {"error": "boom"}, {"seconds_to_target": 2.0, "tag": "c"}]
    chosen = median_run(runs)
    assert chosen["tag"] == "a"  # sorted: 2.0, 5.0, failed (slowest) -> the median is 5.0
    assert chosen["seconds_to_target_runs"] == [5.0, None, 2.0]
    assert median_run([{"seconds_to_target": 1.0}]) == {"seconds_to_target": 1.0}

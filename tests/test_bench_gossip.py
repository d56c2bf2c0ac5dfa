"""Smoke run of `peer bench gossip`: tiny swarm, loose target; the JSON has every field and the checks pass.

Speed is not asserted here (benchmarks measure it); only that the bench runs end to end and that its
invariant checks (W doubly stochastic, edges listed by both ends, sum preserved) hold on real daemons.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def test_bench_gossip_small_swarm_reports_every_topology(tmp_path):
    argv = [sys.executable, "-m", "peer", "bench", "gossip", "--n", "4", "--size", "256KiB", "--target", "1e-2",
            "--topologies", "rewired,ring", "--settle", "2", "--timeout", "30", "--logs", str(tmp_path), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=85)
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
    from peer.bench.gossip import median_run

    runs = [{"seconds_to_target": 5.0, "tag": "a"}, {"error": "boom"}, {"seconds_to_target": 2.0, "tag": "c"}]
    chosen = median_run(runs)
    assert chosen["tag"] == "a"  # sorted: 2.0, 5.0, failed (slowest) -> the median is 5.0
    assert chosen["seconds_to_target_runs"] == [5.0, None, 2.0]
    assert median_run([{"seconds_to_target": 1.0}]) == {"seconds_to_target": 1.0}


def _adjacency(n: int, edges) -> np.ndarray:
    a = np.zeros((n, n))
    for i, j in edges:
        a[i, j] = a[j, i] = 1.0
    return a


def test_same_degree_graphs_keep_every_degree_and_stay_simple():
    from peer.bench.gossip import same_degree_graphs

    # two degree-2 hosts hung on a 4-regular core: the rewired graph's shape with two slow hosts
    ring = [(i, (i + 1) % 6) for i in range(6)] + [(i, (i + 2) % 6) for i in range(6)]
    adj = _adjacency(8, [e for e in ring if e not in ((0, 1), (2, 3))] + [(6, 0), (6, 1), (7, 2), (7, 3)])
    seen = set()
    for g in same_degree_graphs(adj, samples=50, seed=1):
        assert np.array_equal(g, g.T) and not np.diag(g).any() and set(np.unique(g)) <= {0.0, 1.0}
        assert np.array_equal(g.sum(axis=1), adj.sum(axis=1))
        seen.add(g.tobytes())
    assert len(seen) > 25  # the chain moves: mostly different graphs


def test_same_degree_gap_of_a_regular_graph_is_the_random_regular_yardstick():
    from peer.bench.gossip import random_regular_gap, same_degree_gap
    from peer.topology.fixed import random_regular

    ids = [f"p{i:03d}" for i in range(8)]
    index = {p: i for i, p in enumerate(ids)}
    adj = _adjacency(8, [tuple(index[p] for p in e) for e in random_regular(ids, 4, 3)])
    assert abs(same_degree_gap(adj, samples=200) - random_regular_gap(8, 4)) < 0.05

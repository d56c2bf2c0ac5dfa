"""Swarm-sized runs of the view rules in the simulator (peer/bench/scale_sim.py), each a few seconds: half of
2,000 peers failing at once, the concurrent churn that partitions SCAMP and Cyclon, and `peer bench scale`
end to end on a small swarm. Not in the unit tier (`tests/conftest.py`): each builds a swarm of
thousands of simulated peers."""

from __future__ import annotations

import json

import numpy as np

from peer.bench.scale import GOALS, build
from peer.bench.scale_sim import SimConfig, SimPeer, Simulator, components
from peer.cli.main import main
from peer.membership.views import ViewConfig
from peer.topology.local_gap import GapConfig


def built(n: int, seed: int) -> Simulator:
    sim = Simulator(ViewConfig(), GapConfig(), SimConfig(seed=seed))
    build(sim, n)
    sim.run_until(sim.now + 30)
    return sim


def shape(sim: Simulator) -> tuple[list[int], np.ndarray]:
    """(component sizes, largest first; every live peer's degree)."""
    live, pairs, _ = sim.graph()
    return components(len(live), pairs), np.bincount(pairs.ravel(), minlength=len(live))


def run_until_whole(sim: Simulator, within: float) -> bool:
    """Run until the live peers form one component, none below min_degree (True), or `within` seconds pass."""
    end = sim.now + within
    while sim.now < end:
        sim.run_until(sim.now + 1)
        sizes, deg = shape(sim)
        if len(sizes) == 1 and deg.min() >= sim.view_cfg.min_degree:
            return True
    return False


def test_no_peer_is_isolated_after_half_of_2000_fail_at_once():
    sim = built(2000, seed=11)
    sizes, deg = shape(sim)
    assert sizes == [2000] and deg.max() <= sim.view_cfg.max_degree
    for p in sim.rng.sample(sim.alive, 1000):
        sim.crash(p)
    t0 = sim.now
    assert run_until_whole(sim, within=60), shape(sim)[0][:5]
    assert sim.now - t0 < 40  # ~6 s to notice, then repairs from the passive views and lost neighbours
    sim.run_until(sim.now + 60)
    sizes, deg = shape(sim)
    assert sizes == [1000] and deg.min() >= sim.view_cfg.min_degree
    assert np.mean(deg == sim.view_cfg.target_degree) > 0.9  # back to (nearly) regular


def test_concurrent_churn_that_partitions_scamp_and_cyclon():
    """Joins and failures at once, in waves: each wave, 30% of the live peers crash while as many newcomers
    join, each through a random peer of the swarm *before* the wave (so many contacts are dead, and many
    joiners' walks and splits hit dying peers). SCAMP and Cyclon lose connectivity in such runs: their
    views fill with dead entries that nothing replaces in time (Leitão et al., DSN 2007, figures 3-5);
    here a lost edge is noticed, and active views refill from lost neighbours' neighbours and passive
    views, which shuffles keep fresh. A joiner whose contact died, or whose contact was itself stranded,
    knows nobody left to ask: it says so (`NeedContact`) and joins again through another peer, as a daemon
    does through its next bootstrap address."""
    sim = built(1000, seed=12)
    joiners: list[SimPeer] = []
    for _ in range(3):
        before = list(sim.alive)
        victims = sim.rng.sample(before, int(0.3 * len(before)))
        for k, p in enumerate(victims):
            sim.run_until(sim.now + 5.0 / len(victims))  # the wave lasts ~5 s: crashes and joins interleaved
            (sim.crash if k % 4 else sim.leave)(p)
            q = sim.spawn()
            sim.join(q, sim.rng.choice(before))
            joiners.append(q)
        sim.run_until(sim.now + 15)
    assert run_until_whole(sim, within=90), shape(sim)[0][:5]
    sizes, deg = shape(sim)
    assert sizes == [len(sim.alive)] and len(sim.alive) >= 900
    assert all(p.views.degree >= sim.view_cfg.min_degree for p in joiners if p.alive)


def test_bench_scale_small_run_reports_every_figure(capsys):
    argv = ["bench", "scale", "--peers", "150", "--steady", "120", "--churn", "0.02", "--recover", "30", "--seed", "3",
            "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("peers", "state_bytes_per_peer", "control_bits_per_s_per_peer", "connected_after_half_failure",
                "gap_ratio_vs_random_regular", "join_seconds", "consensus_seconds",
                "random_regular_consensus_seconds", "gap_estimate_ratio_median", "goals"):
        assert key in r, key
    assert r["peers"] == 150 and r["bad_messages"] == 0
    assert r["connected_after_half_failure"] == 1.0
    assert 0 < r["state_bytes_per_peer"] < 64 * 1024
    assert 0 < r["control_bits_per_s_per_peer"]
    assert 0.5 < r["gap_ratio_vs_random_regular"] < 1.5
    assert set(r["goals"]) == set(GOALS)


def _status(pid: str, active: list[str], *, sent: int = 0, peers: int = 3, state: int = 1000) -> dict:
    return {"peer_id": pid, "connected": len(active), "peers": [{"bytes_out": 0}] * peers,
            "topology": {"views": {"active": active, "state_bytes": state, "passive": 5, "sent_bytes": sent}}}


def test_the_real_bench_reads_the_graph_the_active_views_form():
    """`peer bench scale --real`'s reading of daemons' statuses (peer/bench/scale_real.py): edges need both
    ends; a one-sided edge, a missing daemon or a degree out of bounds is not settled."""
    from peer.bench.scale_real import compare
    from peer.testing.views import settled, view_graph

    ring = [_status(p, [q for q in "abcd" if abs(ord(q) - ord(p)) in (1, 3)]) for p in "abcd"]
    g = view_graph(ring)
    assert g["connected"] and g["edges"] == 4 and g["edges_one_sided"] == 0 and g["degree_min_max"] == [2, 2]
    assert settled(ring, 4, 2, 8) and not settled(ring, 4, 3, 8) and not settled(ring[:3] + [None], 4, 2, 8)
    split = [_status("a", ["b"]), _status("b", ["a"]), _status("c", ["d"]), _status("d", ["c", "a"])]
    g = view_graph(split)
    assert not g["connected"] and g["largest_component"] == 2 and g["edges_one_sided"] == 1
    sim = {"peers": 4, "steady_seconds": 10.0, "state_bytes_per_peer": 2000, "mean_degree": 2.0,
           "steady_bytes_by_message": {"handshake": 10_000, "view_shuffle": 400, "view_status": 100},
           "control_bits_per_s_per_peer": 2100.0, "control_bits_per_s_views_only": 2000.0}  # 100 of gap rounds
    r = compare({"state_bytes_per_peer": 1000, "control_bits_per_s_per_peer": 50.0, "mean_degree": 2.0}, sim)
    assert r == {"simulated_view_message_bits_per_s_per_peer": 200.0, "state_bytes_per_peer": 0.5,
                 "control_bits_per_s_per_peer": 0.25, "mean_degree": 1.0}

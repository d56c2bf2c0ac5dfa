"""The topology rules that need no view of the whole graph: the sparse gap (peer/topology/sparse_gap.py), the
decentralised gap estimate (local_gap.py) and the local rewiring rule (local_rewire.py)."""

from __future__ import annotations

import math
import random
import types

import numpy as np
import pytest

from peer.topology.fixed import random_regular, ring
from peer.topology.graph import GraphView, LinkEstimate
from peer.topology.local_gap import GapConfig, GapEstimator, GapReading, check_round, reference_gap
from peer.topology.local_rewire import LocalRewireConfig, NeighbourFacts, plan_local_move
from peer.topology.mixing import graph_spectral_gap
from peer.topology.sparse_gap import sparse_spectral_gap
from protocol.schema.views import GapRound
from tests.topology_helpers import names


def index_pairs(ids: list[str], edges) -> np.ndarray:
    at = {p: i for i, p in enumerate(ids)}
    return np.array([sorted(at[x] for x in e) for e in edges], dtype=np.int64).reshape(-1, 2)


# ---- the sparse gap -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,degree,seed", [(30, 3, 0), (120, 4, 1), (200, 6, 2)])
def test_sparse_gap_matches_the_dense_one(n, degree, seed):
    ids = names(n)
    edges = random_regular(ids, degree, seed)
    dense = graph_spectral_gap(GraphView.from_edges(ids, edges))
    assert sparse_spectral_gap(n, index_pairs(ids, edges)) == pytest.approx(dense, abs=1e-9)


def test_sparse_gap_of_a_ring_a_disconnected_graph_and_tiny_ones():
    ids = names(50)
    dense = graph_spectral_gap(GraphView.from_edges(ids, ring(ids)))
    assert sparse_spectral_gap(50, index_pairs(ids, ring(ids))) == pytest.approx(dense, abs=1e-9)
    two_rings = np.array([(i, (i + 1) % 10) for i in range(10)] + [(10 + i, 10 + (i + 1) % 10) for i in range(10)])
    assert sparse_spectral_gap(20, two_rings) == 0.0
    assert sparse_spectral_gap(1, np.zeros((0, 2))) == 0.0
    assert sparse_spectral_gap(2, np.array([(0, 1)])) == pytest.approx(graph_spectral_gap(
        GraphView.from_edges(["a", "b"], [("a", "b")])))


# ---- the decentralised gap estimate -------------------------------------------------------------------

def run_epoch(n: int, pairs: np.ndarray, cfg: GapConfig, seed: int = 0) -> list[GapReading | None]:
    """Every peer's estimator through one epoch, each round's messages delivered to the neighbours."""
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for a, b in pairs.tolist():
        nbrs[a].add(b)
        nbrs[b].add(a)
    rng = random.Random(seed)
    est = [GapEstimator(cfg, random.Random(rng.getrandbits(64))) for _ in range(n)]
    for e in est:
        e.begin(7)
    for _ in range(cfg.rounds):
        msgs = [e.message(len(nbrs[i])) for i, e in enumerate(est)]
        for i, m in enumerate(msgs):
            check_round(m, cfg)
            for j in nbrs[i]:
                est[j].receive(str(i), m)
        for i, e in enumerate(est):
            e.advance({str(j) for j in nbrs[i]})
    assert not any(e.running for e in est)
    return [e.reading for e in est]


def test_the_estimate_on_random_regular_graphs_reads_about_its_reference():
    """On random d-regular graphs the median peer reads within 10% of what the estimator reads there in
    theory (the Kesten-McKay reference), so the ratio reads ~1: "as good as a random regular graph"."""
    cfg = GapConfig()
    for degree in (4, 6):
        ids = names(400)
        pairs = index_pairs(ids, random_regular(ids, degree, 3))
        readings = run_epoch(400, pairs, cfg)
        ratios = sorted(r.ratio for r in readings if r is not None)
        assert len(ratios) == 400
        assert 0.9 < ratios[len(ratios) // 2] < 1.1, degree
        assert readings[0].reference == pytest.approx(reference_gap(degree, cfg.rounds))
        assert readings[0].epoch == 7


def test_the_estimate_sees_a_poorly_mixing_graph():
    """Two random 4-regular halves joined by a few edges mix far worse than one random 4-regular graph:
    the peers' readings say so (the ratio falls well below the rewiring rule's 0.9)."""
    cfg = GapConfig()
    half = names(200)
    a = index_pairs(half, random_regular(half, 4, 1))
    b = index_pairs(half, random_regular(half, 4, 2)) + 200
    # rewire four edges of each half into bridges: degrees stay 4
    bridges = [(a[k][0], b[k][0]) for k in range(4)] + [(a[k][1], b[k][1]) for k in range(4)]
    pairs = np.concatenate([a[4:], b[4:], np.array(bridges)])
    exact = sparse_spectral_gap(400, pairs)
    readings = [r for r in run_epoch(400, pairs, cfg) if r is not None]
    median = sorted(r.ratio for r in readings)[len(readings) // 2]
    assert median < 0.6
    assert exact < 0.5 * reference_gap(4, 2000)  # the true gap is far below a random regular graph's


def test_reference_gap_approaches_the_spectral_bound_as_rounds_grow():
    bound = 1 - (1 + 2 * math.sqrt(3)) / 5  # random 4-regular: Alon-Boppana / Friedman, MH weights
    readings = [reference_gap(4, r) for r in (20, 60, 240, 2000)]
    assert all(x > y for x, y in zip(readings, readings[1:]))
    assert readings[-1] == pytest.approx(bound, rel=0.05)


def test_estimator_ignores_other_rounds_and_bounds_what_it_holds():
    cfg = GapConfig(max_neighbours=2)
    e = GapEstimator(cfg, random.Random(0))
    assert e.message(3) is None  # not in an epoch
    e.begin(1)
    good = GapRound(1, 0, 3, (0.5, -0.5), None)
    e.receive("a", GapRound(0, 0, 3, (1.0, 1.0), None))  # another epoch
    e.receive("b", GapRound(1, 5, 3, (1.0, 1.0), None))  # another round
    for who in ("c", "d", "e", "f"):
        e.receive(who, good)
    assert set(e._got) == {"c", "d"}
    for bad in (GapRound(1, cfg.rounds, 3, (0.0, 0.0), None), GapRound(1, 0, 3, (0.0,), None)):
        with pytest.raises(ValueError):  # in the schema's bounds, but not our config's
            check_round(bad, cfg)
    for args in ((1, 0, 3, (math.inf, 0.0), None), (1, 0, 3, (0.0, 0.0), 1.0), (1, 0, 3, (0.0, 0.0), -50.5),
                 (1, 0, 3, (), None), (1, 0, 3, (0.0,) * 9, None), (-1, 0, 3, (0.0, 0.0), None),
                 (1 << 62, 0, 3, (0.0, 0.0), None), (1, 10_000, 3, (0.0, 0.0), None), (1, 0, (1 << 16) + 1, (0.0,), None)):
        with pytest.raises(ValueError):  # out of the schema's bounds: cannot be built (nor decoded)
            GapRound(*args)
    with pytest.raises(ValueError):
        GapConfig(rounds=4)
    with pytest.raises(ValueError):
        GapConfig(epoch_interval=10.0)


# ---- the local rewiring rule --------------------------------------------------------------------------

CFG = LocalRewireConfig(shard_bytes=16 << 20, mix_probability=0.0)


def link(mbit: float) -> LinkEstimate:
    return LinkEstimate(bandwidth_bps=mbit * 1e6, rtt_s=0.02)


def facts(mbits: dict[str, float], fastest: dict[str, float] | None = None, local: set[str] = frozenset()):
    return {p: NeighbourFacts(4, link(m), (fastest or {}).get(p, 1000e6), p in local) for p, m in mbits.items()}


def test_a_slow_path_is_rerolled_but_a_slow_host_is_kept():
    rng = random.Random(0)
    slow_path = facts({"a": 100, "b": 90, "c": 110, "d": 5})  # d has a 1 Gbit/s link elsewhere
    m = plan_local_move(slow_path, None, CFG, rng, min_degree=2)
    assert m is not None and m.kind == "speed" and m.drop == "d"
    slow_host = facts({"a": 100, "b": 90, "c": 110, "d": 5}, fastest={"d": 6e6})  # d's best link is as slow
    assert plan_local_move(slow_host, None, CFG, rng, min_degree=2) is None
    even = facts({"a": 100, "b": 60, "c": 110, "d": 40})  # nothing 4x slower than the median
    assert plan_local_move(even, None, CFG, rng, min_degree=2) is None


def test_a_repair_edge_is_mixed_away_and_a_low_gap_pauses_speed_moves():
    rng = random.Random(0)
    m = plan_local_move(facts({"a": 100, "b": 100, "c": 100, "d": 100}, local={"c"}), None, CFG, rng, min_degree=2)
    assert m is not None and (m.kind, m.drop) == ("mix", "c")
    low = GapReading(epoch=1, gap=0.05, reference=0.12, degree=4.0)
    slow_path = facts({"a": 100, "b": 90, "c": 110, "d": 5})
    moves = [plan_local_move(slow_path, low, LocalRewireConfig(mix_probability=0.25), rng, min_degree=2)
             for _ in range(200)]
    assert not any(m is not None and m.kind == "speed" for m in moves)
    assert all(m is None or m.kind == "mix" for m in moves) and sum(m is not None for m in moves) > 100
    assert plan_local_move(facts({"a": 100}), None, CFG, rng, min_degree=2) is None  # nothing to trade


def test_local_rewire_config_is_range_checked():
    for bad in (dict(shed_factor=1.0), dict(gap_keep=0.0), dict(mix_probability=1.5), dict(interval=0.0),
                dict(default_bandwidth_bps=0.0), dict(shard_bytes=-1)):
        with pytest.raises(ValueError):
            LocalRewireConfig(**bad)


# ---- the daemon's driver of the estimate (peer/membership/gap_driver.py) ----------------------------------

def test_the_gap_driver_follows_the_wall_clock_and_reads_what_the_estimator_does():
    """Drivers that start at different moments meet at the next epoch boundary of the wall clock, deliver
    every round's value in its slot and read exactly what the estimators read when run in lock step."""
    import trio
    import trio.testing

    from peer.membership.gap_driver import GapDriver

    cfg = GapConfig(rounds=16, round_interval=0.2, epoch_interval=5.0)
    n, degree = 10, 3
    pairs = random_regular(names(n), degree, 3)
    idx = {name: i for i, name in enumerate(names(n))}
    pairs_idx = np.array([(idx[a], idx[b]) for a, b in pairs])
    expected = run_epoch(n, pairs_idx, cfg, seed=5)

    nbrs = {str(i): set() for i in range(n)}
    for a, b in pairs_idx.tolist():
        nbrs[str(a)].add(str(b))
        nbrs[str(b)].add(str(a))
    rng = random.Random(5)
    drivers: dict[str, GapDriver] = {}
    offset = 1_000_003.7  # the wall clock, mid-epoch when the test starts

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(n):
                me = str(i)
                views = types.SimpleNamespace(active=nbrs[me], degree=len(nbrs[me]), gap=None)
                views.set_gap = lambda reading, views=views: setattr(views, "gap", reading)

                async def send(session, msg, me=me):
                    drivers[session].receive(me, msg)

                drivers[me] = GapDriver(cfg, views, random.Random(rng.getrandbits(64)),
                                        sessions=lambda: {p: p for p in drivers}, send=send,
                                        wall_clock=lambda: trio.current_time() + offset)
                nursery.start_soon(drivers[me].run)
                await trio.sleep(0.1)  # each starts a little later, all before the first boundary (1.3 s)
            await trio.sleep(1.3 + cfg.rounds * cfg.round_interval)  # to the end of that epoch, not the next

            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    for i in range(n):
        d = drivers[str(i)]
        assert d.epochs == 1 and d.views.gap is not None, d.status()
        assert d.views.gap.gap == pytest.approx(expected[i].gap) and d.status()["reading"]["ratio"] > 0


def test_gap_rounds_from_peers_outside_the_active_view_take_no_place():
    """The estimator keeps max_neighbours senders a round, first come: any session's rounds used to take those
    places before our neighbours' came (issue 40). Only our active view's are kept now."""
    from peer.membership.gap_driver import GapDriver

    cfg = GapConfig(rounds=16, round_interval=0.2, epoch_interval=5.0)
    views = types.SimpleNamespace(active={"n1", "n2"}, degree=2, gap=None)

    async def send(session, msg):
        pass
    d = GapDriver(cfg, views, random.Random(1), sessions=dict, send=send)
    d.estimator.begin(7)
    for i in range(cfg.max_neighbours + 5):
        d.receive(f"sybil{i}", GapRound(7, 0, 2, (0.5,) * cfg.vectors, None))
    d.receive("n1", GapRound(7, 0, 2, (0.25,) * cfg.vectors, None))
    assert set(d.estimator._got) == {"n1"} and d.ignored == cfg.max_neighbours + 5 and d.received == 1


@pytest.mark.parametrize("body, why", [
    (b"\xc1", "malformed"),
    (b"\x93\x01\x02\x03", "must be a map"),
    ({"epoch": 1, "round": 0, "degree": 3, "values": [0.5, 0.5]}, "slope: missing required field"),
    ({"epoch": 1, "round": 0, "degree": 3, "values": [0.5, "x"], "slope": None}, r"values\[1\]: expected float"),
    ({"epoch": 1, "round": 0, "degree": 3, "values": [0.5, float("nan")], "slope": None}, "NaN"),
    ({"epoch": 1, "round": 0, "degree": 3, "values": [0.5] * 9, "slope": None}, "finite values"),
    ({"epoch": 1, "round": 99, "degree": 3, "values": [0.5, 0.5], "slope": None}, "out of range"),
    ({"epoch": -1, "round": 0, "degree": 3, "values": [0.5, 0.5], "slope": None}, "out of range"),
    ({"epoch": 1, "round": 0, "degree": 3.0, "values": [0.5, 0.5], "slope": None}, "degree: expected int"),
    ({"epoch": 1, "round": 0, "degree": 3, "values": [0.5, 0.5], "slope": 0.5}, "slope"),
    ({"epoch": 1, "round": 0, "degree": 3, "values": [0.5, 0.5], "slope": "0"}, "slope"),
])
def test_a_hostile_gap_round_is_refused_with_the_reason(body, why):
    """What the schema refuses when it decodes a round (ProtocolError), and what our config refuses
    (`check_round`: an epoch of 16 rounds); either closes the session."""
    import msgpack

    from protocol.errors import ProtocolError
    from protocol.limits import DEFAULT_LIMITS
    from protocol.schema import DEFAULT_REGISTRY

    def decode(body) -> GapRound:
        raw = body if isinstance(body, bytes) else msgpack.packb({"t": "gap_round", "v": 1, "b": body})
        msg = DEFAULT_REGISTRY.decode(raw, DEFAULT_LIMITS).message
        check_round(msg, GapConfig(rounds=16, round_interval=0.2, epoch_interval=5.0))
        return msg

    with pytest.raises((ProtocolError, ValueError), match=why):
        decode(body)
    assert decode({"epoch": 1, "round": 0, "degree": 3, "values": [0.5, -0.5], "slope": -0.1}).values == (0.5, -0.5)

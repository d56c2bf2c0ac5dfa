"""Topology math: graph views, mixing weights, spectral gaps and fixed graphs (rewiring: test_topology_rewire.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.topology.fixed import (
    FIXED_KINDS,
    build_fixed,
    build_fixed_view,
    exponential,
    full,
    random_regular,
    ring,
    two_cliques,
)
from peer.topology.graph import GraphView, LinkEstimate, edge_key
from peer.topology.mixing import (
    check_doubly_stochastic,
    graph_spectral_gap,
    local_weights,
    metropolis_weight,
    mixing_matrix,
    node_round_time,
    predicted_round_time,
    spectral_gap,
)
from tests.topology_helpers import names, random_view


# -- graph view -----------------------------------------------------------------


def test_link_reports_merge_pessimistically():
    reports = {
        "a": {"b": LinkEstimate(bandwidth_bps=50e6, rtt_s=0.010)},
        "b": {"a": LinkEstimate(bandwidth_bps=80e6, rtt_s=0.020), "c": LinkEstimate(rtt_s=0.003)},
    }
    v = GraphView.from_reports("abc", [("a", "b"), ("b", "c")], reports)
    assert v.link("b", "a") == LinkEstimate(50e6, 0.020)
    assert v.link("c", "b") == LinkEstimate(None, 0.003)  # one side, one field measured
    assert v.link("a", "c") == LinkEstimate()
    assert LinkEstimate(None, 0.01).combine(LinkEstimate(7.0, None)) == LinkEstimate(7.0, 0.01)


def test_view_helpers_and_immutability():
    v = GraphView.from_edges("abcd", [("a", "b"), ("b", "c"), ("c", "d")])
    assert v.neighbours("b") == {"a", "c"} and v.degree("d") == 1
    assert v.is_connected() and not v.connected_without("b", "c")
    w = v.with_edge("a", "d", LinkEstimate(1e6, 0.1))
    assert w.connected_without("b", "c") and w.degree("a") == 2
    assert v.degree("a") == 1 and not v.has_edge("a", "d")  # original untouched
    u = w.without_edge("a", "d")
    assert u.edges == v.edges and u.link("a", "d") == LinkEstimate(1e6, 0.1)
    ids, a = v.adjacency()
    assert ids == ("a", "b", "c", "d") and (a == a.T).all() and a.sum() == 6
    assert v.hop_distances("a") == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert GraphView.from_edges("abc", [("a", "b")]).component_count() == 2
    with pytest.raises(ValueError):
        GraphView.from_edges("ab", [("a", "z")])
    with pytest.raises(ValueError):
        v.with_edge("a", "a")
    with pytest.raises(ValueError):
        v.degree("zz")


def test_predicted_round_time_uses_slowest_edge_and_defaults():
    links = {("a", "b"): LinkEstimate(10e6, 0.01), ("b", "c"): LinkEstimate(rtt_s=0.002)}
    v = GraphView.from_edges("abc", [("a", "b"), ("b", "c")], links)
    # bandwidth is in bits/s: a-b: 8e6/10e6 + 0.01 = 0.81 s; b-c: 8e6/100e6 (default) + 0.002 = 0.082 s
    assert predicted_round_time(v, 1e6, 100e6, 0.005) == pytest.approx(0.81)
    assert node_round_time(v, "c", 1e6, 100e6, 0.005) == pytest.approx(0.082)
    v2 = GraphView.from_edges("abc", [("b", "c")], links)
    assert predicted_round_time(v2, 1e6, 100e6, 0.005) == pytest.approx(0.082)
    assert predicted_round_time(GraphView.from_edges("ab", []), 1e6, 1e8, 0.005) == 0.0


# -- mixing matrix ----------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 24), p=st.floats(0.0, 1.0), seed=st.integers(0, 2**32 - 1))
def test_metropolis_matrix_is_symmetric_doubly_stochastic(n, p, seed):
    v = random_view(np.random.default_rng(seed), n, p)
    w = mixing_matrix(v)
    assert np.array_equal(w, w.T)
    assert w.min() >= 0.0
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
    check_doubly_stochastic(w, tol=1e-12)
    ids = v.ids()
    for i, node in enumerate(ids):  # each peer's local row matches the global matrix
        if v.degree(node) == 0:
            continue
        self_w, row = local_weights({m: v.degree(m) for m in v.neighbours(node)})
        assert self_w == pytest.approx(w[i, i], abs=1e-12)
        assert self_w >= 1.0 / (1 + v.degree(node)) - 1e-12
        for m, wm in row.items():
            assert wm == pytest.approx(w[i, ids.index(m)], abs=1e-15)
    assert mixing_matrix(v.adjacency()[1]).tolist() == w.tolist()


def test_local_row_never_exceeds_one_with_stale_degrees():
    # Neighbours' degrees may be gossiped late; my own degree is exact, which bounds the row.
    for stale in ([1, 1, 1], [1, 9, 2], [100, 100, 100]):
        self_w, row = local_weights(dict(zip("xyz", stale)))
        assert self_w >= 1 / 4 and sum(row.values()) <= 3 / 4


def test_check_doubly_stochastic_reports_problems():
    with pytest.raises(ValueError, match="square"):
        check_doubly_stochastic(np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match="negative"):
        check_doubly_stochastic(np.array([[1.5, -0.5], [-0.5, 1.5]]))
    with pytest.raises(ValueError, match="row"):
        check_doubly_stochastic(np.array([[0.5, 0.6], [0.5, 0.4]]))
    with pytest.raises(ValueError, match="column"):
        check_doubly_stochastic(np.array([[0.5, 0.5], [0.6, 0.4]]))
    with pytest.raises(ValueError):
        metropolis_weight(0, 3)


# -- spectral gap -------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 4, 5, 8, 15, 16, 33])
def test_ring_gap_matches_closed_form(n):
    # MH on a cycle: W = I/3 + (shift + shift^T)/3, eigenvalues 1/3 + 2/3 cos(2 pi k / n).
    lam = [1 / 3 + 2 / 3 * math.cos(2 * math.pi * k / n) for k in range(1, n)]
    expected = 1 - max(abs(x) for x in lam)
    assert graph_spectral_gap(GraphView.from_edges(names(n), ring(names(n)))) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n", [2, 3, 8, 9, 16])
def test_two_cliques_are_two_complete_halves_and_one_bridge(n):
    ids = names(n)
    v = GraphView.from_edges(ids, two_cliques(list(reversed(ids))))  # discovery order does not matter
    half = (n + 1) // 2
    a, b = sorted(ids)[:half], sorted(ids)[half:]
    assert len(two_cliques(ids)) == half * (half - 1) // 2 + len(b) * (len(b) - 1) // 2 + 1
    assert all(v.degree(x) == len(a) - 1 + (x == a[0]) for x in a)
    assert all(v.degree(x) == len(b) - 1 + (x == b[0]) for x in b)
    gap = graph_spectral_gap(v)
    assert 0 < gap < graph_spectral_gap(GraphView.from_edges(ids, ring(ids))) or n <= 3  # one bridge: a poor gap


@pytest.mark.parametrize("n", [5, 8, 12, 16, 32, 64])
def test_exponential_gap_matches_circulant_closed_form(n):
    edges = exponential(names(n))
    v = GraphView.from_edges(names(n), edges)
    offsets = {(s * sign) % n for k in range(n.bit_length()) if (s := 2**k) < n for sign in (1, -1)}
    d = len(offsets)
    assert all(v.degree(x) == d for x in v.nodes)
    if n & (n - 1) == 0:
        assert d == 2 * int(math.log2(n)) - 1
    lam = [(1 + sum(math.cos(2 * math.pi * k * s / n) for s in offsets)) / (d + 1) for k in range(1, n)]
    assert graph_spectral_gap(v) == pytest.approx(1 - max(abs(x) for x in lam), abs=1e-12)


def test_full_graph_and_degenerate_gaps():
    for n in (2, 3, 10):
        assert graph_spectral_gap(GraphView.from_edges(names(n), full(names(n)))) == pytest.approx(1.0)
    assert spectral_gap(np.ones((1, 1))) == 0.0
    assert spectral_gap(np.zeros((0, 0))) == 0.0
    two_islands = GraphView.from_edges("abcd", [("a", "b"), ("c", "d")])
    assert graph_spectral_gap(two_islands) == 0.0
    with pytest.raises(ValueError, match="symmetric"):
        spectral_gap(np.array([[0.5, 0.5], [0.25, 0.75]]))


def test_random_4_regular_gaps_match_reference():
    reference = {16: 0.27, 32: 0.17, 64: 0.14}
    measured = {}
    for n, want in reference.items():
        gaps = [graph_spectral_gap(GraphView.from_edges(names(n), random_regular(names(n), 4, s))) for s in range(8)]
        measured[n] = float(np.mean(gaps))
        assert abs(measured[n] - want) <= 0.05
    print(f"\nrandom 4-regular MH gap (mean of 8 seeds): {measured}")


def test_metropolis_beats_lazy_and_max_degree_weights():
    """Evidence for the weight rule (see mixing.py): the local alternatives lose."""
    rng = np.random.default_rng(7)
    mh, lazy, maxdeg = [], [], []
    for _ in range(20):
        v = random_view(rng, 24, 0.17)
        if not v.is_connected():
            continue
        a = v.adjacency()[1]
        w = mixing_matrix(a)
        mh.append(spectral_gap(w))
        lazy.append(spectral_gap((w + np.eye(len(a))) / 2))
        wm = a / (1 + a.sum(axis=1).max())
        wm[np.diag_indices(len(a))] = 1 - wm.sum(axis=1)
        maxdeg.append(spectral_gap(wm))
    assert len(mh) >= 5
    assert np.mean(mh) > np.mean(lazy) and np.mean(mh) > np.mean(maxdeg)
    print(f"\nER n=24 mean gap: MH {np.mean(mh):.3f}, lazy MH {np.mean(lazy):.3f}, max-degree {np.mean(maxdeg):.3f}")


# -- fixed topologies ----------------------------------------------------------------


@pytest.mark.parametrize("n,d", [(8, 3), (10, 4), (16, 4), (17, 4), (33, 6), (64, 4), (100, 3)])
def test_random_regular_is_connected_and_regular(n, d):
    for seed in range(3):
        edges = random_regular(names(n), d, seed)
        v = GraphView.from_edges(names(n), edges)
        assert v.is_connected()
        assert sorted(v.degree(x) for x in v.nodes) == [d] * n
        assert edges == random_regular(list(reversed(names(n))), d, seed)  # order-independent
    assert random_regular(names(n), d, 0) != random_regular(names(n), d, 1)


def test_random_regular_fallbacks():
    odd = GraphView.from_edges(names(9), random_regular(names(9), 3, 0))
    assert odd.is_connected() and sorted(odd.degree(x) for x in odd.nodes) == [2] + [3] * 8
    assert random_regular(names(5), 4, 0) == full(names(5))
    assert random_regular(names(5), 10, 0) == full(names(5))
    low = GraphView.from_edges(names(10), random_regular(names(10), 1, 0))
    assert low.is_connected() and {low.degree(x) for x in low.nodes} == {2}
    assert random_regular(names(2), 4, 0) == {edge_key("p000", "p001")}
    assert random_regular(names(1), 4, 0) == frozenset()


def test_build_fixed_dispatch_and_small_cases():
    ids = names(6)
    for kind in FIXED_KINDS:
        v = build_fixed_view(kind, ids, degree=3, seed=4)
        assert v.is_connected() and v.nodes == set(ids)
    assert build_fixed("ring", ids) == ring(ids)
    assert ring(["a"]) == frozenset() and ring(["b", "a"]) == {edge_key("a", "b")}
    assert exponential(["a", "b"]) == {edge_key("a", "b")}
    with pytest.raises(ValueError, match="unknown fixed topology 'star'"):
        build_fixed("star", ids)
    with pytest.raises(ValueError, match="duplicate"):
        ring(["a", "b", "a"])

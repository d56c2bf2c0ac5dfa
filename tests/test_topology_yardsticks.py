"""The yardsticks a swarm's real graph is judged by: its adjacency from reported neighbour lists, and the
gaps of random graphs with the same degrees or the same target degree."""

from __future__ import annotations

import numpy as np

from peer.topology.fixed import random_regular
from peer.topology.yardsticks import graph_of, random_regular_gap, same_degree_gap, same_degree_graphs


def _adjacency(n: int, edges) -> np.ndarray:
    a = np.zeros((n, n))
    for i, j in edges:
        a[i, j] = a[j, i] = 1.0
    return a


def test_graph_of_takes_the_union_and_counts_edges_one_end_lists():
    lists = {"b": {"a", "c"}, "a": {"b"}, "c": set(), "d": {"a", "gone"}}
    ids, adj, one_sided = graph_of(lists)
    assert ids == ["a", "b", "c", "d"]
    assert np.array_equal(adj, _adjacency(4, [(0, 1), (1, 2), (3, 0)]))
    assert one_sided == 2  # b -> c and d -> a; "gone" has not reported, so it is no node


def test_same_degree_graphs_keep_every_degree_and_stay_simple():
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
    ids = [f"p{i:03d}" for i in range(8)]
    index = {p: i for i, p in enumerate(ids)}
    adj = _adjacency(8, [tuple(index[p] for p in e) for e in random_regular(ids, 4, 3)])
    assert abs(same_degree_gap(adj, samples=200) - random_regular_gap(8, 4)) < 0.05

"""Judging the graph a swarm really used, and what to set it against.

`graph_of` assembles the graph from the neighbour lists peers report (and counts edges only one end
lists: a broken or in-flight change); `checked_gap` is its spectral gap once its mixing matrix is checked
to be doubly stochastic. The yardsticks are gaps of random graphs: random regular graphs of the target
degree, and random graphs with the graph's own degree sequence, the fair one where a graph keeps some
nodes at low degree on purpose (rewiring keeps slow hosts there).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping, Set

import numpy as np

from peer.topology.fixed import random_regular
from peer.topology.graph import GraphView, edge_key
from peer.topology.mixing import check_doubly_stochastic, graph_spectral_gap, mixing_matrix, spectral_gap


def graph_of(lists: Mapping[str, Set[str]]) -> tuple[list[str], np.ndarray, int]:
    """(sorted ids, adjacency of the union of neighbour lists, edges listed by one end only).

    A neighbour that has no list of its own (it has not reported) is left out."""
    listed = [(p, q) for p, nbrs in lists.items() for q in nbrs if q in lists]
    ids, adj = GraphView.from_edges(lists, {edge_key(p, q) for p, q in listed}).adjacency()
    return list(ids), adj, sum(1 for p, q in listed if p not in lists[q])


def checked_gap(adj: np.ndarray) -> float:
    """Spectral gap of the MH matrix W of `adj`, after checking W is doubly stochastic (raises if not)."""
    w = mixing_matrix(adj)
    check_doubly_stochastic(w)
    return spectral_gap(w)


def same_degree_graphs(adj: np.ndarray, samples: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Random simple graphs with `adj`'s degree sequence, as adjacency matrices (a fresh one per sample).

    A Markov chain of double-edge swaps (a-b, c-d -> a-d, c-b; a swap that would make a loop or a double
    edge is skipped), started from `adj` itself: after a burn-in it samples the graphs with those degrees
    near-uniformly, which a configuration model with rejection only does for small n.
    """
    rng = np.random.default_rng(seed)
    a = (np.asarray(adj) != 0).astype(np.int8)
    edges = [tuple(e) for e in np.argwhere(np.triu(a))]
    if len(edges) < 2:
        return
    burn_in, every = 10 * len(edges), 2 * len(edges)
    for step in range(burn_in + every * samples):
        i, j = rng.choice(len(edges), size=2, replace=False)
        (p, q), (r, t) = edges[i], edges[j]
        if rng.random() < 0.5:
            r, t = t, r
        if len({p, q, r, t}) == 4 and not a[p, t] and not a[r, q]:
            a[p, q] = a[q, p] = a[r, t] = a[t, r] = 0
            a[p, t] = a[t, p] = a[r, q] = a[q, r] = 1
            edges[i], edges[j] = (p, t), (r, q)
        if step >= burn_in and (step - burn_in) % every == every - 1:
            yield a.astype(float)


def same_degree_gap(adj: np.ndarray, samples: int = 100, seed: int = 0) -> float | None:
    """Median gap of random connected graphs with `adj`'s degrees: the yardstick when degrees differ.

    A rewired graph is not regular where it keeps slow hosts at low degree on purpose, so "a random
    regular graph of the same degree" has no single degree to take; the same degree *sequence* does.
    Disconnected samples (gap 0) are left out: a swarm gossips on a connected graph.
    """
    gaps = [g for g in (spectral_gap(mixing_matrix(a)) for a in same_degree_graphs(adj, samples, seed)) if g > 0]
    return statistics.median(gaps) if gaps else None


def random_regular_gap(n: int, degree: int, seeds: int = 20) -> float:
    """Mean gap of `seeds` random `degree`-regular graphs on n nodes: the yardstick for rewired."""
    ids = [f"p{i:03d}" for i in range(n)]
    return statistics.mean(graph_spectral_gap(GraphView.from_edges(ids, random_regular(ids, degree, s)))
                           for s in range(seeds))

"""Deterministic fixed topologies: the baseline before (or instead of) rewiring.

Every peer that knows the same member list and seed derives the same graph without
talking to anyone, so a fixed topology needs no agreement protocol. Node ids are
sorted first, which makes the result independent of discovery order. Each builder
returns the edge set as a frozenset of 2-element frozensets (see `graph.Edge`);
wrap it with `GraphView.from_edges(ids, edges)` when a view is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from peer.topology.graph import Edge, GraphView, edge_key

Edges = frozenset[Edge]
FIXED_KINDS = ("ring", "exponential", "random_regular", "full", "two_cliques")

_MAX_ATTEMPTS = 1000


def _sorted_unique(ids: Sequence[str]) -> list[str]:
    out = sorted(ids)
    dupes = sorted({x for a, x in zip(out, out[1:]) if a == x})
    if dupes:
        raise ValueError(f"duplicate node ids: {dupes}")
    return out


def _from_index_pairs(ids: list[str], pairs: set[tuple[int, int]]) -> Edges:
    return frozenset(edge_key(ids[i], ids[j]) for i, j in pairs)


def ring(ids: Sequence[str]) -> Edges:
    """A cycle in sorted-id order (one edge for two nodes, none for one)."""
    s = _sorted_unique(ids)
    n = len(s)
    if n < 2:
        return frozenset()
    return frozenset(edge_key(s[i], s[(i + 1) % n]) for i in range(n))


def exponential(ids: Sequence[str]) -> Edges:
    """Node i links to i +- 2^k (mod n) for every 2^k < n, undirected.

    Degree is about 2 log2(n) and the graph has diameter about log2(n): the usual
    static choice for decentralised SGD when all links are equally fast.
    """
    s = _sorted_unique(ids)
    n = len(s)
    pairs: set[tuple[int, int]] = set()
    hop = 1
    while hop < n:
        for i in range(n):
            j = (i + hop) % n
            if i != j:
                pairs.add((min(i, j), max(i, j)))
        hop *= 2
    return _from_index_pairs(s, pairs)


def full(ids: Sequence[str]) -> Edges:
    """Every pair connected: gap 1 with MH weights, but n-1 transfers per round."""
    s = _sorted_unique(ids)
    return frozenset(edge_key(a, b) for i, a in enumerate(s) for b in s[i + 1 :])


def two_cliques(ids: Sequence[str]) -> Edges:
    """The sorted ids in two halves, each complete, joined by one edge (the halves' first nodes).

    Why a graph this poor: it is the sparse case robust aggregation is judged on. The two sides agree only
    through one link, so a rule that trims or takes a median over a peer's neighbours sees the bridge's far
    side as the outlier and cuts it, and the halves drift apart with no attacker at all (He, Karimireddy and
    Jaggi, "Byzantine-robust decentralized learning via ClippedGossip", 2022). `peer bench byzantine` runs
    its attacks on it as well as on the rewired graph.
    """
    s = _sorted_unique(ids)
    n = len(s)
    if n < 2:
        return frozenset()
    half = (n + 1) // 2
    a, b = s[:half], s[half:]
    return full(a) | full(b) | (frozenset({edge_key(a[0], b[0])}) if b else frozenset())


def _try_pairing(stubs: list[int], rng: np.random.Generator) -> set[tuple[int, int]] | None:
    """One Steger-Wormald style pass: pair random stubs, re-pairing only the clashes.

    Plain configuration-model pairing is simple only with probability about
    exp(-(d^2 - 1)/4) (2% for d = 4); re-shuffling just the stubs that formed loops
    or duplicate edges succeeds almost always on the first attempt.
    """
    edges: set[tuple[int, int]] = set()
    while stubs:
        order = rng.permutation(len(stubs))
        shuffled = [stubs[k] for k in order]
        leftover: list[int] = []
        for u, v in zip(shuffled[0::2], shuffled[1::2]):
            e = (min(u, v), max(u, v))
            if u != v and e not in edges:
                edges.add(e)
            else:
                leftover += [u, v]
        if leftover and not _can_pair(leftover, edges):
            return None
        stubs = leftover
    return edges


def _can_pair(stubs: list[int], edges: set[tuple[int, int]]) -> bool:
    nodes = sorted(set(stubs))
    return any(
        (a, b) not in edges for i, a in enumerate(nodes) for b in nodes[i + 1 :]
    )


def _connected(n: int, pairs: set[tuple[int, int]]) -> bool:
    adj: list[list[int]] = [[] for _ in range(n)]
    for i, j in pairs:
        adj[i].append(j)
        adj[j].append(i)
    seen = {0}
    stack = [0]
    while stack:
        for v in adj[stack.pop()]:
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return len(seen) == n


def random_regular(ids: Sequence[str], degree: int, seed: int) -> Edges:
    """A connected simple `degree`-regular graph, deterministic in (ids, seed).

    Graceful fallbacks instead of errors, because the member count is whatever the
    swarm happens to be:
      * n <= 2, or degree >= n - 1: the full graph (the densest simple graph);
      * degree < 2: raised to 2, since a 1-regular graph on n > 2 nodes is a
        matching and never connected;
      * n * degree odd: one node (the last in sorted order) gets degree - 1, as no
        d-regular graph exists then;
      * if no connected pairing turns up in many attempts: the ring.
    """
    s = _sorted_unique(ids)
    n = len(s)
    if n <= 2 or degree >= n - 1:
        return full(s)
    d = max(degree, 2)
    stubs = [i for i in range(n) for _ in range(d)]
    if (n * d) % 2:
        stubs.pop()
    rng = np.random.default_rng(seed)
    for _ in range(_MAX_ATTEMPTS):
        pairs = _try_pairing(list(stubs), rng)
        if pairs is not None and _connected(n, pairs):
            return _from_index_pairs(s, pairs)
    return ring(s)


def build_fixed(kind: str, ids: Sequence[str], degree: int = 4, seed: int = 0) -> Edges:
    """Dispatch by name; `degree` and `seed` only matter for random_regular."""
    builders: dict[str, Callable[[], Edges]] = {
        "ring": lambda: ring(ids),
        "exponential": lambda: exponential(ids),
        "random_regular": lambda: random_regular(ids, degree, seed),
        "full": lambda: full(ids),
        "two_cliques": lambda: two_cliques(ids),
    }
    if kind not in builders:
        raise ValueError(f"unknown fixed topology {kind!r}; choose one of {', '.join(FIXED_KINDS)}")
    return builders[kind]()


def build_fixed_view(kind: str, ids: Sequence[str], degree: int = 4, seed: int = 0) -> GraphView:
    """`build_fixed` wrapped in an (unmeasured) GraphView."""
    return GraphView.from_edges(ids, build_fixed(kind, ids, degree, seed))

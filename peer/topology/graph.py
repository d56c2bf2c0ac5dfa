"""The approximate global graph one peer holds, as an immutable value.

Every peer gossips what it knows about the overlay (who is connected to whom and how
fast each link looked) and assembles a `GraphView`. The view is never authoritative:
it may be stale or partial, so everything built on it (mixing weights, spectral gap,
rewiring plans) is a prediction that the daemon confirms through the wire protocol.

Views are immutable: `with_edge` / `without_edge` return new views, which lets the
rewiring planner try many hypothetical moves without copying bookkeeping by hand.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

Edge = frozenset[str]
"""An undirected edge: the frozenset of its two distinct endpoint ids."""


def edge_key(a: str, b: str) -> Edge:
    """The undirected edge between `a` and `b`; self-loops are rejected."""
    if a == b:
        raise ValueError(f"self-loop on {a!r} is not an edge")
    return frozenset((a, b))


def _min_opt(x: float | None, y: float | None) -> float | None:
    if x is None:
        return y
    if y is None:
        return x
    return min(x, y)


def _max_opt(x: float | None, y: float | None) -> float | None:
    if x is None:
        return y
    if y is None:
        return x
    return max(x, y)


@dataclass(frozen=True)
class LinkEstimate:
    """What is known about one link; `None` means "not measured".

    Either field may be missing because measurements are opportunistic: a peer may
    have timed a ping (rtt) but not yet a transfer (bandwidth), or the reverse.
    `bandwidth_bps` is in bits per second (as networks are quoted and `peer status` shows).
    """

    bandwidth_bps: float | None = None
    rtt_s: float | None = None
    log_se: float = 0.0
    """Standard error of log(bandwidth): how far the measurer trusts its own figure (0: taken as exact).
    Only this peer's own measurements carry one; figures from others' records do not."""

    def __post_init__(self) -> None:
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth_bps}")
        if self.rtt_s is not None and not self.rtt_s >= 0:
            raise ValueError(f"rtt must be >= 0 s, got {self.rtt_s}")
        if not self.log_se >= 0:
            raise ValueError(f"log_se must be >= 0, got {self.log_se}")

    def combine(self, other: LinkEstimate) -> LinkEstimate:
        """Merge two ends' reports pessimistically: min bandwidth, max rtt, the larger uncertainty.

        Links are often asymmetric (upload is slower than download) and an exchange
        moves a shard both ways, so the slower direction is the one that counts.
        """
        return LinkEstimate(
            bandwidth_bps=_min_opt(self.bandwidth_bps, other.bandwidth_bps),
            rtt_s=_max_opt(self.rtt_s, other.rtt_s),
            log_se=max(self.log_se, other.log_se),
        )

    def transfer_time(
        self, nbytes: float, default_bandwidth_bps: float, default_rtt_s: float
    ) -> float:
        """Predicted seconds to move `nbytes` bytes over this link (bandwidth in bits/s; defaults fill gaps)."""
        bw = self.bandwidth_bps if self.bandwidth_bps is not None else default_bandwidth_bps
        rtt = self.rtt_s if self.rtt_s is not None else default_rtt_s
        return nbytes * 8 / bw + rtt


UNMEASURED = LinkEstimate()


@dataclass(frozen=True)
class GraphView:
    """Nodes, undirected edges and per-pair link estimates.

    `links` may also hold estimates for pairs that are *not* edges (a peer probes
    candidates before wiring to them); only edges count towards round time. An edge
    without an estimate is simply unmeasured.
    """

    nodes: frozenset[str]
    edges: frozenset[Edge]
    links: Mapping[Edge, LinkEstimate] = field(default_factory=dict, hash=False)
    _adj: Mapping[str, frozenset[str]] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        nodes = frozenset(self.nodes)
        edges = frozenset(frozenset(e) for e in self.edges)
        for e in edges:
            if len(e) != 2:
                raise ValueError(f"edge {sorted(e)} must join two distinct nodes")
            unknown = e - nodes
            if unknown:
                raise ValueError(f"edge {sorted(e)} names unknown node(s) {sorted(unknown)}")
        links = dict(self.links)
        for e in links:
            if len(e) != 2 or not e <= nodes:
                raise ValueError(f"link estimate for {sorted(e)} is not a pair of known nodes")
        adj: dict[str, set[str]] = {n: set() for n in nodes}
        for e in edges:
            a, b = tuple(e)
            adj[a].add(b)
            adj[b].add(a)
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "links", MappingProxyType(links))
        object.__setattr__(
            self, "_adj", MappingProxyType({n: frozenset(s) for n, s in adj.items()})
        )

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_edges(
        cls,
        nodes: Iterable[str],
        edges: Iterable[tuple[str, str] | Edge],
        links: Mapping[tuple[str, str] | Edge, LinkEstimate] | None = None,
    ) -> GraphView:
        """Build from pairs; link keys may be tuples or frozensets."""
        return cls(
            nodes=frozenset(nodes),
            edges=frozenset(edge_key(*tuple(e)) for e in edges),
            links={edge_key(*tuple(k)): v for k, v in (links or {}).items()},
        )

    @classmethod
    def from_reports(
        cls,
        nodes: Iterable[str],
        edges: Iterable[tuple[str, str] | Edge],
        reports: Mapping[str, Mapping[str, LinkEstimate]],
    ) -> GraphView:
        """Build from per-peer reports: `reports[a][b]` is what `a` measured to `b`.

        When both ends reported, they are merged with `LinkEstimate.combine`; when
        only one did, its report is used as is.
        """
        links: dict[Edge, LinkEstimate] = {}
        for a, row in reports.items():
            for b, est in row.items():
                k = edge_key(a, b)
                links[k] = links[k].combine(est) if k in links else est
        return cls.from_edges(nodes, edges, links)

    # -- queries ------------------------------------------------------------------

    def ids(self) -> tuple[str, ...]:
        """Node ids in the canonical (sorted) order used by matrices."""
        return tuple(sorted(self.nodes))

    def _check_node(self, node: str) -> None:
        if node not in self.nodes:
            raise ValueError(f"unknown node {node!r}")

    def neighbours(self, node: str) -> frozenset[str]:
        self._check_node(node)
        return self._adj[node]

    def degree(self, node: str) -> int:
        return len(self.neighbours(node))

    def has_edge(self, a: str, b: str) -> bool:
        return a != b and edge_key(a, b) in self.edges

    def link(self, a: str, b: str) -> LinkEstimate:
        """The estimate for the pair (edge or not); `UNMEASURED` when unknown."""
        return self.links.get(edge_key(a, b), UNMEASURED)

    def hop_distances(self, source: str) -> dict[str, int]:
        """BFS hop counts from `source`; unreachable nodes are absent."""
        self._check_node(source)
        dist = {source: 0}
        queue = deque([source])
        while queue:
            u = queue.popleft()
            for v in self._adj[u]:
                if v not in dist:
                    dist[v] = dist[u] + 1
                    queue.append(v)
        return dist

    def component_count(self) -> int:
        seen: set[str] = set()
        count = 0
        for n in self.nodes:
            if n not in seen:
                count += 1
                seen.update(self.hop_distances(n))
        return count

    def is_connected(self) -> bool:
        """True for a single component; an empty view counts as connected."""
        return self.component_count() <= 1

    def connected_without(self, a: str, b: str) -> bool:
        """Whether the graph would be connected with edge a-b removed."""
        return self.without_edge(a, b).is_connected()

    def adjacency(self) -> tuple[tuple[str, ...], np.ndarray]:
        """(sorted ids, symmetric 0/1 float matrix) in that id order."""
        ids = self.ids()
        index = {n: i for i, n in enumerate(ids)}
        a = np.zeros((len(ids), len(ids)))
        for e in self.edges:
            u, v = (index[x] for x in e)
            a[u, v] = a[v, u] = 1.0
        return ids, a

    # -- derived views ------------------------------------------------------------

    def with_edge(self, a: str, b: str, link: LinkEstimate | None = None) -> GraphView:
        """A new view with edge a-b added (and its estimate replaced if given)."""
        self._check_node(a)
        self._check_node(b)
        k = edge_key(a, b)
        links = dict(self.links)
        if link is not None:
            links[k] = link
        return GraphView(nodes=self.nodes, edges=self.edges | {k}, links=links)

    def without_edge(self, a: str, b: str) -> GraphView:
        """A new view with edge a-b removed; its estimate is kept (still true)."""
        self._check_node(a)
        self._check_node(b)
        return GraphView(nodes=self.nodes, edges=self.edges - {edge_key(a, b)}, links=self.links)

    def with_link(self, a: str, b: str, link: LinkEstimate) -> GraphView:
        """A new view with the estimate for pair a-b replaced."""
        links = dict(self.links)
        links[edge_key(a, b)] = link
        return GraphView(nodes=self.nodes, edges=self.edges, links=links)

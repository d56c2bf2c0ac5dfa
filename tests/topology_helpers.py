"""Small graphs and link tables shared by the topology tests."""

from __future__ import annotations

import numpy as np

from peer.topology.graph import GraphView, LinkEstimate, edge_key


def names(n: int) -> list[str]:
    return [f"p{i:03d}" for i in range(n)]


def random_view(rng: np.random.Generator, n: int, p: float) -> GraphView:
    ids = names(n)
    edges = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1 :] if rng.random() < p]
    return GraphView.from_edges(ids, edges)


def random_links(rng: np.random.Generator, ids: list[str], measured: float = 1.0) -> dict:
    """Per-pair estimates with bandwidths spread over three decades; some missing."""
    links = {}
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            if rng.random() < measured:
                bw = float(10 ** rng.uniform(6, 9)) if rng.random() < 0.8 else None
                rtt = float(rng.uniform(0.001, 0.05)) if rng.random() < 0.8 else None
                links[edge_key(a, b)] = LinkEstimate(bw, rtt)
    return links

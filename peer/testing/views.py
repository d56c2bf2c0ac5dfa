"""The gossip graph that daemons' partial views form, read off their statuses: for tests, `peer bench scale
--real` and `LocalSwarm.wait_connected` (whether a swarm with partial views has formed)."""

from __future__ import annotations

import statistics


def view_graph(statuses: list[dict | None]) -> dict:
    """The graph the daemons' active views form, and what each holds: from their statuses."""
    sts = [s for s in statuses if s]
    ids = [s["peer_id"] for s in sts]
    active = {s["peer_id"]: set(s["topology"]["views"]["active"]) for s in sts}
    edges = {frozenset((a, b)) for a, bs in active.items() for b in bs if b in active and a in active[b]}
    one_sided = sum(1 for a, bs in active.items() for b in bs if b not in active or a not in active[b])
    degree = {p: len(active[p]) for p in ids}
    seen, stack = set(ids[:1]), list(ids[:1])
    adj: dict[str, set[str]] = {p: set() for p in ids}
    for e in edges:
        a, b = tuple(e)
        adj[a].add(b)
        adj[b].add(a)
    while stack:
        for q in adj[stack.pop()] - seen:
            seen.add(q)
            stack.append(q)
    views = [s["topology"]["views"] for s in sts]
    return {"daemons": len(sts), "edges": len(edges), "edges_one_sided": one_sided,
            "connected": len(ids) > 0 and len(seen) == len(ids), "largest_component": len(seen),
            "degree_min_max": [min(degree.values(), default=0), max(degree.values(), default=0)],
            "mean_degree": round(statistics.mean(degree.values()), 3) if degree else 0.0,
            "state_bytes_max": max((v["state_bytes"] for v in views), default=0),
            "passive_max": max((v["passive"] for v in views), default=0),
            "known_peers_max": max((len(s["peers"]) for s in sts), default=0),
            "sessions_max": max((s["connected"] for s in sts), default=0)}


def settled(statuses: list[dict | None], n: int, min_degree: int, max_degree: int) -> bool:
    """Every daemon answers, the active views form one connected graph of n, degrees within bounds."""
    if len(statuses) != n or not all(statuses):
        return False
    g = view_graph(statuses)
    lo, hi = g["degree_min_max"]
    return g["connected"] and g["edges_one_sided"] == 0 and min_degree <= lo and hi <= max_degree

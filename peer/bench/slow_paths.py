"""Slow paths of a `peer bench gossip --netns` run: shaping them, and telling them apart in the graph.

A slow *host* (every path to it is slow: `Lan.limit`) is one kind; a slow *pair* of otherwise fast hosts
is the other, which a topology can route around. `SlowEdges` answers "is this edge slow?" for the peer
IDs of one run, so the bench can report how much of a graph rides on slow paths and how fast the daemons
measured each kind.
"""

from __future__ import annotations

import statistics
import subprocess
from dataclasses import dataclass

import numpy as np

TC_TIMEOUT = 15.0  # seconds for one tc invocation (as peer.testing.netns allows its own)


@dataclass(frozen=True)
class SlowEdges:
    """Which peer pairs have a slow path: one end is a slow host, or the pair itself is shaped."""

    hosts: frozenset[str] = frozenset()
    pairs: frozenset[frozenset[str]] = frozenset()

    def __call__(self, a: str, b: str) -> bool:
        return a in self.hosts or b in self.hosts or frozenset((a, b)) in self.pairs

    def __bool__(self) -> bool:
        return bool(self.hosts or self.pairs)


def slow_share(ids: list[str], adj: np.ndarray, slow: SlowEdges) -> float | None:
    """The fraction of the graph's edges that are slow (None without edges or without slow paths)."""
    edges = [(i, j) for i in range(len(ids)) for j in range(i + 1, len(ids)) if adj[i, j]]
    if not edges or not slow:
        return None
    return sum(1 for i, j in edges if slow(ids[i], ids[j])) / len(edges)


def shape_pairs(lan, pairs: frozenset[frozenset[int]], mbit: float) -> None:
    """Per-destination htb classes: host i sends to j at `mbit` for every slow pair {i, j} (so both ways).

    `Lan.limit` shapes a whole host; a slow *path* between two otherwise fast hosts needs a class per
    destination, selected by a u32 match on the destination address.
    """
    def tc(ns: str, *argv: str) -> None:
        proc = subprocess.run(["tc", "-n", ns, *argv], capture_output=True, text=True, timeout=TC_TIMEOUT)
        if proc.returncode != 0:
            raise RuntimeError(f"tc -n {ns} {' '.join(argv)}: {proc.stderr.strip()}")

    for i, host in enumerate(lan.hosts):
        peers = sorted(j for p in pairs if i in p for j in p if j != i)
        if not peers:
            continue
        tc(host.name, "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
        tc(host.name, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", "rate", "10gbit")
        for j in peers:
            tc(host.name, "class", "add", "dev", "eth0", "parent", "1:", "classid", f"1:{100 + j}", "htb",
               "rate", f"{max(1, round(mbit * 1000))}kbit")
            tc(host.name, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", "dst", f"{lan.hosts[j].ip}/32", "flowid", f"1:{100 + j}")


def link_summary(daemon, slow_edge: SlowEdges) -> dict:
    """Median measured bandwidth (Mbit/s) of the current edges, split by whether their path is slow."""
    topo = daemon.command("topology", timeout=30)
    fast, slow = [], []
    for link in topo.get("links", []):
        if link.get("bandwidth_bps"):
            (slow if slow_edge(link["a"], link["b"]) else fast).append(link["bandwidth_bps"] / 1e6)
    med = lambda xs: round(statistics.median(xs), 1) if xs else None  # noqa: E731
    return {"measured_edges": len(fast) + len(slow), "fast_edge_mbit_median": med(fast),
            "slow_edge_mbit_median": med(slow), "view_spectral_gap": topo.get("spectral_gap")}

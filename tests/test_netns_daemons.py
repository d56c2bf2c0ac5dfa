"""Daemons on separate (virtual) hosts: Linux network namespaces on one bridge, built by the test.

Each daemon runs inside its own namespace with mDNS on zeroconf's *default* interfaces (as on a real
LAN) and listens on 0.0.0.0. Control sockets are Unix sockets on the shared filesystem, so the test
reads every daemon's status from outside.
"""

from __future__ import annotations

import pytest

from peer.testing.netns import netns_available, our_namespaces, virtual_lan
from peer.testing.swarm import LocalSwarm, swarm_config, unique_swarm

pytestmark = [pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 to create network namespaces")]


def test_three_hosts_discover_each_other_with_default_mdns_interfaces(tmp_path):
    cfg = swarm_config(swarm=unique_swarm("ns"), listen="0.0.0.0:7100", interfaces=[])
    with virtual_lan(3, prefix="ptd") as lan, LocalSwarm(tmp_path) as swarm:
        swarm.start_nodes(3, cfg, hosts=lan.hosts)
        swarm.wait(lambda sts: all(s and s["connected"] == 2 for s in sts), timeout=45,
                   what="3 hosts to discover and connect via mDNS")
        ips = {h.ip for h in lan.hosts}
        for st in swarm.statuses():
            assert {p["source"] for p in st["peers"]} & {"mdns", "inbound"}
            assert {p["address"].rsplit(":", 1)[0] for p in st["peers"]} <= ips
        assert swarm.stop() == [0, 0, 0]
    assert our_namespaces("ptd") == []


def slow_share(lists: dict[str, set[str]], slow: set[str]) -> tuple[float, int]:
    edges = {frozenset((a, b)) for a, nbrs in lists.items() for b in nbrs if b in lists and a in lists[b]}
    return (sum(1 for e in edges if e & slow) / len(edges) if edges else 1.0), len(edges)


def test_rewiring_moves_edges_off_slow_links(tmp_path):
    """6 hosts, 2 of them behind 4 Mbit/s links: after rewiring settles, far fewer edges touch a slow
    host than in a graph that ignores link speed, the graph stays connected, and the spectral gap stays
    above the floor. (How much faster consensus gets is measured by `peer bench gossip --netns`.)"""
    from peer.topology.graph import GraphView
    from peer.topology.mixing import graph_spectral_gap

    n, slow_idx = 6, {4, 5}
    cfg = swarm_config(swarm=unique_swarm("rw"), listen="0.0.0.0:7100", interfaces=[],
                       topology={"kind": "rewired", "target_degree": 3, "min_degree": 1, "max_degree": 4,
                                 "rewire_interval": 1.0, "record_interval": 0.5, "gap_floor": 0.05})
    share_if_blind = 1 - (4 * 3 / 2) / (6 * 5 / 2)  # share of all host pairs that touch a slow host: 0.6
    with virtual_lan(n, prefix="ptr", subnet="10.78.0", rate_mbit={i: 4.0 for i in slow_idx}) as lan, \
            LocalSwarm(tmp_path) as swarm:
        ds = swarm.start_nodes(n, cfg, hosts=lan.hosts)
        swarm.wait(lambda sts: all(s and s["connected"] == n - 1 for s in sts), timeout=60,
                   what="6 namespaced daemons to connect")
        ids = [d.peer_id for d in ds]
        slow = {ids[i] for i in slow_idx}
        found: list = []

        def settled(sts) -> bool:
            lists = {s["peer_id"]: {x["peer_id"] for x in s["topology"]["neighbours"]} for s in sts}
            share, n_edges = slow_share(lists, slow)
            view = GraphView.from_edges(ids, [tuple(e) for e in {frozenset((a, b)) for a, bs in lists.items() for b in bs}])
            found[:] = [share, n_edges, graph_spectral_gap(view), lists]
            return all(sts) and share <= 0.4 and view.is_connected()

        try:
            swarm.wait(lambda sts: all(sts) and settled(sts), timeout=90, interval=1.0,
                       what="rewiring to move edges off the slow hosts")
        except TimeoutError:
            print("final lists:", found[3:] or None, "slow:", slow)
            raise
        share, n_edges, gap = found[:3]
        print(f"slow-edge share {share:.2f} (a speed-blind graph: {share_if_blind:.2f}), {n_edges} edges, gap {gap:.3f}")
        assert gap >= 0.05
    assert our_namespaces("ptr") == []

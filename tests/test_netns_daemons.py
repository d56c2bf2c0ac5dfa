"""Daemons on separate (virtual) hosts: Linux network namespaces on one bridge, built by the test.

Each daemon runs inside its own namespace with mDNS on zeroconf's *default* interfaces (as on a real
LAN) and listens on 0.0.0.0. Control sockets are Unix sockets on the shared filesystem, so the test
reads every daemon's status from outside.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from peer.bench.harness import make_config
from peer.config import to_toml
from peer.control import call
from peer.testing.netns import netns_available, our_namespaces, virtual_lan
from tests.daemons import unique_swarm, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 to create network namespaces")]


def start_in(host, home, cfg_text):
    home.mkdir(parents=True, exist_ok=True)
    (home / "c.toml").write_text(cfg_text)
    log = open(home.parent / f"{home.name}.log", "ab")
    return host.popen([sys.executable, "-m", "peer", "start", "--home", str(home), "--config", str(home / "c.toml")],
                      stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_three_hosts_discover_each_other_with_default_mdns_interfaces(tmp_path):
    cfg = to_toml(make_config(swarm=unique_swarm("ns"), listen="0.0.0.0:7100", interfaces=[]))
    procs, homes = [], [tmp_path / f"host{i}" for i in range(3)]
    try:
        with virtual_lan(3, prefix="ptd") as lan:
            for host, home in zip(lan.hosts, homes):
                procs.append(start_in(host, home, cfg))

            def all_connected():
                sts = [call(h, "status", timeout=3) for h in homes]
                return all(s["connected"] == 2 for s in sts) and sts

            try:
                sts = wait_for(all_connected, timeout=45, what="3 hosts to discover and connect via mDNS")
            except AssertionError:
                for h in homes:
                    print(f"--- {h.name} ---\n" + (h.parent / f"{h.name}.log").read_text()[-3000:])
                raise
            ips = {h.ip for h in lan.hosts}
            for st in sts:
                assert {p["source"] for p in st["peers"]} & {"mdns", "inbound"}
                assert {p["address"].rsplit(":", 1)[0] for p in st["peers"]} <= ips
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                assert p.wait(20) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
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
    cfg = to_toml(make_config(swarm=unique_swarm("rw"), listen="0.0.0.0:7100", interfaces=[],
                              topology={"kind": "rewired", "target_degree": 3, "min_degree": 1, "max_degree": 4,
                                        "rewire_interval": 1.0, "record_interval": 0.5, "gap_floor": 0.05}))
    procs, homes = [], [tmp_path / f"host{i}" for i in range(n)]
    try:
        with virtual_lan(n, prefix="ptr", subnet="10.78.0", rate_mbit={i: 4.0 for i in slow_idx}) as lan:
            for host, home in zip(lan.hosts, homes):
                procs.append(start_in(host, home, cfg))

            def lists():
                out = {}
                for h in homes:
                    st = call(h, "status", timeout=3)
                    out[st["peer_id"]] = {x["peer_id"] for x in st["topology"]["neighbours"]}
                return out

            ids = wait_for(lambda: all(call(h, "status", timeout=3)["connected"] == n - 1 for h in homes)
                           and [call(h, "status", timeout=3)["peer_id"] for h in homes], timeout=60,
                           what="6 namespaced daemons to connect")
            slow = {ids[i] for i in slow_idx}
            share_if_blind = 1 - (4 * 3 / 2) / (6 * 5 / 2)  # share of all host pairs that touch a slow host: 0.6

            def settled():
                share, n_edges = slow_share(lists(), slow)
                view = GraphView.from_edges(ids, [tuple(e) for e in {frozenset((a, b)) for a, bs in lists().items()
                                                                        for b in bs}])
                return share <= 0.4 and view.is_connected() and (share, n_edges, graph_spectral_gap(view))

            try:
                share, n_edges, gap = wait_for(settled, timeout=90, interval=1.0,
                                               what="rewiring to move edges off the slow hosts")
            except AssertionError:
                print("final lists:", lists(), "slow:", slow)
                for h in homes:
                    print(f"--- {h.name} ---\n" + (h.parent / f"{h.name}.log").read_text()[-2000:])
                raise
            print(f"slow-edge share {share:.2f} (a speed-blind graph: {share_if_blind:.2f}), {n_edges} edges, gap {gap:.3f}")
            assert gap >= 0.05
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    assert our_namespaces("ptr") == []

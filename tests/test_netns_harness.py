"""The network-namespace harness itself: reachability, rate limits, cleanup, mDNS inside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peer.testing.netns import (
    NetnsError,
    ProcOutput,
    cleanup_stale,
    measure_tcp_mbit,
    netns_available,
    our_namespaces,
    tc_available,
    virtual_lan,
)

NETNS = netns_available()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not NETNS, reason="needs root, iproute2 (`ip`) and permission to create network namespaces"),
]
needs_tc = pytest.mark.skipif(not tc_available(), reason="needs `tc` (iproute2) for tbf rate limits")
PROBE = Path(__file__).with_name("netns_mdns_probe.py")


def test_hosts_reach_each_other() -> None:
    with virtual_lan(3) as lan:
        assert [h.ip for h in lan.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        for a in lan.hosts:
            for b in lan.hosts:
                if a is not b:
                    assert a.can_reach(b.ip), f"{a.name} cannot reach {b.ip}"
        # Nothing but the LAN is routable from inside: no path out of the namespaces.
        assert not lan.hosts[0].can_reach("192.0.2.1", timeout=1)
        links = lan.hosts[0].run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
        assert "eth0" in links and "MULTICAST" in links


@needs_tc
def test_rate_limit_is_accurate_both_ways_and_adjustable() -> None:
    with virtual_lan(3, rate_mbit={0: 8}) as lan:
        h0, h1, h2 = lan.hosts
        up = measure_tcp_mbit(h0, h1, seconds=1.2, port=5201)
        down = measure_tcp_mbit(h1, h0, seconds=1.2, port=5202)
        free = measure_tcp_mbit(h1, h2, seconds=0.3, port=5203)
        lan.limit(0, 20)
        faster = measure_tcp_mbit(h1, h0, seconds=1.2, port=5204)
    assert 8 * 0.7 <= up <= 8 * 1.3, f"upload {up:.2f} Mbit/s"
    assert 8 * 0.7 <= down <= 8 * 1.3, f"download {down:.2f} Mbit/s"
    assert 20 * 0.7 <= faster <= 20 * 1.3, f"after limit(0, 20): {faster:.2f} Mbit/s"
    assert free > 100, f"unlimited link only {free:.1f} Mbit/s"


def test_cleanup_always_leaves_no_namespaces() -> None:
    with virtual_lan(2) as lan:
        names = lan.namespaces
        assert set(names) <= set(our_namespaces())
        # A process still running at teardown must not keep anything alive.
        sleeper = lan.hosts[0].popen(["sleep", "60"])
    assert sleeper.poll() is not None
    assert our_namespaces() == []

    with pytest.raises(RuntimeError, match="boom"):
        with virtual_lan(2):
            raise RuntimeError("boom")
    assert our_namespaces() == []


def test_stale_namespaces_of_dead_pids_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    stale = f"pt{dead.pid}h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=15)
    try:
        assert stale in cleanup_stale("pt")
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=15).stdout
        assert stale not in names
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True, timeout=15)


def test_nested_lan_needs_its_own_prefix() -> None:
    with virtual_lan(1):
        with pytest.raises(NetnsError, match="another prefix"):
            with virtual_lan(1):
                pass
        with virtual_lan(1, prefix="ptb", subnet="10.77.1") as other:
            assert other.hosts[0].name == f"ptb{os.getpid()}h0"
    assert our_namespaces() == [] and our_namespaces("ptb") == []


def test_mdns_discovery_across_namespaces_with_default_interfaces() -> None:
    """Each namespace runs a probe with zeroconf's *default* interfaces; all find each other."""
    with virtual_lan(3) as lan:
        probes = [
            ProcOutput(h.popen(
                [sys.executable, str(PROBE), "--peer-id", f"ns{h.index}", "--swarm", "lan", "--port", "7000",
                 "--expect", "2", "--timeout", "20"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ), label=f"ns{h.index}")
            for h in lan.hosts
        ]
        try:
            for p in probes:
                assert p.wait_for(lambda line: '"done"' in line, timeout=20) is not None, p.dump()
            for p in probes:
                assert p.proc.stdin is not None
                p.proc.stdin.close()
            for p in probes:
                assert p.proc.wait(timeout=10) == 0, p.dump()
                p.join()
        except BaseException:
            for p in probes:
                print(p.dump(), file=sys.stderr)
            raise
        for i, p in enumerate(probes):
            found = {e["peer_id"]: e["addresses"] for e in p.events() if e["event"] == "found"}
            others = {f"ns{j}": [[lan.hosts[j].ip, 7000]] for j in range(3) if j != i}
            assert found == others, json.dumps(found)

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
from peer.control import ControlError, call
from peer.netns import netns_available, our_namespaces, virtual_lan
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

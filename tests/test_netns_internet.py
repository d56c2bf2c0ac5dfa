"""The internet lab: LANs behind NAT routers and a public segment (peer/testing/internet.py).

One lab serves the whole module (building it takes well under a second, but the file stays fast).
Connections are made by small scripts run inside the namespaces, so what is tested is what a daemon
would see: the NAT'd source address, silence (not a refusal) from a router's WAN side, and a TCP
simultaneous open that works through port-preserving NATs and not through a port-randomizing one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from peer.testing.internet import InternetLab, internet_available, internet_lab
from peer.testing.netns import (
    Host,
    NetnsError,
    ProcOutput,
    cleanup_stale,
    measure_tcp_mbit,
    our_namespaces,
    tc_available,
)

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(not internet_available(),
                       reason="needs root, iproute2 (`ip`), iptables and NAT (conntrack) inside network namespaces"),
]

# Accept `count` connections on `port`; print each peer's (ip, port) as seen after the NATs.
_ACCEPT = r"""
import json, socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(16)
srv.settimeout(10)
print("ready", flush=True)
for _ in range(int(sys.argv[2])):
    conn, addr = srv.accept()
    print(json.dumps({"peer": list(addr)}), flush=True)
    conn.close()
"""

# Dial ip:port from a fixed local port; print how it went (connected / timeout / refused / error).
_DIAL = r"""
import json, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[3])))
s.settimeout(float(sys.argv[4]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
except socket.timeout:
    print(json.dumps({"result": "timeout"}))
except ConnectionRefusedError:
    print(json.dumps({"result": "refused"}))
except OSError as e:
    print(json.dumps({"result": "error", "error": str(e)}))
else:
    print(json.dumps({"result": "connected", "local": list(s.getsockname())}))
"""

# TCP simultaneous open: both sides bind the same port and keep dialing the other's public address.
_SIMOPEN = r"""
import json, socket, sys, time
ip, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[4]
deadline = time.monotonic() + float(sys.argv[3])
tries = 0
while time.monotonic() < deadline:
    tries += 1
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.settimeout(0.5)
    try:
        s.bind(("0.0.0.0", port))
        s.connect((ip, port))
    except OSError:
        s.close()
        time.sleep(0.05)
        continue
    s.settimeout(5)
    s.sendall(name.encode())
    got = s.recv(100).decode()
    print(json.dumps({"result": "connected", "tries": tries, "got": got}))
    sys.exit(0)
print(json.dumps({"result": "timeout", "tries": tries}))
"""


# Join 224.0.0.251 (mDNS's group) on a spare port; print every sender heard within argv[1] seconds.
_MCAST_RECV = r"""
import json, socket, struct, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", 5399))
s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton("224.0.0.251") + socket.inet_aton("0.0.0.0"))
print("ready", flush=True)
heard, end = set(), time.monotonic() + float(sys.argv[1])
while (left := end - time.monotonic()) > 0:
    s.settimeout(left)
    try:
        heard.add(s.recvfrom(100)[1][0])
    except socket.timeout:
        break
print(json.dumps({"heard": sorted(heard)}), flush=True)
"""

_MCAST_SEND = r"""
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(3):
    s.sendto(b"x", ("224.0.0.251", 5399))
    time.sleep(0.1)
"""


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def dial(host: Host, ip: str, port: int, *, local_port: int = 0, timeout: float = 2.0) -> dict:
    proc = host.run([sys.executable, "-c", _DIAL, ip, str(port), str(local_port), str(timeout)],
                    capture_output=True, text=True, timeout=timeout + 10)
    assert proc.returncode == 0, proc.stderr
    return _last_json(proc.stdout)


def acceptor(host: Host, port: int, count: int) -> ProcOutput:
    out = ProcOutput(host.popen([sys.executable, "-c", _ACCEPT, str(port), str(count)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                     label=f"acceptor in {host.name}")
    assert out.wait_for(lambda line: line == "ready", timeout=10) is not None, out.dump()
    return out


def peers_seen(out: ProcOutput, count: int) -> list[tuple[str, int]]:
    assert out.proc.wait(timeout=10) == 0, out.dump()
    out.join()
    seen = [(e["peer"][0], e["peer"][1]) for e in out.events()]
    assert len(seen) == count, out.dump()
    return seen


@pytest.fixture(scope="module")
def lab() -> Iterator[InternetLab]:
    with internet_lab() as built:
        yield built


def test_layout(lab: InternetLab) -> None:
    assert list(lab.sites) == ["public", "lan1", "lan2", "lan3"]
    assert [h.index for h in lab.hosts()] == list(range(7))
    assert [h.ip for h in lab.sites["public"].hosts] == ["10.99.0.11", "10.99.0.12"]
    assert [h.ip for h in lab.sites["lan2"].hosts] == ["192.168.2.2", "192.168.2.3"]
    assert [(s.public_ip, s.nat) for s in lab.sites.values()] == [
        (None, "none"), ("10.99.0.1", "preserving"), ("10.99.0.2", "preserving"), ("10.99.0.3", "random")]
    lan3_host = lab.sites["lan3"].hosts[0]
    assert lab.site_of(lan3_host).name == "lan3" and lab.external_ip(lan3_host) == "10.99.0.3"
    assert set(lab.namespaces) == set(our_namespaces("pti"))


def test_lan_hosts_reach_public_hosts_through_their_nat(lab: InternetLab) -> None:
    """Every LAN host dials a public host; the public host sees the router's WAN address, and the
    local port kept by the port-preserving NATs but replaced by the randomizing one."""
    public = lab.sites["public"].hosts[1]
    lan_hosts = [h for name, s in lab.sites.items() if name != "public" for h in s.hosts]
    out = acceptor(public, 7000, len(lan_hosts))
    local_ports = {}
    for h in lan_hosts:  # distinct local ports: lan1's two hosts on one port would collide at the NAT
        res = dial(h, public.ip, 7000, local_port=41000 + h.index)
        assert res["result"] == "connected", (h.name, res)
        local_ports[h.name] = res["local"][1]
    seen = peers_seen(out, len(lan_hosts))
    for h, (ip, port) in zip(lan_hosts, seen):
        site = lab.site_of(h)
        assert ip == site.public_ip, (h.name, ip)
        if site.nat == "preserving":
            assert port == local_ports[h.name], f"{h.name}: port-preserving NAT changed {local_ports[h.name]} to {port}"
        else:
            assert port != local_ports[h.name], f"{h.name}: --random-fully kept source port {port}"


def test_no_unsolicited_inbound(lab: InternetLab) -> None:
    """A public host dialing a router's WAN address gets silence (a timeout), not a refusal, even
    where a LAN host listens on that port; a LAN's private addresses are not routable from outside."""
    lan_host = lab.sites["lan1"].hosts[0]
    out = acceptor(lan_host, 7001, 1)
    try:
        public = lab.sites["public"].hosts[0]
        assert dial(public, "10.99.0.1", 7001, timeout=1.5)["result"] == "timeout"
        assert dial(public, lan_host.ip, 7001, timeout=1.5)["result"] == "error"  # no route
        # The listener itself is fine: its LAN neighbour reaches it.
        assert dial(lab.sites["lan1"].hosts[1], lan_host.ip, 7001)["result"] == "connected"
        peers_seen(out, 1)
    finally:
        if out.proc.poll() is None:
            out.proc.kill()


def test_simultaneous_open_through_preserving_nats_only(lab: InternetLab) -> None:
    """lan1<->lan2 (both port-preserving) meet by simultaneous open; lan1<->lan3 (random) never do."""
    a, b = lab.sites["lan1"].hosts
    c, r = lab.sites["lan2"].hosts[0], lab.sites["lan3"].hosts[0]
    pairs = [(a, c, 40001), (b, r, 40002)]
    procs = []
    for x, y, port in pairs:
        for me, other in ((x, y), (y, x)):
            cmd = [sys.executable, "-c", _SIMOPEN, lab.external_ip(other), str(port), "3", me.name]
            procs.append(ProcOutput(me.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                                    label=f"simopen {me.name}"))
    for p in procs:
        p.proc.wait(timeout=15)
        p.join()
    res = [p.events()[-1] if p.events() else {"dump": p.dump()} for p in procs]
    assert res[0]["result"] == "connected" and res[0]["got"] == c.name, res
    assert res[1]["result"] == "connected" and res[1]["got"] == a.name, res
    assert res[2]["result"] == "timeout" and res[3]["result"] == "timeout", res


def test_hosts_on_one_lan_talk_directly(lab: InternetLab) -> None:
    """Neighbours on a LAN see each other's private address (no NAT between them)."""
    a, b = lab.sites["lan2"].hosts
    out = acceptor(b, 7002, 1)
    assert dial(a, b.ip, 7002)["result"] == "connected"
    assert peers_seen(out, 1)[0][0] == a.ip


def test_multicast_stays_inside_each_lan(lab: InternetLab) -> None:
    """mDNS's group reaches LAN neighbours only: routers do not forward it, the internet does not carry it."""
    (p0, p1), (a, b), (c, _) = lab.sites["public"].hosts, lab.sites["lan1"].hosts, lab.sites["lan2"].hosts
    receivers = {h.name: ProcOutput(h.popen([sys.executable, "-c", _MCAST_RECV, "1.5"], stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, text=True), label=f"mcast in {h.name}")
                 for h in (p1, b, c)}
    for out in receivers.values():
        assert out.wait_for(lambda line: line == "ready", timeout=10) is not None, out.dump()
    senders = [h.popen([sys.executable, "-c", _MCAST_SEND]) for h in (p0, a)]
    assert [p.wait(timeout=10) for p in senders] == [0, 0]
    heard = {}
    for name, out in receivers.items():
        assert out.proc.wait(timeout=10) == 0, out.dump()
        out.join()
        heard[name] = out.events()[-1]["heard"]
    assert heard == {p1.name: [], b.name: [a.ip], c.name: []}


@pytest.mark.skipif(not tc_available(), reason="needs `tc` (iproute2) for tbf rate limits")
def test_router_limit_caps_a_lans_uplink(lab: InternetLab) -> None:
    sender, receiver = lab.sites["lan2"].hosts[1], lab.sites["public"].hosts[0]
    lab.router_limit("lan2", 8)
    try:
        up = measure_tcp_mbit(sender, receiver, seconds=1.2, port=5301)
    finally:
        lab.router_unlimit("lan2")
    assert 8 * 0.7 <= up <= 8 * 1.3, f"through an 8 Mbit/s router limit: {up:.2f} Mbit/s"


def test_teardown_leaves_nothing() -> None:
    """A second, small lab (another prefix; the module's is still up): processes and namespaces go,
    on a normal exit and on an exception; a nested lab with a live prefix is refused."""
    small = (("lan1", 1, "random"),)
    with internet_lab(public=1, lans=small, prefix="ptj") as lab:
        assert len(our_namespaces("ptj")) == 4
        sleeper = lab.hosts()[1].popen(["sleep", "60"])
        with pytest.raises(NetnsError, match="another prefix"):
            with internet_lab(public=1, lans=small, prefix="ptj"):
                pass
    assert sleeper.poll() is not None
    assert our_namespaces("ptj") == []
    with pytest.raises(RuntimeError, match="boom"):
        with internet_lab(public=1, lans=small, prefix="ptj"):
            raise RuntimeError("boom")
    assert our_namespaces("ptj") == []


def test_stale_lab_namespaces_of_dead_pids_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    stale = [f"ptj{dead.pid}i", f"ptj{dead.pid}r1", f"ptj{dead.pid}h0"]
    for ns in stale:
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=15)
    try:
        assert sorted(cleanup_stale("ptj")) == sorted(stale)
    finally:
        for ns in stale:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=15)
    assert os.getpid() != dead.pid

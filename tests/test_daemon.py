"""Real daemons as subprocesses on 127.0.0.1: discovery, failure detection, rejoin, swarms, bootstrap, shutdown."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from peer.home import Home
from peer.testing.daemon import DaemonProcess
from peer.testing.process import ManagedProcess
from tests.daemons import QUICK_FAILURE_DETECTION, REPO, config_file, unique_swarm, wait_for

pytestmark = pytest.mark.slow


def quick_config(path, **kw):
    """A config whose daemons notice a killed peer in about 2 s, with debug logs."""
    return config_file(path, membership=QUICK_FAILURE_DETECTION, log_level="debug", **kw)


def all_connected(daemons, n):
    return all(len(d.connected_ids()) == n - 1 for d in daemons)


def test_four_daemons_find_each_other_by_mdns_then_survive_kill_and_rejoin(cluster, tmp_path):
    cfg = quick_config(tmp_path / "c.toml", swarm=unique_swarm())
    ds = [cluster.start(f"d{i}", config=cfg) for i in range(4)]
    for d in ds:
        d.wait_ready()
    wait_for(lambda: all_connected(ds, 4), timeout=30, what="4 daemons all connected to each other")
    ids = {d.peer_id for d in ds}
    assert len(ids) == 4

    victim, rest = ds[3], ds[:3]
    victim_id = victim.peer_id
    victim.kill()
    t0 = time.monotonic()

    def marked_dead():
        return all(any(p["peer_id"] == victim_id and p["state"] == "dead" for p in d.status()["peers"]) for d in rest)

    wait_for(marked_dead, timeout=10, what="the killed daemon to be marked dead by the others")
    assert time.monotonic() - t0 < 2.0 + 4.0  # dead_after (2 s) plus slack for polling three daemons under load

    # Restart with the same home: same peer ID, and it rejoins everyone.
    victim.start()
    victim.wait_ready()
    assert victim.peer_id == victim_id
    wait_for(lambda: all_connected(ds, 4), timeout=30, what="the restarted daemon to rejoin all peers")


def test_two_swarms_on_one_host_never_connect(cluster, tmp_path):
    a = quick_config(tmp_path / "a.toml", swarm=unique_swarm("a"))
    b = quick_config(tmp_path / "b.toml", swarm=unique_swarm("b"))
    da = [cluster.start(f"a{i}", config=a) for i in range(2)]
    db = [cluster.start(f"b{i}", config=b) for i in range(2)]
    for d in da + db:
        d.wait_ready()
    wait_for(lambda: all_connected(da, 2) and all_connected(db, 2), timeout=30, what="each swarm to connect internally")
    time.sleep(2.0)  # give a wrong cross-swarm connection a chance to happen
    a_ids = {d.peer_id for d in da}
    b_ids = {d.peer_id for d in db}
    for d in da:
        assert {p["peer_id"] for p in d.status()["peers"]} <= a_ids
    for d in db:
        assert {p["peer_id"] for p in d.status()["peers"]} <= b_ids


@pytest.mark.full_view("peer exchange")
def test_join_only_learns_everyone_by_peer_exchange(cluster, tmp_path):
    cfg = quick_config(tmp_path / "c.toml", swarm=unique_swarm(), mdns=False)
    seed = cluster.start("seed", config=cfg)
    st = seed.wait_ready()
    addr = st["listen"]
    others = [cluster.start(f"j{i}", "--join", addr, config=cfg) for i in range(3)]
    for d in others:
        d.wait_ready()
    ds = [seed] + others
    wait_for(lambda: all_connected(ds, 4), timeout=30, what="join-only daemons to learn each other via peer exchange")
    sources = {p["source"] for p in others[0].status()["peers"]}
    assert "pex" in sources or "inbound" in sources


def test_sigterm_is_graceful_and_leaves_nothing_behind(cluster, tmp_path):
    cfg = quick_config(tmp_path / "c.toml", swarm=unique_swarm())
    a, b = cluster.start("a", config=cfg), cluster.start("b", config=cfg)
    a.wait_ready(), b.wait_ready()
    wait_for(lambda: all_connected([a, b], 2), timeout=30, what="two daemons to connect")
    b_id = b.peer_id
    assert a.stop() == 0
    assert not Home(a.home).control_socket.exists()
    assert Home(a.home).peer_cache.exists()  # peer cache saved on the way out
    # b hears the goodbye (no need to wait for the heartbeat deadline)
    wait_for(lambda: any(p["state"] == "dead" and "goodbye" in p["reason"] for p in b.status()["peers"]),
             timeout=5, what="b to see a's goodbye")
    assert b.stop() == 0
    out = subprocess.run(["pgrep", "-f", f"--home {a.home}"], capture_output=True, text=True)
    assert out.stdout.strip() == ""
    assert b_id


def start_and_fail(name, home, *args, config=None):
    """`peer start` that should refuse to run: its exit code and output."""
    d = DaemonProcess.create(name, home, config=config, args=args, log_path=home.parent / f"{name}.log").start()
    try:
        return d.wait_stopped(60), d.log_tail()
    finally:
        d.kill()


def run_peer(*args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "peer", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, **kw)


def test_bad_config_is_a_one_line_error_naming_file_line_and_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\nswarm = "ok"\n\n[membership]\ndead_after = "soon"\n')
    code, out = start_and_fail("bad", tmp_path / "h", config=bad)
    assert code == 2
    assert f"{bad}:5: [membership] dead_after: expected a number" in out
    bad.write_text("[daemon]\nswram = 'typo'\n")
    r = run_peer("config", "show", "--config", str(bad))
    assert r.returncode == 2 and "unknown key" in r.stderr and ":2:" in r.stderr
    bad.write_text("[daemon\n")
    r = run_peer("config", "show", "--config", str(bad))
    assert r.returncode == 2 and "not valid TOML" in r.stderr


def test_occupied_port_and_missing_daemon_are_clear_errors(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        code, out = start_and_fail("occupied", tmp_path / "h", "--listen", f"127.0.0.1:{port}", "--no-mdns")
        assert code == 2
        assert "cannot listen on 127.0.0.1" in out and "pick another" in out
    finally:
        s.close()
    r = run_peer("status", "--home", str(tmp_path / "nobody"))
    assert r.returncode == 2 and "no daemon is running" in r.stderr


def test_stale_control_socket_is_replaced_and_second_daemon_refused(cluster, tmp_path):
    home = tmp_path / "h"
    home.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(Home(home).control_socket))
    stale.close()  # a socket file with nobody listening, as a crashed daemon leaves it
    cfg = quick_config(tmp_path / "c.toml", swarm=unique_swarm(), mdns=False)
    d = cluster.start("d", config=cfg, home=home)
    d.wait_ready()
    assert oct(os.stat(Home(home).control_socket).st_mode & 0o777) == "0o600"
    assert oct(os.stat(Home(home).identity_file).st_mode & 0o777) == "0o600"
    code, out = start_and_fail("second", home, config=cfg)
    assert code == 2 and "already running" in out


@pytest.mark.full_view("bandwidth probes of neighbours")
def test_status_json_and_rich_output(cluster, tmp_path):
    cfg = quick_config(tmp_path / "c.toml", swarm=unique_swarm())
    a, b = cluster.start("a", config=cfg), cluster.start("b", config=cfg)
    a.wait_ready(), b.wait_ready()
    wait_for(lambda: all_connected([a, b], 2), timeout=30, what="two daemons to connect")
    wait_for(lambda: all(p["rtt_ms"] is not None for p in a.status()["peers"]), timeout=10, what="an RTT sample")
    r = run_peer("status", "--home", str(a.home), "--json")
    assert r.returncode == 0
    import json

    st = json.loads(r.stdout)
    for key in ("peer_id", "swarm", "listen", "uptime_s", "version", "peers"):
        assert key in st
    p = st["peers"][0]
    for key in ("peer_id", "address", "state", "rtt_ms", "bytes_in", "bytes_out", "last_seen_s"):
        assert key in p
    r = run_peer("status", "--home", str(a.home))
    assert r.returncode == 0 and "connected" in r.stdout and st["peer_id"] in r.stdout
    # once the neighbour is probed, its bandwidth shows with the factor it is good to
    wait_for(lambda: any(n.get("bandwidth_bps") for n in a.status()["topology"]["neighbours"]), timeout=30,
             what="a probed neighbour")
    n = next(n for n in a.status()["topology"]["neighbours"] if n.get("bandwidth_bps"))
    assert n["bandwidth_spread"] >= 1.0
    from peer.cli.status_view import _mbit

    assert _mbit(n) == f"{n['bandwidth_bps'] / 1e6:.0f} ×÷{n['bandwidth_spread']:.1f}"
    assert _mbit({"bandwidth_bps": 9.5e8}) == "950"  # an older daemon's status has no spread
    r = run_peer("id", "--home", str(a.home))
    assert r.stdout.strip() == st["peer_id"]


def test_status_views_and_peer_stop(cluster, tmp_path):
    """`peer status --topology`, `peer status --watch` (until stopped) and `peer stop`, as the README shows them."""
    cfg = quick_config(tmp_path / "c.toml", swarm=unique_swarm())
    a, b = cluster.start("a", config=cfg), cluster.start("b", config=cfg)
    wait_for(lambda: all_connected([a, b], 2), timeout=30, what="two daemons to connect")
    a_id, b_id = a.peer_id, b.peer_id
    wait_for(lambda: a.status()["topology"]["degree"] == 1, timeout=30, what="an edge between them")
    r = run_peer("status", "--home", str(a.home), "--topology")
    assert r.returncode == 0 and a_id[:8] in r.stdout and b_id[:8] in r.stdout, r.stdout + r.stderr
    watch = ManagedProcess("watch", [sys.executable, "-m", "peer", "status", "--home", str(a.home), "--watch",
                                     "--interval", "0.2"], log_path=tmp_path / "watch.out", cwd=REPO).start()
    try:
        wait_for(lambda: watch.log_path.read_text(errors="replace").count(a_id) >= 2, timeout=30,
                 what="two refreshes of peer status --watch")
        assert watch.running
    finally:
        watch.stop()
    r = run_peer("stop", "--home", str(a.home))
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr
    assert a.wait_stopped(10) == 0 and not Home(a.home).control_socket.exists()

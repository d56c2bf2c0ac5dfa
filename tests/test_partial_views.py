"""Partial views in real daemons (`[membership] views = "partial"`, issue 30): a swarm on loopback forms one
connected gossip graph with every degree in bounds, and what each daemon holds (sessions, known peers) does
not grow to the full mesh; survivors of frozen peers repair the graph; a digits swarm trains to its target
on the views' edges; a peer sending bad or too many view messages has its session closed, with the reason."""

from __future__ import annotations

import io
import os
import signal
import statistics
import time

import pytest
import trio
from rich.console import Console

from peer.bench.scale_real import partial_config
from peer.testing.views import settled, view_graph
from peer.cli.status_view import render_status
from peer.membership.view_driver import SESSION_IDLE_S, VIEW_BYTES_PER_S
from peer.testing.attacker import attacker_session
from peer.testing.attacks import dropped, my_id, send_raw
from peer.session.transport import SessionClosed
from peer.testing.swarm import write_config
from peer.topology.graph import GraphView
from peer.topology.mixing import graph_spectral_gap
from protocol.schema.views import Entry, NeighbourRequest
from tests.daemons import rank_env, steps_done, unique_swarm, wait_for
from tests.test_training import digits_config, done, trainer

pytestmark = pytest.mark.slow

N = 14  # 13 sessions each would be the full mesh; the views keep about target_degree plus a few
MIN_DEGREE, MAX_DEGREE = 2, 8  # [topology]'s defaults, which these daemons run with


def test_fourteen_daemons_form_a_connected_bounded_graph(cluster, tmp_path):
    swarm = unique_swarm()
    # the gap estimate every 20 s, 60 rounds of 0.25 s: a reading comes while the sessions settle below
    gap = {"membership": {"gap_every": 20.0, "gap_round": 0.25}}
    first = cluster.start("v1", config=partial_config(swarm, [], **gap))
    listen = first.wait_ready()["listen"]
    ds = [first] + [cluster.start(f"v{i}", config=partial_config(swarm, [listen], **gap)) for i in range(2, N + 1)]
    for d in ds:
        d.wait_ready()
    cluster.wait(lambda sts: settled(sts, N, MIN_DEGREE, MAX_DEGREE), timeout=60, interval=0.5,
                 what=f"{N} partial views to form one connected graph, degrees {MIN_DEGREE}..{MAX_DEGREE}")

    # the gossip neighbours the averaging engine reads are the active views
    def neighbours_are_the_views(sts) -> bool:
        return all({n["peer_id"] for n in s["topology"]["neighbours"]} == set(s["topology"]["views"]["active"])
                   for s in sts)
    cluster.wait(neighbours_are_the_views, timeout=10, what="topology neighbours to be the active views")

    # sessions made while joining (the contact had one with everyone) close once idle: what a daemon holds
    # comes down to its neighbours and a few shuffle partners, well below the full mesh's N - 1
    def bounded(sts) -> bool:
        sessions = [s["connected"] for s in sts]
        known = [len(s["peers"]) for s in sts]
        return statistics.mean(sessions) <= MAX_DEGREE and statistics.mean(known) <= MAX_DEGREE
    cluster.wait(bounded, timeout=SESSION_IDLE_S + 30, interval=1.0,
                 what="sessions and known peers to come down to about the active view")
    sts = cluster.statuses()
    g = view_graph(sts)
    assert g["connected"] and MIN_DEGREE <= g["degree_min_max"][0] and g["degree_min_max"][1] <= MAX_DEGREE, g
    assert g["state_bytes_max"] < 16 * 1024, g  # the views' whole state, serialized
    # no full-view machinery ran: no peer exchange flood, no rewiring of the whole graph
    assert all(s["topology"]["moves"] == 0 for s in sts)
    print(f"{N} daemons: {g}, sessions {sorted(s['connected'] for s in sts)}")
    # every daemon estimated the gap with its neighbours (peer/membership/gap_driver.py): a reading the local
    # rewiring reads, near a random regular graph's (one epoch's reading is within about +-15% on large
    # graphs; 14 peers on a loaded host miss some round values, so only a loose band is checked)
    def gap_read(sts) -> bool:
        return all((s["topology"]["views"]["gap"] or {}).get("reading") for s in sts)
    cluster.wait(gap_read, timeout=60, interval=1.0, what="every daemon to read the gap")
    sts = cluster.statuses()
    readings = sorted(s["topology"]["views"]["gap"]["reading"]["gap"] for s in sts)
    ids = [s["peer_id"] for s in sts]
    edges = {tuple(sorted((s["peer_id"], p))) for s in sts for p in s["topology"]["views"]["active"] if p in ids}
    exact = graph_spectral_gap(GraphView.from_edges(ids, sorted(edges)))
    print(f"local gap readings {readings}; the graph's gap {exact:.4f}")
    # 60 rounds read a little above the gap (local_gap's docstring); a reading is of the graph during its
    # epoch, which the views may have changed since, and a loaded host misses round values, which reads low
    # (0.18 against 0.31 in one clean-clone run; 0.232 against 0.242 on a quieter machine)
    assert 0.4 * exact < statistics.median(readings) < 2.0 * exact, (readings, exact)
    console = Console(file=io.StringIO(), width=160)
    console.print(render_status(sts[0]))  # `peer status` shows the partial view and its gap reading
    assert "partial view" in console.file.getvalue() and "local gap" in console.file.getvalue()


@pytest.mark.serial  # 32 daemons take the whole machine for a while
def test_thirty_two_daemons_converge_to_a_connected_graph_with_bounded_records(cluster, tmp_path):
    """The issue's count: 32 daemons joining through one contact form one connected graph of active views,
    degrees in bounds, and what each holds (its views' state, the peers it knows, its sessions) stays near
    its degree, not the swarm's size."""
    n, swarm = 32, unique_swarm()
    first = cluster.start("w1", config=partial_config(swarm, []))
    listen = first.wait_ready()["listen"]
    ds = [first] + [cluster.start(f"w{i}", config=partial_config(swarm, [listen])) for i in range(2, n + 1)]
    for d in ds:
        d.wait_ready(timeout=60)
    took = cluster.wait(lambda sts: settled(sts, n, MIN_DEGREE, MAX_DEGREE), timeout=120, interval=1.0,
                        what=f"{n} partial views to form one connected graph, degrees {MIN_DEGREE}..{MAX_DEGREE}")
    g = view_graph(cluster.statuses())
    print(f"{n} daemons settled in {took:.1f} s: {g}")
    assert g["state_bytes_max"] < 16 * 1024 and g["passive_max"] <= n, g
    # sessions made while joining close once idle; the contact, which met everyone, comes down too
    # (shuffles make a session with a random passive peer every 30 s, so a few more come and go)
    def bounded(sts) -> bool:
        sessions, known = [s["connected"] for s in sts], [len(s["peers"]) for s in sts]
        return (statistics.mean(sessions) <= MAX_DEGREE and statistics.mean(known) <= 2 * MAX_DEGREE
                and max(sessions) <= 2 * MAX_DEGREE)
    try:
        cluster.wait(bounded, timeout=SESSION_IDLE_S + 60, interval=2.0,
                     what="every daemon's sessions and known peers to stay bounded")
    except TimeoutError:
        sts = cluster.statuses()
        raise AssertionError(f"sessions {sorted(s['connected'] for s in sts)}, known peers "
                             f"{sorted(len(s['peers']) for s in sts)}") from None
    sts = cluster.statuses()
    print(f"then sessions {sorted(s['connected'] for s in sts)}, known peers {sorted(len(s['peers']) for s in sts)}")


def test_the_survivors_of_frozen_peers_repair_their_views(cluster, tmp_path):
    """10 daemons, 3 frozen at once (SIGSTOP: no goodbye, no closed socket, and a dial to one hangs in its
    handshake): the 7 left learn it when their sessions go silent (`dead_after`), pair up with their lost
    neighbours' other neighbours, find the frozen ones in their passive views unreachable, and form one
    connected graph again, degrees in bounds."""
    n, killed = 10, 3
    swarm = unique_swarm()
    quick = {"heartbeat_interval": 0.3, "dead_after": 2.0}
    first = cluster.start("k1", config=partial_config(swarm, [], membership=quick))
    listen = first.wait_ready()["listen"]
    ds = [first] + [cluster.start(f"k{i}", config=partial_config(swarm, [listen], membership=quick))
                    for i in range(2, n + 1)]
    for d in ds:
        d.wait_ready()
    cluster.wait(lambda sts: settled(sts, n, MIN_DEGREE, MAX_DEGREE), timeout=60, interval=0.5,
                 what=f"{n} partial views to form one connected graph")
    frozen, live = ds[-killed:], ds[:-killed]  # not the contact: the survivors repair without rejoining through it
    try:
        for d in frozen:
            os.kill(d.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: settled([d.try_status() for d in live], n - killed, MIN_DEGREE, MAX_DEGREE), timeout=45,
                 interval=0.5, what=f"the {n - killed} survivors' views to form one connected graph again")
        print(f"{n - killed} survivors connected again {time.monotonic() - t0:.1f} s after {killed} froze: "
              f"{view_graph([d.try_status() for d in live])}")
    finally:
        for d in frozen:
            d.kill()  # SIGKILL ends a stopped process too


def test_a_restarted_daemon_without_join_finds_the_swarm_through_its_peer_cache(cluster, tmp_path):
    """No --join and no mDNS at the second start: the peers it had sessions with (the peer cache, saved
    when it stopped) are its contacts to join again (view_driver.CACHE_CONTACTS); its old contact is gone."""
    swarm, n = unique_swarm(), 5
    first = cluster.start("c1", config=partial_config(swarm, []))
    listen = first.wait_ready()["listen"]
    ds = [first] + [cluster.start(f"c{i}", config=partial_config(swarm, [listen])) for i in range(2, n + 1)]
    for d in ds:
        d.wait_ready()
    cluster.wait(lambda sts: settled(sts, n, MIN_DEGREE, MAX_DEGREE), timeout=60, interval=0.5,
                 what=f"{n} partial views to form one connected graph")
    leaver = ds[-1]
    assert leaver.stop() == 0
    first.stop()  # the --join contact is gone too
    live = ds[1:-1]
    wait_for(lambda: settled([d.try_status() for d in live], n - 2, MIN_DEGREE, MAX_DEGREE), timeout=45,
             interval=0.5, what="the three left to reconnect")
    cluster.restart(leaver, config=partial_config(swarm, []))
    leaver.wait_ready()
    wait_for(lambda: settled([d.try_status() for d in [*live, leaver]], n - 1, MIN_DEGREE, MAX_DEGREE), timeout=45,
             interval=0.5, what="the restarted daemon to join again through its peer cache")


def test_a_digits_swarm_trains_with_partial_views(cluster, tmp_path):
    """The 4-peer digits swarm of tests/test_training.py, with partial views (and mDNS, its contacts). A job
    waits for peers whose records say they train it, and under partial views records go to neighbours only:
    it waits for its target degree's worth (2), not world - 1 (it would wait out `join_wait`, then train
    alone while the others finish)."""
    cfg = digits_config(tmp_path / "c.toml", membership={"views": "partial"}, min_peers=2)
    ds = [cluster.start(f"t{i}", config=cfg, env=rank_env(i, 4)) for i in range(4)]
    wait_for(lambda: done(ds), timeout=150, interval=0.5, what="4 peers with partial views to finish training",
             progress=lambda: steps_done(ds))
    sts = [d.status() for d in ds]
    accs = [trainer(d)["accuracy"] for d in ds]
    print(f"partial views: held-out accuracy per peer {[round(a * 100, 2) for a in accs]}")
    assert all(trainer(d)["reached_target"] for d in ds), accs
    assert all(s["gossip"]["exchanges"] > 0 for s in sts)
    # the averaging partners were the views' edges: every peer had one at least, and the topology's
    # neighbours (what the averaging engine reads) are the active views
    assert all(s["topology"]["views"]["degree"] >= 1 for s in sts), [s["topology"]["views"] for s in sts]
    wait_for(lambda: all({n["peer_id"] for n in s["topology"]["neighbours"]} == set(s["topology"]["views"]["active"])
                         for s in (d.status() for d in ds)), timeout=10, what="topology neighbours to be the active views")


def _victim(cluster, tmp_path) -> dict:
    swarm = unique_swarm()
    d = cluster.start("victim", config=write_config(tmp_path / "v.toml", partial_config(swarm, [])))
    return d.wait_ready()


def test_a_bad_view_message_closes_its_session_with_the_reason(cluster, tmp_path):
    status = _victim(cluster, tmp_path)

    async def out_of_bounds() -> str:
        async with attacker_session(status) as s:
            me = {"peer_id": my_id(s), "addresses": ["127.0.0.1:9"]}
            # a shuffle of 33 entries: over the 32 a view message may carry (the schema refuses it)
            await send_raw(s, "view_shuffle", {"origin": me, "ttl": 0, "degree": 1,
                                               "entries": [{"peer_id": f"x{i}", "addresses": []} for i in range(33)]})
            with trio.move_on_after(10):
                await s.closed.wait()
            return (await dropped(status, my_id(s)))[1]

    async def not_the_sender() -> str:
        async with attacker_session(status) as s:
            # an edge asked for on another peer's behalf
            await s.send_message(NeighbourRequest(Entry("peer0000000000000042", ("127.0.0.1:9",)), 0, True, None))
            with trio.move_on_after(10):
                await s.closed.wait()
            return (await dropped(status, my_id(s)))[1]

    reason = trio.run(out_of_bounds)
    assert "protocol error: view_shuffle" in reason and "33 entries, more than 32" in reason, reason
    reason = trio.run(not_the_sender)
    assert "bad view message" in reason and "not the sender" in reason, reason


def test_a_peer_flooding_view_messages_is_cut_off(cluster, tmp_path):
    status = _victim(cluster, tmp_path)

    async def attack() -> str:
        async with attacker_session(status) as s:
            flood = NeighbourRequest(Entry(my_id(s), ("127.0.0.1:9",)), 0, True, None)
            t0 = time.monotonic()
            with trio.move_on_after(20):
                while not s.closed.is_set():
                    try:
                        await s.send_message(flood)
                    except SessionClosed:
                        break
            assert time.monotonic() - t0 < 20, "still not cut off after 20 s"
            return (await dropped(status, my_id(s)))[1]

    reason = trio.run(attack)
    assert f"view messages faster than {VIEW_BYTES_PER_S} bytes/s" in reason, reason

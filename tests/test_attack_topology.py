"""Attacks on the topology plane against a real daemon (issue 15): poisoned and oversized topology records,
and edge commits without a proposal. Each runs through the real handshake as a throwaway identity."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import msgpack
import pytest
import trio

from peer.testing.attacker import attacker_session
from protocol import identity as ident
from protocol.frames import KIND_MESSAGE
from protocol.schema import EdgeAccept, EdgeCommit, EdgeDrop, EdgePropose, Ping, Pong, TopologyRecords
from protocol.schema.topology import MAX_RECORD_LINKS, MAX_RECORD_NEIGHBOURS, topology_record_signing_bytes
from tests.daemons import config_file, unique_swarm, wait_for

pytestmark = pytest.mark.slow


def signed_record_body(*, neighbours: list[str], links: list[list], key=None) -> dict:
    """The wire body of a topology record signed by a fresh identity, whatever its fields say (the
    typed record would refuse the bad ones, so the attacker builds the body itself)."""
    key = key or ident.generate_identity()
    pub = ident.public_key_bytes(key)
    ns = SimpleNamespace(peer_id=ident.peer_id_from_public_bytes(pub), public_key=pub, version=1,
                         issued=time.time(), neighbours=neighbours,
                         links=[SimpleNamespace(peer=p, bandwidth_bps=b, rtt_s=r) for p, b, r in links])
    return {"peer_id": ns.peer_id, "public_key": pub, "version": 1, "issued": ns.issued, "neighbours": neighbours,
            "links": [{"peer": p, "bandwidth_bps": b, "rtt_s": r} for p, b, r in links],
            "signature": ident.sign(key, topology_record_signing_bytes(ns))}


async def send_raw(session, type_name: str, body: dict) -> None:
    """One message as raw msgpack (NaN included), sealed by the session like any other frame."""
    await session._send_frame(KIND_MESSAGE, 0, msgpack.packb({"t": type_name, "v": 1, "r": 0, "q": 0, "b": body},
                                                             use_bin_type=True))


async def pump(session, got: list) -> None:
    """Answer the daemon's pings (so it keeps us) and keep every other message it sends."""
    async for env in session.incoming:
        if isinstance(env.message, Ping):
            await session.reply(env, Pong(echo=env.message.sent))
        else:
            got.append(env.message)


def fake_id(i: int) -> str:
    return f"{i:020d}"


def start_victim(cluster, tmp_path):
    d = cluster.start("victim", config=config_file(tmp_path / "c.toml", swarm=unique_swarm(), mdns=False))
    return d, d.wait_ready()


BAD_RECORDS = {
    "bandwidth_bps": lambda: signed_record_body(neighbours=[], links=[[fake_id(1), 0.0, 0.01]]),
    "NaN": lambda: signed_record_body(neighbours=[], links=[[fake_id(1), math.nan, 0.01]]),
    "rtt_s": lambda: signed_record_body(neighbours=[], links=[[fake_id(1), 1e9, -1.0]]),
    "neighbours": lambda: signed_record_body(neighbours=[fake_id(i) for i in range(5000)], links=[]),
    "link reports": lambda: signed_record_body(neighbours=[], links=[[fake_id(i), 1e9, 0.01] for i in range(5000)]),
}


def test_poisoned_topology_records_close_the_sender_and_the_daemon_keeps_serving(cluster, tmp_path):
    d, status = start_victim(cluster, tmp_path)
    for why, make in BAD_RECORDS.items():
        attacker: list[str] = []

        async def attack() -> None:
            async with attacker_session(status) as s:
                attacker.append(ident.peer_id_of(s.cfg.identity))
                await send_raw(s, "topo_records", {"records": [make()]})
                with trio.fail_after(10):  # the daemon closes the session at decode time
                    await s.closed.wait()
        trio.run(attack)
        st = wait_for(lambda: next((st for st in [d.status()] if st["connected"] == 0), None), timeout=10,
                      what="the attacker's session to end at the daemon")
        # `peer status` keeps working: the view never holds a bad record
        assert d.running and st["topology"]["view_nodes"] == 1, why
        reasons = [p["reason"] for p in st["peers"] if p["peer_id"] == attacker[0]]
        assert reasons and "protocol error" in reasons[0] and why in reasons[0], (why, reasons)

    # an honest record from a throwaway identity (its own) still enters the view
    async def honest() -> None:
        async with attacker_session(status) as s:
            await send_raw(s, "topo_records", {"records": [signed_record_body(neighbours=[], links=[], key=s.cfg.identity)]})
            await s.request(Ping(sent=1.0), timeout=10)  # handled after the records (one dispatcher)
            assert not s.closed.is_set()
    trio.run(honest)
    assert d.status()["topology"]["view_nodes"] == 2 and d.running


def test_many_large_records_never_make_a_broadcast_exceed_the_message_limit(cluster, tmp_path):
    """Hundreds of records of the largest allowed size from throwaway identities: the daemon holds a
    bounded view, keeps broadcasting (in messages under the limit) and never exits."""
    d, status = start_victim(cluster, tmp_path)
    n = 700
    big = [signed_record_body(neighbours=[fake_id(j) for j in range(MAX_RECORD_NEIGHBOURS)],
                              links=[[fake_id(j), 1e9, 0.01] for j in range(MAX_RECORD_LINKS)]) for _ in range(n)]
    got: list = []

    async def attack() -> None:
        async with attacker_session(status) as s, trio.open_nursery() as nursery:
            nursery.start_soon(pump, s, got)
            per_msg = 40  # ~12 KiB each: 40 fit under the 1 MiB message limit
            for i in range(0, n, per_msg):
                await send_raw(s, "topo_records", {"records": big[i:i + per_msg]})
            # broadcasts keep coming, each a valid message (our session's limits are the defaults)
            t0 = len(got)
            with trio.fail_after(30):
                while sum(len(m.records) for m in got[t0:] if isinstance(m, TopologyRecords)) < 500:
                    await trio.sleep(0.2)
            assert not s.closed.is_set()
            nursery.cancel_scope.cancel()
    trio.run(attack)
    st = d.status()
    assert d.running and 500 <= st["topology"]["view_nodes"] <= 513  # MAX_VIEW_RECORDS + us
    # every broadcast decoded under the default message limit (else our session would have closed), and
    # one round needs several messages
    assert sum(isinstance(m, TopologyRecords) for m in got) >= 2


def test_an_edge_commit_without_a_proposal_makes_no_neighbour(cluster, tmp_path):
    d, status = start_victim(cluster, tmp_path)
    got: list = []

    async def attack() -> None:
        async with attacker_session(status) as s, trio.open_nursery() as nursery:
            nursery.start_soon(pump, s, got)
            me = ident.peer_id_of(s.cfg.identity)
            await s.send_message(EdgeCommit(proposal=12345))
            with trio.fail_after(10):
                while not any(isinstance(m, EdgeDrop) for m in got):
                    await trio.sleep(0.05)
            st = await trio.to_thread.run_sync(d.status)
            assert me not in [n["peer_id"] for n in st["topology"]["neighbours"]]
            # the real protocol still works: propose, accept, commit with the proposal's id
            reply = await s.request(EdgePropose(degree=0, reason="test"), timeout=10)
            assert isinstance(reply.message, EdgeAccept)
            await s.send_message(EdgeCommit(proposal=reply.reply_to + 1))  # the wrong proposal
            await s.send_message(EdgeCommit(proposal=reply.reply_to))
            await trio.to_thread.run_sync(lambda: wait_for(
                lambda: me in [n["peer_id"] for n in d.status()["topology"]["neighbours"]],
                timeout=10, what="the properly committed edge"))
            nursery.cancel_scope.cancel()
    trio.run(attack)
    assert d.running

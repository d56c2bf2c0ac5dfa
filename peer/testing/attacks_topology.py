"""Topology and membership attacks of issue 15 (registered in `peer.testing.attacks.SCENARIOS`): signed
records bad in one field each (`BAD_RECORDS`), records of origins nobody vouches for, a peer record of
90,000 addresses, and an edge commit without its proposal.

Their own module because the attacker builds the records' wire bodies itself (`signed_record_body`):
the typed records would refuse the bad ones.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from types import SimpleNamespace

import trio

from peer.testing.attacker import attacker_session
from peer.testing.attacks import (CLOSE_WAIT_S, Observed, answer_pings, my_id, scenario, send_raw, until_closed,
                                  victim_status)
from protocol import identity as ident
from protocol.schema import EdgeAccept, EdgeCommit, EdgeDrop, EdgePropose, Ping
from protocol.schema.topology import topology_record_signing_bytes


def fake_id(i: int) -> str:
    return f"{i:020d}"


def signed_record_body(*, neighbours: list[str], links: list[list], key=None, stage: dict | None = None,
                       groups: list[str] | None = None) -> dict:
    """The wire body of a topology record signed by a fresh identity, whatever its fields say (the typed
    record would refuse the bad ones, so the attacker builds the body itself)."""
    key = key or ident.generate_identity()
    pub = ident.public_key_bytes(key)
    ns = SimpleNamespace(peer_id=ident.peer_id_from_public_bytes(pub), public_key=pub, version=1,
                         issued=time.time(), neighbours=neighbours,
                         links=[SimpleNamespace(peer=p, bandwidth_bps=b, rtt_s=r) for p, b, r in links],
                         stage=None if stage is None else _stage_namespace(stage), groups=list(groups or []),
                         training=None)
    body = {"peer_id": ns.peer_id, "public_key": pub, "version": 1, "issued": ns.issued, "neighbours": neighbours,
            "links": [{"peer": p, "bandwidth_bps": b, "rtt_s": r} for p, b, r in links],
            "signature": ident.sign(key, topology_record_signing_bytes(ns))}
    if stage is not None:
        body["stage"] = stage
    if groups:
        body["groups"] = list(groups)
    return body


def _stage_namespace(stage: dict) -> SimpleNamespace:
    """The attribute view of a stage announcement that the signing bytes read (optional fields defaulted)."""
    full = {"step": 0, "moving_to": -1, "moved_from": -1, "copies": [], "profiles": [], "memory_mib": 0,
            "stage_room_mib": 0, "memory_used_mib": 0, "addresses": [], **stage}
    full["copies"] = [SimpleNamespace(**c) for c in full["copies"]]
    full["profiles"] = [SimpleNamespace(**p) for p in full["profiles"]]
    return SimpleNamespace(**full)


BAD_RECORDS = {  # the field the victim must name in its reason -> a record bad in that field
    "bandwidth_bps": lambda: signed_record_body(neighbours=[], links=[[fake_id(1), 0.0, 0.01]]),
    "NaN": lambda: signed_record_body(neighbours=[], links=[[fake_id(1), math.nan, 0.01]]),
    "rtt_s": lambda: signed_record_body(neighbours=[], links=[[fake_id(1), 1e9, -1.0]]),
    "neighbours": lambda: signed_record_body(neighbours=[fake_id(i) for i in range(5000)], links=[]),
    "link reports": lambda: signed_record_body(neighbours=[], links=[[fake_id(i), 1e9, 0.01] for i in range(5000)]),
    # a stage announcement claiming an impossible throughput, to draw every microbatch to its author
    "samples_per_s": lambda: signed_record_body(neighbours=[], links=[], stage={
        "pipeline": "p", "stage": 0, "stages": 2, "samples_per_s": 1e12, "queue": 0, "cuts": [1]}),
    "cuts": lambda: signed_record_body(neighbours=[], links=[], stage={
        "pipeline": "p", "stage": 0, "stages": 3, "samples_per_s": 1.0, "queue": 0, "cuts": [5, 2]}),
    # a move to a stage the pipeline does not have, or more stage copies than a record may list
    "moving_to": lambda: signed_record_body(neighbours=[], links=[], stage={
        "pipeline": "p", "stage": 0, "stages": 2, "samples_per_s": 1.0, "queue": 0, "cuts": [1], "moving_to": 7}),
    "copies": lambda: signed_record_body(neighbours=[], links=[], stage={
        "pipeline": "p", "stage": 0, "stages": 2, "samples_per_s": 1.0, "queue": 0, "cuts": [1],
        "copies": [{"stage": 1, "step": i} for i in range(50)]}),
    # addresses for drivers to dial (partial views): more than an entry carries, or one no dialer could parse
    "addresses": lambda: signed_record_body(neighbours=[], links=[], stage={
        "pipeline": "p", "stage": 0, "stages": 2, "samples_per_s": 1.0, "queue": 0, "cuts": [1],
        "addresses": [f"127.0.0.1:{1000 + i}" for i in range(50)]}),
    "neither host:port": lambda: signed_record_body(neighbours=[], links=[], stage={
        "pipeline": "p", "stage": 0, "stages": 2, "samples_per_s": 1.0, "queue": 0, "cuts": [1],
        "addresses": ["127.0.0.1:4000/../../etc"]}),
    # more averaging groups than a record may list, or a name past the limit (each would make every
    # receiver hold and search it)
    "groups": lambda: signed_record_body(neighbours=[], links=[], groups=[f"g{i}" for i in range(100)]),
    "group name": lambda: signed_record_body(neighbours=[], links=[], groups=["x" * 5000]),
}


async def bad_topology_record(status: dict, why: str) -> Observed:
    """One record bad in `why` (a key of BAD_RECORDS): the victim must close the session at decode time."""
    async with attacker_session(status) as s:
        obs = Observed(attacker=my_id(s))
        t0 = trio.current_time()
        await send_raw(s, "topo_records", {"records": [BAD_RECORDS[why]()]})
        return await until_closed(status, s, t0, obs)


@scenario("bad_topology_records", "drop", "signed topology records with zero bandwidth, NaN, negative RTT, 5000 entries")
async def bad_topology_records(status: dict) -> Observed:
    each = {why: await bad_topology_record(status, why) for why in BAD_RECORDS}
    closed = [o.closed_after_s for o in each.values()]
    named = all(why in o.reason for why, o in each.items())
    return Observed(attacker=list(each.values())[-1].attacker, ok=all(o.ok for o in each.values()) and named,
                    closed_after_s=None if None in closed else max(closed),
                    reason="; ".join(o.reason for o in each.values()),
                    facts={why: asdict(o) for why, o in each.items()})


@scenario("unknown_origin_records", "refuse",
          "validly signed topology records of 300 throwaway origins from a peer that is no neighbour")
async def unknown_origin_records(status: dict) -> Observed:
    """None may enter the view (only records of peers the victim met, or relayed by a neighbour, do); the
    attacker's own record may, and its session stays open (honest flooding relays such records too)."""
    n = 300
    async with attacker_session(status) as s, trio.open_nursery() as nursery:
        nursery.start_soon(answer_pings, s)
        obs = Observed(attacker=my_id(s))
        before = (await victim_status(status))["topology"]
        bodies = [signed_record_body(neighbours=[], links=[]) for _ in range(n)]
        await send_raw(s, "topo_records", {"records": bodies[:150]})
        await send_raw(s, "topo_records", {"records": bodies[150:]
                                           + [signed_record_body(neighbours=[], links=[], key=s.cfg.identity)]})
        await s.request(Ping(sent=1.0), timeout=10)  # handled after the records (one dispatcher)
        after = (await victim_status(status))["topology"]
        obs.facts = {"view_nodes_before": before["view_nodes"], "view_nodes_after": after["view_nodes"],
                     "refused": after["records_unvouched"] - before["records_unvouched"],
                     "session_kept": not s.closed.is_set()}
        # at most one node more: the attacker itself (a session peer, its own record)
        obs.ok = (after["view_nodes"] <= before["view_nodes"] + 1 and obs.facts["refused"] >= n
                  and obs.facts["session_kept"])
        obs.reason = f"{obs.facts['refused']} records refused"
        nursery.cancel_scope.cancel()
    return obs


@scenario("oversized_peer_record", "drop", "a peer record listing 90,000 addresses")
async def oversized_peer_record(status: dict) -> Observed:
    body = {"peer_id": "p" * 20, "public_key": b"k" * 32, "swarm": status["swarm"],
            "addresses": [f"{i}:1" for i in range(90_000)], "issued": time.time(), "expires": time.time() + 60,
            "signature": b"s" * 64}
    async with attacker_session(status) as s:
        obs = Observed(attacker=my_id(s))
        t0 = trio.current_time()
        await send_raw(s, "pex", {"peers": [body]})
        return await until_closed(status, s, t0, obs)


@scenario("edge_commit_without_proposal", "refuse", "an edge commit naming no proposal of the victim's")
async def edge_commit_without_proposal(status: dict) -> Observed:
    got: list = []
    async with attacker_session(status) as s, trio.open_nursery() as nursery:
        nursery.start_soon(answer_pings, s, got)
        me = my_id(s)
        obs = Observed(attacker=me)
        await s.send_message(EdgeCommit(proposal=12345))
        with trio.move_on_after(CLOSE_WAIT_S):
            while not any(isinstance(m, EdgeDrop) for m in got):
                await trio.sleep(0.05)
        neighbours = lambda st: [n["peer_id"] for n in st["topology"]["neighbours"]]  # noqa: E731
        obs.facts["edge_drop"] = any(isinstance(m, EdgeDrop) for m in got)
        obs.facts["neighbour_after_bare_commit"] = me in neighbours(await victim_status(status))
        # the real protocol still works: propose, accept, commit with the proposal's id (after a wrong one)
        reply = await s.request(EdgePropose(degree=0, reason="test"), timeout=10)
        obs.facts["proposal_accepted"] = isinstance(reply.message, EdgeAccept)
        await s.send_message(EdgeCommit(proposal=reply.reply_to + 1))
        await s.send_message(EdgeCommit(proposal=reply.reply_to))
        obs.facts["neighbour_after_proper_commit"] = False
        with trio.move_on_after(10):
            while not obs.facts["neighbour_after_proper_commit"]:
                obs.facts["neighbour_after_proper_commit"] = me in neighbours(await victim_status(status))
                await trio.sleep(0.1)
        obs.facts["session_kept"] = not s.closed.is_set()
        obs.ok = (obs.facts["edge_drop"] and not obs.facts["neighbour_after_bare_commit"]
                  and obs.facts["neighbour_after_proper_commit"])
        obs.reason = "refused with an edge drop" if obs.facts["edge_drop"] else "no edge drop"
        nursery.cancel_scope.cancel()
    return obs

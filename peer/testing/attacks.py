"""The attacks of issue 15 as library code: one scenario per attack class, shared by the attack tests
(tests/test_attack_*.py) and `peer bench hostile`.

Each scenario takes the victim's `peer status --json` and runs its attack through `attacker_session` as a
fresh identity over the real protocol; it returns what it observed (`Observed`): whether and when the
victim closed the attacker's session and why, what it refused, and the facts a test asserts on. Scenarios
never assert: a test judges the facts, the bench judges `Observed.ok` plus its own bounds (memory, the
honest peer). The victim's status is polled through its control socket (`status["home"]`), so a scenario
needs nothing but the status and runs as well in a separate attacker process:

    python -m peer.testing.attacks SCENARIO --status-json '{"listen": ..., ...}'

prints the `Observed` as one JSON object. Adding a class is one `@scenario(...)` function below.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Awaitable, Callable

import msgpack
import numpy as np
import trio

from peer.averaging.bans import BAN_AFTER
from peer.averaging.bounds import COMMIT_SLACK_S, hold_seconds
from peer.config import Config
from peer.control import call
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.streams import PARKED_HEADER_SECONDS
from peer.testing.attacker import attacker_session
from peer.testing.swarm import swarm_config
from protocol import identity as ident
from protocol.frames import KIND_MESSAGE
from protocol.limits import GiB
from protocol.schema import EdgeAccept, EdgeCommit, EdgeDrop, EdgePropose, Ping, Pong, TensorHeader
from protocol.schema.gossip import AverageAccept, AverageCommit, AverageOffer, AverageReject, ParamsRequest, TensorSpec
from protocol.schema.pipeline import StageStateRequest
from protocol.schema.session import ErrorReply
from protocol.schema.topology import topology_record_signing_bytes

# ---- the victim the averaging classes need -----------------------------------------------------------

SIZE = 4096  # float32s of the victim's consensus vector: 16 KiB a side, so an exchange is quick
SPECS = [TensorSpec(name="x", dtype="float32", shape=[SIZE])]
EXCHANGE_TIMEOUT = 3.0  # the victim's hold: min(this, hold_seconds(16 KiB)) + COMMIT_SLACK_S
LOAD_MARGIN_S = 5.0  # a loaded 2-core machine's scheduling delay on top of the victim's own deadline
CLOSE_WAIT_S = 10.0  # a session the victim closes at decode time is closed well within this
HOLD_S = hold_seconds(SIZE * 4, EXCHANGE_TIMEOUT) + COMMIT_SLACK_S  # how long the victim holds an accepted offer


def averaging_configs(swarm: str, victim_listen: str | None = None, *, membership: dict | None = None) -> Config:
    """The victim's config (consensus vector served, never initiating) or, with `victim_listen`, the honest
    peer's (joins the victim and averages with it every 50 ms)."""
    options = {"size": SIZE, "rounds": 0, "world": 2, "track_error": False}
    options.update({"initiate": False} if victim_listen is None else {"interval": 0.05})
    cfg = swarm_config(swarm=swarm, mdns=False, trainer="trainers.consensus", options=options,
                       gossip={"exchange_timeout": EXCHANGE_TIMEOUT}, membership=membership,
                       join=[victim_listen] if victim_listen else None)
    # the victim relays (as a public daemon would), so the relay's caps are attacked too
    return cfg.replace(nat={"reachability": "public"}) if victim_listen is None else cfg


# ---- what a scenario saw -------------------------------------------------------------------------------

@dataclass
class Observed:
    """What one attack observed. `ok`: the victim did what the class requires (closed, refused, banned)."""

    attacker: str = ""  # the attacker's peer id (the last one, where a scenario uses several)
    ok: bool = False
    closed_after_s: float | None = None  # from the offending message to the victim closing our session
    banned_after_s: float | None = None  # from the first offending message to the victim banning us
    reason: str = ""  # the victim's reason (its status entry for us, or its reply)
    facts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    """One attack class. `outcome`: what the victim must do — "drop" the session (within the bound the
    bench checks), "refuse" the request and keep the session, "ban" the peer, or stay "bounded" in memory."""

    name: str
    outcome: str
    doc: str
    run: Callable[[dict], Awaitable[Observed]]
    averaging: bool = False  # needs the victim of `averaging_configs` (a consensus vector, a neighbour to be)


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, outcome: str, doc: str, *, averaging: bool = False):
    """Register the decorated `async def f(status) -> Observed` as attack class `name`."""
    def register(fn: Callable[[dict], Awaitable[Observed]]):
        SCENARIOS[name] = Scenario(name, outcome, doc, fn, averaging)
        return fn
    return register


# ---- helpers -------------------------------------------------------------------------------------------

def my_id(session) -> str:
    return ident.peer_id_of(session.cfg.identity)


async def victim_status(status: dict) -> dict:
    """The victim's status now, through its control socket."""
    return await trio.to_thread.run_sync(lambda: call(Path(status["home"]), "status"))


async def dropped(status: dict, peer: str, wait: float = 5.0) -> tuple[float | None, str]:
    """Seconds until the victim lists `peer` as no longer connected, with its reason; (None, '') if not
    within `wait` (by default long enough for a session it has just closed to show in its status)."""
    t0 = trio.current_time()
    with trio.move_on_after(wait):
        while True:
            for p in (await victim_status(status))["peers"]:
                if p["peer_id"] == peer and p["state"] != "connected" and p["reason"]:
                    return trio.current_time() - t0, p["reason"]
            await trio.sleep(0.1)
    return None, ""


async def send_raw(session, type_name: str, body: dict) -> None:
    """One message as raw msgpack (NaN included), sealed by the session like any other frame."""
    await session._send_frame(KIND_MESSAGE, 0, msgpack.packb({"t": type_name, "v": 1, "r": 0, "q": 0, "b": body},
                                                             use_bin_type=True))


async def answer_pings(session, got: list | None = None) -> None:
    """What a live peer must do for the victim to keep the session: answer heartbeats; keep the rest in `got`."""
    async for env in session.incoming:
        if isinstance(env.message, Ping):
            await session.reply(env, Pong(echo=env.message.sent))
        elif got is not None:
            got.append(env.message)


async def until_closed(status: dict, session, t0: float, obs: Observed, wait: float = CLOSE_WAIT_S) -> Observed:
    """Wait (at most `wait` s) for the victim to close `session`; fill in when and why."""
    with trio.move_on_after(wait):
        await session.closed.wait()
    if session.closed.is_set():
        obs.closed_after_s = trio.current_time() - t0
        obs.reason = (await dropped(status, obs.attacker))[1]
        obs.ok = True
    else:
        obs.reason = f"session still open after {wait:.0f} s"
    return obs


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
                         stage=None if stage is None else _stage_namespace(stage), groups=list(groups or []))
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
    full = {"step": 0, "moving_to": -1, "moved_from": -1, "copies": [], **stage}
    full["copies"] = [SimpleNamespace(**c) for c in full["copies"]]
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
    # more averaging groups than a record may list, or a name past the limit (each would make every
    # receiver hold and search it)
    "groups": lambda: signed_record_body(neighbours=[], links=[], groups=[f"g{i}" for i in range(100)]),
    "group name": lambda: signed_record_body(neighbours=[], links=[], groups=["x" * 5000]),
}


# ---- streams -------------------------------------------------------------------------------------------

@scenario("huge_tensor_header", "drop", "an unsolicited tensor header announcing 4 GiB")
async def huge_tensor_header(status: dict) -> Observed:
    async with attacker_session(status) as s:
        obs = Observed(attacker=my_id(s))
        t0 = trio.current_time()
        await s.send_message(TensorHeader(stream=1, name="w", dtype="float32", shape=[1 << 30], codec="raw",
                                          nbytes=4 * GiB))
        async with trio.open_nursery() as n:
            n.start_soon(answer_pings, s)  # a live peer in every other way: the header alone must get us dropped
            await until_closed(status, s, t0, obs, PARKED_HEADER_SECONDS + 15)
            n.cancel_scope.cancel()
    return obs


@scenario("control_flood", "bounded", "2000 control messages of ~60 KB each (offers naming 50 fat specs)")
async def control_flood(status: dict) -> Observed:
    fat = AverageOffer(group="g", tensors=[TensorSpec("x" * 1000 + str(i), "float32", [1]) for i in range(50)],
                       streams=[], max_weight=0.1, rule="pairwise", codec="raw", step=0)
    sent = 0
    async with attacker_session(status) as s:
        obs = Observed(attacker=my_id(s))
        with trio.move_on_after(10):
            for _ in range(2000):  # ~120 MB decoded if all were held
                await s.send_message(fat)
                sent += 1
        obs.facts = {"sent": sent, "closed": s.closed.is_set()}
    obs.ok = True  # the bound is the victim's memory, which the caller measures
    return obs


# ---- topology and membership -----------------------------------------------------------------------------

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


# ---- averaging -------------------------------------------------------------------------------------------

async def become_neighbour(session, status: dict) -> bool:
    reply = await session.request(EdgePropose(degree=0), timeout=10)
    if not isinstance(reply.message, EdgeAccept):
        return False
    await session.send_message(EdgeCommit(proposal=reply.reply_to))
    with trio.move_on_after(20):
        while not any(n["peer_id"] == my_id(session) for n in (await victim_status(status))["topology"]["neighbours"]):
            await trio.sleep(0.2)
        return True
    return False


def offer(session, **kw) -> tuple[AverageOffer, OutgoingGroup]:
    ours = OutgoingGroup(session, SPECS)
    return AverageOffer(group="vector", tensors=SPECS, streams=ours.streams, max_weight=0.5, rule="metropolis",
                        **kw), ours


def _describe(message) -> str:
    said = " ".join(str(x) for x in (getattr(message, "code", ""), getattr(message, "reason", "")) if x)
    return f"{type(message).__name__}: {said}"


@scenario("params_as_non_neighbour", "refuse", "a parameter download and an offer from a peer that is no neighbour",
          averaging=True)
async def params_as_non_neighbour(status: dict) -> Observed:
    async with attacker_session(status) as s, trio.open_nursery() as n:
        n.start_soon(answer_pings, s)
        obs = Observed(attacker=my_id(s))
        reply = await s.request(ParamsRequest(group="vector"), timeout=10)
        rejected = await s.request(offer(s)[0], timeout=10)
        obs.facts = {"params_reply": _describe(reply.message), "offer_reply": _describe(rejected.message),
                     "session_kept": not s.closed.is_set()}
        obs.ok = (isinstance(reply.message, ErrorReply) and reply.message.code == "not_neighbour"
                  and isinstance(rejected.message, AverageReject) and "neighbour" in rejected.message.reason)
        obs.reason = obs.facts["params_reply"]
        n.cancel_scope.cancel()
    return obs


@scenario("stage_state_as_non_member", "refuse",
          "a stage's state (weights, optimizer) asked for by a peer that serves no stage of the pipeline")
async def stage_state_as_non_member(status: dict) -> Observed:
    pl = status.get("pipeline") or {}
    async with attacker_session(status) as s, trio.open_nursery() as n:
        n.start_soon(answer_pings, s)
        obs = Observed(attacker=my_id(s))
        req = StageStateRequest(pl.get("pipeline") or "shakespeare", pl.get("my_stage") or 0, pl.get("cuts") or [])
        reply = await s.request(req, timeout=10)
        obs.facts = {"state_reply": _describe(reply.message), "session_kept": not s.closed.is_set()}
        obs.ok = isinstance(reply.message, ErrorReply) and reply.message.code == "not_a_member"
        obs.reason = obs.facts["state_reply"]
        n.cancel_scope.cancel()
    return obs


@scenario("lapsing_neighbour", "ban", f"a neighbour that lets {BAN_AFTER} accepted exchanges lapse", averaging=True)
async def lapsing_neighbour(status: dict) -> Observed:
    async with attacker_session(status) as s, trio.open_nursery() as n:
        n.start_soon(answer_pings, s)
        me = my_id(s)
        obs = Observed(attacker=me, facts={"held_s": [], "hold_bound_s": HOLD_S + LOAD_MARGIN_S})
        if not await become_neighbour(s, status):
            obs.reason = "could not become a neighbour"
            n.cancel_scope.cancel()
            return obs
        first = None
        for i in range(BAN_AFTER):
            msg, _ours = offer(s)  # our tensor never follows, and we never commit
            reply = await s.request(msg, timeout=10)
            if not isinstance(reply.message, AverageAccept):
                obs.reason = f"offer {i} not accepted: {_describe(reply.message)}"
                break
            # the victim's snapshot may come (we take it off the wire unread); ours never does
            IncomingGroup(s, reply.message.streams, SPECS).discard()
            t0 = trio.current_time()
            first = t0 if first is None else first
            with trio.move_on_after(HOLD_S + LOAD_MARGIN_S):
                while (await victim_status(status))["gossip"]["lapsed"].get(me, 0) <= i:
                    await trio.sleep(0.2)
            obs.facts["held_s"].append(round(trio.current_time() - t0, 3))
        st = await victim_status(status)
        obs.facts["bans"] = st["bans"]
        mine = [b for b in st["bans"] if b["peer"] == me]
        if mine and first is not None:
            obs.banned_after_s = trio.current_time() - first
            obs.reason = mine[0]["reason"]
        rejected = await s.request(offer(s)[0], timeout=10)
        refused = await s.request(ParamsRequest(group="vector"), timeout=10)
        obs.facts["offer_after_ban"] = _describe(rejected.message)
        obs.facts["params_after_ban"] = _describe(refused.message)
        obs.ok = (bool(mine) and "lapse" in obs.reason and len(obs.facts["held_s"]) == BAN_AFTER
                  and all(t <= HOLD_S + LOAD_MARGIN_S for t in obs.facts["held_s"])
                  and isinstance(rejected.message, AverageReject) and "banned" in rejected.message.reason
                  and isinstance(refused.message, ErrorReply) and refused.message.code == "banned")
        n.cancel_scope.cancel()
    return obs


async def _exchange(s, status: dict, values: np.ndarray) -> np.ndarray:
    """One whole exchange as the initiator: send `values`, get the victim's snapshot, commit, and wait until
    the victim has applied it (its clip counted), so the next offer is not refused as in flight."""
    clipped = (await victim_status(status))["gossip"]["clipped"].get(my_id(s), 0)
    msg, ours = offer(s)
    got: list = []

    async def ask() -> None:
        got.append(await s.request(msg, timeout=10))
    async with trio.open_nursery() as n:
        n.start_soon(ask)
        n.start_soon(lambda: ours.send([values]))
    reply = got[0]
    if not isinstance(reply.message, AverageAccept):
        raise RuntimeError(f"offer not accepted: {_describe(reply.message)}")
    theirs = await IncomingGroup(s, reply.message.streams, SPECS).receive(timeout=10)
    await s.send_message(AverageCommit(exchange=reply.reply_to))
    with trio.fail_after(10):
        while (await victim_status(status))["gossip"]["clipped"].get(my_id(s), 0) <= clipped:
            await trio.sleep(0.2)
    return np.asarray(theirs[0])


@scenario("poisoning_neighbour", "ban", "a neighbour committing -1000x the victim's model, then 3e38 everywhere",
          averaging=True)
async def poisoning_neighbour(status: dict) -> Observed:
    norms: list[float] = []
    async with attacker_session(status) as s, trio.open_nursery() as n:
        n.start_soon(answer_pings, s)
        me = my_id(s)
        obs = Observed(attacker=me, facts={"norms": norms})
        if not await become_neighbour(s, status):
            obs.reason = "could not become a neighbour"
            n.cancel_scope.cancel()
            return obs
        # the victim's snapshot each exchange brings shows what the one before did to it
        t0 = trio.current_time()
        start = await _exchange(s, status, np.zeros(SIZE, np.float32))  # learn its values (nothing applied)
        norms.append(float(np.linalg.norm(start)))
        norms.append(float(np.linalg.norm(await _exchange(s, status, -1000.0 * start))))  # clipped
        norms.append(float(np.linalg.norm(await _exchange(s, status, np.full(SIZE, 3e38, np.float32)))))
        st = await victim_status(status)
        obs.facts.update(clipped=st["gossip"]["clipped"].get(me), bans=st["bans"])
        mine = [b for b in st["bans"] if b["peer"] == me]
        if mine:
            obs.banned_after_s, obs.reason = trio.current_time() - t0, mine[0]["reason"]
        # a clipped update moves the victim by at most w * max_update_ratio (8) * its norm, w <= 1/3 with 2
        # neighbours (metropolis); unclipped, -1000x would have made it 334x
        obs.facts["norm_bound"] = (1 + 8 / 3) * max(norms[:2]) * 1.01
        obs.ok = (bool(mine) and obs.facts["clipped"] == BAN_AFTER and bool(np.all(np.isfinite(norms)))
                  and norms[2] <= obs.facts["norm_bound"])
        n.cancel_scope.cancel()
    return obs


# ---- classes in modules of their own (importing one registers its scenarios) --------------------------

importlib.import_module("peer.testing.attacks_liveness")
importlib.import_module("peer.testing.attacks_nat")


# ---- the attacker process --------------------------------------------------------------------------------

def run_scenario(name: str, status: dict) -> Observed:
    """Run attack class `name` against the victim whose status is `status` (blocking)."""
    return trio.run(SCENARIOS[name].run, status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peer.testing.attacks", description=__doc__.split("\n")[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("--status-json", required=True, help="the victim's `peer status --json`")
    args = p.parse_args(argv)
    obs = run_scenario(args.scenario, json.loads(args.status_json))
    print(json.dumps(asdict(obs), default=str))
    return 0


if __name__ == "__main__":
    # Run as a script this file is `__main__`, a second copy of the module; modules of more classes register
    # theirs with `peer.testing.attacks`, so its main (and registry) is the one to use.
    from peer.testing.attacks import main as canonical_main

    sys.exit(canonical_main())

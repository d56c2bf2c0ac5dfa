"""Attacks on averaging against a real daemon (issue 15, items 4 and 7), through the real protocol.

A victim daemon serves exchanges (consensus trainer, not initiating) to an honest daemon that keeps
averaging with it; a fresh identity (`attacker_session`) then asks for the model without being a
neighbour, becomes a neighbour through the topology handshake and lets accepted exchanges lapse, or
commits poisoned values. Each test checks the bound: what is refused and why, how long the weight is
held, that the attacker ends up banned (in `peer status`), that the victim's values stay bounded, and that
the honest peer's exchanges with the victim keep succeeding.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from peer.averaging.bans import BAN_AFTER
from peer.averaging.bounds import COMMIT_SLACK_S, hold_seconds
from peer.control import call
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.testing.attacker import attacker_session
from protocol.schema import Ping, Pong
from protocol.schema.gossip import (AverageAccept, AverageCommit, AverageOffer, AverageReject, ParamsReply,
                                    ParamsRequest, TensorSpec)
from protocol.schema.session import ErrorReply
from protocol.schema.topology import EdgeAccept, EdgeCommit, EdgePropose
from tests.daemons import config_file, rank_env, unique_swarm, wait_for

pytestmark = pytest.mark.slow

SIZE = 4096  # float32s: 16 KiB a side
SPECS = [TensorSpec(name="x", dtype="float32", shape=[SIZE])]
EXCHANGE_TIMEOUT = 3.0  # the victim's hold: min(this, hold_seconds(16 KiB)) + COMMIT_SLACK_S
LOAD_MARGIN_S = 5.0  # a loaded 2-core machine's scheduling delay on top of the victim's own deadline


def start_victim_and_honest(cluster, tmp_path):
    common = dict(swarm=unique_swarm(), mdns=False, trainer="trainers.consensus",
                  gossip={"exchange_timeout": EXCHANGE_TIMEOUT})
    options = {"size": SIZE, "rounds": 0, "world": 2, "track_error": False}
    victim = cluster.start("victim", config=config_file(tmp_path / "v.toml", **common,
                                                         options={**options, "initiate": False}), env=rank_env(0, 2))
    vs = victim.wait_ready()
    honest = cluster.start("honest", config=config_file(tmp_path / "h.toml", **common, join=[vs["listen"]],
                                                         options={**options, "interval": 0.05}), env=rank_env(1, 2))
    honest.wait_ready()
    wait_for(lambda: served(victim) > 0, timeout=60, what="the honest peer to average with the victim")
    return victim, victim.status()


def served(d) -> int:
    return d.status().get("gossip", {}).get("served", 0)


def vector(d) -> np.ndarray:
    return np.frombuffer(call(d.home, "group_stats", {"values": True})["vector"]["values"][0], dtype=np.float32)


async def answer_pings(session) -> None:
    """What a live peer must do for the victim not to drop the session: answer heartbeats, drain the rest."""
    async for env in session.incoming:
        if isinstance(env.message, Ping):
            await session.reply(env, Pong(echo=env.message.sent))


async def become_neighbour(session, victim) -> None:
    reply = await session.request(EdgePropose(degree=0), timeout=10)
    assert isinstance(reply.message, EdgeAccept), reply.message
    await session.send_message(EdgeCommit(proposal=reply.reply_to))
    with trio.fail_after(20):
        while not any(n["peer_id"] == my_id(session) for n in (await status(victim))["topology"]["neighbours"]):
            await trio.sleep(0.2)


def my_id(session) -> str:
    from protocol.identity import peer_id_from_public_bytes, public_key_bytes

    return peer_id_from_public_bytes(public_key_bytes(session.cfg.identity))


async def status(d) -> dict:
    return await trio.to_thread.run_sync(d.status)


def offer(session, **kw) -> tuple[AverageOffer, OutgoingGroup]:
    ours = OutgoingGroup(session, SPECS)
    return AverageOffer(group="vector", tensors=SPECS, streams=ours.streams, max_weight=0.5, rule="metropolis",
                        **kw), ours


def test_parameters_go_to_neighbours_only(cluster, tmp_path):
    victim, vs = start_victim_and_honest(cluster, tmp_path)

    async def attack() -> None:
        async with attacker_session(vs) as s, trio.open_nursery() as n:
            n.start_soon(answer_pings, s)
            reply = await s.request(ParamsRequest(group="vector"), timeout=10)
            assert isinstance(reply.message, ErrorReply) and reply.message.code == "not_neighbour", reply.message
            rejected = await s.request(offer(s)[0], timeout=10)
            assert isinstance(rejected.message, AverageReject) and "neighbour" in rejected.message.reason
            await become_neighbour(s, victim)  # a neighbour gets the model (streamed from the engine's nursery)
            reply = await s.request(ParamsRequest(group="vector"), timeout=10)
            assert isinstance(reply.message, ParamsReply), reply.message
            got = await IncomingGroup(s, reply.message.streams, SPECS).receive(timeout=10)
            assert got[0].shape == (SIZE,) and np.isfinite(got[0]).all()
            n.cancel_scope.cancel()
    trio.run(attack)
    assert victim.status()["gossip"]["params_refused"] >= 1
    assert victim.running


def test_accepted_exchanges_left_to_lapse_are_freed_in_bounded_time_and_get_the_peer_banned(cluster, tmp_path):
    victim, vs = start_victim_and_honest(cluster, tmp_path)
    hold = hold_seconds(SIZE * 4, EXCHANGE_TIMEOUT) + COMMIT_SLACK_S
    held: list[float] = []
    served_before = served(victim)

    async def attack() -> None:
        async with attacker_session(vs) as s, trio.open_nursery() as n:
            n.start_soon(answer_pings, s)
            await become_neighbour(s, victim)
            me = my_id(s)
            for i in range(BAN_AFTER):
                msg, _ours = offer(s)  # our tensor never follows, and we never commit
                reply = await s.request(msg, timeout=10)
                assert isinstance(reply.message, AverageAccept), reply.message
                s.discard(reply.message.streams)  # their tensors come; a session refuses streams nobody expects
                t0 = trio.current_time()
                with trio.fail_after(hold + LOAD_MARGIN_S):
                    while (await status(victim))["gossip"]["lapsed"].get(me, 0) <= i:
                        await trio.sleep(0.2)
                held.append(trio.current_time() - t0)
            st = await status(victim)
            assert [b["peer"] for b in st["bans"]] == [me], st["bans"]
            assert "lapse" in st["bans"][0]["reason"]
            rejected = await s.request(offer(s)[0], timeout=10)
            assert isinstance(rejected.message, AverageReject) and "banned" in rejected.message.reason
            refused = await s.request(ParamsRequest(group="vector"), timeout=10)
            assert isinstance(refused.message, ErrorReply) and refused.message.code == "banned"
            n.cancel_scope.cancel()
    trio.run(attack)
    assert all(t <= hold + LOAD_MARGIN_S for t in held), held
    # the honest neighbour kept averaging with the victim all along
    wait_for(lambda: served(victim) > served_before + 10, timeout=30, what="the honest peer's exchanges to go on")
    assert victim.running


def test_poisoned_updates_are_clipped_the_victim_stays_bounded_and_the_poisoner_is_banned(cluster, tmp_path):
    victim, vs = start_victim_and_honest(cluster, tmp_path)
    norms: list[float] = []

    async def exchange(s, values: np.ndarray) -> np.ndarray:
        """One whole exchange as the initiator: send `values`, get the victim's snapshot, commit, and wait
        until the victim has applied it (its clip counted), so the next offer is not refused as in flight."""
        clipped = (await status(victim))["gossip"]["clipped"].get(my_id(s), 0)
        msg, ours = offer(s)
        got: list = []

        async def ask() -> None:
            got.append(await s.request(msg, timeout=10))
        async with trio.open_nursery() as n:
            n.start_soon(ask)
            n.start_soon(lambda: ours.send([values]))
        reply = got[0]
        assert isinstance(reply.message, AverageAccept), reply.message
        theirs = await IncomingGroup(s, reply.message.streams, SPECS).receive(timeout=10)
        await s.send_message(AverageCommit(exchange=reply.reply_to))
        with trio.fail_after(10):
            while (await status(victim))["gossip"]["clipped"].get(my_id(s), 0) <= clipped:
                await trio.sleep(0.2)
        return np.asarray(theirs[0])

    async def attack() -> None:
        async with attacker_session(vs) as s, trio.open_nursery() as n:
            n.start_soon(answer_pings, s)
            await become_neighbour(s, victim)
            # the victim's snapshot each exchange brings shows what the one before did to it
            start = await exchange(s, np.zeros(SIZE, np.float32))  # learn its values (a zero norm: nothing applied)
            norms.append(float(np.linalg.norm(start)))
            seen = await exchange(s, -1000.0 * start)  # -1000x the model: clipped
            norms.append(float(np.linalg.norm(seen)))
            seen = await exchange(s, np.full(SIZE, 3e38, np.float32))  # its norm overflows: nothing applied
            norms.append(float(np.linalg.norm(seen)))
            st = await status(victim)
            assert st["gossip"]["clipped"].get(my_id(s)) == BAN_AFTER, st["gossip"]
            assert [b["peer"] for b in st["bans"]] == [my_id(s)]
            n.cancel_scope.cancel()
    trio.run(attack)
    assert np.all(np.isfinite(norms))
    after = vector(victim)
    assert np.all(np.isfinite(after))
    # the clipped update moved the victim by at most w * max_update_ratio (8) * its norm, w <= 1/3 here
    # (metropolis with 2 neighbours): 3.67x its norm at most (the honest neighbour's averaging only pulls it
    # back); unclipped, -1000x would have made it 334x
    assert norms[2] <= (1 + 8 / 3) * max(norms[:2]) * 1.01, norms
    assert float(np.linalg.norm(after)) <= (1 + 8 / 3) * max(norms[:2]) * 1.01, norms
    assert victim.running

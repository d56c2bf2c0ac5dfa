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
from peer.control import call
from peer.session.groups import IncomingGroup
from peer.testing.attacker import attacker_session
from peer.testing.attacks import (HOLD_S, LOAD_MARGIN_S, SIZE, SPECS, answer_pings, averaging_configs,
                                  become_neighbour, run_scenario)
from protocol.schema.gossip import ParamsReply, ParamsRequest
from peer.testing.swarm import write_config
from tests.daemons import rank_env, unique_swarm, wait_for

pytestmark = pytest.mark.slow


def start_victim_and_honest(cluster, tmp_path):
    swarm = unique_swarm()
    victim = cluster.start("victim", config=write_config(tmp_path / "v.toml", averaging_configs(swarm)),
                           env=rank_env(0, 2))
    vs = victim.wait_ready()
    honest = cluster.start("honest", config=write_config(tmp_path / "h.toml", averaging_configs(swarm, vs["listen"])),
                           env=rank_env(1, 2))
    honest.wait_ready()
    wait_for(lambda: served(victim) > 0, timeout=60, what="the honest peer to average with the victim")
    return victim, victim.status()


def served(d) -> int:
    return d.status().get("gossip", {}).get("served", 0)


def vector(d) -> np.ndarray:
    return np.frombuffer(call(d.home, "group_stats", {"values": True})["vector"]["values"][0], dtype=np.float32)


def test_parameters_go_to_neighbours_only(cluster, tmp_path):
    victim, vs = start_victim_and_honest(cluster, tmp_path)
    obs = run_scenario("params_as_non_neighbour", vs)
    assert obs.facts["params_reply"] == "ErrorReply: not_neighbour", obs
    assert obs.facts["offer_reply"].startswith("AverageReject") and "neighbour" in obs.facts["offer_reply"], obs
    assert victim.status()["gossip"]["params_refused"] >= 1
    assert victim.running


def test_a_neighbour_downloads_the_model(cluster, tmp_path):
    """The refusal above is by role: once a neighbour, the same identity gets the model, streamed from the
    engine's nursery (not the session's dispatch task, which must keep answering pings)."""
    victim, vs = start_victim_and_honest(cluster, tmp_path)

    async def download() -> None:
        async with attacker_session(vs) as s, trio.open_nursery() as n:
            n.start_soon(answer_pings, s)
            assert await become_neighbour(s, vs)
            reply = await s.request(ParamsRequest(group="vector"), timeout=10)
            assert isinstance(reply.message, ParamsReply), reply.message
            got = await IncomingGroup(s, reply.message.streams, SPECS).receive(timeout=10)
            assert got[0].shape == (SIZE,) and np.isfinite(got[0]).all()
            n.cancel_scope.cancel()
    trio.run(download)
    assert victim.running


def test_accepted_exchanges_left_to_lapse_are_freed_in_bounded_time_and_get_the_peer_banned(cluster, tmp_path):
    victim, vs = start_victim_and_honest(cluster, tmp_path)
    served_before = served(victim)
    obs = run_scenario("lapsing_neighbour", vs)
    assert len(obs.facts["held_s"]) == BAN_AFTER, obs
    assert [b["peer"] for b in obs.facts["bans"]] == [obs.attacker], obs.facts["bans"]
    assert "lapse" in obs.facts["bans"][0]["reason"]
    assert obs.facts["offer_after_ban"].startswith("AverageReject") and "banned" in obs.facts["offer_after_ban"]
    assert obs.facts["params_after_ban"] == "ErrorReply: banned", obs
    assert all(t <= HOLD_S + LOAD_MARGIN_S for t in obs.facts["held_s"]), obs.facts["held_s"]
    # the honest neighbour kept averaging with the victim all along
    wait_for(lambda: served(victim) > served_before + 10, timeout=30, what="the honest peer's exchanges to go on")
    assert victim.running


def test_poisoned_updates_are_clipped_the_victim_stays_bounded_and_the_poisoner_is_banned(cluster, tmp_path):
    victim, vs = start_victim_and_honest(cluster, tmp_path)
    obs = run_scenario("poisoning_neighbour", vs)
    norms = obs.facts["norms"]
    assert len(norms) == 3, obs
    assert obs.facts["clipped"] == BAN_AFTER, obs.facts
    assert [b["peer"] for b in obs.facts["bans"]] == [obs.attacker]
    assert np.all(np.isfinite(norms))
    after = vector(victim)
    assert np.all(np.isfinite(after))
    # the clipped update moved the victim by at most w * max_update_ratio (8) * its norm, w <= 1/3 here
    # (metropolis with 2 neighbours): 3.67x its norm at most (the honest neighbour's averaging only pulls it
    # back); unclipped, -1000x would have made it 334x
    assert norms[2] <= (1 + 8 / 3) * max(norms[:2]) * 1.01, norms
    assert float(np.linalg.norm(after)) <= (1 + 8 / 3) * max(norms[:2]) * 1.01, norms
    assert victim.running

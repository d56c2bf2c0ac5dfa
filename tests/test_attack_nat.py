"""The relay and dial-back are services strangers use (issue 18): attacked over the real protocol against
a real daemon that relays, they refuse, stay within their caps and release what they held."""

from __future__ import annotations

import pytest

from peer.config import RelaySection
from peer.testing.attacks import averaging_configs, run_scenario
from peer.testing.swarm import unique_swarm, write_config

pytestmark = pytest.mark.slow


@pytest.fixture
def victim(cluster, tmp_path):
    d = cluster.start("victim", config=write_config(tmp_path / "v.toml", averaging_configs(unique_swarm("nat"))))
    return d.wait_ready()


def test_relay_refuses_circuits_beyond_its_caps_and_releases_pending_ones(victim):
    obs = run_scenario("relay_abuse", victim)
    assert obs.facts["unreserved_refused"], obs
    assert obs.facts["reserved"], obs  # the victim relays (reachability = public)
    assert obs.facts["incoming_seen"] <= RelaySection().max_circuits_per_peer, obs
    assert obs.facts["granted"] == 0 and obs.facts["circuits_left"] == 0, obs
    assert obs.ok, obs


def test_dial_back_never_dials_another_ip_or_too_often(victim):
    obs = run_scenario("dialback_elsewhere", victim)
    assert obs.ok, obs
    assert any("not your address" in r for r in obs.facts["reasons"]), obs
    assert any("one request per" in r for r in obs.facts["reasons"]), obs


def test_circuit_hellos_with_guessed_tokens_are_closed(victim):
    obs = run_scenario("circuit_token_guess", victim)
    assert obs.ok, obs

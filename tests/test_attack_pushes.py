"""An attack on the sparse outer exchange among real daemons (peer/averaging/pushes.py, push_gate.py): four honest
peers in local mode with outer_codec "sparse", and a fifth whose trainer (peer/testing/push_liar.py) pushes huge
updates ten times a second to every partner. Each honest receiver scales what it takes down to a few of its own
updates, refuses the pushes past its rate, strikes the liar for pushes far past its own and bans it; the honest
peers finish, their replicas together, and train. Then the subtler liar, which pushes back the honest peers' mean
update negated, inside the norm bound: each honest receiver sees it point away from its own, adds none of it,
and bans it."""

from __future__ import annotations

import pytest

from peer.testing.push_liar import NAME as LIAR
from peer.testing.swarm import LocalSwarm, swarm_config, unique_swarm
from tests.daemons import trainer_steps
from tests.test_local_steps import STEPS, TINY, _swarm_options, farthest_apart, outer_weights

pytestmark = pytest.mark.slow


def _liar_among_four(tmp_path, steps: int = STEPS, **attack) -> tuple[list[dict], list, str]:
    """Four honest sparse peers training `steps` each and the liar (push_liar's options `attack`), run until the
    honest peers finish: their statuses, their outer weights, and the liar's id."""
    name = unique_swarm("psl")
    topology = {"kind": "full", "target_degree": 4, "min_degree": 4}
    honest_cfg = swarm_config(swarm=name, trainer="trainers.gossip_sgd",
                              options=_swarm_options(outer_codec="sparse", max_steps=steps, eval_every=steps),
                              topology=topology)
    liar_cfg = swarm_config(swarm=name, trainer=LIAR, topology=topology,
                            options={"model": TINY["model"], "model_options": TINY["model_options"], "seed": 0,
                                     **attack})
    with LocalSwarm(tmp_path / "liar") as swarm:
        liar = swarm.start("liar", config=liar_cfg)
        liar.wait_ready()
        honest = swarm.start_nodes(4, honest_cfg)
        swarm.wait(lambda sts: all(s and s.get("trainer", {}).get("state") == "done" for s in sts[1:]), timeout=240,
                   what="the four honest peers to finish", interval=0.25, progress=lambda sts: trainer_steps(sts[1:]))
        sts = [d.status() for d in honest]
        weights = [outer_weights(d) for d in honest]
        liar_id = liar.status()["peer_id"]
        assert (liar.status()["trainer"].get("pushes_started") or 0) > 0
    return sts, weights, liar_id


def test_a_liar_flooding_huge_pushes_is_clipped_rate_limited_and_banned_and_the_honest_peers_train(tmp_path):
    sts, weights, liar_id = _liar_among_four(tmp_path)
    for s in sts:
        pushes = s["gossip"]["pushes"]
        assert pushes["clipped"] >= 1 and pushes["refused"] >= 1, pushes  # liar's: dropped, then refused (rate, ban)
        assert liar_id in s["gossip"]["struck"], s["gossip"]["struck"]
        assert liar_id in {b["peer"] for b in s["gossip"]["bans"]}, s["gossip"]["bans"]
        assert s["trainer"]["rounds"] == STEPS // 20
        # from ~4.2 at the start; without the liar 2.55-2.70, with it (banned after 3 pushes) 2.61-2.73
        assert s["trainer"]["test_loss"] < 3.0, s["trainer"]
    apart = farthest_apart(weights)
    # none of the liar's pushes was taken (each far past the bound: evidence), so the honest replicas hold what
    # they pushed each other, but for the rounds before each one banned the liar, when it still counted in n
    # (alone they drift 0.40 apart: tests/test_local_steps.py); measured 0.016
    assert apart < 0.05, apart


def test_a_liar_pushing_the_swarm_s_mean_update_negated_is_seen_pointing_away_and_banned(tmp_path):
    # 16 rounds, not 10: a strike takes the mean of 4 or more of the liar's pushes (push_gate.py, `turned_away`), a
    # ban 3 strikes, and a receiver takes at most 1.5 of its pushes a round (after a burst of 3)
    sts, weights, liar_id = _liar_among_four(tmp_path, steps=320, attack="negate", interval=0.5, magnitude=0.05)
    for s in sts:
        pushes = s["gossip"]["pushes"]
        assert pushes["opposed"] >= 1, pushes  # the liar's, none of them added
        assert liar_id in {b["peer"] for b in s["gossip"]["bans"]}, s["gossip"]["bans"]
        assert s["gossip"]["bans"] and all(b["peer"] == liar_id for b in s["gossip"]["bans"]), s["gossip"]["bans"]
        assert s["trainer"]["test_loss"] < 3.0, s["trainer"]
        print("pushes' cosines, the liar's among them:", pushes.get("cosine"), "opposed", pushes["opposed"])

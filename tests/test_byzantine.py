"""Lying peers among real daemons (issue 29, item 3): five honest peers train the digits CNN beside one that
runs an attack of the library (peer/testing/byzantine_trainer.py through peer/testing/byzantine.py). Against every attack
the honest peers still reach the target and no honest peer is banned; an attacker the defence can see (its
values point away from ours, or sit far past the honest radius) is banned within a few exchanges by the
peers it reaches. Both shares of liars, both topologies and the figures: `peer bench byzantine`."""

from __future__ import annotations

import pytest

from peer.testing.byzantine import ATTACKS, SwarmPlan, run_swarm
from tests.daemons import unique_swarm

pytestmark = pytest.mark.slow

TARGET = 0.95  # as the training tests'
BAN_WITHIN = 16  # exchanges with the liar (3-15 in peer bench byzantine): 3 strikes ban (peer/averaging/bans.py); some carry
#                  honest-looking values (it holds the honest mean while it downloads its neighbours' models,
#                  and an exchange it serves sends what the last one left), which are no evidence


# Open (issue 40): until 2026-11-29 the dissensus liar's trainer crashed at its first download (no victim yet)
# and its daemon served a frozen model, so this case passed without the attack. Run for real, the liar
# displaces its victim, the victim's far distance widens its neighbours' radius for the liar (the ratchet of
# radius.py's references) and in about one run in three an honest peer ends short of the target, twice at
# 10% (docs/benchmarks.md, 2026-11-29). The per-partner share bound (peer/averaging/shares.py) did not close it.
OPEN = {"dissensus": "issue 40: the radius ratchet lets a dissensus liar displace its victim's neighbours"}


@pytest.mark.parametrize("attack", [pytest.param(a, marks=pytest.mark.xfail(reason=OPEN[a], strict=False))
                                    if a in OPEN else a for a in ATTACKS])
def test_the_honest_peers_reach_the_target_and_a_visible_liar_is_banned(tmp_path, attack):
    plan = SwarmPlan(honest=5, liars=1, attack=attack,
                     topology={"kind": "rewired", "target_degree": 3, "min_degree": 2, "max_degree": 4},
                     honest_options={"model": "digits_cnn", "mode": "adpsgd", "target_accuracy": TARGET,
                                     "max_steps": 1500, "eval_every": 20},
                     gossip={"exchange_timeout": 5.0})
    out = run_swarm(plan, tmp_path, unique_swarm("byz"), timeout=300)
    peers = out["peers"]
    print(f"{attack}: honest accuracy {[round(p['accuracy'] * 100, 1) for p in peers]}, steps "
          f"{[p['step'] for p in peers]}; watch {out['watch']}; liar {out['liars']}")
    assert all(p["state"] == "done" and p["reached_target"] for p in peers), peers
    assert out["watch"]["honest_banned"] == 0, out["watch"]["false_positives"]
    (liar,) = out["watch"]["liars"].values()
    if ATTACKS[attack].detectable:  # every honest peer that met it attacking long enough banned it in time
        assert liar["exchanges_unbanned_max"] <= BAN_WITHIN, liar
        assert liar["exchanges_until_ban_max"] is None or liar["exchanges_until_ban_max"] <= BAN_WITHIN, liar

"""Attacks on the pipeline's stage-state transfer against a real daemon, through the real protocol (issue 17).

A victim serves stage 0 of a two-stage pipeline and drives a few microbatches through a second daemon serving
stage 1, so its stage has trained state worth stealing. A fresh identity that serves no stage of the pipeline
then asks for that state: it is refused (`not_a_member`), the session is kept (asking is not malformed), and
the refusal is counted in the victim's status.
"""

from __future__ import annotations

import pytest

from peer.testing.attacks import run_scenario
from peer.testing.swarm import swarm_config
from tests.daemons import rank_env, unique_swarm

pytestmark = pytest.mark.slow

TINY = dict(d_model=32, n_layers=2, n_heads=2, block=16, microbatch=8, batch_size=16, stages=2, dropout=0.0,
            seed=0, join_wait=60.0, samples=64, copy_every=0.0, rebalance=False)


def test_a_stage_state_goes_to_pipeline_members_only(cluster):
    swarm = unique_swarm("ap")
    cfg = lambda stage: swarm_config(swarm=swarm, trainer="trainers.swarm_pipeline",  # noqa: E731
                                     options={**TINY, "initial_stage": stage}, topology={"record_interval": 1.0})
    victim = cluster.start("victim", config=cfg(0), env=rank_env(0, 2))
    cluster.start("stage1", config=cfg(1), env=rank_env(1, 2))
    vs = victim.wait_until(lambda st: (st.get("trainer") or {}).get("driving_done") and st, timeout=120,
                           what="the victim to drive its microbatches")
    obs = run_scenario("stage_state_as_non_member", vs)
    assert obs.ok and obs.facts["session_kept"], obs
    assert victim.status()["pipeline"]["state_transfers"]["refused"].get("not_a_member", 0) >= 1
    assert victim.running

"""A stage server that blames the driver for every call, with real daemons on 127.0.0.1 (issue 39, item 5):
it refuses each call as bad input (peer/testing/lying_stage.py, "blame"), which any honest peer of its stage
contradicts by serving the same call. Every honest driver finishes its samples without a failed microbatch
(each blamed call re-sent to the honest peer of the stage), strikes the liar and nobody else, and bans it.

Two stages; stage 1 has two peers (one honest, the liar). Peers are pinned to their stage, rebalancing is
off, and no call is checked (verify_fraction 0), so only the refusals can strike anyone.
"""

from __future__ import annotations

import pytest

from peer.testing import lying_stage
from peer.testing.swarm import rank_env, swarm_config, unique_swarm
from tests.pipeline_status import driver, pipe, samples_done, trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TRAINER = "trainers.swarm_pipeline"
TINY = dict(d_model=32, n_layers=2, n_heads=2, block=16, microbatch=8, batch_size=16, stages=2, dropout=0.0,
            lr=3e-3, grad_clip=0.0, seed=0, join_wait=60.0, rebalance=False, in_flight=2)
START_S = 90.0  # daemons start, profile, agree on a cut and cover every stage: ~10 s here, generous for CI
TOPOLOGY = {"record_interval": 1.0}
STAGES = [0, 1, 1]  # node3, the second peer of stage 1, blames every driver
LIAR = 2


def test_a_server_blaming_its_drivers_is_struck_and_fails_no_honest_microbatch(cluster):
    # Long enough to outlast the liar's join: it loads stage 1's state from its honest peer while the drivers
    # already drive, refusing calls meanwhile (not_serving), and a driver avoids it for first_ban after each. At
    # 320 samples one CI run ended 1.5 s after the liar was ready, inside that avoidance: no call reached it.
    samples = 960
    swarm = unique_swarm("blame")
    ds = []
    for i, s in enumerate(STAGES):
        o = dict(initial_stage=s, samples=samples, role="server" if i == LIAR else "auto")
        if i == LIAR:
            o.update(lying_stage.options("blame"))
        cfg = swarm_config(swarm=swarm, trainer=TRAINER, options={**TINY, **o}, topology=TOPOLOGY).replace(
            pipeline={"verify_fraction": 0.0, "first_ban": 0.5, "max_ban": 1.0})  # the loading liar is tried soon
        ds.append(cluster.start(f"node{i + 1}", config=cfg, env=rank_env(i, len(STAGES))))
    drivers = [d for i, d in enumerate(ds) if i != LIAR]
    cluster.wait(lambda sts: all(trainer(s).get("driving_done") for i, s in enumerate(sts) if i != LIAR),
                 timeout=START_S + 240, what="the drivers to drive their samples", interval=1.0, progress=samples_done)
    liar = ds[LIAR].peer_id
    struck = set()
    for d in drivers:
        s = d.status()
        t, dr = trainer(s), driver(s)
        print(f"{d.name}: done {dr['done']} failed {dr['failed']} resent {dr['resent']} struck {dr['struck']} "
              f"bans {pipe(s).get('bans')} liar refused {dr['calls'].get(liar, 0)} served")
        assert t["samples"] == samples and t["microbatches_failed"] == 0 and dr["failed"] == 0, (d.name, t, dr)
        assert set(dr["struck"]) <= {liar} and dr["calls"].get(liar, 0) == 0, (d.name, dr)
        struck |= set(dr["struck"])
    assert struck == {liar}  # a driver that never picked it (the balancer prefers the measured peer) strikes nobody
    served = pipe(ds[LIAR].status()).get("server", {})
    assert served.get("served", 0) == 0 and served.get("accumulated_samples", 0) == 0, served

"""At most once per stage with real daemons (issue 28): a reply lost after the server's compute, the call re-sent
to another peer of the stage, enters the stage once; a microbatch failed at the first stage leaves no gradient
in the later ones. In both, every stage's accumulated samples equal the driver's done microbatches x their size,
as `peer status` shows them. The faults are injected into the driver by tests/pipeline_faults.py, once.
One microbatch in flight, so no other call or ack is under way when the fault hits: the counts are exact."""

from __future__ import annotations

import pytest

from peer.testing.swarm import rank_env, swarm_config, unique_swarm
from tests.pipeline_status import driver, pipe, trainer

pytestmark = pytest.mark.slow

MB, SAMPLES = 8, 64
TINY = dict(d_model=32, n_layers=2, n_heads=2, block=16, microbatch=MB, batch_size=16, dropout=0.0, seed=0,
            join_wait=60.0, samples=SAMPLES, in_flight=1, rebalance=False, copy_every=0.0, eval_every=0)
START_S = 90.0  # daemons start, profile, agree on a cut and cover every stage: ~10 s here, generous for CI


def config(swarm: str, stage: int, stages: int, **fault):
    return swarm_config(swarm=swarm, trainer="tests.pipeline_faults", topology={"record_interval": 1.0},
                        options={**TINY, "stages": stages, "initial_stage": stage,
                                 "role": "auto" if stage == 0 else "server", **fault})


def start(cluster, stages: list[int], **fault) -> list:
    swarm, n = unique_swarm("once"), len(stages)
    ds = [cluster.start(f"node{i + 1}", config=config(swarm, s, max(stages) + 1, **fault), env=rank_env(i, n))
          for i, s in enumerate(stages)]
    ds[0].wait_until(lambda st: trainer(st).get("driving_done"), timeout=START_S, what="node1 to drive", interval=0.5,
                     progress=lambda st: trainer(st).get("samples"))
    return ds


def accumulated(sts: list[dict]) -> dict[int, int]:
    """Stage -> the samples its servers took, over the daemons."""
    out: dict[int, int] = {}
    for st in sts:
        for stage, n in pipe(st)["server"]["accumulated_by_stage"].items():
            out[int(stage)] = out.get(int(stage), 0) + n
    return out


def test_a_reply_lost_after_the_compute_and_resent_counts_once(cluster):
    """Two stages; node2 and node3 serve stage 1. The first "loss" reply is lost after the server computed it
    (the session cut), and the call goes to the stage's other peer."""
    ds = start(cluster, [0, 1, 1], fault="lose_reply", fault_stage=1, fault_kind="loss")
    sts = [d.status() for d in ds]
    t, dr = trainer(sts[0]), driver(sts[0])
    assert t["microbatches_done"] == SAMPLES // MB and t["microbatches_failed"] == 0, t
    assert dr["resent"] >= 1 and dr["ack_lost"] == 0, dr
    assert accumulated(sts) == {0: SAMPLES, 1: SAMPLES}, (accumulated(sts), dr)  # not SAMPLES + MB at stage 1
    assert dr["acked_samples"] == [SAMPLES, SAMPLES] and dr["samples"] == SAMPLES, dr
    stage1 = [pipe(st)["server"] for st in sts[1:]]
    # the lost reply's gradient: still kept there, or dropped as unacknowledged; never taken
    assert sum(s["kept"] + s["dropped"].get("unacked", 0) for s in stage1) == 1, stage1
    assert sum(s["served"] for s in stage1) >= SAMPLES // MB + 1, stage1
    assert "lost the reply" in ds[0].log_path.read_text()


def test_a_microbatch_failed_at_the_first_stage_leaves_no_gradient_in_the_others(cluster):
    """Three stages, one peer each; the first microbatch's backward fails at stage 0 (the driver's own), after
    stages 1 and 2 computed theirs: they drop them, and every stage takes the other microbatches only."""
    ds = start(cluster, [0, 1, 2], fault="fail", fault_stage=0, fault_kind="backward")
    sts = [d.status() for d in ds]
    t, dr = trainer(sts[0]), driver(sts[0])
    done = SAMPLES // MB - 1
    assert t["microbatches_done"] == done and t["microbatches_failed"] == 1, t
    assert dr["dropped"] == 2 and dr["ack_lost"] == 0, dr
    assert accumulated(sts) == {0: done * MB, 1: done * MB, 2: done * MB}, (accumulated(sts), dr)
    assert dr["acked_samples"] == [done * MB] * 3, dr
    for st in sts[1:]:
        assert pipe(st)["server"]["dropped"] == {"failed": 1} and pipe(st)["server"]["kept"] == 0, pipe(st)["server"]

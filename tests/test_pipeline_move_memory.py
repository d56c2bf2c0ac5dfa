"""A move between stages of different sizes stays within the mover's memory budget (issue 28).

Four daemons, each in a memory cgroup with `[pipeline] memory_mib` the same, train a model of 3 blocks of
4096² between a small input and head (trainers/pipeline/wide.py): by the plan's estimate (trainers/pipeline/memory.py,
averaging and the idle receive buffers included) any cut in two stages gives one stage about 1185 MiB to hold and the
other about 760, so a peer's room (its budget less what the process held before any block) holds the big stage
but not both. Two peers start on each stage; once all drive, both peers of the big stage are killed (-9), a peer
of the small stage takes the big one over, freeing its old stage first (trainers/pipeline/seat.py,
`_move_freeing_first`), and the big stage steps again; the freed stage's copy is on disk. The survivors' resident
memory is sampled throughout and never exceeds the budget.
"""

from __future__ import annotations

import pytest

from peer.bench.memory_caps import MemoryCaps
from peer.testing.process import wait_for
from peer.testing.rss import RssSampler
from peer.testing.swarm import rank_env, swarm_config, unique_swarm
from tests.pipeline_status import pipe, trainer

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(600)]

DAEMONS = 4
CAP_MIB = 1800  # each daemon's cgroup and budget: a room of 1390-1465 MiB beside the 335-410 MiB a daemon holds
#                 before any block, so the big stage (~1185 MiB) fits with a margin and both stages (~1945) do not
OPTIONS = dict(model_factory="trainers.pipeline.wide:uneven_test", dataset_factory="trainers.pipeline.wide:digits",
               stages=2, microbatch=8, batch_size=16, samples=0, in_flight=1, lr=3e-5, eval_batches=2,
               join_wait=120.0, rebalance_every=600.0, copy_every=0.0, checkpoint_every=0.0, threads=1)
#              (rebalancing stays on for the takeover of an emptied stage; no planned move comes within 600 s)
START_S = 300.0  # 4 daemons import torch, agree on a cut, build a stage each and drive, on 2 loaded cores
TAKEOVER_S = 120.0  # the dead peers noticed (dead_after 4 s), the claim settled, a stage freed, built and served


def test_a_move_to_a_bigger_stage_frees_the_old_one_first_and_stays_within_the_budget(cluster):
    support = MemoryCaps.probe()
    if support.mechanism is None:
        pytest.skip(f"no memory cgroups here: {support.reason}")
    name = unique_swarm("move")
    with MemoryCaps(DAEMONS, CAP_MIB, support) as caps, RssSampler() as rss:
        ds = []
        for i in range(DAEMONS):
            cfg = swarm_config(swarm=name, trainer="trainers.swarm_pipeline", topology={"record_interval": 1.0},
                               pipeline={"memory_mib": CAP_MIB}, options={**OPTIONS, "initial_stage": i // 2})
            d = cluster.start(f"node{i + 1}", config=cfg, env={**rank_env(i, DAEMONS), "OMP_NUM_THREADS": "1"})
            caps.add(i, d.pid)
            rss.watch(d.pid)
            ds.append(d)

        sts: list = []

        def driving(now) -> bool:
            sts[:] = now
            for d, st in zip(ds, now):  # a trainer that failed (a cut that does not fit, say) fails the test now
                state = trainer(st).get("state", "")
                assert not state.startswith("failed"), f"{d.name}: {state}"
            return all(trainer(st).get("microbatches_done", 0) >= 2 for st in now)

        cluster.wait(driving, timeout=START_S, what="every daemon driving", interval=1.0)
        cuts = trainer(sts[0])["cuts"]
        assert len(cuts) == 1 and cuts[0] in (2, 3), cuts
        big = 1 if cuts[0] == 2 else 0  # the stage with two of the three wide blocks
        victims = [d for d, st in zip(ds, sts) if pipe(st)["my_stage"] == big]
        survivors = [d for d in ds if d not in victims]
        assert len(victims) == 2, [pipe(st)["my_stage"] for st in sts]
        for v in victims:
            assert v.kill() == -9

        def took_over():
            got = [d.try_status() for d in survivors]
            for st in got:
                moved = [m for m in pipe(st).get("moves", []) if m["to"] == big]
                if pipe(st).get("my_stage") == big and moved:
                    return st, moved[0]
            return None
        taker, move = wait_for(took_over, timeout=TAKEOVER_S, what=f"a peer to take stage {big} over", interval=0.5)
        assert move["from"] == 1 - big and move.get("freed_first") is True, move
        steps_at_move = trainer(taker).get("stage_steps", 0)
        mover = next(d for d in survivors if d.try_status()["peer_id"] == taker["peer_id"])
        mover.wait_until(lambda st: trainer(st).get("stage_steps", 0) > steps_at_move, timeout=TAKEOVER_S,
                         what=f"stage {big} to step again after the move", interval=0.5)
        peaks = rss.peaks()
        kills = [caps.oom_kills(i) for i in range(DAEMONS)]
        st = mover.status()
    mem = pipe(st)["memory"]
    copies = pipe(st)["state_transfers"]["copies"]  # the stage it freed, kept to hand out: on disk, not in memory
    assert [(c["stage"], c["where"]) for c in copies] == [(1 - big, "disk")], copies
    assert mem["budget_mib"] == CAP_MIB, mem
    log = mover.log_path.read_text()
    assert "freeing the old one first" in log, mover.name
    for d in survivors:
        assert peaks[d.pid].hwm_mib <= CAP_MIB, (d.name, peaks[d.pid], CAP_MIB)
    assert all(kills[ds.index(d)] in (0, None) for d in survivors), kills

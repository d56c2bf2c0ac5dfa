"""Rebalancing between pipeline stages with real daemons on 127.0.0.1 (issue 17, "Tests"):

  * a peer slowed 8x makes its stage the bottleneck: a peer of a stage with spare capacity moves there, and the
    drivers' throughput rises; every microbatch in flight during the move is accounted for (none failed, the calls
    handed back were re-sent), and no two peers left one stage at once;
  * a stage emptied by kill -9 of its only peer is taken over by a peer of another stage from a copy of its state,
    and training goes on (the stage steps again, every surviving driver finishes);
  * a peer joining a trained stage holds, after the transfer, exactly the state of the peer it came from
    (weights, optimizer state, step).

Peers are pinned to their first stage (`initial_stage`) so each test starts from a known assignment.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from peer.home import Home
from peer.pipeline.copies import COPY_SUFFIX
from peer.testing.process import wait_for
from peer.testing.swarm import rank_env, swarm_config, unique_swarm
from peertrain.checkpoints import read_checkpoint
from tests.pipeline_status import driver, no_one_struck, pipe, samples_done, trainer

# 600 s: their waits on drivers bound the time without progress (wait_for's `progress`), not the whole run
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAINER = "trainers.swarm_pipeline"
TINY = dict(d_model=32, n_layers=2, n_heads=2, block=16, microbatch=8, batch_size=16, stages=4, dropout=0.0,
            lr=3e-3, grad_clip=0.0, seed=0, join_wait=60.0, rebalance_every=3.0, copy_every=3.0)
START_S = 90.0  # start, profile, agree on a cut, cover every stage: ~10 s here, generous for a loaded CI machine
TOPOLOGY = {"record_interval": 1.0}  # stage records (and the moves in them) spread within a second
SLOW = 8.0  # the slowed peer: slow enough that its stage, not the shared 2-core CPU, bounds the pipeline


def config(swarm: str, **options):
    return swarm_config(swarm=swarm, trainer=TRAINER, options={**TINY, **options}, topology=TOPOLOGY)


def stage_of(st: dict | None) -> int | None:
    return pipe(st).get("my_stage")


def peers_per_stage(st: dict) -> dict[int, list[str]]:
    return {e["stage"]: [p["peer_id"] for p in e["peers"]] for e in pipe(st).get("stage_map", [])}


def moves(sts) -> list[dict]:
    return [dict(m, peer=s["peer_id"]) for s in sts if s for m in pipe(s).get("moves", [])]


def assert_one_leaver_per_stage(all_moves: list[dict]) -> None:
    """No two moves out of one stage overlap in time (each runs from its claim, `took_s` before it ended)."""
    by_stage: dict[int, list[tuple[float, float, str]]] = {}
    for m in all_moves:
        by_stage.setdefault(m["from"], []).append((m["at"] - m["took_s"], m["at"], m["peer"]))
    for stage, spans in by_stage.items():
        spans.sort()
        for (a0, a1, p), (b0, b1, q) in zip(spans, spans[1:]):
            assert b0 >= a1, f"{p[:8]} and {q[:8]} left stage {stage} at once: {a0:.1f}-{a1:.1f} and {b0:.1f}-{b1:.1f}"


@pytest.mark.serial
def test_a_slowed_peer_draws_a_move_that_raises_throughput(cluster):
    """Five daemons on stages 0, 0, 1, 2, 3; the lone peer of stage 2 (a transformer block: the head of stage 3
    is too cheap to bound anything even slowed) computes 8x slower, so stage 2 bounds the pipeline. A peer must
    move to stage 2 (leaving a stage that keeps a peer), and the drivers' samples/s after the moves must beat
    the rate before them."""
    o = dict(d_model=128, block=64, n_heads=4, samples=0, in_flight=2)
    swarm = unique_swarm("rb")
    stages = [0, 0, 1, 2, 3]
    ds = [cluster.start(f"node{i + 1}", config=config(swarm, initial_stage=s, slowdown=SLOW if s == 2 else 1.0, **o),
                        env=rank_env(i, len(stages))) for i, s in enumerate(stages)]
    trace: list[tuple[float, int]] = []  # (time, samples done by all drivers)

    def poll_until(pred, timeout: float, what: str):
        def once():
            sts = cluster.statuses()
            trace.append((time.time(), sum(trainer(s).get("samples") or 0 for s in sts)))
            return pred(sts) and sts
        return wait_for(once, timeout=timeout, what=what, interval=0.5)
    poll_until(lambda sts: trace[-1][1] > 0, START_S, "the drivers to start")
    poll_until(lambda sts: any(m["to"] == 2 for m in moves(sts)), 120, "a peer to move to the slowed stage 2")
    settled = time.time() + 15
    final = poll_until(lambda sts: time.time() > settled and time.time() > max(m["at"] for m in moves(sts)) + 15,
                       90, "15 s after the last move")

    def rate(t0: float, t1: float) -> float:
        pts = [(t, n) for t, n in trace if t0 <= t <= t1]
        assert len(pts) >= 3, f"too few status rounds between {t0:.1f} and {t1:.1f}"
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
    # Before any move (a loaded machine may first fill another stage it measured as slow) against after the last.
    all_moves = sorted(moves(final), key=lambda m: m["at"])
    first_start = all_moves[0]["at"] - all_moves[0]["took_s"]
    started = next(t for t, n in trace if n > 0)
    before = rate(started, first_start)
    after = rate(all_moves[-1]["at"] + 3, trace[-1][0])
    print(f"moves {[(m['from'], m['to'], m['reason']) for m in all_moves]}: drivers' samples/s {before:.1f} before, "
          f"{after:.1f} after")
    assert after > before * 1.2, f"throughput {before:.1f} -> {after:.1f} samples/s after the moves"
    # every stage keeps a peer; stage 2 gained a fast one (the slowed peer itself may then leave it for the next
    # bottleneck: it is 8x slower wherever it computes, and the rules may place it where it costs least)
    assert all_moves[0]["to"] == 2 and all(peers_per_stage(final[0]).values()), peers_per_stage(final[0])

    # Every microbatch accounted for: none failed; calls the mover held for its old stage were handed back and re-sent.
    for d, s in zip(ds, final):
        assert driver(s).get("failed") == 0 and not driver(s).get("failures"), (d.name, driver(s))
        assert no_one_struck(s), (d.name, pipe(s).get("bans"), driver(s).get("verify"))
    handed_back = sum(pipe(s)["server"].get("handed_back", 0) for s in final)
    resent = sum(driver(s).get("resent", 0) for s in final)
    assert handed_back <= resent, (handed_back, resent)
    assert_one_leaver_per_stage(moves(final))


def test_a_stage_emptied_by_kill_is_taken_over_and_training_resumes(cluster):
    """Five daemons on stages 0, 0, 1, 2, 3 drive their samples. Mid-run the only peer of stage 2 is killed: a
    stage-0 peer takes stage 2 over from the freshest copy (peers back up the next stage every `copy_every`
    seconds, in memory where it fits), the drivers' waiting ends, stage 2 steps again, and every surviving driver
    finishes with nothing lost."""
    # ~200 samples/s a driver here: a copy is kept within a second (copy_every 1 s) and the kill lands before
    # AFTER_KILL samples are left, so stage 2 must step again for the drivers to finish (4,000 samples a driver,
    # 20 s of driving and most of it after the takeover, cost 150 s on a loaded CI machine)
    n, samples, after_kill = 5, 1600, 600
    swarm = unique_swarm("rb")
    stages = [0, 0, 1, 2, 3]
    ds = [cluster.start(f"node{i + 1}", config=config(swarm, initial_stage=s, samples=samples, rebalance_every=600.0,
                                                      copy_every=1.0),
                        env=rank_env(i, n)) for i, s in enumerate(stages)]
    sts: list = [None] * n

    def mid_run(got) -> bool:
        sts[:] = got
        copies = [c for s in sts for c in (pipe(s).get("state_transfers") or {}).get("copies", []) if c["stage"] == 2]
        return all(s and 160 <= (trainer(s).get("samples") or 0) < samples - after_kill for s in sts) and bool(copies)
    cluster.wait(mid_run, timeout=START_S, what="every daemon driving and a copy of stage 2 kept",
                 interval=0.3, progress=samples_done)  # START_S bounds the time without progress once samples move
    for d, s in zip(ds, sts):  # this tiny stage's copy fits the room beside all its stage may hold: kept in memory,
        for c in pipe(s)["state_transfers"]["copies"]:  # no file (a copy that does not fit goes to disk: see
            assert c["where"] == "memory" and c["mb"] > 0, (d.name, c)  # test_pipeline_move_memory.py)
            assert not list(Home(d.home).stage_copies.glob(f"*-stage{c['stage']}{COPY_SUFFIX}")), (d.name, c)
    victim = ds[stages.index(2)]
    assert stage_of(sts[stages.index(2)]) == 2 and len(peers_per_stage(sts[0])[2]) == 1, peers_per_stage(sts[0])
    assert victim.kill() == -9
    survivors = [d for d in ds if d is not victim]

    def took_stage_2(s) -> bool:  # serving it and its move recorded (a status may show the one before the other)
        return stage_of(s) == 2 and any(m["to"] == 2 for m in pipe(s).get("moves", []))

    def taken_over():
        got = [d.try_status() for d in survivors]
        return got if any(took_stage_2(s) for s in got) else None
    got = wait_for(taken_over, timeout=60, what="a peer to take stage 2 over", interval=0.3)
    taker = next(s for s in got if took_stage_2(s))
    move = next(m for m in pipe(taker)["moves"] if m["to"] == 2)
    assert move["from"] == 0 and "no peer" in move["reason"] and move["step"] > 0, move
    steps_at_takeover = trainer(taker).get("stage_steps", 0)

    latest: list = []

    def finished():
        latest[:] = [d.try_status() for d in survivors]
        return list(latest) if all(trainer(s).get("driving_done") for s in latest) else None
    final = wait_for(finished, timeout=120, what="the surviving drivers to finish", interval=0.5,
                     progress=lambda: samples_done(latest))
    for d, s in zip(survivors, final):
        t, dr = trainer(s), driver(s)
        assert t["samples"] == samples and t["microbatches_failed"] == 0 and dr["failed"] == 0, (d.name, t, dr)
        assert no_one_struck(s), (d.name, pipe(s).get("bans"), dr.get("verify"))
    taker_now = next(s for s in final if s["peer_id"] == taker["peer_id"])
    assert trainer(taker_now)["stage_steps"] > steps_at_takeover, "stage 2 did not step after the takeover"
    assert_one_leaver_per_stage(moves(final))


def test_a_joining_peer_holds_exactly_its_sources_stage_state(cluster):
    """node1 (stage 0) drives 160 samples through node2 (stage 1), then both only serve. node3 then joins stage 1:
    it downloads node2's state, and both checkpoints hold the same weights, optimizer state and step, bit for bit."""
    o = dict(stages=2, average_every=0, rebalance=False, copy_every=0.0)
    swarm = unique_swarm("rb")
    d1 = cluster.start("node1", config=config(swarm, initial_stage=0, samples=160, **o), env=rank_env(0, 2))
    d2 = cluster.start("node2", config=config(swarm, initial_stage=1, role="server", **o), env=rank_env(1, 2))
    d1.wait_until(lambda st: trainer(st).get("driving_done"), timeout=START_S, what="node1 to drive its samples",
                  progress=lambda st: trainer(st).get("samples"))
    d3 = cluster.start("node3", config=config(swarm, initial_stage=1, role="server", **o), env=rank_env(1, 2))
    def my_step(st: dict) -> int:
        return next((p["step"] for e in pipe(st).get("stage_map", []) for p in e["peers"] if p["me"]), 0)
    d3.wait_until(lambda st: stage_of(st) == 1 and my_step(st) > 0, timeout=START_S,
                  what="node3 to join stage 1 with its state")
    states = []
    for d in (d2, d3):
        assert wait_for(lambda: d.command("checkpoint", timeout=60), timeout=60, what=f"{d.name}'s checkpoint") \
            == {"saved": True}
        states.append(read_checkpoint(d.home / "checkpoints" / "latest.pt")["worker"])
    src, got = states
    assert got["steps"] == src["steps"] > 0 and got["samples"] == src["samples"], (got["steps"], src["steps"])
    assert got["module"].keys() == src["module"].keys()
    for k, v in src["module"].items():
        assert torch.equal(got["module"][k], v), k
    so, go = src["optimizer"]["state"], got["optimizer"]["state"]
    assert so.keys() == go.keys() and so, "no optimizer state moved"
    for i, entry in so.items():
        for k, v in entry.items():
            assert torch.equal(torch.as_tensor(go[i][k]), torch.as_tensor(v)), (i, k)


def test_a_restarted_peer_resumes_its_stage_from_its_checkpoint_when_still_needed(cluster):
    """node1 (stage 0) drives through node2, the only peer of stage 1, which checkpoints every second. node2 is
    killed mid-run; with rebalancing off and no copies nobody takes stage 1 over, so node1's microbatches wait.
    node2 restarted on its home finds stage 1 still without a peer: it resumes it from its own checkpoint (its
    step, not a fresh start), and node1 finishes with nothing lost."""
    o = dict(stages=2, rebalance=False, copy_every=0.0, checkpoint_every=1.0, samples=4000, in_flight=1,
             d_model=64, block=64, n_heads=4)  # a few seconds of driving: long enough to kill node2 mid-run
    swarm = unique_swarm("rb")
    d1 = cluster.start("node1", config=config(swarm, initial_stage=0, **o), env=rank_env(0, 2))
    cfg2 = config(swarm, initial_stage=1, role="server", **o)
    d2 = cluster.start("node2", config=cfg2, env=rank_env(1, 2))
    d1.wait_until(lambda st: (trainer(st).get("samples") or 0) >= 160, timeout=START_S, what="node1 to be driving")
    wait_for(lambda: (d2.home / "checkpoints" / "latest.pt").exists(), timeout=30, what="node2's first checkpoint")
    time.sleep(1.5)  # one more checkpoint, of a stage that has stepped
    assert d2.kill() == -9
    saved = read_checkpoint(d2.home / "checkpoints" / "latest.pt")
    assert saved["stage"] == 1 and saved["worker"]["steps"] > 0, (saved["stage"], saved["worker"]["steps"])
    d1.wait_until(lambda st: driver(st).get("waiting"), timeout=30, what="node1's microbatches to wait for stage 1")
    d2 = cluster.start("node2", config=cfg2, env=rank_env(1, 2))  # the same home: its identity and checkpoint
    d2.wait_until(lambda st: stage_of(st) == 1, timeout=START_S, what="node2 to serve stage 1 again")
    # it serves the stage (status) a moment before it has loaded the checkpoint and said so (log): wait for both
    resumed = wait_for(lambda: re.search(r"resumed stage 1 from our checkpoint at step (\d+)", d2.log_path.read_text()),
                       timeout=30, what="node2 to say it resumed stage 1 from its checkpoint")
    assert int(resumed.group(1)) >= saved["worker"]["steps"], d2.log_path.read_text()[-2000:]
    st = d1.wait_until(lambda st: trainer(st).get("driving_done") and st, timeout=START_S + 60,
                       what="node1 to finish driving", progress=lambda st: trainer(st).get("samples"))
    t, dr = trainer(st), driver(st)
    assert t["samples"] == 4000 and t["microbatches_failed"] == 0 and dr["failed"] == 0, (t, dr)
    assert no_one_struck(st), (pipe(st).get("bans"), dr.get("verify"))

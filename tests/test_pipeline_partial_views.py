"""A swarm pipeline under partial views (`[membership] views = "partial"`, issue 30): a driver reaches the stage
servers the views never brought it a session with, by the addresses their announcements carry.

Eleven daemons on loopback, mDNS off, all joining through the first; gossip degree 2 (at most 3). Six run no
trainer (the contact among them): they make the swarm wider than the pipeline. Four serve a stage of 2 each.
Once every stage is announced, a driver joins: its sessions are the contact's (a plain daemon) and the two
or three its join's walk and split bring, so it has none with two or more of the four servers, whose
announcements reach it along the gossip graph. It drives its samples through both stages, calling every
server of each (the balancer tries a peer it never timed early): each one it has no session with is reached
by a lookup. It finishes without a failed microbatch, and the servers it reached answered its calls.
"""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from peer.bench.scale_real import partial_config
from peer.cli.status_view import render_status
from peer.testing.process import wait_for
from peer.testing.swarm import rank_env, unique_swarm
from tests.pipeline_status import driver, no_one_struck, pipe, trainer

# Serial: eleven daemons start at once, and beside another worker's daemons on 2 cores their heartbeats missed
# the 4 s `dead_after` at start-up (sessions closed, views of degree 1-3 reshuffled); twice in full runs
# (2026-11-28) one server then never saw a stage-0 record within START_S. Alone it passes in ~60 s.
pytestmark = [pytest.mark.slow, pytest.mark.serial]

SERVERS = 4  # 2 per stage
PLAIN = 6  # daemons with no trainer, the contact among them
TRAINER = "trainers.swarm_pipeline"
# the tiny char transformer of tests/test_pipeline_swarm.py, cut in 2 stages; the driver moves 64 samples
TINY = dict(d_model=32, n_layers=2, n_heads=2, block=16, microbatch=8, batch_size=16, stages=2, dropout=0.0,
            lr=3e-3, grad_clip=0.0, seed=0, join_wait=60.0, samples=64, in_flight=2)
TOPOLOGY = {"record_interval": 1.0, "target_degree": 2, "min_degree": 1, "max_degree": 3}
DRIVERS = 3  # drivers tried in turn until one lacks a session with a server it calls (see the test)
START_S = 120.0  # daemons importing torch on 2 cores, then the pipeline's settling: ~30 s here


def config(swarm: str, join: list[str], role: str = ""):
    if not role:
        return partial_config(swarm, join, topology=TOPOLOGY)
    return partial_config(swarm, join, trainer=TRAINER, options={**TINY, "role": role}, topology=TOPOLOGY)


def test_a_driver_reaches_stage_servers_it_has_no_session_with(cluster):
    swarm = unique_swarm("pipeviews")
    t0 = time.monotonic()
    contact = cluster.start("c1", config=config(swarm, []))
    listen = contact.wait_ready()["listen"]
    for i in range(2, PLAIN + 1):
        cluster.start(f"c{i}", config=config(swarm, [listen]))
    servers = [cluster.start(f"s{i}", config=config(swarm, [listen], "server"), env=rank_env(i, SERVERS))
               for i in range(SERVERS)]

    seen: list = []  # each server's stages with peers, at the last look: what a failure shows

    def both_stages_served() -> bool:
        sts = [d.try_status() for d in servers]
        seen[:] = [s and [e["stage"] for e in pipe(s).get("stage_map", []) if e["peers"]] for s in sts]
        return all(m == [0, 1] for m in seen)
    try:
        wait_for(both_stages_served, timeout=START_S, interval=0.5, what="the servers to cover both stages")
    except TimeoutError as exc:
        cluster.dump_logs()
        raise TimeoutError(f"{exc}; stages each server saw served: {seen}") from None

    served_s = time.monotonic() - t0
    server_ids = {s.peer_id for s in servers}
    # The premise (the driver has no session with a server it calls) comes from where its join's walks end,
    # and a walk may end at every server: then no lookup is needed and there is nothing to check. That driver
    # stops and a new one (a new key, new walks) joins, at most DRIVERS times; each is a fresh draw.
    for attempt in range(DRIVERS):
        d = cluster.start(f"driver{attempt}", config=config(swarm, [listen], "driver"), env=rank_env(0, 1))
        st = d.wait_until(lambda st: trainer(st).get("driving_done") and st, timeout=START_S, interval=0.5,
                          what="the driver to drive its samples", progress=lambda st: trainer(st).get("samples"))
        if pipe(st)["reach"]["dialed_servers"] or attempt == DRIVERS - 1:
            break
        print(f"driver {attempt}: its walks brought it a session with every server it called; another joins")
        assert d.stop() == 0
    t, dr, reach = trainer(st), driver(st), pipe(st)["reach"]
    print(f"both stages served after {served_s:.0f} s, the driver done after {time.monotonic() - t0:.0f} s")
    print(f"driver: {reach['dialed_servers']} servers reached by a lookup ({reach}); calls "
          f"{ {p[:8]: n for p, n in dr['calls'].items()} }; sessions {st['connected']}")
    assert t["samples"] == TINY["samples"] and t["microbatches_failed"] == 0 and dr["failed"] == 0, (t, dr)
    assert no_one_struck(st), pipe(st).get("bans")
    assert set(dr["calls"]) <= server_ids and len(dr["calls"]) >= 2, dr["calls"]
    # servers it had no session with were reached by their announcement, and answered its calls (any one of them:
    # a server that moved stage meanwhile may have refused the call it was reached for)
    assert reach["dialed_servers"] >= 1 and set(reach["dialed"]) <= server_ids, reach
    assert any(dr["calls"].get(p, 0) > 0 for p in reach["dialed"]), (reach, dr["calls"])
    assert reach["pending"] == 0, reach  # every lookup ended (reached, or failed by its deadline)
    console = Console(file=io.StringIO(), width=160)
    console.print(render_status(st))  # `peer status` shows the lookups
    assert f"{reach['dialed_servers']} servers reached" in console.file.getvalue()

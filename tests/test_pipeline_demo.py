"""The pipeline demo (`./dev demo pipeline`): its config builds the model the README describes, `peer local`
runs a pipeline to the end and prints its result, and `peer status` / `peer local status` show the stage map."""

from __future__ import annotations

import copy
import sys
from dataclasses import replace

import pytest
from rich.console import Console

from peer.cli.local import _training_finished
from peer.cli.pipeline_view import render_pipeline
from peer.cli.status_view import render_local_summary, render_status
from peer.config import load
from peer.testing.process import ManagedProcess
from peer.testing.swarm import unique_swarm, write_config
from tests.daemons import REPO
from trainers.options import parse_options
from trainers.swarm_pipeline import SwarmPipelineOptions, _check
from peer.testing.pace import scaled

CONFIG = REPO / "configs" / "train-pipeline.toml"
# The demo's model with everything that costs time shrunk, so 4 daemons finish in well under a minute.
TINY = dict(d_model=32, n_layers=2, n_heads=2, block=16, microbatch=8, batch_size=16, samples=160, dropout=0.0,
            lr=3e-3)


def test_the_demo_config_loads_and_builds_the_model_the_readme_describes():
    cfg = load(CONFIG)
    assert cfg.trainer.name == "trainers.swarm_pipeline"
    o = parse_options(SwarmPipelineOptions, cfg.trainer.options, trainer=cfg.trainer.name)
    _check(o)
    assert o.stages == 4 and 8 <= o.n_layers <= 12 and 256 <= o.d_model <= 512  # the size
    # activations crossing a cut are MBs-scale: microbatch x block x width floats
    assert o.microbatch * o.block * o.d_model * 4 >= 512 * 1024


def _status(stage_map_peers: list[list[dict]], *, bottleneck: int, waiting=(), avoided: str | None = None) -> dict:
    """A daemon's status with a pipeline section shaped as peer/pipeline/service.py writes it."""
    smap = []
    for s, peers in enumerate(stage_map_peers):
        smap.append({"stage": s, "capacity": float(sum(p["samples_per_s"] for p in peers)), "peers": peers})
    if avoided:
        smap[1]["peers"][0]["avoided"] = avoided
    return {
        "peer_id": "aaaaaaaa" + "x" * 12, "swarm": "demo", "protocol_version": 1, "version": "0", "listen": "127.0.0.1:1",
        "mdns": True, "ciphers": ["aes-256-gcm"], "uptime_s": 42.0, "pid": 1, "home": "/h", "connected": 3, "peers": [],
        "pipeline": {
            "pipeline": "shakespeare", "stages": len(smap), "cuts": [3, 5, 7], "my_stage": 0, "role": "server+driver",
            "bottleneck": bottleneck, "stage_map": smap,
            "server": {"served": 816, "refused": {"busy": 3}, "failed": 0, "queue": 2, "compute_s": 6.5,
                       "last_error": ""},
            "driver": {"done": 100, "failed": 1, "retried": 2, "resent": 5, "in_flight": 4, "evaluated": 4,
                       "samples": 800, "loss": 2.84, "waiting": list(waiting), "calls": {},
                       "failures": [{"microbatch": 7, "reason": "stage 3 loss: 5 calls failed"}], "deadline_s": 10.2},
        },
        "trainer": {"trainer": "trainers.swarm_pipeline", "state": "training", "loss": 3.0383, "val_loss": 2.9356,
                    "samples_per_s": 95.8, "samples": 800, "microbatches_done": 100, "microbatches_failed": 1,
                    "stage_steps": 138, "stage_samples": 2208, "stage_samples_per_s": 4902.3},
    }


def _peer(pid: str, speed: float, queue: int = 0, me: bool = False) -> dict:
    return {"peer_id": pid * 20, "samples_per_s": speed, "queue": queue, "me": me, "avoided": None}


def _text(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(renderable)
    return console.export_text()


def test_peer_status_shows_the_stage_map_and_the_accounting():
    st = _status([[_peer("a", 4535.0, me=True)], [_peer("b", 1393.0, 4), _peer("c", 700.0)], [], [_peer("d", 2766.0)]],
                 bottleneck=2, waiting=[{"stage": 2, "for_s": 12.0}],
                 avoided="avoided for 3.0s more: no answer within its 10.0s deadline")
    out = _text(render_status(st))
    assert "aaaaaaaa (me)" in out and "bbbbbbbb" in out and "cccccccc" in out and "dddddddd" in out
    assert "2 ◀ bottleneck" in out and "no live peer" in out  # the empty stage is the bottleneck, and says so
    assert "1393" in out and "2093" in out  # a peer's speed, its stage's capacity
    assert "avoided for 3.0s more" in out
    assert "100 done" in out and "2 retried (5 calls re-sent)" in out and "1 failed" in out and "4 in flight" in out
    assert "for stage 2 (12s)" in out and "3.0383" in out and "val loss 2.9356" in out
    assert "microbatch 7: stage 3 loss" in out
    assert "served  816 calls" in out and "refused busy 3" in out


def test_peer_status_shows_each_peers_memory_and_ours():
    """Memory is a budget (issue 28): each peer's use and budget in the stage map, ours with its source."""
    me = {**_peer("a", 4535.0, me=True), "memory_mib": 1960, "memory_used_mib": 1130}
    st = _status([[me], [_peer("b", 1393.0)]], bottleneck=1, waiting=[], avoided=None)
    st["pipeline"]["memory"] = {"budget_mib": 1960, "stage_room_mib": 1626, "used_mib": 1130,
                                "source": "[pipeline] memory_mib"}
    st["trainer"]["model_mib"] = 6058
    out = _text(render_status(st))
    assert "1130/1960" in next(line for line in out.splitlines() if "aaaaaaaa (me)" in line)
    assert "1130 MiB used of a 1960 MiB budget ([pipeline] memory_mib)" in out and "a stage may use 1626 MiB" in out
    assert "model 6058 MiB in all" in out


def test_peer_status_shows_moves_steps_copies_and_handed_back_calls():
    now = 1_000_000.0
    st = _status([[_peer("a", 4535.0, me=True)], [_peer("b", 1393.0, 4), _peer("c", 700.0)], [_peer("e", 0.0)],
                  [_peer("d", 2766.0)]], bottleneck=2)
    pl = st["pipeline"]
    for entry in pl["stage_map"]:
        for p in entry["peers"]:
            p["step"], p["moving_to"] = 1200 + entry["stage"], -1
    pl["stage_map"][1]["peers"][1]["moving_to"] = 2  # c is leaving stage 1 for the bottleneck
    pl["stage_map"][1]["peers"][1]["avoided"] = "avoided for 2.0s more: refused (moved)"
    pl["moving_to"] = 3
    pl["server"]["handed_back"] = 6
    long_reason = ("stage 2 is the bottleneck (812.4 samples/s); stage 1 has 2093.0: predicted 812.4 -> 1406.9 "
                   "samples/s (gain 73%, needed 10%)")
    pl["moves"] = [  # this peer (now on stage 0) went 1 -> 2 an hour ago, then took over stage 0 when it emptied
        {"at": now - 3725.0, "from": 1, "to": 2, "reason": long_reason, "took_s": 4.62, "dropped_samples": 24,
         "source": "dddddddd", "step": 977, "live": True, "mb": 12.34, "download_s": 0.61},
        {"at": now - 125.0, "from": 2, "to": 0, "reason": "stage 0 has no peer", "took_s": 1.4,
         "dropped_samples": 0, "source": "none (restarted)", "step": 0, "live": False, "mb": 0.0, "download_s": 0.0},
    ]
    pl["state_transfers"] = {"copies": [{"stage": 2, "step": 1180, "age_s": 125.2}, {"stage": 1, "step": 977,
                                                                                    "age_s": 30.0}],
                             "served": 2, "refused": {"busy": 1}, "fetched": 1, "fetch_failed": 1, "uploads": 1,
                             "last_error": "cccccccc: stage 3: refused (no_state): the copy is gone"}
    out = _text(render_pipeline(pl, st["trainer"], now=now))
    assert "my stage 0   moving to stage 3" in out
    assert "step" in out and "1201" in out and "1203" in out  # each peer's step
    c_row = next(line for line in out.splitlines() if "cccccccc" in line)
    assert "-> stage 2" in c_row and "avoided for 2.0s more" in c_row  # moving, and avoided after its hand-back
    assert "-> stage" not in next(line for line in out.splitlines() if "bbbbbbbb" in line)
    assert "handed back 6" in out and "served  816 calls" in out
    newest, oldest = (next(line for line in out.splitlines() if mark in line) for mark in ("2 -> 0", "1 -> 2"))
    assert out.index("2 -> 0") < out.index("1 -> 2")  # newest first
    assert "2m05s" in newest and "1.4s" in newest and "none (restarted): step 0" in newest
    assert "stage 0 has no peer" in newest
    assert "1h02m" in oldest and "4.6s" in oldest and "dddddddd: step 977 live, 12.3 MB in 0.6s" in oldest
    assert " 24 " in oldest and "stage 2 is the bottleneck" in oldest and "…" in oldest
    assert "(gain 73%" not in out  # the reason is cut to fit; --json has it whole
    assert "seating" not in out  # nothing decided, nothing cooling: no line
    pl["seating"] = {"order": {"to_stage": 1, "reason": "stage 1 has no peer"}, "moving": False, "cooling_from": 2,
                     "noise": 0.02, "settling": False}
    out = _text(render_pipeline(pl, st["trainer"], now=now))
    seat_line = next(line for line in out.splitlines() if "seating" in line)
    assert "ordered to stage 1: stage 1 has no peer" in seat_line and "stage 2 cooling down" in seat_line
    assert "stage 1 step 977 (30s old)   stage 2 step 1180 (2m05s old)" in out
    assert "2 sent   refused busy 1   1 sending   1 fetched   1 fetches failed" in out
    assert "refused (no_state): the copy is gone" in out


def test_peer_status_without_moves_shows_no_moves_block():
    st = _status([[_peer("a", 10.0, me=True)], [_peer("b", 9.0)]], bottleneck=1)
    st["pipeline"]["state_transfers"] = {"copies": [], "served": 0, "refused": {}, "fetched": 0, "fetch_failed": 0,
                                         "uploads": 0, "last_error": ""}
    st["pipeline"]["moves"], st["pipeline"]["moving_to"] = [], None
    out = _text(render_status(st))
    assert "moves" not in out and "moving to" not in out and "handed back" not in out and "aaaaaaaa (me)" in out
    st["pipeline"]["state_transfers"]["copies"] = [{"stage": 1, "step": 5, "age_s": 3.0}]  # a backup, no move yet
    out = _text(render_status(st))
    assert "moves" in out and "stage 1 step 5 (3s old)" in out and "0 sent" in out


def test_peer_local_table_shows_each_nodes_stage_and_ends_when_every_driver_is_done():
    a = _status([[_peer("a", 10.0, me=True)], [_peer("b", 9.0)], [_peer("c", 8.0)], [_peer("d", 7.0)]], bottleneck=3)
    b = copy.deepcopy(a)
    b["peer_id"], b["pipeline"]["my_stage"] = "bbbbbbbb" + "y" * 12, 3
    rows = [{"node": "node1", "status": a}, {"node": "node2", "status": b},
            {"node": "node3", "status": None, "error": "down"}]
    out = _text(render_local_summary(rows))
    assert "node1" in out and "node2" in out and "down" in out
    assert "3 ◀" in out and "stage map as node1 sees it" in out and "val loss" in out and "2.936" in out
    assert not _training_finished(rows)  # a pipeline's peers say "serving", never "done", once they finish driving
    a["trainer"]["driving_done"] = True
    assert not _training_finished(rows)
    b["trainer"]["driving_done"] = True
    assert _training_finished(rows)


@pytest.mark.slow
def test_the_pipeline_demo_runs_to_its_result(tmp_path):
    """`./dev demo pipeline` (peer local --config configs/train-pipeline.toml --demo) with 4 daemons, one a
    stage, and the model shrunk: every driver finishes, none loses a microbatch, the result line prints."""
    cfg = load(CONFIG)
    cfg = replace(cfg, daemon=replace(cfg.daemon, swarm=unique_swarm("pipe")),
                  trainer=replace(cfg.trainer, options={**cfg.trainer.options, **TINY}))
    path = write_config(tmp_path / "train-pipeline.toml", cfg)
    local = ManagedProcess("peer-local", [sys.executable, "-m", "peer", "local", "--root", str(tmp_path / "runs"),
                                          "--n", "4", "--config", str(path), "--demo", "--timeout", f"{scaled(150):g}"],
                           log_path=tmp_path / "local.out", cwd=REPO).start()
    try:
        code = local.wait_stopped(170)
    finally:
        local.stop()
    out = local.log_path.read_text(errors="replace")
    assert code == 0, out[-3000:]
    assert "pipeline training finished" in out and "0 failed" in out, out[-3000:]
    assert "node4" in out.split("pipeline training finished", 1)[1], out[-3000:]

"""`peer bench pipeline`: how its figures are read from polled statuses, and one small end-to-end run.

Speed is not asserted (the bench reports it); the run guards the plumbing: every field is there and sane.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from peer.bench.pipeline_codecs import CodecRun, codecs_of, figures
from peer.bench.pipeline_figures import Poll, busy_shares, bytes_per_microbatch, rate, recovery, stage_capacities
from peer.bench.pipeline_rebalance import (best_assignment, cpu_caps_from_shares, cumulative, fraction, moved, predicted,
                                           reported_moves, round_robin, series_rate, shares, speed_factors,
                                           stage_changes, stage_rates, windowed)
from peer.bench.pipeline_rebalance import recovery as churn_recovery
from peer.bench.pipeline_uneven import contention
from tests.daemons import REPO
from peer.testing.pace import scaled


def _st(samples: int, caps: list[float] | None = None) -> dict:
    smap = [{"stage": s, "capacity": c, "peers": [{"peer_id": f"p{s}", "samples_per_s": c}]}
            for s, c in enumerate(caps or [10.0, 10.0])]
    return {"pipeline": {"driver": {"samples": samples}, "stage_map": smap}}


def test_rate_counts_only_polls_where_every_driver_answered() -> None:
    polls = [Poll(0.0, [_st(0), _st(0)]), Poll(1.0, [_st(10), None]), Poll(2.0, [_st(20), _st(20)])]
    assert rate(polls, [0, 1], 0.0, 2.0) == pytest.approx(20.0)  # (40 - 0) / 2
    assert rate(polls, [0], 1.0, 2.0) == pytest.approx(10.0)
    assert rate(polls[:2], [0, 1], 0.0, 2.0) is None  # one usable poll


def test_stage_capacity_is_the_sum_of_its_peers_and_unmeasured_means_unknown() -> None:
    st = _st(0, [4.0, 6.0])
    st["pipeline"]["stage_map"][1]["peers"].append({"peer_id": "q", "samples_per_s": 3.0})
    assert stage_capacities(st, 2) == [4.0, 9.0]
    assert stage_capacities(_st(0, [4.0, 0.0]), 2) is None
    assert stage_capacities(st, 3) is None


def test_busy_share_is_the_compute_seconds_a_server_added_per_second() -> None:
    def st(compute_s: float | None, stage: int = 1) -> dict:
        return {"pipeline": {"my_stage": stage, "server": {"compute_s": compute_s}}}
    polls = [Poll(0.0, [st(1.0), st(0.0), None]), Poll(1.0, [st(1.5), None, st(5.0)]),
             Poll(4.0, [st(4.9, 2), st(3.0), st(6.0)])]
    assert busy_shares(polls, [0, 1, 2], 0.0, 4.0) == [{"stage": 2, "busy": 0.975}, {"stage": 1, "busy": 0.75},
                                                       {"stage": 1, "busy": 0.333}]
    assert busy_shares(polls, [1], 0.5, 4.0) == [None]  # seen in one poll only


def test_recovery_is_the_first_window_after_the_kill_back_within_ten_percent() -> None:
    # 10 samples/s, then nothing for 2 s after the kill at t=5, then 10 samples/s again
    counts, n = [], 0
    for i in range(21):
        t = i * 0.5
        counts.append((t, n))
        n += 0 if 5.0 <= t < 7.0 else 5
    polls = [Poll(t, [_st(c)]) for t, c in counts]
    got, trace = recovery(polls, [0], 5.0, 10.0, window=2.0)
    assert got == pytest.approx(2.0) and trace[0] == [0.0, 0.0]


def test_bytes_per_microbatch_per_codec() -> None:
    b = bytes_per_microbatch([8, 64, 256], 4, "float16", "raw", x_bytes=4096, y_bytes=4096)
    act = 8 * 64 * 256
    assert b["per_cut"] == {"raw": 8 * act, "float16": 4 * act, "q8": 2 * (act + 4 * (act // 4096))}
    assert b["via_driver"]["raw"] == 8 * 4 * act + 6 * 4 * act + 3 * 4096  # 3S-4 activations, 2S-2 gradients
    assert b["this_run"]["via_driver"] == 8 * 2 * act + 6 * 4 * act + 3 * 4096


@pytest.mark.slow
def test_bench_pipeline_tiny_loopback_run_reports_every_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "pipeline", "--tiny", "--daemons", "5",
                           "--duration", "10", "--window", "2", "--no-netns", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=scaled(300))  # ~60 s; minutes on a loaded host
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout)
    for key in ("samples_per_s", "slowest_stage_bound_samples_per_s", "efficiency", "bytes_per_microbatch", "done",
                "retried", "lost", "recovery_s", "request_deadline_s", "loss_vs_reference", "memory_vs_torch"):
        assert key in out, key
    assert out["loss_vs_reference"] > 0 and out["reference_samples"] > 0  # one process on as many samples
    assert out["memory_vs_torch"] is None  # --tiny skips the 67 M-parameter probes
    assert out["samples_per_s"] > 0 and out["slowest_stage_bound_samples_per_s"] > 0
    assert 0 < out["efficiency"] == pytest.approx(out["samples_per_s"] / out["slowest_stage_bound_samples_per_s"], rel=0.01)
    assert out["done"] > 0 and out["retried"] >= 0 and out["lost"] >= 0
    assert out["request_deadline_s"] > 0
    assert out["kill"]["done"] and out["kill"]["trace"]
    assert out["recovery_s"] is None or out["recovery_s"] >= 0
    assert sorted(out["bytes_per_microbatch"]["per_cut"]) == ["float16", "q8", "raw"]
    assert out["daemons"] == 5 and out["stages"] == 4 and sum(out["peers_per_stage"]) == 5
    assert out["cpu_cap"]["note"]  # capped, or a clear reason why not
    assert len(out["compute_busy_by_daemon"]) == 5
    assert all(b is None or 0 <= b["busy"] <= 1.5 for b in out["compute_busy_by_daemon"])


# ---- --codec (issue 28): pipeline_codecs.py ------------------------------------------------------------------
def _run(codec: str, val_loss: float | None, nbytes: int | None) -> CodecRun:
    return CodecRun(codec=codec, val_loss=val_loss, val_loss_by_driver=[val_loss], train_loss=None,
                    bytes_per_microbatch=nbytes, samples_per_s=1.0, done=10, failed=0, samples=80, cuts=[1, 2, 3],
                    startup_s=1.0, drive_s=1.0)


def test_raw_is_always_the_reference_and_named_once() -> None:
    assert codecs_of("q8") == ["raw", "q8"]
    assert codecs_of("q8, raw,float16,q8") == ["raw", "q8", "float16"]
    for bad in ("", "raw,bf16", ","):
        with pytest.raises(ValueError):
            codecs_of(bad)


def test_the_fewest_bytes_within_the_tolerance_is_recommended() -> None:
    runs = [_run("raw", 2.0, 1000), _run("float16", 2.01, 520), _run("q8", 2.06, 280)]
    out = figures(runs, tolerance=0.01)
    assert out["loss_gap_float16"] == pytest.approx(0.005) and out["loss_gap_q8"] == pytest.approx(0.03)
    assert out["bytes_ratio_float16"] == pytest.approx(0.52) and out["bytes_ratio_q8"] == pytest.approx(0.28)
    assert out["codecs"]["q8"]["loss_gap"] == pytest.approx(0.06) and out["same_cut"]
    assert out["recommended"] == "float16" and out["tolerance_relative"] == 0.01
    assert figures(runs, tolerance=0.05)["recommended"] == "q8"
    assert figures(runs, tolerance=0.001)["recommended"] == "raw"
    lower = [_run("raw", 2.0, 1000), _run("q8", 1.99, 280)]  # a lower loss is within any tolerance
    assert figures(lower, tolerance=0.0)["recommended"] == "q8"
    unmeasured = [_run("raw", 2.0, 1000), _run("q8", None, 280)]  # no loss: never recommended
    assert figures(unmeasured, tolerance=0.5)["recommended"] == "raw"
    assert figures(unmeasured, tolerance=0.5)["loss_gap_float16"] is None


@pytest.mark.slow
def test_bench_pipeline_tiny_codec_comparison_reports_every_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "pipeline", "--codec", "raw,q8", "--tiny",
                           "--samples", "480", "--no-netns", "--no-caps", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=scaled(300))  # ~40 s; minutes on a loaded host
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout)
    for key in ("codecs", "loss_gap_float16", "loss_gap_q8", "bytes_ratio_float16", "bytes_ratio_q8", "recommended",
                "tolerance_relative", "same_cut", "config"):
        assert key in out, key
    assert sorted(out["codecs"]) == ["q8", "raw"] and out["loss_gap_float16"] is None
    for codec, r in out["codecs"].items():
        assert r["val_loss"] is not None and math.isfinite(r["val_loss"]), (codec, r)
        assert r["done"] == 60 and r["failed"] == 0 and r["samples"] == 480 and r["samples_per_s"] > 0, (codec, r)
        assert r["bytes_per_microbatch"] > 0 and r["cuts"] == [1, 2, 3], (codec, r)
    assert math.isfinite(out["loss_gap_q8"]) and 0 < out["bytes_ratio_q8"] < 1
    assert out["same_cut"] and out["recommended"] in ("raw", "q8")
    assert out["config"]["drivers"] == 1 and out["config"]["in_flight_per_driver"] == 1


# ---- --uneven / --churn (issue 17): pipeline_rebalance.py ------------------------------------------------------
def test_brute_force_finds_the_hand_made_best_assignment() -> None:
    # 4 equal stages, peers of speed 2, 2, 1.5, 1, 1, 0.5 (speed = share of the model per second): the best
    # gives each stage 2 ({0}, {1}, {2, 5}, {3, 4}): 2 / 0.25 = 8 samples/s; round-robin leaves stage 3 with 1
    plan = shares([10.0, 10.0, 10.0, 10.0])
    speeds = [2.0, 2.0, 1.5, 1.0, 1.0, 0.5]
    rr = round_robin(6, 4)
    assert rr == (0, 1, 2, 3, 0, 1)
    assert predicted(rr, speeds, plan) == pytest.approx(4.0)
    best, thr = best_assignment(speeds, plan, start=rr)
    assert thr == pytest.approx(8.0)
    assert sorted(stage_rates(best, speeds, plan)) == pytest.approx([8.0] * 4)
    assert {frozenset(p for p in range(6) if best[p] == s) for s in range(4)} == \
        {frozenset({0}), frozenset({1}), frozenset({2, 5}), frozenset({3, 4})}
    assert moved(rr, best) == 2  # of the ties, the one closest to the start: two peers move
    assert best == (0, 1, 2, 3, 3, 2)


def test_brute_force_weighs_stages_by_their_planned_cost() -> None:
    # stage 0 costs 3x each other stage: the one fast peer belongs there, where it runs as fast as a slow one
    # elsewhere (1.5 / 0.5 = 0.5 / (1/6) = 3 samples/s); anywhere else stage 0 gets 0.5 / 0.5 = 1
    plan = shares([3.0, 1.0, 1.0, 1.0])
    speeds = [0.5, 1.5, 0.5, 0.5]
    best, thr = best_assignment(speeds, plan)
    assert best == (1, 0, 2, 3) and thr == pytest.approx(3.0)  # ties among the slow ones: the first in order
    assert predicted((0, 1, 2, 3), speeds, plan) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        best_assignment([1.0, 1.0], plan)  # fewer peers than stages


def test_speed_factor_is_measured_rate_times_planned_share() -> None:
    plan = shares([1.0, 3.0])
    v = speed_factors([40.0, 10.0], [0, 1], plan)
    assert v == pytest.approx([10.0, 7.5])
    assert stage_rates((1, 0), v, plan) == pytest.approx([30.0, 40 / 3])  # each peer on the other stage


def test_uneven_caps_add_up_to_the_cpus() -> None:
    assert cpu_caps_from_shares([2, 2, 1.5, 1, 1, 0.5], 2.0) == [0.5, 0.5, 0.375, 0.25, 0.25, 0.125]
    with pytest.raises(ValueError):
        cpu_caps_from_shares([1, 0], 2.0)


def _dst(samples: int, pid: int = 1, failed: int = 0, stage: int | None = 0) -> dict:
    return {"pid": pid, "pipeline": {"my_stage": stage, "driver": {"samples": samples, "failed": failed}}}


def test_cumulative_counts_survive_a_kill_and_a_restart() -> None:
    # daemon 1 drives 80 samples, is killed (no answer), comes back as a new process counting from 0
    polls = [Poll(0.0, [_dst(0), _dst(0, 2)]), Poll(1.0, [_dst(10), _dst(80, 2)]), Poll(2.0, [_dst(20), None]),
             Poll(3.0, [_dst(30), _dst(0, 3, stage=None)]), Poll(4.0, [_dst(40), _dst(16, 3, stage=2)])]
    assert [v for _, v in cumulative(polls)] == [0, 90, 100, 110, 136]
    assert series_rate(cumulative(polls), 1.0, 4.0) == pytest.approx(46 / 3)
    assert stage_changes(polls) == [{"at_s": 4.0, "daemon": 1, "from": 0, "to": 2}]


def test_churn_figures_on_synthetic_polls() -> None:
    # 10 samples/s; a kill at t=10 stops everything for 3 s, then 10 samples/s again; the fraction of a
    # best of 10 over the 20 s after the kill is 17/20
    polls, n = [], 0
    for i in range(61):
        t = i * 0.5
        polls.append(Poll(t, [_dst(n)]))
        n += 0 if 10.0 <= t < 13.0 else 5
    series = cumulative(polls)
    pre = series_rate(series, 8.0, 10.0)
    assert pre == pytest.approx(10.0)
    got, trace = churn_recovery(series, 10.0, pre, window=2.0, t_end=30.0)
    # the first 2 s window with >= 9 samples/s starts at 13 s (the one from 12.5 s holds 3 polls' progress: 7.5)
    assert got == pytest.approx(3.0) and trace[0] == [0.0, 0.0] and [2.5, 7.5] in trace
    assert fraction(series_rate(series, 10.0, 30.0), 10.0) == pytest.approx(0.85)
    assert churn_recovery(series, 10.0, 100.0, window=2.0, t_end=30.0)[0] is None  # never back to 90 of 100
    assert windowed(series, 0.0, 30.0, 10.0) == [[0.0, 10.0], [10.0, 7.0], [20.0, 10.0]]


def test_moves_reported_by_the_rebalancer_are_collected_when_present() -> None:
    sts = [{"pipeline": {"moves": [{"at": 105.0, "from": 0, "to": 3, "reason": "bottleneck", "took_s": 1.5}]}},
           {"pipeline": {}}, None]
    assert reported_moves(sts, t0_unix=100.0) == [{"daemon": 0, "at": 105.0, "from": 0, "to": 3,
                                                   "reason": "bottleneck", "took_s": 1.5, "at_s": 5.0}]


@pytest.mark.slow
def test_bench_pipeline_tiny_uneven_churn_run_reports_every_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "pipeline", "--tiny", "--daemons", "5", "--no-netns",
                           "--uneven", "--churn", "--warmup", "1", "--measure", "3", "--rebalance-for", "3",
                           "--churn-every", "4", "--churn-events", "1", "--window", "1", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=scaled(300))  # ~60 s idle; minutes on a loaded host
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout)
    for key in ("fraction_of_best_static", "fraction_of_best_rebalanced", "fraction_of_best_churn", "recovery_s",
                "lost", "lost_with_killed_drivers", "static", "best", "rebalanced", "churn", "speeds", "caps",
                "durations_s", "command"):
        assert key in out, key
    assert out["static"]["pinned"] == [0, 1, 2, 3, 0] and out["static"]["assignment"] == [0, 1, 2, 3, 0]
    best = out["best"]
    assert sorted(set(best["pinned"])) == [0, 1, 2, 3] and best["assignment"] == best["pinned"]
    assert best["predicted_samples_per_s"] >= out["static"]["predicted_samples_per_s"] > 0
    assert best["measured_samples_per_s"] > 0 and out["fraction_of_best_static"] > 0
    assert out["fraction_of_best_rebalanced"] > 0 and out["fraction_of_best_churn"] >= 0
    assert len(out["speeds"]["per_daemon"]) == 5 and len(out["speeds"]["plan_ms"]) == 4
    assert len(out["recovery_s"]) == 1 and len(out["churn"]["events"]) == 1
    assert out["churn"]["events"][0]["restarted_after_s"] >= 1
    assert out["lost"] >= 0 and out["lost_with_killed_drivers"] >= 0
    assert out["rebalanced"]["series"] and out["churn"]["series"]
    if out["caps"]["cpus"]:
        assert sum(out["caps"]["cpus"]) == pytest.approx(2.0, abs=0.01) and len(set(out["caps"]["cpus"])) > 1


def test_a_starved_slowest_stage_is_flagged() -> None:
    w = {"stage_capacity_samples_per_s": [30.0, 20.0, 40.0, 35.0], "assignment_at_end": [0, 1, 2, 3, 1],
         "cpu_used_of_cap": [0.5, 0.6, 0.4, 0.5, 0.95], "load_1m": [7.0, 8.0]}
    assert "stage (1) used 60%" in contention("best", w)
    w["cpu_used_of_cap"][1] = 0.9
    assert contention("best", w) is None

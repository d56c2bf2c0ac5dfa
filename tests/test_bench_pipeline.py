"""`peer bench pipeline`: how its figures are read from polled statuses, and one small end-to-end run.

Speed is not asserted (the bench reports it); the run guards the plumbing: every field is there and sane.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.bench.pipeline_figures import Poll, bytes_per_microbatch, rate, recovery, stage_capacities
from tests.daemons import REPO


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
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # ~60 s; minutes on a loaded host
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(proc.stdout)
    for key in ("samples_per_s", "slowest_stage_bound_samples_per_s", "efficiency", "bytes_per_microbatch", "done",
                "retried", "lost", "recovery_s", "request_deadline_s"):
        assert key in out, key
    assert out["samples_per_s"] > 0 and out["slowest_stage_bound_samples_per_s"] > 0
    assert 0 < out["efficiency"] == pytest.approx(out["samples_per_s"] / out["slowest_stage_bound_samples_per_s"], rel=0.01)
    assert out["done"] > 0 and out["retried"] >= 0 and out["lost"] >= 0
    assert out["request_deadline_s"] > 0
    assert out["kill"]["done"] and out["kill"]["trace"]
    assert out["recovery_s"] is None or out["recovery_s"] >= 0
    assert sorted(out["bytes_per_microbatch"]["per_cut"]) == ["float16", "q8", "raw"]
    assert out["daemons"] == 5 and out["stages"] == 4 and sum(out["peers_per_stage"]) == 5
    assert out["cpu_cap"]["note"]  # capped, or a clear reason why not

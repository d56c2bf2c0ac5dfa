"""`peer bench wan` (issue 41): the link it chooses, its per-outer-step figures and top-level keys from runs already
read (no processes), and one tiny end-to-end run in network namespaces."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.bench.train_gossip import peer_summary
from peer.bench.wan_figures import (choose_link_mbit, exchange_s, h100_mapping, loss_vs_tokens, mode_figures,
                                    per_peer_allreduce, per_peer_gossip, wan_figures)
from peer.testing.netns import netns_available
from peer.testing.pace import scaled

P100M = 106_616_129  # lm_100m


def test_the_link_makes_a_float32_exchange_ratio_times_a_round() -> None:
    mbit = choose_link_mbit(P100M, round_compute_s=8.0, ratio=5.0)
    assert exchange_s(P100M, mbit) / 8.0 == pytest.approx(5.0, rel=0.01)
    assert exchange_s(P100M, 100.0) == pytest.approx(34.1, abs=0.1)  # 426 MB at 100 Mbit/s
    h = h100_mapping(P100M, 5.0)
    assert h["round_compute_s"] == pytest.approx(6.82, abs=0.01)
    assert h["tokens_per_round"] == pytest.approx(6.82 * 989e12 * 0.4 / (6 * P100M), rel=0.01)
    with pytest.raises(ValueError):
        choose_link_mbit(P100M, 0.0, 5.0)


def _lines(rounds: list[int | None], compute: float, final_elapsed: float) -> list[dict]:
    """A local-mode peer's metrics: the meta line, one line per step (4 s each; the last also evaluates, 3 s),
    then the final line whose clock also holds the checkpoint."""
    out: list[dict] = [{"trainer": "trainers.gossip_sgd", "parameters": 10, "state": "training", "ts": 0.0}]
    for i, r in enumerate(rounds, 1):
        last = i == len(rounds)
        out.append({"step": i, "elapsed_s": 4.0 * i + 3.0 * last, "compute_s": compute * i / len(rounds),
                    "eval_s": 3.0 * last, "ts": 4.0 * i, "test_loss": 4.0 - i / 10,
                    **({"rounds": r, "rounds_skipped": 0} if r is not None else {})})
    out.append({"step": len(rounds), "elapsed_s": final_elapsed, "compute_s": compute, "ts": final_elapsed,
                "test_loss": 3.0, "reached_target": False})
    return out


def test_outer_steps_are_rounds_timed_inside_the_loop() -> None:
    peers = [peer_summary(_lines([1, 2, 3, 4], compute=12.0, final_elapsed=60.0), 0.0, "test_loss"),
             peer_summary(_lines([1, 2, 3, 4], compute=8.0, final_elapsed=40.0), 0.0, "test_loss")]
    raw = {"peers": peers, "netdev_tx_bytes_training": [4_000_000, 2_000_000]}
    each = per_peer_gossip("local", raw)
    assert [p["outer_steps"] for p in each] == [4, 4]
    # 16 s in the loop: not 60 with the checkpoint, nor 19 with the last step's evaluation
    assert [p["wall_per_outer_step"] for p in each] == [4.0, 4.0]
    assert [p["utilization"] for p in each] == [0.75, 0.5]
    assert [p["bytes_per_outer_step"] for p in each] == [1_000_000, 500_000]
    f = mode_figures(each)
    assert f["utilization"] == pytest.approx(0.625) and f["bytes_per_outer_step"] == 750_000
    ad = per_peer_gossip("adpsgd", raw)  # AD-PSGD: one exchange per step
    assert ad[0]["outer_steps"] == 4 and ad[0]["bytes_per_outer_step"] == 1_000_000


def test_allreduce_ranks_step_once_per_outer_step() -> None:
    raw = {"steps": 2, "elapsed_s_per_worker": [110.0, 110.0], "compute_s_per_worker": [10.0, 20.0],
           "eval_s_per_worker": [10.0, 10.0], "bytes_sent_per_worker_each": [600, 800]}
    each = per_peer_allreduce(raw)
    assert [p["wall_per_outer_step"] for p in each] == [50.0, 50.0]
    assert [p["utilization"] for p in each] == [0.1, 0.2] and each[1]["bytes_per_outer_step"] == 400


def test_a_peers_curve_has_a_point_per_evaluation() -> None:
    """gossip_sgd's lines carry the last held-out loss until the next evaluation (2026-11-29's run: a point
    per step)."""
    lines = [{"step": s, "elapsed_s": s, "ts": s, "test_loss": loss}
             for s, loss in ((1, None), (10, 2.8), (11, 2.8), (12, 2.8), (20, 2.7), (21, 2.7))]
    assert peer_summary(lines, 0.0, "test_loss")["test_loss_curve"] == [[10, 2.8], [20, 2.7]]


def test_loss_against_tokens_averages_peers_at_common_steps() -> None:
    curves = [[[10, 3.0], [20, 2.8]], [[10, 3.2], [20, 2.6], [30, 2.5]]]
    assert loss_vs_tokens(curves, tokens_per_step=100) == [[2000, 3.1], [4000, 2.7]]
    assert loss_vs_tokens([], 100) == []


def test_top_level_keys_and_the_sparse_figures() -> None:
    big = {"local": {"bytes_per_outer_step": 400.0, "compute_per_outer_step": 8.0, "utilization": 0.8,
                     "wall_per_outer_step": 10.0},
           "local_q8": {"bytes_per_outer_step": 100.0, "utilization": 0.9, "wall_per_outer_step": 9.0},
           "local_sparse": {"bytes_per_outer_step": 8.0, "utilization": 0.95, "wall_per_outer_step": 8.5},
           "allreduce": {"bytes_per_outer_step": 900.0, "utilization": 0.1, "wall_per_outer_step": 80.0}}
    small = {"local": {"seconds_to_target": 30.0}, "allreduce": {"seconds_to_target": 120.0},
             "local_sparse": {"seconds_to_target": 24.0}}
    out = wan_figures(params=P100M, link_mbit=85.0, planned_ratio=5.0, big=big, small=small,
                      curves={"local": [[1000, 3.0], [2000, 2.5]], "local_sparse": [[1000, 3.1], [2000, 2.55]]},
                      target=2.7)
    for key in ("params", "link_mbit", "exchange_to_compute_ratio", "modes", "bytes_ratio_vs_fp32", "utilization",
                "loss_gap", "time_to_target_vs_allreduce"):
        assert key in out
    assert out["exchange_to_compute_ratio"] == pytest.approx(exchange_s(P100M, 85.0) / 8.0, abs=0.01)
    assert out["bytes_ratio_vs_fp32"] == {"local_q8": 4.0, "local_sparse": 50.0}
    assert out["bytes_ratio_vs_fp32_copy"]["local_sparse"] == pytest.approx(P100M * 4 / 8.0, rel=1e-3)
    assert out["loss_gap"] == pytest.approx(0.02)  # at the most tokens both reached
    assert out["utilization"]["local"] == 0.8 and out["utilization"]["adpsgd"] is None
    assert out["utilization"]["local_sparse"] == 0.95
    assert out["time_to_target_vs_allreduce"] == 0.25 and out["time_to_target_vs_allreduce_sparse"] == 0.2
    assert out["modes"]["local"]["loss_vs_tokens"] == [[1000, 3.0], [2000, 2.5]]
    met = {g["goal"]: g["met"] for g in out["goals"]}
    assert met["params >= 1e8"] is True and met["time_to_target_vs_allreduce <= 0.2 (small model)"] is False
    assert met["time_to_target_vs_allreduce_sparse <= 0.2 (small model, sparse)"] is True
    assert met["bytes_ratio_vs_fp32 >= 100 (sparse)"] is False and met["utilization >= 0.9 with sparse and overlap"]
    assert met["loss_gap <= 0.02 (sparse vs local fp32, small model)"] is True
    bare = wan_figures(params=P100M, link_mbit=85.0, planned_ratio=5.0, big={}, small={}, curves={}, target=None)
    assert bare["loss_gap"] is None and bare["bytes_ratio_vs_fp32"]["local_sparse"] is None


TINY = json.dumps({"d_model": 16, "n_layers": 1, "n_heads": 2, "block": 16})


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 to create network namespaces")
def test_bench_wan_smoke() -> None:
    """Two peers, a tiny char transformer in both parts, two rounds: the JSON comes out with every key filled."""
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "bench", "wan", "--n", "2", "--link-mbit", "20",
         "--big-model", "char_transformer", "--big-model-options", TINY, "--big-modes", "local,allreduce,local_sparse",
         "--big-rounds", "2", "--big-allreduce-steps", "2", "--small-model", "char_transformer",
         "--small-model-options", TINY, "--small-modes", "local,allreduce,local_sparse", "--small-inner-steps", "2",
         "--small-steps", "20", "--small-allreduce-steps", "20", "--target-loss", "4.5", "--eval-every", "2",
         "--eval-samples", "16", "--timeout", f"{scaled(60):g}", "--json"],
        capture_output=True, text=True, timeout=scaled(240))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["link_mbit"] == 20 and out["params"] > 0 and out["loss_gap"] is not None
    ar, local = out["modes"]["allreduce"], out["modes"]["local"]
    assert ar["bytes_per_outer_step"] > 0 and ar["wall_per_outer_step"] > 0 and 0 < ar["utilization"] <= 1, out
    # a tiny local run may end before the bench's first poll sees it train: its bytes are then ~0, not missing
    assert local["bytes_per_outer_step"] is not None and local["utilization"] is not None, out
    assert ar["loss_vs_tokens"] and local["loss_vs_tokens"], out
    assert out["time_to_target_vs_allreduce"] is not None and out["modes"]["local_sparse"]["loss_vs_tokens"], out

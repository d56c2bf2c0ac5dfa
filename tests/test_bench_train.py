"""`peer bench train`: how time-to-target is read from the peers' metrics, and one small end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.bench.train_gossip import peer_summary, summarise_gossip
from peer.testing.pace import scaled


def _lines(start: float, evals: list[tuple[int, float, float]]) -> list[dict]:
    """The metrics lines one peer publishes: the meta line, then (step, elapsed_s, accuracy) per evaluation."""
    out = [{"trainer": "trainers.gossip_sgd", "parameters": 10, "state": "training", "ts": start}]
    for step, elapsed, acc in evals:
        out.append({"step": step, "epoch": step / 10, "elapsed_s": elapsed, "accuracy": acc,
                    "samples_per_s": step * 32 / elapsed, "ts": start + elapsed + 0.001})
    return out


def test_time_to_target_is_until_the_last_peer_from_the_first_start() -> None:
    fast = peer_summary(_lines(100.0, [(10, 1.0, 0.5), (20, 2.0, 0.96), (30, 3.0, 0.94)]), 0.95)
    slow = peer_summary(_lines(100.5, [(10, 1.0, 0.5), (20, 2.0, 0.90), (30, 3.0, 0.951)]), 0.95)
    assert fast["reached"] and fast["seconds_to_target"] == 2.0 and fast["epochs_to_target"] == 2.0
    assert slow["steps_to_target"] == 30
    run = {"peers": [fast, slow], "wire_bytes_out": [100, 300], "gossip_payload_bytes_sent": [50, 150],
           "exchanges": [4, 4], "failed_exchanges": [0, 0], "recent_exchange_s": [0.1, 0.3], "netdev_tx_bytes": None,
           "bench_wall_s": 9.0}
    s = summarise_gossip(run, 2)
    assert s["reached_target"] and s["peers_reached"] == 2
    assert s["seconds_to_target"] == pytest.approx(3.5)  # 100.0 -> 100.5 + 3.0
    assert s["seconds_to_target_first_peer"] == pytest.approx(2.0)
    assert s["epochs_to_target"] == 3.0 and s["bytes_sent_per_peer"] == 200


def test_a_peer_that_never_reaches_the_target_means_no_time() -> None:
    a = peer_summary(_lines(0.0, [(10, 1.0, 0.97)]), 0.95)
    b = peer_summary(_lines(0.0, [(10, 1.0, 0.80)]), 0.95)
    run = {"peers": [a, b], "wire_bytes_out": [1, 1], "gossip_payload_bytes_sent": [1, 1], "exchanges": [1, 1],
           "failed_exchanges": [0, 0], "recent_exchange_s": [], "netdev_tx_bytes": None, "bench_wall_s": 1.0}
    s = summarise_gossip(run, 2)
    assert not s["reached_target"] and s["seconds_to_target"] is None and s["peers_reached"] == 1


BENCH_SETUP_S = 60  # beside its modes' own bounds (--timeout each): imports, the profile, the single-process reference


@pytest.mark.slow
def test_bench_train_smoke() -> None:
    """Two daemons (AD-PSGD) and two gloo ranks reach an easy target; one JSON object comes out."""
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "bench", "train", "--n", "2", "--modes", "adpsgd,allreduce",
         "--target", "0.85", "--eval-every", "10", "--timeout", f"{scaled(70):g}", "--json"],
        capture_output=True, text=True, timeout=2 * scaled(70) + scaled(BENCH_SETUP_S))  # the bench bounds each mode
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    modes = result["modes"]
    assert modes["adpsgd"]["reached_target"] and modes["allreduce"]["reached_target"], result
    assert modes["allreduce"]["backend"] in ("gloo", "nccl")
    assert modes["adpsgd"]["seconds_to_target"] > 0 and modes["adpsgd"]["bytes_sent_per_peer"] > 0
    assert result["ratio_to_allreduce"] == pytest.approx(
        modes["adpsgd"]["seconds_to_target"] / modes["allreduce"]["seconds_to_target"], rel=0.01)


def test_a_loss_target_is_reached_by_falling_to_it() -> None:
    lines = [{"trainer": "trainers.gossip_sgd", "parameters": 10, "ts": 0.0}]
    lines += [{"step": s, "elapsed_s": s / 10, "test_loss": loss, "accuracy": 0.3, "ts": s / 10 + 0.001,
               **({"rounds": s // 20, "rounds_skipped": 0} if s < 60 else {})}
              for s, loss in ((20, 2.9), (40, 2.44), (60, 2.40))]
    p = peer_summary(lines, 2.45, "test_loss")
    assert p["reached"] and p["steps_to_target"] == 40 and p["test_loss_at_target"] == 2.44
    assert p["rounds"] == 2  # from the last line that has them (the trainer's final line does not)
    assert not peer_summary(lines, 2.3, "test_loss")["reached"]
    assert not peer_summary(lines, 0.0, "test_loss")["reached"]  # no target: never reached


def test_local_modes_are_gossip_sgd_local_with_their_outer_codec() -> None:
    from peer.bench.train_plan import Plan

    plan = Plan("char_transformer", 2.45, 10, 0.0, {}, [], {}, {}, {}, metric="test_loss", inner_steps=20,
                local_eval_every=20)
    assert plan.mode_options("adpsgd") == {"mode": "adpsgd"}
    assert plan.mode_options("local") == {"mode": "local", "inner_steps": 20, "eval_every": 20, "outer_codec": "raw"}
    q8 = plan.mode_options("local_q8")
    assert q8["mode"] == "local" and q8["outer_codec"] == "q8" and q8["outer_error_feedback"] is True


def test_lm_figures_ratios_and_goals() -> None:
    from argparse import Namespace

    from peer.bench.train_lm import lm_figures
    from peer.bench.train_plan import Plan

    plan = Plan("char_transformer", 2.45, 10, 0.0, {"batch_size": 16, "eval_samples": 512}, [], {}, {}, {},
                metric="test_loss", inner_steps=20, local_eval_every=20)
    run = lambda s, b, sps: {"reached_target": True, "seconds_to_target": s, "bytes_sent_per_peer": b,  # noqa: E731
                             "samples_per_s_per_peer": sps}
    modes = {"local": run(10.0, 1000, 400.0), "local_q8": run(11.0, 250, 400.0), "adpsgd": run(25.0, 9000, 300.0),
             "allreduce": {**run(40.0, 50000, 64.0), "bytes_sent_estimate_ring": 660_000 * 100, "steps_to_target": 100}}
    f = lm_figures(modes, plan, Namespace(link_mbit=20.0))
    assert f["ratio_local_to_allreduce"] == 0.25 and f["ratio_local_to_adpsgd"] == 0.4
    assert f["bytes_ratio_q8_to_float32"] == 0.25 and f["bytes_per_peer_to_target"]["allreduce"] == 50000
    modes["local"]["bytes_sent_training_per_peer"] = 800  # the training window counts where it was measured
    assert lm_figures(modes, plan, Namespace(link_mbit=20.0))["bytes_ratio_q8_to_float32"] == 0.312
    assert [g["met"] for g in f["goals"]] == [False, True, True]
    assert f["profile"]["allreduce_s_per_step"] == 0.25 and f["profile"]["allreduce_link_s_per_step"] == 0.264
    modes["local_q8"]["reached_target"] = False  # bytes to the loss only where the loss was reached
    assert lm_figures(modes, plan, Namespace(link_mbit=0.0))["bytes_ratio_q8_to_float32"] is None


@pytest.mark.slow
@pytest.mark.timeout(4 * 60 + BENCH_SETUP_S + 30)  # past the subprocess's own bound (conftest scales it)
def test_bench_train_language_model_smoke() -> None:
    """Two peers per mode train the small char transformer to an easy loss on loopback: local (float32 and 8-bit
    outer exchanges), AD-PSGD and gloo all-reduce; every figure of issue 20 comes out."""
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "bench", "train", "--model", "char_transformer", "--n", "2",
         "--target-loss", "2.9", "--max-steps", "120", "--inner-steps", "10", "--repeats", "1", "--timeout", f"{scaled(60):g}",
         "--json"],
        capture_output=True, text=True, timeout=4 * scaled(60) + scaled(BENCH_SETUP_S))  # four modes, each bounded by the bench
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    modes = result["modes"]
    assert set(modes) == {"local", "local_q8", "adpsgd", "allreduce"} and result["target_test_loss"] == 2.9
    for mode, r in modes.items():
        assert r["reached_target"] and r["seconds_to_target"] > 0 and r["bytes_sent_per_peer"] > 0, (mode, r)
    assert all(x <= 2.9 for x in modes["local"]["test_loss_at_target_per_peer"])
    assert modes["allreduce"]["test_loss_at_target"] <= 2.9
    assert modes["local"]["rounds_per_peer"] and all(r >= 1 for r in modes["local"]["rounds_per_peer"])
    for key, num, den in (("ratio_local_to_allreduce", "local", "allreduce"),
                          ("ratio_local_to_adpsgd", "local", "adpsgd")):
        assert result[key] == pytest.approx(modes[num]["seconds_to_target"] / modes[den]["seconds_to_target"], rel=0.01)
    assert result["bytes_ratio_q8_to_float32"] == pytest.approx(
        modes["local_q8"]["bytes_sent_per_peer"] / modes["local"]["bytes_sent_per_peer"], rel=0.01)
    assert result["local"]["inner_steps"] == 10 and len(result["goals"]) == 3
    assert all(g["value"] is not None and isinstance(g["met"], bool) for g in result["goals"])
    assert all(result["profile"][f"{m}_s_per_step"] > 0 for m in modes)

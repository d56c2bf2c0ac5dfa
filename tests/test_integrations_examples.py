"""The framework examples (issue 42), run as a user runs them: one command starts 3 local peers (each its own
daemon inside its process) and the single-process reference on the same total samples, then compares.

What is checked is what the README promises: every peer within 3 points of the single process's held-out
accuracy, and the peers' final models within 1% of their norm of each other. Each example uses the real
framework (transformers, accelerate, lightning) with a tiny model built from code or a config: no download.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
GAP_POINTS = 3.0  # issue 42: each peer within 3 points of the single-process (DDP-equivalent) run
MODELS_APART = 0.01  # ... and the peers' final models within 1% of their norm
RUN_TIMEOUT_S = 600


def run_example(script: str, *args: str, agree: bool = True) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "examples" / script), *args], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"{script} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                           f"{proc.stderr[-5000:]}"
    summary = json.loads(lines[-1])
    logs = Path(summary["logs"])

    def explain() -> str:
        return json.dumps(summary) + "".join(f"\n--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(logs.glob("*.log")))

    assert len(summary["peers"]) == 3, explain()
    assert summary["worst_gap"] <= GAP_POINTS, explain()
    if agree:
        assert summary["models_apart"] <= MODELS_APART, explain()
    for role in ("peer0", "peer1", "peer2"):
        result = json.loads((logs / f"{role}.json").read_text())
        ex = result["exchanges"]
        assert ex["initiated"] + ex["served"] > 0, explain()  # it trained in the swarm, not alone
    return summary


def test_hugging_face_trainer_example():
    pytest.importorskip("transformers")
    run_example("hf_trainer.py", "--steps", "120")


def test_hugging_face_trainer_late_joiner_starts_from_the_swarms_model():
    """The third peer starts once the others train: it downloads their model (at their step) before its first
    step, and ends as good; the others settle while it still trains, up to settle's bound, so the models'
    agreement is not asked of this run."""
    pytest.importorskip("transformers")
    summary = run_example("hf_trainer.py", "--steps", "120", "--late-peer", agree=False)
    late = summary["joined_at_step"][2]
    assert late is not None and late > 0, summary


def test_lightning_example():
    pytest.importorskip("lightning")
    run_example("lightning_digits.py", "--steps", "200")


def test_accelerate_example_with_bf16():
    pytest.importorskip("accelerate")
    summary = run_example("accelerate_loop.py", "--steps", "200", "--mixed-precision", "bf16")
    assert summary["steps"] == 200


def test_torchrun_example_two_gloo_ranks_per_peer():
    """Each peer a torchrun job of 2 gloo ranks (DDP inside, rank 0 gossips); the reference has all 6 ranks'
    batch in one process."""
    summary = run_example("torchrun_digits.py", "--steps", "200")
    assert summary["steps"] == 200

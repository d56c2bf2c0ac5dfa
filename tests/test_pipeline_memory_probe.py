"""The memory plan against what a stage really holds (issue 39, item 3): `trainers/pipeline/memory_probe.py` runs a
stage of two 4096² blocks (33 M parameters) as the daemon serves it, in a fresh process, and reads its peak; the
plan's estimate (trainers/pipeline/memory.py) must not be below it, nor far above (a plan that over-counts refuses
cuts that fit). Ratios to plain torch are `peer bench pipeline --memory`'s (a benchmark, not a test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

OVER_AT_MOST = 1.5  # measured 1.13-1.16 (docs/benchmarks.md, 2026-11-28, fourth session); room for another machine


def peak(optimizer: str, max_held: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "trainers.pipeline.memory_probe", "--mode", "stage",
                           "--model", "trainers.pipeline.wide:issue_stage", "--data", "trainers.pipeline.wide:digits",
                           "--lo", "1", "--hi", "3", "--optimizer", optimizer, "--max-held", str(max_held),
                           "--microbatches", "12"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_plans_estimate_covers_a_stages_measured_peak(optimizer):
    got = peak(optimizer, max_held=0)
    print(got)
    assert got["above_baseline_mib"] <= got["estimate_mib"] <= OVER_AT_MOST * got["above_baseline_mib"], got

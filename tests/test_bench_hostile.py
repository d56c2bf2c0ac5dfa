"""`peer bench hostile` end to end with three quick attack classes: it must run them from attacker processes
against a real victim beside an honest peer and print its keys. The bounds themselves are the attack
tests' (tests/test_attack_*.py) and the bench's figures; this guards the bench's own plumbing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.daemons import REPO
from peer.testing.pace import scaled

pytestmark = pytest.mark.slow


def test_bench_hostile_runs_three_classes_and_reports_each():
    classes = ["oversized_peer_record", "params_as_non_neighbour", "circuit_flood"]
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "hostile", "--classes", ",".join(classes), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=scaled(180))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["passed"] is True and list(out["classes"]) == classes
    for name, c in out["classes"].items():
        for key in ("passed", "rss_growth_mb", "dropped_after_s", "honest_exchanges_continued", "detail"):
            assert key in c, (name, key)
        assert c["passed"] and c["honest_exchanges_continued"] and c["rss_growth_mb"] < 64, (name, c)
    # dropped at decode time; refused with the session kept
    assert out["classes"]["oversized_peer_record"]["dropped_after_s"] <= out["goal"]["dropped_within_s"]
    assert "90000 addresses" in out["classes"]["oversized_peer_record"]["detail"]["reason"]
    assert out["classes"]["params_as_non_neighbour"]["dropped_after_s"] is None
    assert out["classes"]["params_as_non_neighbour"]["detail"]["facts"]["session_kept"] is True
    # a flood class says whether a second honest peer got in during it, how fast, and the victim's descriptors
    flood = out["classes"]["circuit_flood"]["flood"]
    assert flood["honest_completed"] and flood["honest_first_try"] and flood["honest_latency_s"] > 0, flood
    assert flood["victim_fds_start"] <= flood["victim_fds_max"] <= flood["fd_bound"], flood


def test_bench_hostile_refuses_an_unknown_class():
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "hostile", "--classes", "nope", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 2 and "unknown classes" in proc.stderr

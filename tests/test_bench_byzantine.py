"""`peer bench byzantine` end to end at its smallest: one liar among three daemons, one attack, one topology,
and the exchange-time comparison on a small vector. The figures are the bench's; this guards its plumbing
(every key the issue asks for is there, the liar's status is read, no run failed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.daemons import REPO
from peer.testing.pace import scaled

pytestmark = pytest.mark.slow


def test_bench_byzantine_smoke_reports_every_figure():
    argv = [sys.executable, "-m", "peer", "bench", "byzantine", "--n", "3", "--fractions", "1/3", "--attacks",
            "sign_flip", "--topologies", "rewired", "--steps", "30", "--eval-every", "30", "--no-cost",
            "--exchange-size", "1MiB", "--exchange-rounds", "2", "--exchange-repeat", "1", "--json"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=scaled(400))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    for key in ("worst_drop_points_eighth", "worst_drop_points_quarter", "honest_banned", "no_attack_cost_points",
                "no_attack_exchange_time_ratio", "attacks", "goals", "met", "radius_max_ratio"):
        assert key in out, key
    assert out["errors"] == 0 and out["no_attack_exchange_time_ratio"] > 0
    f = out["attacks"]["sign_flip"]["1/3"]["rewired"]
    assert len(f["per_peer"]) == 2 and f["detectable"] is True and f["liars"] == 1
    assert f["liar_status"][0]["attack"] == "sign_flip" and f["liar_status"][0]["learned"] > 0
    assert out["no_attack"]["rewired/1/3"]["worst_drop"] == 0.0
    assert out["no_attack"]["rewired/1/3"]["radius_max_to_honest"] > 0  # read from the honest daemons' statuses

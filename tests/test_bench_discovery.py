"""`peer bench discovery` end to end with 3 daemons and one trial: it must run and print every figure.
Speed is not asserted (the bench reports it); this guards its plumbing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peer.testing.swarm import swarm_config, unique_swarm, write_config
from tests.daemons import REPO
from peer.testing.pace import scaled

pytestmark = pytest.mark.slow


def test_three_daemons_one_trial(tmp_path):
    cfg = write_config(tmp_path / "c.toml", swarm_config(swarm=unique_swarm("disc")))  # not `local`: tests run at once
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "discovery", "--n", "3", "--trials", "1",
                           "--config", str(cfg), "--json"], cwd=REPO, capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["n"] == 3 and out["trials"] == 1
    assert out["seconds_until_all_connected"] > 0 and len(out["trial_seconds"]) == 1
    assert out["rss_mb_per_idle_daemon"] > 0 and out["rss_mb_max"] >= out["rss_mb_per_idle_daemon"]

"""`peer bench attach` end to end, small: every figure is there and the sum is kept (speed is not judged).
The bytes-per-host half runs the shipped example under torchrun, as tests/test_attach.py does; here only
its figures' arithmetic is checked, on a run of 10 steps."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.daemons import REPO
from peer.testing.pace import scaled

pytestmark = pytest.mark.slow


def test_bench_attach_smoke_reports_every_figure():
    out = subprocess.run([sys.executable, "-m", "peer", "bench", "attach", "--size", "1MiB", "--rounds", "3",
                          "--repeat", "1", "--steps", "10", "--average-every", "5", "--json"],
                         capture_output=True, text=True, timeout=scaled(240), cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout)
    for key in ("hosted_exchange_s", "attached_exchange_s", "attached_call_s", "overhead_ratio"):
        assert r[key] > 0, key
    assert len(r["samples"]["hosted_s"]) == len(r["samples"]["attached_call_s"]) == 3
    b = r["bytes_per_host"]
    assert b["ranks_as_one_peer"]["peers_per_host"] == 1 and b["ranks_as_peers"]["peers_per_host"] == 2
    assert b["ranks_as_one_peer"]["averaging_bytes_per_host_per_step"] > 0 and b["expected_ratio"] == 0.5

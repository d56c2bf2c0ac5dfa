"""`peer bench transport` end to end with a small tensor: it must run and print every figure.

Speed is not asserted here (benchmarks report it); this guards the bench's own plumbing, including the
both-ways round (two processes streaming to each other at once over one sealed session).
"""

from __future__ import annotations

import json
import subprocess
import sys

from protocol.cipher import CIPHERS
from tests.daemons import REPO
from peer.testing.pace import scaled


def test_small_tensor_one_way_and_both_ways():
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "transport", "--size", "4MiB", "--rounds", "2",
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=scaled(90))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["payload_bytes"] == 4 << 20 and out["rounds"] == 2
    for key in ("seconds", "encrypted_gbps", "plain_tcp_gbps", "aead_seal_gbps", "both_ways_seconds"):
        assert out[key] > 0, key
    assert out["cipher"] in CIPHERS

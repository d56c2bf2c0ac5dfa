"""`peer bench average` end to end with a small tensor: it must run, preserve the sum and print its keys.

Speed is not asserted here (benchmarks report it); this guards the bench's own plumbing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from protocol.cipher import CIPHERS
from tests.daemons import REPO
from peer.testing.pace import scaled

pytestmark = pytest.mark.slow


def _bench(*argv: str, timeout: float = 90) -> tuple[int, dict | None, str]:
    proc = subprocess.run([sys.executable, "-m", "peer", "bench", "average", "--json", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    try:
        return proc.returncode, json.loads(proc.stdout), proc.stderr
    except ValueError:
        return proc.returncode, None, proc.stdout + proc.stderr


def test_two_peers_small_tensor():
    rc, out, err = _bench("--peers", "2", "--size", "256KiB", "--rounds", "5", "--settle", "0.5", "--timeout", f"{scaled(60):g}")
    assert rc == 0 and out is not None, err
    for key in ("peers", "payload_bytes", "rounds", "seconds_per_exchange", "effective_gbps", "sum_preserved",
                "cipher", "notes"):
        assert key in out, key
    assert out["peers"] == 2 and out["payload_bytes"] == 256 * 1024 and out["rounds"] == 5
    assert out["sum_preserved"] is True
    assert out["seconds_per_exchange"] > 0 and len(out["exchange_samples_s"]) == 5
    assert out["cipher"] in CIPHERS
    assert out["defence"] is True


def test_two_peers_without_the_defence():
    """The benchmark's switch reaches the daemons: they report the defence off, and the sum is still kept
    (neither side clips)."""
    rc, out, err = _bench("--peers", "2", "--size", "256KiB", "--rounds", "3", "--settle", "0.5", "--timeout", f"{scaled(60):g}",
                          "--no-defence")
    assert rc == 0 and out is not None, err
    assert out["defence"] is False and out["sum_preserved"] is True


def test_bad_arguments_fail_cleanly():
    rc, out, err = _bench("--peers", "1")
    assert rc == 1 and out is None and "--peers" in err

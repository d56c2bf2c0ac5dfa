"""`peer local`, the quick start's main job: N real daemons on this host, logs streamed or a live table,
`peer local status` / `peer local stop` from another terminal, and every daemon stopped on the way out."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from peer.config import load
from peer.home import Home
from peer.testing.process import ManagedProcess, wait_for
from peer.testing.swarm import node_homes, unique_swarm, write_config
from tests.daemons import REPO
from peer.testing.pace import scaled

pytestmark = pytest.mark.slow


def own_swarm(tmp_path, config: str):
    """A shipped config under a swarm name of its own, so tests running at once never meet."""
    cfg = load(REPO / "configs" / config)
    return write_config(tmp_path / config, replace(cfg, daemon=replace(cfg.daemon, swarm=unique_swarm("loc"))))


def peer_local(tmp_path, *args: str) -> ManagedProcess:
    return ManagedProcess("peer-local", [sys.executable, "-m", "peer", "local", "--root", str(tmp_path / "runs"), *args],
                          log_path=tmp_path / "local.out", cwd=REPO).start()


def run_peer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer", *args], capture_output=True, text=True, cwd=REPO, timeout=scaled(60))


def test_peer_local_streams_logs_and_is_stopped_by_peer_local_stop(tmp_path):
    cfg = own_swarm(tmp_path, "local.toml")
    root = tmp_path / "runs"
    local = peer_local(tmp_path, "--n", "2", "--config", str(cfg), "--timeout", f"{scaled(120):g}")
    try:
        def connected():
            r = run_peer("local", "status", "--root", str(root), "--json")
            rows = json.loads(r.stdout) if r.returncode == 0 else []
            return len(rows) == 2 and all(row["status"] and row["status"]["connected"] == 1 for row in rows)
        wait_for(connected, timeout=60, what="peer local's 2 daemons to connect", interval=0.5)
        assert [h.name for h in node_homes(root)] == ["node1", "node2"]
        r = run_peer("local", "status", "--root", str(root))
        assert r.returncode == 0 and "node1" in r.stdout and "node2" in r.stdout
        assert run_peer("local", "stop", "--root", str(root)).returncode == 0
        assert local.wait_stopped(40) == 0, local.log_tail()
    finally:
        local.stop()
    out = local.log_path.read_text()
    assert "[node1]" in out and "[node2]" in out  # each daemon's log streamed with its name
    assert "INFO" in Home(root / "node1").log_file.read_text()  # and kept in its home


def test_peer_local_demo_trains_to_the_target_and_exits(tmp_path):
    """The quick start's `./dev demo`, with 2 daemons instead of 4 to keep the suite short."""
    cfg = own_swarm(tmp_path, "train-digits.toml")
    local = peer_local(tmp_path, "--n", "2", "--config", str(cfg), "--demo", "--timeout", f"{scaled(240):g}")
    try:
        code = local.wait_stopped(260)
    finally:
        local.stop()
    out = local.log_path.read_text(errors="replace")
    assert code == 0, out[-3000:]
    assert "training finished" in out and "2/2 peers reached the 95% target" in out, out[-3000:]
    assert re.search(r"dashboard: +http://127\.0\.0\.1:\d+/ ", out), out[:2000]  # node1's, printed at start


def test_peer_local_demo_stops_at_once_when_every_trainer_fails(tmp_path):
    """A trainer that raises at start: the demo does not wait for its timeout; it exits 1 with each cause."""
    cfg = load(REPO / "configs" / "train-digits.toml")
    broken = cfg.replace(daemon={"swarm": unique_swarm("loc")},
                         trainer={"options": {**cfg.trainer.options, "model_factory": "tests.user_data:broken_model"}})
    path = write_config(tmp_path / "broken.toml", broken)
    local = ManagedProcess("peer-local", [sys.executable, "-m", "peer", "local", "--root", str(tmp_path / "runs"),
                                          "--n", "2", "--config", str(path), "--demo", "--timeout", f"{scaled(300):g}"],
                           log_path=tmp_path / "local.out", cwd=REPO, env={"PYTHONPATH": str(REPO)}).start()
    t0 = time.monotonic()
    try:
        code = local.wait_stopped(120)
    finally:
        local.stop()
    took = time.monotonic() - t0
    out = local.log_path.read_text(errors="replace")
    assert code == 1, out[-3000:]
    assert took < 90, f"took {took:.0f}s: the demo waited instead of stopping at the failure"
    assert "every trainer failed" in out, out[-3000:]
    for node in ("node1", "node2"):
        assert f"{node}: RuntimeError: this model factory always fails" in out, out[-3000:]
        assert str(tmp_path / "runs" / node / "daemon.log") in out, out[-3000:]

"""Checkpoints are data: what the gossip trainer saves loads with torch.load(weights_only=True), and a
checkpoint planted in a home that would run code when unpickled is refused by the trainer host and by
`peer export`, with the reason, and runs nothing (issue 15, class 8)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from peer.home import Home, atomic_write
from peer.trainer_host import TrainerSwarm
from peertrain.checkpoints import CheckpointRefused, read_checkpoint
from tests.daemons import REPO
from trainers.baseline import make_optimizer, seeded_model
from trainers.gossip_sgd import GossipSGDOptions
from peer.testing.pace import scaled


class _WritesAFile:
    """Unpickling this runs a shell command that creates `marker` (what a planted checkpoint could do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _trainer_state(optimizer: str) -> dict:
    """A checkpoint as trainers/gossip_sgd.py's save() builds it, after a real optimizer step."""
    model = seeded_model("digits_mlp", 0)
    opt = make_optimizer(model.parameters(), optimizer, lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    o = GossipSGDOptions()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7,
            "model_name": o.model_factory or o.model, "options": asdict(o)}


def _host(home: Path) -> TrainerSwarm:
    return TrainerSwarm(SimpleNamespace(daemon=SimpleNamespace(home=Home(home), peer_id="p" * 20)))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_what_the_gossip_trainer_saves_loads_as_data(tmp_path, optimizer) -> None:
    state = _trainer_state(optimizer)
    swarm = _host(tmp_path)
    swarm.save_checkpoint(state)
    loaded = swarm.load_checkpoint()
    assert loaded is not None and loaded["step"] == 7 and loaded["options"] == state["options"]
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


def test_a_checkpoint_that_would_run_code_is_refused_by_the_trainer_host(tmp_path, caplog) -> None:
    marker = tmp_path / "pwned"
    swarm = _host(tmp_path / "home")
    swarm.save_checkpoint({"model": {}, "step": 1, "x": _WritesAFile(marker)})
    with pytest.raises(CheckpointRefused, match="loading it could run code"):
        read_checkpoint(Home(tmp_path / "home").latest_checkpoint)
    with caplog.at_level(logging.ERROR, logger="peertrain.trainer"):
        assert swarm.load_checkpoint() is None
    assert "refusing checkpoint" in caplog.text and "starting without it" in caplog.text
    assert not marker.exists()


@pytest.mark.process
def test_peer_export_refuses_a_checkpoint_that_would_run_code_and_writes_nothing(tmp_path) -> None:
    home, marker, out = Home(tmp_path / "home"), tmp_path / "pwned", tmp_path / "model.pt"
    buf = io.BytesIO()
    torch.save({"model": {}, "step": 1, "x": _WritesAFile(marker)}, buf)
    atomic_write(home.latest_checkpoint, buf.getvalue(), mode=0o600)
    r = subprocess.run([sys.executable, "-m", "peer", "export", "--home", str(home.root), str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=scaled(120))
    assert r.returncode == 2 and "refusing checkpoint" in r.stderr, r.stdout + r.stderr
    assert not marker.exists() and not out.exists()


@pytest.mark.process
def test_peer_export_writes_a_file_that_loads_as_data(tmp_path) -> None:
    home, out = Home(tmp_path / "home"), tmp_path / "model.pt"
    _host(home.root).save_checkpoint(_trainer_state("sgd"))
    r = subprocess.run([sys.executable, "-m", "peer", "export", "--home", str(home.root), str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=scaled(120))
    assert r.returncode == 0, r.stdout + r.stderr
    saved = torch.load(out, weights_only=True)
    assert saved["step"] == 7 and saved["model_name"] == "digits_mlp"


@pytest.mark.process
def test_a_daemon_whose_home_holds_a_planted_checkpoint_refuses_it_and_trains_afresh(cluster, tmp_path) -> None:
    """A real daemon hosting the gossip trainer, started on a home where someone planted a checkpoint that
    runs a command when unpickled: the daemon logs the refusal, runs nothing, and trains from scratch."""
    from tests.daemons import config_file, rank_env, unique_swarm, wait_for

    home, marker = Home(tmp_path / "home"), tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({**_trainer_state("sgd"), "step": 50, "x": _WritesAFile(marker)}, buf)
    atomic_write(home.latest_checkpoint, buf.getvalue(), mode=0o600)
    cfg = config_file(tmp_path / "c.toml", swarm=unique_swarm(), mdns=False, trainer="trainers.gossip_sgd",
                      options={"model": "digits_mlp", "world": 1, "min_peers": 0, "max_steps": 30,
                               "checkpoint_every": 0, "eval_every": 10, "join_wait": 0.5})
    d = cluster.start("planted", config=cfg, home=home.root, env=rank_env(0, 1))
    d.wait_ready()
    wait_for(lambda: d.status().get("trainer", {}).get("step", 0) >= 1, timeout=60, what="training to start")
    assert "refusing checkpoint" in d.log_tail(200) and "GLOBAL posix.system" in d.log_tail(200)
    assert not d.status()["trainer"].get("resumed_from_step")
    assert not marker.exists() and d.running

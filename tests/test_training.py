"""Gossip training with real daemons: the digits swarm reaches its target, survives a death, takes a
late joiner and resumes a restarted peer from its checkpoint. A single-process baseline with the same
model and recipe runs first, so a regression in either shows up side by side."""

from __future__ import annotations

import subprocess
import sys

import pytest

from peer.home import Home
from tests.daemons import REPO, config_file, rank_env, steps_done, unique_swarm, wait_for
from peer.testing.pace import scaled

pytestmark = pytest.mark.slow

TARGET = 0.95


def digits_config(path, *, membership: dict | None = None, **options):
    opts = {"model": "digits_cnn", "mode": "adpsgd", "world": 4, "target_accuracy": TARGET, "eval_every": 20,
            "join_wait": 30.0}
    opts.update(options)
    return config_file(path, swarm=unique_swarm(), trainer="trainers.gossip_sgd", options=opts,
                       topology={"kind": "rewired", "target_degree": 2, "min_degree": 1, "max_degree": 3,
                                 "rewire_interval": 1.0, "record_interval": 0.5},
                       gossip={"exchange_timeout": 5.0}, membership=membership)


def trainer(d) -> dict:
    return d.status().get("trainer", {})


def done(daemons) -> bool:
    return all(trainer(d).get("state") == "done" for d in daemons)


def test_single_process_baseline_for_comparison():
    from trainers.baseline import train_single

    r = train_single("digits_cnn")
    print(f"single-process digits_cnn: {r.test_accuracy * 100:.2f}% held-out in {r.seconds:.1f}s")
    assert r.test_accuracy >= TARGET


@pytest.mark.parametrize("mode", ["adpsgd", "dpsgd"])
def test_four_daemons_train_digits_to_target(cluster, tmp_path, mode):
    cfg = digits_config(tmp_path / "c.toml", mode=mode)
    ds = [cluster.start(f"t{i}", config=cfg, env=rank_env(i, 4)) for i in range(4)]
    wait_for(lambda: done(ds), timeout=120, interval=0.5, what=f"4 {mode} peers to finish training",
             progress=lambda: steps_done(ds))
    accs = [trainer(d)["accuracy"] for d in ds]
    print(f"{mode}: held-out accuracy per peer {[round(a * 100, 2) for a in accs]}, steps {[trainer(d)['step'] for d in ds]}")
    assert all(trainer(d)["reached_target"] for d in ds), accs
    assert all(d.status()["gossip"]["exchanges"] > 0 for d in ds)
    assert not [b for d in ds for b in d.status()["gossip"]["bans"]]  # no honest peer banned (issue 29)


def test_daemons_train_on_a_users_plain_torch_datasets(cluster, tmp_path):
    """`dataset_factory` returning two TensorDatasets and `loss` by import path, as a user's config names them:
    each daemon imports tests/user_data.py (PYTHONPATH), shards the TensorDataset by rank and reaches the target."""
    cfg = digits_config(tmp_path / "c.toml", model="digits_mlp", world=2, loss="torch.nn:CrossEntropyLoss",
                        dataset_factory="tests.user_data:digits_tensors")
    ds = [cluster.start(f"u{i}", config=cfg, env={**rank_env(i, 2), "PYTHONPATH": str(REPO)}) for i in range(2)]
    wait_for(lambda: done(ds), timeout=120, interval=0.5, what="2 peers on a user's TensorDatasets to finish",
             progress=lambda: steps_done(ds))
    assert all(trainer(d)["reached_target"] for d in ds), [trainer(d).get("accuracy") for d in ds]
    from tests.user_data import digits_tensors

    sizes = [trainer(d)["shard_size"] for d in ds]
    assert sum(sizes) == len(digits_tensors()[0]) and max(sizes) - min(sizes) <= 1  # the training rows, split by rank


def test_training_survives_a_peer_killed_mid_run(cluster, tmp_path):
    # a slightly slower run (small per-step delay) so there is a "mid-run" to kill in
    cfg = digits_config(tmp_path / "c.toml", step_delay=0.004)
    ds = [cluster.start(f"k{i}", config=cfg, env=rank_env(i, 4)) for i in range(4)]
    wait_for(lambda: all(trainer(d).get("step", 0) >= 30 for d in ds), timeout=90, what="training to get going")
    ds[3].kill()
    rest = ds[:3]
    wait_for(lambda: done(rest), timeout=120, interval=0.5, what="the 3 survivors to finish",
             progress=lambda: steps_done(rest))
    assert all(trainer(d)["reached_target"] for d in rest), [trainer(d).get("accuracy") for d in rest]


def test_late_joiner_downloads_parameters_and_catches_up(cluster, tmp_path):
    cfg = digits_config(tmp_path / "c.toml", step_delay=0.004, min_peers=2)
    early = [cluster.start(f"e{i}", config=cfg, env=rank_env(i, 4)) for i in range(3)]
    wait_for(lambda: all(trainer(d).get("step", 0) >= 60 for d in early), timeout=90, what="the first 3 to train a while")
    late = cluster.start("late", config=cfg, env=rank_env(3, 4))
    wait_for(lambda: trainer(late).get("joined_at_step"), timeout=60, what="the late peer to download parameters")
    wait_for(lambda: done([late]), timeout=120, interval=0.5, what="the late peer to finish",
             progress=lambda: steps_done([late]))
    assert trainer(late)["reached_target"], trainer(late).get("accuracy")


def test_restarted_peer_resumes_from_its_checkpoint(cluster, tmp_path):
    # no target: run the step budget, checkpoint every 20 steps, stop one peer half-way and restart it
    cfg = digits_config(tmp_path / "c.toml", target_accuracy=0.0, max_steps=400, checkpoint_every=20,
                        step_delay=0.01, min_peers=1)
    ds = [cluster.start(f"r{i}", config=cfg, env=rank_env(i, 2)) for i in range(2)]
    wait_for(lambda: trainer(ds[1]).get("step", 0) >= 60, timeout=90, what="some training")
    assert ds[1].stop() == 0  # graceful: the trainer saves its checkpoint on the way out
    assert Home(ds[1].home).latest_checkpoint.exists()
    export_and_load(ds[1].home, tmp_path / "model.pt")  # `peer export` with no daemon running: from disk
    ds[1].start()
    wait_for(lambda: trainer(ds[1]).get("resumed_from_step"), timeout=60, what="the restart to resume")
    assert trainer(ds[1])["resumed_from_step"] >= 60
    export_and_load(ds[1].home, tmp_path / "live.pt")  # with the daemon running: it checkpoints first


def export_and_load(home, out):
    """`peer export` as the README shows it; the file loads into the model it names."""
    import torch

    from trainers.models import build_model

    r = subprocess.run([sys.executable, "-m", "peer", "export", "--home", str(home), str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=scaled(120))
    assert r.returncode == 0 and "wrote" in r.stdout, r.stdout + r.stderr
    saved = torch.load(out, weights_only=True)  # an export is plain data
    build_model(saved["model_name"]).load_state_dict(saved["state_dict"])
    assert saved["step"] > 0

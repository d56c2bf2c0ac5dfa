"""A user's own data and model drive the swarm pipeline (issue 28, "One data path"): `dataset_factory` returns
plain torch datasets, a map-style TensorDataset of float features or an IterableDataset, and `model_factory`
a list of blocks and a loss; two daemons serve two stages and each drives its shard to the end.

Each run is small (a few hundred samples per driver) and its validation loss is compared with the untrained
model's on the same microbatches, computed here from the same factory (every peer builds it from one seed).
"""

from __future__ import annotations

import math

import pytest

from peer.testing.swarm import rank_env, swarm_config, unique_swarm
from tests import user_data
from tests.pipeline_status import driver, samples_done, trainer
from trainers.pipeline.blocks import from_factory
from trainers.pipeline.reference import evaluate

# 600 s: their waits on drivers bound the time without progress (wait_for's `progress`), not the whole run
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAINER = "trainers.swarm_pipeline"
# Two stages, no moves (measured in test_pipeline_rebalance_swarm), one thread per daemon, no clipping.
SMALL = dict(stages=2, microbatch=8, batch_size=16, eval_batches=4, samples=400, in_flight=2, optimizer="adam",
             grad_clip=0.0, seed=0, threads=1, join_wait=60.0, rebalance=False)
START_S = 90.0  # two daemons start, profile, agree on a cut and drive 400 samples each: ~15 s here
TOPOLOGY = {"record_interval": 1.0}  # stage announcements spread within a second


def run_pipeline(cluster, name: str, **options) -> list[dict]:
    """Two daemons, each serving a stage and driving its shard (rank i of 2), to the end; their trainer figures."""
    cfg = swarm_config(swarm=unique_swarm("pipe"), trainer=TRAINER, options={**SMALL, "pipeline": name, **options},
                       topology=TOPOLOGY)
    ds = [cluster.start(f"node{i + 1}", config=cfg, env=rank_env(i, 2)) for i in range(2)]
    cluster.wait(lambda sts: all(trainer(s).get("driving_done") for s in sts), timeout=START_S,
                 what="both daemons to drive their samples", interval=0.5, progress=samples_done)
    out = []
    for d, st in zip(ds, cluster.statuses()):
        t = trainer(st)
        assert t["samples"] == SMALL["samples"], (d.name, t)
        assert t["microbatches_failed"] == 0 and driver(st)["failed"] == 0, (d.name, t, driver(st))
        assert t["microbatches_done"] == SMALL["samples"] // SMALL["microbatch"], (d.name, t)
        out.append(t)
    return out


def untrained_val_loss(model_factory: str, data) -> float:
    _, test = data()
    return evaluate(from_factory(model_factory), test, microbatch=SMALL["microbatch"],
                    eval_batches=SMALL["eval_batches"])


def test_a_tensor_dataset_of_float_features_drives_the_pipeline(cluster):
    """Regression: 8 float features, float targets, a user's Linear+ReLU blocks and mse_loss."""
    blocks, data = "tests.user_data:regression_blocks", "tests.user_data:regression"
    figures = run_pipeline(cluster, "regression", model_factory=blocks, dataset_factory=data, lr=1e-2)
    before = untrained_val_loss(blocks, user_data.regression)
    print(f"regression val_loss: untrained {before:.4f}, trained {[t['val_loss'] for t in figures]}")
    for t in figures:
        assert t["val_loss"] is not None and math.isfinite(t["val_loss"]), t
        assert t["val_loss"] < 0.2 * before, (before, t)


def test_an_iterable_dataset_drives_the_pipeline(cluster):
    """Digits as streams (train and test IterableDatasets without a length), a user's blocks and cross-entropy:
    each driver keeps every second item of the stream, pass after pass."""
    blocks, data = "tests.user_data:digits_blocks", "tests.user_data:digits_streams"
    figures = run_pipeline(cluster, "digits", model_factory=blocks, dataset_factory=data, lr=1e-2)
    before = untrained_val_loss(blocks, user_data.digits_streams)
    print(f"digits val_loss: untrained {before:.4f}, trained {[t['val_loss'] for t in figures]}")
    for t in figures:
        assert t["val_loss"] is not None and math.isfinite(t["val_loss"]), t
        assert t["val_loss"] < 0.8 * before, (before, t)

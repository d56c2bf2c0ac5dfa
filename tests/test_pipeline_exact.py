"""Exact and good (issue 39, item 2): a pipeline trains as one process does on the same microbatches.

Three daemons serve three stages; one of them drives. Its microbatches go two at a time (the trainer's default
in_flight), so a stage may step between a microbatch's forward and its backward (the backward then recomputes
the forward against the current weights: docs/design.md, "Swarm pipeline"), and each gradient
enters each stage once. One
process training the same blocks on the same microbatches in the same order with the same optimizer
(trainers/pipeline/reference.py) must reach the same validation loss within 2%.
"""

from __future__ import annotations

import pytest

from peer.testing.swarm import rank_env, unique_swarm
from tests.pipeline_status import driver, samples_done, trainer
from tests.test_pipeline_swarm import START_S, TINY, config, driving_done, rel
from trainers.datasets import load_char_corpus
from trainers.pipeline.blocks import char_transformer_pipeline
from trainers.pipeline.reference import train_reference
from trainers.swarm_pipeline import PipelineData, training_microbatches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SAMPLES = 480  # 60 microbatches, 30 steps of 16 samples (the loss falls to about 3.12); ~26 s on 2 loaded cores
STAGES = 3


def test_three_stages_on_three_daemons_train_as_one_process(cluster):
    swarm = unique_swarm("exact")
    opts = dict(stages=STAGES, samples=SAMPLES, in_flight=2)
    ds = [cluster.start("node1", config=config(swarm, **opts), env=rank_env(0, 1))]
    ds += [cluster.start(f"node{i}", config=config(swarm, role="server", **opts), env=rank_env(0, 1))
           for i in (2, 3)]
    cluster.wait(lambda sts: driving_done(sts[:1]), timeout=START_S + 120, what="the driver to drive its samples",
                 interval=0.5, progress=samples_done)
    st = cluster.statuses()[0]
    t, d = trainer(st), driver(st)
    assert t["samples"] == SAMPLES and t["microbatches_failed"] == 0 and d["failed"] == 0, (t, d)
    assert d["acked_samples"] == [SAMPLES] * STAGES and d["ack_lost"] == 0, d  # each gradient entered once
    got = ds[0].command("evaluate", timeout=120)
    assert got.get("val_loss") is not None, got

    train, test, vocab = load_char_corpus(block=TINY["block"])
    model = char_transformer_pipeline(len(vocab), d_model=TINY["d_model"], n_layers=TINY["n_layers"],
                                      n_heads=TINY["n_heads"], block=TINY["block"], dropout=0.0, seed=TINY["seed"])
    ours = training_microbatches(PipelineData(train, test, "the corpus"), 0, 1, microbatch=TINY["microbatch"],
                                 seed=TINY["seed"])
    ref = train_reference(model, train, test, batch_size=TINY["batch_size"], microbatch=TINY["microbatch"],
                          lr=TINY["lr"], samples=SAMPLES, seed=TINY["seed"], eval_batches=4, microbatches=ours)
    print(f"pipeline val_loss {got['val_loss']:.4f}, one process {ref['val_loss']:.4f} "
          f"(rel {rel(got['val_loss'], ref['val_loss']):.4f})")
    assert rel(got["val_loss"], ref["val_loss"]) <= 0.02, (got, ref)

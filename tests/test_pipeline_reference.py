"""The single-process yardstick trains: a short run lowers the validation loss."""

from __future__ import annotations

import pytest
import torch

from trainers.datasets import load_char_corpus
from trainers.pipeline.blocks import char_transformer_pipeline
from trainers.pipeline.reference import evaluate, train_reference

BLOCK = 16


def test_a_tiny_run_lowers_val_loss() -> None:
    train, test, vocab = load_char_corpus(block=BLOCK)
    model = char_transformer_pipeline(len(vocab), d_model=32, n_layers=2, n_heads=4, block=BLOCK, dropout=0.1)
    before = evaluate(model, test, microbatch=8, eval_batches=4)
    rng = torch.get_rng_state()
    out = train_reference(model, train, test, batch_size=16, microbatch=8, lr=3e-3, samples=16 * 60,
                          eval_batches=4)
    assert torch.equal(torch.get_rng_state(), rng)
    assert out["samples"] == 960 and out["steps"] == 60 and out["seconds"] > 0
    assert out["val_loss"] < before - 0.5, (before, out)
    assert out["train_loss"] < before


def test_same_seed_same_run_and_errors() -> None:
    train, test, vocab = load_char_corpus(block=BLOCK)

    def run(seed: int) -> float:
        model = char_transformer_pipeline(len(vocab), d_model=16, n_layers=1, n_heads=2, block=BLOCK)
        return train_reference(model, train, test, batch_size=8, microbatch=4, lr=1e-3, samples=24,
                               seed=seed, eval_batches=1)["val_loss"]

    assert run(0) == run(0) != run(1)
    model = char_transformer_pipeline(len(vocab), d_model=16, n_layers=1, n_heads=2, block=BLOCK)
    with pytest.raises(ValueError, match="multiple"):
        train_reference(model, train, test, batch_size=6, microbatch=4, lr=1e-3, samples=8)
    with pytest.raises(ValueError, match="eval_batches"):
        evaluate(model, test, microbatch=4, eval_batches=0)


@pytest.mark.process
def test_the_reference_run_command_trains_a_pipeline_runs_options() -> None:
    """`python -m trainers.pipeline.reference_run`, what `peer bench pipeline` compares its loss with: the run's
    own options, trained for the samples asked, one JSON line."""
    import json
    import subprocess
    import sys

    opts = {"d_model": 32, "n_layers": 2, "n_heads": 2, "block": BLOCK, "microbatch": 8, "batch_size": 16,
            "stages": 2, "samples": 0}
    done = subprocess.run([sys.executable, "-m", "trainers.pipeline.reference_run", "--options", json.dumps(opts),
                           "--samples", "64"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["samples"] == 64 and got["steps"] == 4 and got["val_loss"] > 0, got
    bad = subprocess.run([sys.executable, "-m", "trainers.pipeline.reference_run", "--options", json.dumps(opts),
                          "--samples", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--samples must be at least 1" in bad.stderr

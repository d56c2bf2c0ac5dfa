"""Single-process training of a PipelineModel with the pipeline's semantics: the yardstick.

A pipeline run and this one read the same kind of microbatches (any torch dataset, batched by
trainers/torch_data.py with a generator seeded by `seed`), take one optimizer step per batch with the
gradient of the mean loss over the batch, and are scored the same way (the test set's first
microbatches, in order), so a gap between them is the pipeline's doing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from trainers import torch_data
from trainers.baseline import make_optimizer
from trainers.pipeline.blocks import PipelineModel, seeded


def _device(net: torch.nn.Module) -> torch.device:
    return next((p.device for p in net.parameters()), torch.device("cpu"))


@torch.no_grad()
def evaluate(model: PipelineModel, test: Any, *, microbatch: int, eval_batches: int) -> float:
    """Mean loss over the first `eval_batches` microbatches of `test` in order, eval mode (restored after)."""
    if microbatch < 1 or eval_batches < 1:
        raise ValueError(f"evaluate: microbatch and eval_batches must be >= 1, got {microbatch}, {eval_batches}")
    net = model.sequential()
    dev = _device(net)
    was_training = net.training
    net.eval()
    losses: list[float] = []
    try:
        for x, y in torch_data.take(torch_data.loader(test, microbatch, shuffle=False), eval_batches, "the test set"):
            losses.append(float(model.loss_fn(net(x.to(dev)), y.to(dev))))
    finally:
        net.train(was_training)
    if not losses:
        raise ValueError("evaluate: the test set is empty")
    return sum(losses) / len(losses)


def train_reference(
    model: PipelineModel, train: Any, test: Any, *, batch_size: int, microbatch: int, lr: float,
    samples: int, seed: int = 0, optimizer: str = "adam", eval_batches: int = 8,
    microbatches: Iterator[tuple[Any, Any]] | None = None,
) -> dict[str, Any]:
    """Train `model.sequential()` in place until `samples` samples; returns val_loss, train_loss (last
    batch), samples, steps, seconds (training only).

    Each batch is batch_size // microbatch microbatches; each microbatch backpropagates its mean
    loss weighted by its share of the batch's samples, so the step sees the gradient of the mean
    over the batch even when an epoch's last microbatch is short. Dropout draws from an RNG
    seeded by `seed` (the caller's RNG state is restored afterwards). `microbatches`: the (x, y) to train on, in
    order (a pipeline driver's own, to compare with it on the same ones); by default `train`, shuffled by `seed`.
    """
    if microbatch < 1 or batch_size < microbatch or batch_size % microbatch:
        raise ValueError(f"train_reference: batch_size ({batch_size}) must be a positive multiple "
                         f"of microbatch ({microbatch})")
    if samples < 1:
        raise ValueError(f"train_reference: samples must be >= 1, got {samples}")
    per_batch = batch_size // microbatch
    net = model.sequential()
    dev = _device(net)
    opt = make_optimizer(net.parameters(), optimizer, lr=lr)
    gen = torch.Generator().manual_seed(seed)

    # endless: epoch after epoch from the same generator
    stream = microbatches if microbatches is not None else torch_data.endless(
        torch_data.loader(train, microbatch, generator=gen), "the train set",
        empty="train_reference: the training set is empty")
    done, steps, train_loss = 0, 0, float("nan")
    net.train()
    with seeded(seed, dev):
        start = time.perf_counter()
        while done < samples:
            batch = [next(stream) for _ in range(per_batch)]
            total = sum(len(x) for x, _ in batch)
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for x, y in batch:
                loss = model.loss_fn(net(x.to(dev)), y.to(dev))
                (loss * (len(x) / total)).backward()
                loss_sum += loss.item() * len(x)
            opt.step()
            steps += 1
            done += total
            train_loss = loss_sum / total
        seconds = time.perf_counter() - start
    val_loss = evaluate(model, test, microbatch=microbatch, eval_batches=eval_batches)
    return {"val_loss": val_loss, "train_loss": train_loss, "samples": done, "steps": steps, "seconds": seconds}

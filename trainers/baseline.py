"""Single-process reference training: the numbers distributed runs are compared against.

`evaluate`, `batch_loss` and `make_optimizer` live here because every trainer must measure and
step the same way, or a gap between a distributed run and this baseline could be an artefact.

    python -m trainers.baseline --model digits_mlp --epochs 30
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainers.datasets import ArrayDataset, CharDataset, load_for_model
from trainers.models import build_model, count_parameters, pick_device


@dataclass(frozen=True)
class Hyperparams:
    """One training recipe; `RECOMMENDED` holds the measured defaults for each built-in model."""

    epochs: int
    batch_size: int
    lr: float
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    max_steps: int | None = None
    # mode = "local" (peertrain/outer.py): DiLoCo's outer step, for an Adam inner optimizer
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


# Measured on a shared 2-core CPU with one torch thread (faster than two for these sizes), scored
# on the split_seed=0 test set: digits_mlp ~96.4% (96.1-96.7% over init seeds) in ~1.2 s;
# digits_cnn ~98% in ~3 s; digits_wide_mlp ~96.4% in ~7 s; char_transformer's loss falls from
# ln(65)=4.17 to ~2.3 in 120 steps (~25-35 s). Constant learning rates on purpose: distributed
# trainers reuse these recipes, and a schedule would tie them to a global step count.
RECOMMENDED: MappingProxyType[str, Hyperparams] = MappingProxyType({
    # Local steps on the digits models: plain averaging of the rounds (outer lr 1, no outer momentum). Their inner
    # SGD already carries momentum 0.9 at its largest stable rate, and DiLoCo's outer Nesterov (0.7, 0.9) scales
    # a round's move by up to 0.7 / (1 - 0.9) = 7: digits_cnn alone in local mode (20 inner steps) fell to 10% by
    # step 1,000; at (1.0, 0) it reached 96.4% at step 300, (0.7, 0.5) 96.1%, (1.0, 0.5) 93.3% (2026-11-29).
    "digits_mlp": Hyperparams(epochs=30, batch_size=32, lr=0.05, optimizer="sgd", momentum=0.9,
                              outer_lr=1.0, outer_momentum=0.0),
    "digits_cnn": Hyperparams(epochs=15, batch_size=32, lr=0.05, optimizer="sgd", momentum=0.9,
                              outer_lr=1.0, outer_momentum=0.0),
    "digits_wide_mlp": Hyperparams(epochs=10, batch_size=128, lr=0.1, optimizer="sgd", momentum=0.9,
                                   outer_lr=1.0, outer_momentum=0.0),
    "char_transformer": Hyperparams(epochs=1, batch_size=32, lr=3e-3, optimizer="adam", momentum=0.9, max_steps=120),
    # The link-bound language models (trainers/models.py, LM_PRESETS): a step takes 1.2 s (lm_14m, 16 x 128
    # tokens) and 4.1 s (lm_100m, 4 x 256) on this 2-core CPU (2026-11-28); GPT-2-small-like Adam rates. Their
    # step budgets are not yet measured against a loss target (issue 41's `peer bench wan` will).
    "lm_14m": Hyperparams(epochs=1, batch_size=16, lr=1e-3, optimizer="adam", momentum=0.9, max_steps=300),
    "lm_100m": Hyperparams(epochs=1, batch_size=4, lr=6e-4, optimizer="adam", momentum=0.9, max_steps=20),
})


@dataclass(frozen=True)
class BaselineResult:
    model: str
    test_accuracy: float
    test_loss: float
    train_loss: float
    seconds: float
    samples_per_s: float
    epochs: int
    steps: int
    parameters: int
    device: str
    hyperparams: dict[str, Any]


Dataset = ArrayDataset | CharDataset


def batch_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; sequence logits (B, T, V) are flattened so every position counts."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_optimizer(
    params: Iterable[nn.Parameter], name: str, *, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; choose 'sgd' or 'adam'")


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: Dataset, device: torch.device | str | None = None, *, batch_size: int = 512
) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole dataset; per token for sequence models.

    The model's train/eval mode is restored afterwards so a trainer can call this mid-run.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    try:
        for x, y in dataset.batches(batch_size, shuffle=False):
            x, y = x.to(device), y.to(device)
            logits = model(x)
            n = y.numel()
            total_loss += float(batch_loss(logits, y)) * n
            correct += int((logits.argmax(-1) == y).sum())
            count += n
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("cannot evaluate on an empty dataset")
    return total_loss / count, correct / count


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's intra-op thread count (1 is fastest for these tiny CPU models)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def seeded_model(name: str, seed: int, **opts: Any) -> nn.Module:
    """Build a model whose initial weights depend only on `seed`, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(name, **opts)


def train_single(
    model: str = "digits_mlp",
    *,
    epochs: int | None = None,
    batch_size: int | None = None,
    lr: float | None = None,
    optimizer: str | None = None,
    momentum: float | None = None,
    weight_decay: float | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    split_seed: int = 0,
    device: torch.device | str | None = None,
    threads: int | None = 1,
    model_opts: dict[str, Any] | None = None,
) -> BaselineResult:
    """Train one built-in model in this process and report held-out accuracy and throughput.

    Unset hyperparameters come from `RECOMMENDED[model]`. `seed` drives initial weights and batch
    order; `split_seed` picks the held-out rows and stays 0 so every run is scored on the same test
    set. `threads` is the torch CPU thread count during the run (restored afterwards); None leaves
    it alone.
    """
    base = RECOMMENDED.get(model)
    if base is None:
        raise ValueError(f"no baseline recipe for model {model!r}; choose one of {', '.join(RECOMMENDED)}")
    hp = dataclasses.replace(
        base,
        **{
            k: v
            for k, v in dict(
                epochs=epochs, batch_size=batch_size, lr=lr, optimizer=optimizer,
                momentum=momentum, weight_decay=weight_decay, max_steps=max_steps,
            ).items()
            if v is not None
        },
    )
    dev = torch.device(device) if device is not None else pick_device()
    train, test, opts = load_for_model(model, seed=split_seed)
    net = seeded_model(model, seed, **{**opts, **(model_opts or {})}).to(dev)
    opt = make_optimizer(net.parameters(), hp.optimizer, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
    gen = torch.Generator().manual_seed(seed)

    steps, samples, epochs_done, last_epoch_loss = 0, 0, 0, float("nan")
    with torch_threads(threads):
        start = time.perf_counter()
        net.train()
        for _ in range(hp.epochs):
            epoch_loss, epoch_batches = 0.0, 0
            for x, y in train.batches(hp.batch_size, gen):
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                loss = batch_loss(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                epoch_loss += loss.item()
                epoch_batches += 1
                steps += 1
                samples += len(x)
                if hp.max_steps is not None and steps >= hp.max_steps:
                    break
            epochs_done += 1
            last_epoch_loss = epoch_loss / max(epoch_batches, 1)
            if hp.max_steps is not None and steps >= hp.max_steps:
                break
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - start
        test_loss, test_acc = evaluate(net, test, dev)

    return BaselineResult(
        model=model,
        test_accuracy=test_acc,
        test_loss=test_loss,
        train_loss=last_epoch_loss,
        seconds=seconds,
        samples_per_s=samples / seconds if seconds > 0 else float("inf"),
        epochs=epochs_done,
        steps=steps,
        parameters=count_parameters(net),
        device=str(dev),
        hyperparams=dataclasses.asdict(hp),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainers.baseline", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="digits_mlp", choices=sorted(RECOMMENDED))
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--optimizer", choices=["sgd", "adam"])
    p.add_argument("--momentum", type=float)
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--max-steps", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu or cuda; default: cuda when present")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    a = p.parse_args(argv)
    result = train_single(
        a.model, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, optimizer=a.optimizer,
        momentum=a.momentum, weight_decay=a.weight_decay, max_steps=a.max_steps,
        seed=a.seed, device=a.device, threads=a.threads or None,
    )
    json.dump(dataclasses.asdict(result), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A user's own data and losses as a config names them (`dataset_factory = "tests.user_data:digits_tensors"`):
plain torch datasets, no peertrain types. Daemon subprocesses import this module, so it must stay importable
from the repository root (tests pass it on PYTHONPATH) and cheap to import."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset, TensorDataset

from trainers.datasets import load_digits


def _digits_tensors() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    train, test = load_digits()
    return (train.x.clone(), train.y.clone()), (test.x.clone(), test.y.clone())


def digits_tensors() -> tuple[TensorDataset, TensorDataset]:
    """Digits as a user would hand them over: two TensorDatasets of (N, 64) floats and int64 labels."""
    (xt, yt), (xv, yv) = _digits_tensors()
    return TensorDataset(xt, yt), TensorDataset(xv, yv)


class Stream(IterableDataset):
    """Digits as a stream of (x, y) samples in a fixed order, with no length."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y)


def digits_stream() -> tuple[Stream, TensorDataset]:
    (xt, yt), (xv, yv) = _digits_tensors()
    return Stream(xt, yt), TensorDataset(xv, yv)


def digits_no_test() -> tuple[TensorDataset, None]:
    return digits_tensors()[0], None


def regression() -> tuple[TensorDataset, TensorDataset]:
    """y = x·w with float targets: no class logits, so loss only (with `loss = "torch.nn.functional:mse_loss"`)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=g)
    x = torch.randn(256, 8, generator=g)
    return TensorDataset(x[:192], x[:192] @ w), TensorDataset(x[192:], x[192:] @ w)


def linear_regressor() -> torch.nn.Module:
    return torch.nn.Linear(8, 1)


def digits_streams() -> tuple[Stream, Stream]:
    """Digits with both halves streams: training and validation from IterableDatasets."""
    (xt, yt), (xv, yv) = _digits_tensors()
    return Stream(xt, yt), Stream(xv, yv)


def regression_blocks() -> tuple[list[torch.nn.Module], object]:
    """A pipeline model as a user writes one: a list of Linear+ReLU blocks and a loss (`model_factory`), for
    `regression`'s 8 float features and float targets."""
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU()),
              torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()),
              torch.nn.Linear(32, 1)]
    return blocks, torch.nn.functional.mse_loss


def digits_blocks() -> tuple[list[torch.nn.Module], object]:
    """Digits' 64 float pixels to 10 class logits in two blocks, with cross-entropy (`model_factory`)."""
    return [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()), torch.nn.Linear(64, 10)], \
        torch.nn.functional.cross_entropy


def not_a_pair():
    return digits_tensors()[0]


def strings():
    """Samples that cannot be batched into tensors."""
    return [("a picture", 1), ("another", 0)], None


def per_sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target, reduction="none")


def broken_model():
    raise RuntimeError("this model factory always fails")

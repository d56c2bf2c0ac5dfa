"""A model bigger than one host, for the big-model test and `peer bench pipeline --big`: wide residual linear
blocks on the digits (real 8x8 handwritten digits, trainers/datasets.py), as a user would write one.

It is written the way the README asks a user to write a model too big for one host: a list of *builders*
(functions that build one block), so a peer builds only the blocks of the stage it serves
(trainers/pipeline/blocks.py). Each block is `x + relu(linear(layernorm(x)))`: the residual keeps a deep
stack of wide layers trainable at the default initialisation (at a small learning rate: 3e-5 for 32 blocks of
3072, which reaches a validation loss of 0.88 in 160 samples in one process; 1e-4 gives 3.5, 1e-3 diverges).
"""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from trainers.datasets import load_digits

DIGITS_FEATURES, DIGITS_CLASSES = 64, 10


class WideBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.relu(self.linear(self.norm(x)))


def _head(width: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, DIGITS_CLASSES))


def wide(width: int, depth: int):
    """(builders, loss) for `model_factory`."""
    return ([functools.partial(nn.Linear, DIGITS_FEATURES, width)]
            + [functools.partial(WideBlock, width) for _ in range(depth)]
            + [functools.partial(_head, width)]), F.cross_entropy


def big_test():
    """The big-model test's model: 36 blocks of 3072² (340 M parameters, 1.4 GB of weights; 5.4 GB with
    gradients and Adam's moments)."""
    return wide(3072, 36)


def big_bench():
    """`peer bench pipeline --big`'s model: 42 blocks of 3072² (397 M parameters, 1.6 GB of weights; 6.3 GB
    with gradients and Adam's moments)."""
    return wide(3072, 42)


def issue_235m():
    """Issue 39's user model: 25 blocks of 3072² (236 M parameters, 0.9 GB of weights; 3.5 GB with gradients and
    Adam's moments), for 4 stages on 4 daemons capped at 1.8 GB (`peer bench pipeline --big --daemons 4
    --memory-mib 1800 --big-model trainers.pipeline.wide:issue_235m`)."""
    return wide(3072, 25)


def issue_stage():
    """`peer bench pipeline --memory`'s model: four blocks of 4096² between the input and the head, so blocks
    [1, 5) are the stage of issue 39 (67 M parameters, 256 MiB of weights)."""
    return wide(4096, 4)


def digits():
    """(train, test) torch datasets of the digits: (64,) float features, int64 labels."""
    train, test = load_digits()
    return TensorDataset(train.x.clone(), train.y.clone()), TensorDataset(test.x.clone(), test.y.clone())


def uneven_test():
    """The move-memory test's model: 3 blocks of 4096² between the input and the head, so any cut in two
    stages gives one stage twice the other's blocks (67 M parameters, 1 GB with gradients and Adam's moments)."""
    return wide(4096, 3)

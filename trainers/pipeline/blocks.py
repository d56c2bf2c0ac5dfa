"""Models as an ordered list of blocks plus a loss: the unit a pipeline cuts into stages.

A model is a list of block *builders*, not of built blocks: a peer materialises only the blocks of the
stage it serves, each alone and under its own seed, so a model bigger than any one host can be cut across
peers (docs/design.md, "Only your stage in memory"). The built-in char transformer reuses
`trainers.models.Block`; user models come from a "pkg.module:fn" factory returning `(blocks, loss_fn)`.
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainers.datasets import load_factory
from trainers.models import Block

# torch's CPU generator is one per process: a stage computing under its seed and a worker being built for
# another stage (a move, a backup) in another thread would otherwise reseed it under each other's feet, and a
# backward's recomputed dropout masks would no longer match its forward's. Re-entrant: seeded code may nest.
_RNG_LOCK = threading.RLock()

LossFn = Callable[[Tensor, Tensor], Tensor]

# Seed the RNG while a user factory builds its blocks, so every peer that calls the same factory
# starts from the same weights unless the factory seeds itself.
FACTORY_SEED = 0


CPU = torch.device("cpu")
BlockBuilder = Callable[[], nn.Module]
"""Builds one block: called under that block's own seed (`block_seed`), on the device it will live on."""


def block_seed(seed: int, index: int) -> int:
    """The RNG seed block `index` is built under: a function of (seed, index) alone, so every peer builds the
    same weights for block i without building blocks 0..i-1 (a per-block seed instead of one RNG stream)."""
    return (seed * BLOCK_SEED_STRIDE + index + 1) % (1 << 63)


# Blocks per model seed in `block_seed`: seeds of different models' blocks do not meet below a million blocks.
BLOCK_SEED_STRIDE = 1_000_003


@dataclass
class PipelineModel:
    """A model as blocks applied in order (x -> block 0 -> ... -> block n-1) and the loss on the last output.

    The blocks are *builders*: `build(i)` materialises block i alone, so a peer holds only the blocks of the
    stage it serves. A builder is either a callable returning an nn.Module (built under `block_seed(seed, i)`,
    on the target device), a module on the `meta` device (given storage there and initialised by its
    submodules' `reset_parameters()` under the same seed), or an already built module (a factory that returns
    those has built the whole model on every peer: fine for models that fit, see README).
    """

    name: str
    builders: list[Any]  # per block: a BlockBuilder, a meta-device nn.Module, or a built nn.Module
    loss_fn: LossFn
    seed: int = 0
    traced: dict = field(default_factory=dict, repr=False)  # trainers/pipeline/shapes.py's cache, per input shape
    _whole: nn.Sequential | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.builders)

    def build(self, i: int, device: torch.device | str | None = None) -> nn.Module:
        """Block i with its initial weights, alone, on `device` (CPU by default): bit-exact the block i of
        `sequential()` as first built. A built module (not a builder) is returned as it is, moved."""
        if not 0 <= i < len(self.builders):
            raise IndexError(f"{self.name}: block {i} of {len(self.builders)}")
        spec = self.builders[i]
        target = torch.device(device) if device is not None else torch.device("cpu")
        if isinstance(spec, nn.Module):
            if not _on_meta(spec):
                return spec.to(target)
            return _materialise(spec, block_seed(self.seed, i), f"{self.name} block {i}").to(target)
        with seeded(block_seed(self.seed, i), CPU):  # built on the CPU: the same weights whatever the device
            blk = spec()
        if not isinstance(blk, nn.Module):
            raise ValueError(f"{self.name}: block {i}'s builder returned a {type(blk).__name__}, not an nn.Module")
        return blk.to(target)

    def on_meta(self, i: int) -> nn.Module:
        """Block i without storage (shapes and parameter counts at no memory cost); a built module as it is."""
        spec = self.builders[i]
        if isinstance(spec, nn.Module):
            return spec
        with torch.device("meta"):
            blk = spec()
        if not isinstance(blk, nn.Module):
            raise ValueError(f"{self.name}: block {i}'s builder returned a {type(blk).__name__}, not an nn.Module")
        return blk

    def sequential(self) -> nn.Sequential:
        """Every block built, as one module (single-process reference runs and tests: the whole model in
        memory). Built once: later calls return the same module, so a reference trains it in place."""
        if self._whole is None:
            self._whole = nn.Sequential(*(self.build(i) for i in range(len(self.builders))))
        return self._whole


def _on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _materialise(meta: nn.Module, seed: int, where: str) -> nn.Module:
    """A meta-device module given storage on the CPU and initialised by its submodules' `reset_parameters()`
    under `seed`. Every parameter and buffer must belong to a submodule that has one, else its values would be
    whatever the memory held: that is an error naming the tensor (build such a block in a builder instead)."""
    blk = copy.deepcopy(meta).to_empty(device=CPU)
    covered: set[int] = set()
    with seeded(seed, CPU):
        for mod in blk.modules():
            reset = getattr(mod, "reset_parameters", None)
            if callable(reset):
                reset()
                covered.update(id(t) for t in itertools.chain(mod.parameters(recurse=False),
                                                               mod.buffers(recurse=False)))
    for name, t in itertools.chain(blk.named_parameters(), blk.named_buffers()):
        if id(t) not in covered:
            raise ValueError(f"{where}: {name} is on the meta device but no reset_parameters() initialises it; "
                             "return a builder (a function that builds the block) instead")
    return blk


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run under RNG state `seed` and restore the caller's afterwards (CPU, and `device` if CUDA).

    Dropout draws from this state, so two runs of the same blocks under the same seed use the
    same masks: what lets a stage recompute a forward for its backward instead of storing it.
    """
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with _RNG_LOCK, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class TokenEmbedding(nn.Module):
    """(b, t) int64 token ids -> (b, t, d) float32: token plus learned position embedding."""

    def __init__(self, vocab: int, d_model: int, block: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.block = block
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.block:
            raise ValueError(f"TokenEmbedding: sequence length {t} exceeds block size {self.block}")
        # Ids come from peers: an out-of-range id is an IndexError on CPU and a device-side assert
        # (which poisons the whole CUDA context) on GPU, so reject it here as bad input.
        if idx.numel() and not idx.is_meta and (int(idx.min()) < 0 or int(idx.max()) >= self.vocab):
            raise ValueError(f"TokenEmbedding: token ids must be in [0, {self.vocab}), "
                             f"got [{int(idx.min())}, {int(idx.max())}]")
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))


class LMHead(nn.Module):
    """(b, t, d) -> (b, t, vocab) logits: final LayerNorm then the output projection."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln(x))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross entropy of (b, t, V) logits against (b, t) int64 targets (every position counts).

    Targets come from peers; out-of-range ones are rejected as ValueError (on GPU they would be a
    device-side assert).
    """
    v = logits.shape[-1]
    if targets.numel() and not targets.is_meta and (int(targets.min()) < 0 or int(targets.max()) >= v):
        raise ValueError(f"lm_loss: targets must be in [0, {v}), got [{int(targets.min())}, {int(targets.max())}]")
    return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1))


def char_transformer_pipeline(
    vocab: int, *, d_model: int = 256, n_layers: int = 8, n_heads: int = 8, block: int = 128,
    dropout: float = 0.1, seed: int = 0,
) -> PipelineModel:
    """TokenEmbedding, n_layers x Block, LMHead, as builders: block i's weights depend only on (seed, i).

    Defaults (~6.4 M parameters, 25 MB; a 16-window microbatch's activation is 2 MiB) are sized
    so that shipping activations and averaging parameters are real costs, which is what a pipeline
    benchmark needs to show.
    """
    if vocab < 1:
        raise ValueError(f"char_transformer_pipeline: vocab must be >= 1, got {vocab}")
    if n_layers < 0:
        raise ValueError(f"char_transformer_pipeline: n_layers must be >= 0, got {n_layers}")
    builders: list[Any] = [functools.partial(TokenEmbedding, vocab, d_model, block)]
    builders += [functools.partial(Block, d_model, n_heads, dropout) for _ in range(n_layers)]
    builders.append(functools.partial(LMHead, d_model, vocab))
    name = f"char_transformer(vocab={vocab},d={d_model},layers={n_layers},heads={n_heads},block={block})"
    return PipelineModel(name=name, builders=builders, loss_fn=lm_loss, seed=seed)


def from_factory(spec: str) -> PipelineModel:
    """A user model: "pkg.module:fn" whose fn() returns (blocks, loss_fn), blocks an nn.Sequential or a list
    whose items are builders (functions returning one block), modules on the `meta` device, or built modules.

    The factory runs with the RNG seeded to FACTORY_SEED (and the caller's RNG state restored), so every peer
    gets the same weights for built modules; builders and meta modules get their block's own seed (`build`).
    Only builders and meta modules keep a peer from building the whole model: see PipelineModel.
    """
    factory = load_factory(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FACTORY_SEED)
        result = factory()
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError(f"model factory {spec!r} must return a pair (blocks, loss_fn), "
                         f"got {type(result).__name__}")
    blocks_obj, loss_fn = result
    if isinstance(blocks_obj, (nn.Sequential, list, tuple)):
        blocks = list(blocks_obj)
    else:
        raise ValueError(f"model factory {spec!r}: blocks must be an nn.Sequential or a list of nn.Module or of "
                         f"functions building one, got {type(blocks_obj).__name__}")
    if not blocks:
        raise ValueError(f"model factory {spec!r} returned no blocks")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module) and not callable(b):
            raise ValueError(f"model factory {spec!r}: block {i} is a {type(b).__name__}, neither an nn.Module "
                             "nor a function building one")
    if not callable(loss_fn):
        raise ValueError(f"model factory {spec!r}: loss_fn is a {type(loss_fn).__name__}, not callable")
    return PipelineModel(name=spec, builders=blocks, loss_fn=loss_fn, seed=FACTORY_SEED)

"""Models as an ordered list of blocks plus a loss: the unit a pipeline cuts into stages.

The built-in char transformer reuses `trainers.models.Block` and builds its modules in the same
order as `CharTransformer`, so for one seed both start from identical weights. User models come
from a "pkg.module:fn" factory returning `(blocks, loss_fn)`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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


@dataclass
class PipelineModel:
    """Blocks applied in order (x -> blocks[0] -> ... -> blocks[-1]) and the loss on the last output."""

    name: str
    blocks: list[nn.Module]
    loss_fn: LossFn

    def sequential(self) -> nn.Sequential:
        """The same block objects (not copies) as one module, for single-process reference runs."""
        return nn.Sequential(*self.blocks)


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
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.vocab):
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
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= v):
        raise ValueError(f"lm_loss: targets must be in [0, {v}), got [{int(targets.min())}, {int(targets.max())}]")
    return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1))


def char_transformer_pipeline(
    vocab: int, *, d_model: int = 256, n_layers: int = 8, n_heads: int = 8, block: int = 128,
    dropout: float = 0.1, seed: int = 0,
) -> PipelineModel:
    """TokenEmbedding, n_layers x Block, LMHead, with weights that depend only on `seed`.

    Defaults (~6.4 M parameters, 25 MB; a 16-window microbatch's activation is 2 MiB) are sized
    so that shipping activations and averaging parameters are real costs, which is what a pipeline
    benchmark needs to show. Modules are built in `CharTransformer`'s order, so the same seed gives
    the same initial weights as `seeded_model("char_transformer", seed, ...)`.
    """
    if vocab < 1:
        raise ValueError(f"char_transformer_pipeline: vocab must be >= 1, got {vocab}")
    if n_layers < 0:
        raise ValueError(f"char_transformer_pipeline: n_layers must be >= 0, got {n_layers}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks: list[nn.Module] = [TokenEmbedding(vocab, d_model, block)]
        blocks += [Block(d_model, n_heads, dropout) for _ in range(n_layers)]
        blocks.append(LMHead(d_model, vocab))
    name = f"char_transformer(vocab={vocab},d={d_model},layers={n_layers},heads={n_heads},block={block})"
    return PipelineModel(name=name, blocks=blocks, loss_fn=lm_loss)


def from_factory(spec: str) -> PipelineModel:
    """A user model: "pkg.module:fn" whose fn() returns (nn.Sequential | list[nn.Module], loss_fn).

    The factory runs with the RNG seeded to FACTORY_SEED (and the caller's RNG state restored), so
    every peer building it gets the same initial weights.
    """
    factory = load_factory(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(FACTORY_SEED)
        result = factory()
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError(f"model factory {spec!r} must return a pair (blocks, loss_fn), "
                         f"got {type(result).__name__}")
    blocks_obj, loss_fn = result
    if isinstance(blocks_obj, nn.Sequential):
        blocks = list(blocks_obj)
    elif isinstance(blocks_obj, (list, tuple)):
        blocks = list(blocks_obj)
    else:
        raise ValueError(f"model factory {spec!r}: blocks must be an nn.Sequential or a list of nn.Module, "
                         f"got {type(blocks_obj).__name__}")
    if not blocks:
        raise ValueError(f"model factory {spec!r} returned no blocks")
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise ValueError(f"model factory {spec!r}: block {i} is a {type(b).__name__}, not an nn.Module")
    if not callable(loss_fn):
        raise ValueError(f"model factory {spec!r}: loss_fn is a {type(loss_fn).__name__}, not callable")
    return PipelineModel(name=spec, blocks=blocks, loss_fn=loss_fn)

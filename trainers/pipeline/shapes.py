"""What crosses each cut of a pipeline model, and what each block weighs, without building the model.

A peer must know the shape of every block boundary (the activations a stage takes and returns, checked on
every call) and each block's parameter bytes (the memory a stage needs, the cost estimate of a block nobody
has measured) before it holds any block: the model may not fit it. So the blocks run on the `meta` device
(tensors with shapes and no storage) one at a time. A block whose forward reads values (a data-dependent
branch, `.item()`) cannot run there: that block alone is built on the CPU and run on zeros of its input's
shape, then dropped, so the peak is one block, never the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from trainers.pipeline.blocks import PipelineModel, seeded


@dataclass(frozen=True)
class Boundary:
    """Per-sample shape and dtype of a tensor crossing a block boundary (dim 0, the batch, left out)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def nbytes(self, batch: int) -> int:
        n = batch
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class ModelShapes:
    """`boundary[0]` is the model's input, `boundary[i + 1]` block i's output; `targets` the loss's target."""

    boundary: list[Boundary]
    targets: Boundary
    param_bytes: list[int]  # per block: its parameters and buffers
    meta_only: bool  # no block had to be built to trace it

    def out_bytes(self, i: int, batch: int) -> int:
        return self.boundary[i + 1].nbytes(batch)


def trace(model: PipelineModel, x: Tensor, y: Tensor) -> ModelShapes:
    """The boundaries and block sizes of `model` for a microbatch like (x, y); cached on the model per
    input shape. ValueError naming the block if one does not keep the batch in dim 0 or the loss is not a
    scalar."""
    key = (x.dtype, tuple(x.shape), y.dtype, tuple(y.shape))
    got = model.traced.get(key)
    if got is None:
        got = model.traced[key] = _trace(model, x, y)
    return got


def _trace(model: PipelineModel, x: Tensor, y: Tensor) -> ModelShapes:
    where = f"{model.name}"
    if x.dim() < 1 or y.dim() < 1 or x.shape[0] != y.shape[0] or x.shape[0] < 1:
        raise ValueError(f"{where}: the sample input and targets must share a batch dim 0 >= 1, "
                         f"got {list(x.shape)} and {list(y.shape)}")
    b = x.shape[0]
    boundary = [Boundary(x.dtype, tuple(x.shape[1:]))]
    sizes: list[int] = []
    meta_only = True
    h = x.to("meta")
    with torch.no_grad():
        for i in range(len(model)):
            blk = model.on_meta(i)
            sizes.append(sum(t.numel() * t.element_size() for t in (*blk.parameters(), *blk.buffers())))
            try:
                out = _run(blk, h, i)
            except (NotImplementedError, RuntimeError, ValueError, TypeError):
                meta_only = False  # reads values: run this block alone, for real, on zeros of its input
                real = model.build(i)
                with seeded(0, torch.device("cpu")):
                    out = _run(real, x if i == 0 else torch.zeros(h.shape, dtype=h.dtype), i)
                del real
            if not isinstance(out, Tensor) or out.dim() < 1 or out.shape[0] != b:
                got = list(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(f"{where}: block {i} must return a tensor with the batch ({b}) in dim 0, got {got}")
            boundary.append(Boundary(out.dtype, tuple(out.shape[1:])))
            h = out.to("meta")
        try:
            loss = model.loss_fn(h, y.to("meta"))
        except (NotImplementedError, RuntimeError, ValueError, TypeError):
            loss = None  # a loss that reads values: checked on the last stage's first call instead
        if isinstance(loss, Tensor) and loss.dim() != 0:
            raise ValueError(f"{where}: loss_fn must return a scalar tensor, got {list(loss.shape)}")
    return ModelShapes(boundary, Boundary(y.dtype, tuple(y.shape[1:])), sizes, meta_only)


def _run(blk: nn.Module, h: Tensor, i: int) -> Tensor:
    """Block `blk` on `h`, where its parameters are (a built module: on zeros of `h`'s shape)."""
    dev = next((p.device for p in blk.parameters()), None)
    if dev is not None and dev.type != h.device.type:
        h = torch.zeros(h.shape, dtype=h.dtype, device=dev) if h.is_meta else h.to(dev)
    return blk(h)

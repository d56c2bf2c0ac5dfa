"""The one routine both sides of an exchange compute the pair's squared distance with (and our norms).

Both sides clip an exchange by the same scale s (peer/averaging/bounds.py), computed from the announced
radii and ||b - a||^2; s is the same on both sides only if ||b - a||^2 is the same number, bit for bit,
whatever each side's tensors live in (numpy arrays, torch CPU tensors, CUDA, bfloat16). So it is computed
here, once, from the wire values both sides hold identically (our snapshot as the other side decodes it,
and what we decoded of theirs: CPU copies either way), by one fixed procedure:

- tensors in spec order, each flat, cut into blocks of `NORM_BLOCK` elements (elements, not bytes: the
  cut is a function of the spec alone);
- per block, the difference in the work dtype (float64 for float64 tensors, float32 for the rest;
  float16 and bfloat16 are widened to float32 exactly first), squared in that dtype, then summed in that
  dtype by numpy's pairwise summation (`np.add.reduce`: fixed C code, no BLAS, whose order depends on no
  CPU feature, thread count or memory alignment);
- the blocks' sums added in order in a Python float.

Why it is the same on both sides: IEEE subtraction rounds symmetrically (fl(a - b) = -fl(b - a)), so
the differences the two sides square are negatives of each other and their squares identical; the rest is
the same operations in the same order. Values too large to square (|difference| > 1.8e19 in float32) give
inf, and bounds.py applies nothing then, on both sides alike.

Cost: one read of both operands per exchange before anything is added (an update must never be applied
unclipped, not even a block of it: a trainer step may read the tensors between blocks). Per block of 2^16
float32 values here: subtract 8 us, square 5, sum 10 in float32 (31 in float64: the cast dominated); the
angle's product and its sum add 20. Per 64 MiB, under load: the distance took 17 ms with float64 sums, 13-14
with float32 ones, 23-25 with the angle. A float32 block sum is within ~1e-6 of exact, far below anything
a clip decides, and both sides get the same bits; it overflows only for values past ~7e16, where the
exchange is refused on both sides (inf) as for any overflow.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

NORM_BLOCK = 1 << 16  # elements per block: 256 KiB of float32, the scratch and both operands' blocks stay in L2


def diff_sq(xs: Iterable[Any], ys: Iterable[Any]) -> float:
    """||xs - ys||^2 over matching tensors (numpy arrays or CPU torch tensors of equal dtypes and shapes),
    by the fixed procedure of the module docstring: bit-identical to diff_sq(ys, xs) on any peer."""
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):  # inf/NaN flow into the sum: bounds.py refuses those
        for x, y in zip(xs, ys):
            for bx, by, scratch in _blocks(x, y):
                np.subtract(bx, by, out=scratch, dtype=scratch.dtype)
                np.square(scratch, out=scratch)
                total += float(np.add.reduce(scratch))
    return total


def diff_sq_and_dot(xs: Iterable[Any], ys: Iterable[Any]) -> tuple[float, float]:
    """(||xs - ys||^2, <xs, ys>) in one pass, each by the fixed procedure of the module docstring (the product
    like the square: fl(x * y) = fl(y * x), so both sides get the same bits): the clip's distance and the
    angle that tells values pointing away from ours (bounds.opposed)."""
    total = dot = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for x, y in zip(xs, ys):
            for bx, by, scratch in _blocks(x, y):
                np.multiply(bx, by, out=scratch, dtype=scratch.dtype)
                dot += float(np.add.reduce(scratch))
                np.subtract(bx, by, out=scratch, dtype=scratch.dtype)
                np.square(scratch, out=scratch)
                total += float(np.add.reduce(scratch))
    return total, dot


def sum_sq(xs: Iterable[Any]) -> float:
    """||xs||^2 by the same procedure (a parameter download's check, and our norm when none is known)."""
    total = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for x in xs:
            for bx, _, scratch in _blocks(x, None):
                np.square(bx, out=scratch, dtype=scratch.dtype)
                total += float(np.add.reduce(scratch))
    return total


def dot_on_support(xs: Iterable[Any], support: Iterable[tuple[np.ndarray, np.ndarray]]) -> float:
    """<xs, s> for a sparse s given per tensor as (flat indices, values), in float64: a received push against our
    own last one (peer/averaging/push_gate.py); one side's figure, so no fixed procedure is needed."""
    dot = 0.0
    for x, (idx, vals) in zip(xs, support):
        fx = _flat(x)
        picked = fx[idx] if isinstance(fx, np.ndarray) else _as_array(fx[idx])
        dot += float(np.dot(picked.astype(np.float64), vals.astype(np.float64)))
    return dot


def _flat(t: Any) -> Any:
    """`t` as a flat numpy array sharing its memory, or (a dtype numpy lacks: bfloat16) a flat CPU torch tensor."""
    if isinstance(t, np.ndarray):
        return t.reshape(-1)
    t = t.detach()
    if t.device.type != "cpu":  # snapshots and received copies are CPU tensors; anything else is copied once
        t = t.cpu()
    t = t.reshape(-1)
    try:
        return t.numpy()
    except (TypeError, RuntimeError):  # bfloat16: widened block by block (exactly) in _as_array
        return t


def _as_array(block: Any) -> np.ndarray:
    if isinstance(block, np.ndarray):
        return block
    import torch

    return block.to(torch.float32).numpy()  # bfloat16 -> float32 is exact (the same bits, shifted)


def _blocks(x: Any, y: Any | None) -> Iterator[tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
    """(block of x, block of y, scratch of the block's length in the work dtype), NORM_BLOCK elements at a time."""
    fx = _flat(x)
    fy = _flat(y) if y is not None else None
    n = fx.shape[0]
    if fy is not None and fy.shape[0] != n:
        raise ValueError(f"tensors of {n} and {fy.shape[0]} elements have no distance")
    itemsize = fx.itemsize if isinstance(fx, np.ndarray) else 2
    work = np.empty(min(NORM_BLOCK, n), dtype=np.float64 if itemsize == 8 else np.float32)
    for i in range(0, n, NORM_BLOCK):
        j = min(n, i + NORM_BLOCK)
        yield (_as_array(fx[i:j]), _as_array(fy[i:j]) if fy is not None else None, work[:j - i])

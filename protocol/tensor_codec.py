"""The tensor codecs: what a tensor's body is on the wire, and the element math behind each codec.

A tensor travels as a `TensorHeader` message followed by its body in KIND_CHUNK
frames. The body is the tensor's elements, little-endian, C order, encoded by
one of three codecs:

``raw``
    The bytes as they are, for every allowed dtype; bit-exact.
``float16``
    Float dtypes sent as IEEE float16 (2 bytes/element) and decoded back to the
    original dtype. For |x| <= 65504 the error is at most 2**-11 * |x| (normal
    range) or 2**-25 (subnormal range); finite values beyond are saturated to
    +-65504 rather than turned into Inf; NaN/Inf are sent as they are.
``q8``
    Blockwise absmax 8-bit quantization for float dtypes. Elements are cut into
    blocks of `block` elements (the last may be shorter); per block
    ``scale = absmax / 127`` (rounded *up* to float32) and ``q = round(x / scale)``
    as int8, decoded as ``x' = q * scale``. Hence, per element,
    ``|x - x'| <= scale / 2 ~= absmax(block) / 254`` (plus float32 rounding of
    the scale and the product; for bfloat16 add bfloat16 rounding of x').
    The body is the int8 values of all elements followed by one float32 scale
    per block. A block holding NaN/Inf decodes as all NaN (receivers reject it
    unless they allow non-finite values). Scales must fit float32, so float64
    blocks with absmax above ~4e40 cannot be q8-encoded.

``sparse``
    Top-k in chunks with 2-bit values, for updates sent with error feedback (SparseLoCo's recipe: what a send
    leaves out is carried into the next one, so only the few largest entries need to travel). Elements are cut
    into chunks of `block` elements (the last may be shorter, <= 65536 so an index is a u16); of each chunk
    only its `topk` largest in magnitude travel, as their index in the chunk (strictly increasing) and a 2-bit
    code: a sign bit (2) and a magnitude bit (1) choosing one of the chunk's two float32 magnitudes, the mean
    of the chosen entries' magnitudes at or below their median and of those above it. Every other element
    decodes as 0. The body is the u16 indices of all chunks, then the codes packed four to a byte (the first
    in the low bits), then two float32 magnitudes per chunk (low, high). At the defaults (4096, 64) a float32
    tensor travels in 1/108 of its bytes. A chunk holding NaN/Inf has NaN magnitudes (receivers reject it
    unless they allow non-finite values); magnitudes must fit float32.

bfloat16 has no numpy dtype: it is carried as its raw 2-byte words (an int16
array), converted from and to torch with ``.view(torch.int16)`` /
``.view(torch.bfloat16)``.

Streaming a body with bounded memory is `protocol.tensor_encoder` (send) and
`protocol.tensor_decoder` (receive); this module holds what both sides agree on:
the dtypes and codecs, the exact body size of a tensor, and the element
conversions. torch is never imported here unless a caller asks for a torch tensor.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "CODECS",
    "DENSE_CODECS",
    "DEFAULT_Q8_BLOCK",
    "DEFAULT_SPARSE_CHUNK",
    "DEFAULT_SPARSE_TOPK",
    "DTYPES",
    "FLOAT_DTYPES",
    "MAX_NDIM",
    "MAX_Q8_BLOCK",
    "MAX_SPARSE_CHUNK",
    "tensor_nbytes",
]

DTYPES: types.MappingProxyType[str, np.dtype[Any]] = types.MappingProxyType(
    {
        "float32": np.dtype("<f4"),
        "float16": np.dtype("<f2"),
        "bfloat16": np.dtype("<i2"),  # raw bfloat16 words
        "float64": np.dtype("<f8"),
        "int8": np.dtype("i1"),
        "uint8": np.dtype("u1"),
        "int32": np.dtype("<i4"),
        "int64": np.dtype("<i8"),
    }
)
"""Allowed dtype names and the numpy dtype their elements have on the wire."""

FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
CODECS = ("raw", "float16", "q8", "sparse")
"""Every codec the wire carries (a tensor body's `codec`)."""
DENSE_CODECS = ("raw", "float16", "q8")
"""The codecs that carry every element: what an exchange of whole tensors (averaging weights, a stage's
activations) may use. A sparse body carries a few entries and zeros the rest: right only for updates whose
left-out part a sender carries into its next send (error feedback), never for weights themselves (their
residual would hold the whole model: docs/design.md, "Sparse updates")."""
MAX_NDIM = 8
DEFAULT_Q8_BLOCK = 4096
MAX_Q8_BLOCK = 1 << 20
"""Largest q8 block: one block must fit in one conversion step."""
DEFAULT_SPARSE_CHUNK = 4096
"""Elements per sparse chunk: SparseLoCo's chunked top-k, small enough that a chunk's two magnitudes fit its
entries, large enough that they cost 0.2 bytes per kept entry."""
DEFAULT_SPARSE_TOPK = 64
"""Entries kept per chunk: 1.6% density, 152 body bytes per 16 KiB of float32 (108x fewer), SparseLoCo's 1-3%
range, where error feedback still trains as well as dense sends (docs/benchmarks.md)."""
MAX_SPARSE_CHUNK = 1 << 16
"""Largest sparse chunk: an index within it is a u16."""

CONVERT_STEP = 1 << 20  # elements converted at a time: bounds the temporaries (a few MiB)
F16_MAX = 65504.0
U32 = 1 << 32  # stream ids are u32: below this


# --- sizes -------------------------------------------------------------------


def sparse_counts(n: int, block: int, topk: int) -> tuple[int, int]:
    """(chunks, entries kept) of `n` elements cut into chunks of `block`, `topk` kept per chunk."""
    if n == 0:
        return 0, 0
    chunks = -(-n // block)
    return chunks, topk * (chunks - 1) + min(topk, n - (chunks - 1) * block)


def body_spec(dtype: str, shape: Sequence[int], codec: str, block: int, topk: int = 0) -> tuple[int, int]:
    """(element count, body bytes) for a tensor description; ValueError if invalid."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {str(dtype)[:32]!r}")
    if not isinstance(codec, str) or codec not in CODECS:
        raise ValueError(f"unknown codec {str(codec)[:32]!r}")
    if codec != "raw" and dtype not in FLOAT_DTYPES:
        raise ValueError(f"codec {codec!r} needs a float dtype, not {dtype!r}")
    if not isinstance(shape, (list, tuple)):
        raise ValueError("shape must be a list of ints")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"{len(shape)} dimensions, more than {MAX_NDIM}")
    for d in shape:
        if type(d) is not int or d < 0:
            raise ValueError(f"bad dimension {d!r} in shape (must be an int >= 0)")
    if codec == "q8":
        if type(block) is not int or not 1 <= block <= MAX_Q8_BLOCK:
            raise ValueError(f"q8 block must be an int in [1, {MAX_Q8_BLOCK}], got {block!r}")
    elif codec == "sparse":
        if type(block) is not int or not 1 <= block <= MAX_SPARSE_CHUNK:
            raise ValueError(f"sparse block must be an int in [1, {MAX_SPARSE_CHUNK}], got {block!r}")
        if type(topk) is not int or not 1 <= topk <= block:
            raise ValueError(f"sparse topk must be an int in [1, block {block}], got {topk!r}")
    elif block != 0:
        raise ValueError(f"block must be 0 for codec {codec!r}, got {block!r}")
    if codec != "sparse" and topk != 0:
        raise ValueError(f"topk must be 0 for codec {codec!r}, got {topk!r}")
    n = math.prod(shape)
    if codec == "raw":
        return n, n * DTYPES[dtype].itemsize
    if codec == "float16":
        return n, 2 * n
    if codec == "sparse":
        chunks, kept = sparse_counts(n, block, topk)
        return n, 2 * kept + -(-kept // 4) + 8 * chunks
    return n, n + 4 * -(-n // block)


def tensor_nbytes(dtype: str, shape: Sequence[int], codec: str = "raw", block: int = 0, topk: int = 0) -> int:
    """Exact body length of a tensor sent with `codec` (`block` for q8 and sparse, `topk` for sparse)."""
    return body_spec(dtype, shape, codec, block, topk)[1]


def codec_params(codec: str) -> tuple[int, int]:
    """(block, topk) a sender uses by default for `codec` (0 where the codec has none)."""
    if codec == "q8":
        return DEFAULT_Q8_BLOCK, 0
    if codec == "sparse":
        return DEFAULT_SPARSE_CHUNK, DEFAULT_SPARSE_TOPK
    return 0, 0


# --- element conversions -------------------------------------------------------


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """bfloat16 words -> float32 (exact: bfloat16 is float32's top half)."""
    return (words.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 words, round-to-nearest-even like torch."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    words = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # rounding could carry a NaN's payload into Inf: keep it a quiet NaN
        words[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return words.view(np.int16)


def to_float16(x: np.ndarray) -> np.ndarray:
    """float -> float16, saturating finite overflow instead of making it Inf."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    inf = np.isinf(h)
    if inf.any():
        fix = inf & np.isfinite(x)
        h[fix] = np.copysign(F16_MAX, x[fix]).astype(np.float16)
    return h


def quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """One step of whole blocks (the last may be short) -> (int8 values, float32 scales)."""
    n = x.shape[0]
    calc = np.float64 if x.dtype == np.float64 else np.float32
    absmax = np.maximum.reduceat(np.abs(x), np.arange(0, n, block))
    ideal = absmax.astype(np.float64) / 127.0
    with np.errstate(over="ignore"):
        scales = ideal.astype(np.float32)
    low = scales.astype(np.float64) < ideal
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))  # round up: |x| <= 127*scale
    bad = ~np.isfinite(scales)
    if bad.any():
        if (bad & np.isfinite(absmax)).any():
            raise ValueError("q8: a block's absmax is beyond float32 scale range; use codec 'raw'")
        scales[bad] = np.nan
    divisor = np.where(bad | (scales == 0), np.float32(1), scales).astype(calc)
    y = x.astype(calc, copy=True)
    np.divide(y, np.repeat(divisor, block)[:n], out=y)
    if bad.any():
        y[np.repeat(bad, block)[:n]] = 0
    np.rint(y, out=y)
    np.clip(y, -127, 127, out=y)
    return y.astype(np.int8), scales


def sparsify(x: np.ndarray, block: int, topk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole chunks of `x` (the last may be short) -> (u16 indices, codes 0..3 as u8, float32 magnitudes: two
    per chunk), as the module docstring says: per chunk its `topk` largest entries by magnitude, indices
    increasing."""
    n = x.shape[0]
    full = n // block * block
    parts = []
    if full:
        parts.append(_sparse_rows(x[:full].reshape(-1, block), topk))
    if n > full:
        parts.append(_sparse_rows(x[full:].reshape(1, -1), min(topk, n - full)))
    if not parts:
        return np.empty(0, "<u2"), np.empty(0, np.uint8), np.empty(0, "<f4")
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            np.concatenate([p[2] for p in parts]))


def _sparse_rows(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    calc = np.float64 if rows.dtype == np.float64 else np.float32
    mag = np.abs(rows.astype(calc, copy=False))
    bad = ~np.isfinite(mag).all(axis=1)
    if bad.any():
        mag = np.where(np.isfinite(mag), mag, 0)  # a chunk with NaN/Inf: its magnitudes go NaN below
    if k < rows.shape[1]:
        idx = np.argpartition(-mag, k - 1, axis=1)[:, :k]
        idx.sort(axis=1)
    else:
        idx = np.broadcast_to(np.arange(k), (rows.shape[0], k))
    vals = np.take_along_axis(rows, idx, axis=1).astype(calc)
    m = np.abs(vals)
    split = np.median(m, axis=1, keepdims=True)
    high = m > split
    n_high = high.sum(axis=1)
    hi_sum = np.where(high, m, 0).sum(axis=1)
    lo_sum = m.sum(axis=1) - hi_sum
    lo = lo_sum / np.maximum(k - n_high, 1)
    hi = np.where(n_high > 0, hi_sum / np.maximum(n_high, 1), lo)
    with np.errstate(over="ignore", invalid="ignore"):
        scales = np.stack([lo, hi], axis=1).astype(np.float32)
    if (~np.isfinite(scales) & ~bad[:, None]).any():
        raise ValueError("sparse: a chunk's magnitude is beyond float32 range; use codec 'raw'")
    scales[bad] = np.nan
    codes = (np.signbit(vals).astype(np.uint8) << 1) | high.astype(np.uint8)
    return idx.astype("<u2").reshape(-1), codes.reshape(-1), scales.reshape(-1)


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """2-bit codes -> bytes, four to a byte, the first in the low bits."""
    pad = (-codes.shape[0]) % 4
    c = np.concatenate([codes, np.zeros(pad, np.uint8)]).reshape(-1, 4) if pad else codes.reshape(-1, 4)
    return (c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)).astype(np.uint8)


def unpack_codes(packed: np.ndarray, count: int) -> np.ndarray:
    """`pack_codes`' inverse: the first `count` codes."""
    c = np.stack([packed & 3, (packed >> 2) & 3, (packed >> 4) & 3, packed >> 6], axis=1)
    return c.reshape(-1)[:count]


# --- torch, only where the caller has imported it ----------------------------


def torch_module() -> Any:
    """torch if the process already imported it (so we never import it ourselves)."""
    return sys.modules.get("torch")


def is_torch_tensor(obj: Any) -> bool:
    torch = torch_module()
    return torch is not None and isinstance(obj, torch.Tensor)

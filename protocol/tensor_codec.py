"""Tensors to chunk-frame bodies and back, with bounded memory on both sides.

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

bfloat16 has no numpy dtype: it is carried as its raw 2-byte words (an int16
array), converted from and to torch with ``.view(torch.int16)`` /
``.view(torch.bfloat16)``.

Memory: the encoder yields views of the tensor itself for raw data and converts
the other codecs one ~1 MiB step at a time. The decoder allocates the output
array once (or uses `out=`), receives raw bodies straight into it, and receives
float16/q8 bodies into the *tail* of that same buffer and then expands them
front to back in place (each step reads its input before its output can reach
it), so no second full-size buffer exists; q8 adds only its scales.

torch is never imported here unless a caller asks for a torch tensor.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.errors import LimitExceeded, ProtocolError
from protocol.limits import DEFAULT_CHUNK_SIZE, WireLimits
from protocol.schema.tensor import TensorHeader

__all__ = [
    "CODECS",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_Q8_BLOCK",
    "DTYPES",
    "FLOAT_DTYPES",
    "MAX_NDIM",
    "MAX_Q8_BLOCK",
    "DecodedTensor",
    "TensorDecoder",
    "TensorEncoder",
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
CODECS = ("raw", "float16", "q8")
MAX_NDIM = 8
DEFAULT_Q8_BLOCK = 4096
MAX_Q8_BLOCK = 1 << 20
"""Largest q8 block: one block must fit in one conversion step."""

_STEP = 1 << 20  # elements converted at a time: bounds the temporaries (a few MiB)
_F16_MAX = 65504.0
_U32 = 1 << 32
_Q8_SATURATE = {"float32": float(np.finfo(np.float32).max), "float16": _F16_MAX}


# --- sizes -------------------------------------------------------------------


def _body_spec(dtype: str, shape: Sequence[int], codec: str, block: int) -> tuple[int, int]:
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
    elif block != 0:
        raise ValueError(f"block must be 0 for codec {codec!r}, got {block!r}")
    n = math.prod(shape)
    if codec == "raw":
        return n, n * DTYPES[dtype].itemsize
    if codec == "float16":
        return n, 2 * n
    return n, n + 4 * -(-n // block)


def tensor_nbytes(dtype: str, shape: Sequence[int], codec: str = "raw", block: int = 0) -> int:
    """Exact body length of a tensor sent with `codec` (`block` only for q8)."""
    return _body_spec(dtype, shape, codec, block)[1]


# --- element conversions -------------------------------------------------------


def _bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """bfloat16 words -> float32 (exact: bfloat16 is float32's top half)."""
    return (words.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 words, round-to-nearest-even like torch."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    words = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # rounding could carry a NaN's payload into Inf: keep it a quiet NaN
        words[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return words.view(np.int16)


def _to_float16(x: np.ndarray) -> np.ndarray:
    """float -> float16, saturating finite overflow instead of making it Inf."""
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    inf = np.isinf(h)
    if inf.any():
        fix = inf & np.isfinite(x)
        h[fix] = np.copysign(_F16_MAX, x[fix]).astype(np.float16)
    return h


def _quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
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
    y /= np.repeat(divisor, block)[:n]
    if bad.any():
        y[np.repeat(bad, block)[:n]] = 0
    np.rint(y, out=y)
    np.clip(y, -127, 127, out=y)
    return y.astype(np.int8), scales


# --- encoding ------------------------------------------------------------------


def _torch_module() -> Any:
    """torch if the process already imported it (so we never import it ourselves)."""
    return sys.modules.get("torch")


def _is_torch_tensor(obj: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(obj, torch.Tensor)


def _flatten(tensor: Any) -> tuple[np.ndarray, str, list[int], Any]:
    """(flat C-contiguous wire-dtype array, dtype name, shape, object keeping memory alive)."""
    if _is_torch_tensor(tensor):
        torch = _torch_module()
        t = tensor.detach()
        if t.layout != torch.strided:
            raise ValueError(f"only dense tensors can be sent, not {t.layout}")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
        if t.device.type != "cpu":
            t = t.cpu()  # the one copy a device tensor needs
        t = t.contiguous()  # no-op when it already is
        arr = (t.view(torch.int16) if dtype == "bfloat16" else t).numpy()
        return arr.reshape(-1), dtype, list(tensor.shape), t
    if isinstance(tensor, (np.ndarray, np.generic)):
        arr = np.asarray(tensor)
        dtype = arr.dtype.name
        if dtype == "bfloat16":  # ml_dtypes' numpy bfloat16, if someone has it
            arr = np.ascontiguousarray(arr).view(np.int16)
        elif dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
        flat = np.ascontiguousarray(arr, dtype=DTYPES[dtype]).reshape(-1)
        return flat, dtype, [int(d) for d in arr.shape], flat
    raise TypeError(f"expected a numpy array or torch tensor, got {type(tensor).__name__}")


def _split(view: memoryview, size: int) -> Iterator[memoryview]:
    for offset in range(0, len(view), size):
        yield view[offset : offset + size]


class TensorEncoder:
    """Turns one tensor into a `TensorHeader` and the chunks of its body.

    Accepts a numpy array or a torch tensor (device tensors are copied to the
    CPU once, non-contiguous ones made contiguous). `chunks()` can be iterated
    again to resend. Raw chunks are views of the tensor's memory, so the tensor
    must not be modified until they are sent.
    """

    def __init__(
        self,
        name: str,
        tensor: Any,
        codec: str = "raw",
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        block: int = DEFAULT_Q8_BLOCK,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError("tensor name must be a str")
        if type(chunk_size) is not int or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        flat, dtype, shape, keepalive = _flatten(tensor)
        block = block if codec == "q8" else 0
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.codec = codec
        self.block = block
        self.chunk_size = chunk_size
        self.nbytes = _body_spec(dtype, shape, codec, block)[1]
        self._flat = flat
        self._keepalive = keepalive

    def header(self, stream: int) -> TensorHeader:
        """The message announcing this tensor's body on chunk stream `stream`."""
        if type(stream) is not int or not 0 <= stream < _U32:
            raise ValueError(f"stream must be a u32, got {stream!r}")
        return TensorHeader(
            stream=stream,
            name=self.name,
            dtype=self.dtype,
            shape=list(self.shape),
            codec=self.codec,
            nbytes=self.nbytes,
            block=self.block,
        )

    def chunks(self) -> Iterator[memoryview]:
        """The body, in pieces of at most `chunk_size` bytes."""
        if self.codec == "raw" or (self.codec == "float16" and self.dtype == "float16"):
            yield from _split(memoryview(self._flat.view(np.uint8)), self.chunk_size)
        elif self.codec == "float16":
            step = min(_STEP, max(1, self.chunk_size // 2))
            for i in range(0, self._flat.shape[0], step):
                half = _to_float16(self._as_float(i, i + step))
                yield from _split(memoryview(half.view(np.uint8)), self.chunk_size)
        else:
            yield from self._q8_chunks()

    def _as_float(self, start: int, stop: int) -> np.ndarray:
        part = self._flat[start:stop]
        return _bf16_to_f32(part) if self.dtype == "bfloat16" else part

    def _q8_chunks(self) -> Iterator[memoryview]:
        block = self.block
        step = max(1, min(self.chunk_size, _STEP) // block) * block
        scales = []
        for i in range(0, self._flat.shape[0], step):
            q, s = _quantize(self._as_float(i, i + step), block)
            scales.append(s)
            yield from _split(memoryview(q.view(np.uint8)), self.chunk_size)
        if scales:
            yield from _split(memoryview(np.concatenate(scales).view(np.uint8)), self.chunk_size)


# --- decoding ------------------------------------------------------------------


@dataclass(slots=True)
class DecodedTensor:
    """A received tensor. `array` holds bfloat16 as its int16 words."""

    name: str
    dtype: str
    array: np.ndarray

    def to_torch(self, device: Any = None) -> Any:
        """As a torch tensor sharing `array`'s memory (copied only to move to `device`)."""
        import torch  # lazy: only a caller that wants torch pays for it

        t = torch.from_numpy(self.array)
        if self.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t if device is None else t.to(device)


class TensorDecoder:
    """Receives one tensor body announced by a `TensorHeader`.

    The header is checked completely before anything is allocated. Body bytes
    are then written where they belong: `slot(n)` gives a writable view for the
    next n bytes (the transport decrypts a chunk straight into it) and
    `advance(n)` commits them. `finish()` expands the codec and returns the
    tensor. `memory_bytes` is what this decoder allocated, for the session's
    in-flight budget.
    """

    @staticmethod
    def check_header(header: TensorHeader, limits: WireLimits) -> tuple[int, int]:
        """Check every field of `header` against the codec and `limits`, allocating nothing; returns
        (elements, body bytes). Raises ProtocolError (LimitExceeded for a limit)."""
        if not isinstance(header, TensorHeader):
            raise TypeError(f"expected a TensorHeader, got {type(header).__name__}")
        what = f"tensor {str(header.name)[:64]!r}"
        try:
            numel, body = _body_spec(header.dtype, header.shape, header.codec, header.block)
        except ValueError as e:
            raise ProtocolError(f"{what}: {e}") from None
        if type(header.stream) is not int or not 0 <= header.stream < _U32:
            raise ProtocolError(f"{what}: bad stream id {header.stream!r}")
        wire = DTYPES[header.dtype]
        decoded = numel * wire.itemsize
        if decoded > limits.max_tensor_bytes:
            raise LimitExceeded(
                f"{what}: {decoded} bytes decoded, above max_tensor_bytes {limits.max_tensor_bytes}"
            )
        if math.prod(max(d, 1) for d in header.shape) * wire.itemsize > limits.max_tensor_bytes:
            raise LimitExceeded(f"{what}: shape {header.shape[:MAX_NDIM]} is absurdly large")
        if body > limits.max_tensor_bytes:
            raise LimitExceeded(
                f"{what}: {body} body bytes, above max_tensor_bytes {limits.max_tensor_bytes}"
            )
        if type(header.nbytes) is not int or header.nbytes != body:
            raise ProtocolError(
                f"{what}: header says {header.nbytes!r} body bytes but "
                f"{header.dtype}{list(header.shape)} as {header.codec} takes {body}"
            )
        return numel, body

    def __init__(
        self,
        header: TensorHeader,
        limits: WireLimits,
        *,
        allow_nonfinite: bool = False,
        out: Any = None,
    ) -> None:
        numel, body = self.check_header(header, limits)
        name = header.name
        self._what = f"tensor {str(name)[:64]!r}"
        wire = DTYPES[header.dtype]

        if out is None:
            array = np.empty(tuple(header.shape), dtype=wire)
            allocated = array.nbytes
        else:
            array = self._check_out(out, header, wire)
            allocated = 0
        self.name: str = name
        self.dtype: str = header.dtype
        self.shape: tuple[int, ...] = tuple(header.shape)
        self.codec: str = header.codec
        self.block: int = header.block
        self.nbytes: int = body
        self.allow_nonfinite = allow_nonfinite
        self._array = array
        self._flat = array.reshape(-1)
        self._numel = numel
        raw_bytes = self._flat.view(np.uint8)
        k = wire.itemsize
        self._scales: np.ndarray | None = None
        if self.codec == "q8":
            self._scales = np.empty(-(-numel // self.block), dtype="<f4")
            allocated += self._scales.nbytes
            regions = [raw_bytes[(k - 1) * numel :], self._scales.view(np.uint8)]
        elif self.codec == "float16":
            regions = [raw_bytes[(k - 2) * numel :]]
        else:
            regions = [raw_bytes]
        # (start offset in the body, writable bytes) in body order
        self._regions: list[tuple[int, memoryview]] = []
        offset = 0
        for region in regions:
            self._regions.append((offset, memoryview(region)))
            offset += region.shape[0]
        self.memory_bytes: int = allocated
        self._received = 0
        # For raw float bodies the NaN/Inf check runs chunk by chunk as bytes arrive, while they are
        # still in cache (a separate pass over a large tensor at the end costs ~20% of a transfer).
        self._check_as_received = self.codec == "raw" and self.dtype in FLOAT_DTYPES and not allow_nonfinite
        self._checked = 0  # body bytes already checked
        self._nonfinite = False
        self._slot: tuple[int, bytearray | None] | None = None
        self._result: DecodedTensor | None = None

    def _check_out(self, out: Any, header: TensorHeader, wire: np.dtype[Any]) -> np.ndarray:
        if _is_torch_tensor(out):
            torch = _torch_module()
            if out.device.type != "cpu" or not out.is_contiguous():
                raise ValueError("out must be a contiguous CPU tensor")
            t = out.detach()
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)
            elif str(t.dtype).removeprefix("torch.") not in DTYPES:
                raise ProtocolError(f"{self._what}: dtype {header.dtype} does not match out dtype {t.dtype}")
            out = t.numpy()
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array or torch tensor, got {type(out).__name__}")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("out must be a writable C-contiguous array")
        if header.dtype == "bfloat16" and (
            out.dtype.name == "bfloat16" or (out.dtype.kind in "iu" and out.dtype.itemsize == 2)
        ):
            out = out.view(np.int16)
        if out.dtype != wire:
            raise ProtocolError(f"{self._what}: dtype {header.dtype} does not match out dtype {out.dtype}")
        if tuple(out.shape) != tuple(header.shape):
            raise ProtocolError(
                f"{self._what}: shape {list(header.shape)} does not match out shape {list(out.shape)}"
            )
        return out

    @property
    def received(self) -> int:
        return self._received

    @property
    def remaining(self) -> int:
        return self.nbytes - self._received

    @property
    def done(self) -> bool:
        return self._received == self.nbytes

    def slot(self, n: int) -> memoryview:
        """Writable view where the next `n` body bytes go; commit them with `advance`.

        ProtocolError if the peer sends more than the header declared.
        """
        if type(n) is not int or n < 0:
            raise ValueError(f"slot size must be an int >= 0, got {n!r}")
        if n > self.remaining:
            raise ProtocolError(
                f"{self._what}: body longer than the {self.nbytes} bytes declared "
                f"({self._received} received, {n} more arriving)"
            )
        pos = self._received
        for start, region in self._regions:
            if start <= pos and pos + n <= start + len(region):
                self._slot = (n, None)
                return region[pos - start : pos - start + n]
        staging = bytearray(n)  # only when n straddles the q8 values/scales boundary
        self._slot = (n, staging)
        return memoryview(staging)

    def advance(self, n: int) -> None:
        """Commit `n` bytes written into the view the last `slot(m)` returned (n <= m)."""
        if self._slot is None or type(n) is not int or not 0 <= n <= self._slot[0]:
            raise ValueError("advance(n) must follow slot(m) with 0 <= n <= m")
        staging = self._slot[1]
        self._slot = None
        if staging is not None:
            pos, src = self._received, memoryview(staging)[:n]
            for start, region in self._regions:
                lo, hi = max(pos, start), min(pos + n, start + len(region))
                if lo < hi:
                    region[lo - start : hi - start] = src[lo - pos : hi - pos]
        self._received += n
        if self._check_as_received and not self._nonfinite:
            k = self._flat.itemsize
            lo, hi = self._checked // k, self._received // k
            if hi > lo:
                self._nonfinite = not self._finite(self._flat[lo:hi])
                self._checked = hi * k

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Copy `data` in as the next body bytes (slot + copy + advance)."""
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.slot(view.nbytes)[:] = view
        self.advance(view.nbytes)

    def finish(self) -> DecodedTensor:
        """Check the body is complete, expand its codec, refuse NaN/Inf unless allowed."""
        if self._result is not None:
            return self._result
        if not self.done:
            raise ProtocolError(
                f"{self._what}: body incomplete, {self._received} of {self.nbytes} bytes"
            )
        if self.codec == "float16" and self.dtype != "float16":
            self._expand_float16()
        elif self.codec == "q8":
            self._expand_q8()
        if self._check_as_received:
            bad = self._nonfinite
        else:
            bad = not self.allow_nonfinite and self.dtype in FLOAT_DTYPES and not self._all_finite()
        if bad:
            raise ProtocolError(f"{self._what} contains NaN/Inf")
        self._result = DecodedTensor(self.name, self.dtype, self._array)
        return self._result

    def _store(self, start: int, values: np.ndarray) -> None:
        stop = start + values.shape[0]
        if self.dtype == "bfloat16":
            self._flat[start:stop] = _f32_to_bf16(values)
        else:
            with np.errstate(over="ignore"):
                self._flat[start:stop] = values

    def _expand_float16(self) -> None:
        n, k = self._numel, self._flat.itemsize
        half = self._flat.view(np.uint8)[(k - 2) * n :].view(np.float16)
        for i in range(0, n, _STEP):
            # astype copies this step's input before _store can overwrite it;
            # later input lies beyond what this step writes (k*j <= (k-2)*n + 2*j).
            self._store(i, half[i : i + _STEP].astype(np.float32))

    def _expand_q8(self) -> None:
        assert self._scales is not None
        n, k, block = self._numel, self._flat.itemsize, self.block
        values = self._flat.view(np.uint8)[(k - 1) * n :].view(np.int8)
        limit = _Q8_SATURATE.get(self.dtype)
        step = max(1, _STEP // block) * block
        for i in range(0, n, step):
            j = min(i + step, n)
            scales = self._scales[i // block : -(-j // block)]
            # 127 * (scale rounded up) may land just above the dtype's largest
            # finite value: compute such steps in float64 and saturate.
            near_max = limit is not None and float(np.fmax.reduce(np.abs(scales))) * 127 > limit * 0.999
            calc = np.float64 if self.dtype == "float64" or near_max else np.float32
            x = values[i:j].astype(calc)  # copied before it is overwritten, as above
            x *= np.repeat(scales.astype(calc), block)[: j - i]
            if near_max:
                np.clip(x, -limit, limit, out=x)
            self._store(i, x)

    def _all_finite(self) -> bool:
        flat = self._flat
        for i in range(0, flat.shape[0], _STEP):
            if not self._finite(flat[i : i + _STEP]):
                return False
        return True

    def _finite(self, part: np.ndarray) -> bool:
        if self.dtype == "bfloat16":
            return not ((part.view(np.uint16) & 0x7F80) == 0x7F80).any()
        return bool(np.isfinite(part).all())

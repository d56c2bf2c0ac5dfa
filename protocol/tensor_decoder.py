"""Receiving one tensor body announced by a `TensorHeader`, the header checked before anything is allocated.

Memory: the decoder allocates the output array once (or uses `out=`), receives
raw bodies straight into it, and receives float16/q8 bodies into the *tail* of
that same buffer and then expands them front to back in place (each step reads
its input before its output can reach it), so no second full-size buffer
exists; q8 adds only its scales. A sparse body (a few percent of the tensor) is received into its own three
buffers and scattered into a zeroed tensor at the end. The codecs themselves are `protocol.tensor_codec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.errors import LimitExceeded, ProtocolError
from protocol.limits import WireLimits
from protocol.schema.tensor import TensorHeader
from protocol.tensor_codec import (CONVERT_STEP, DTYPES, F16_MAX, FLOAT_DTYPES, MAX_NDIM, U32, body_spec,
                                   f32_to_bf16, is_torch_tensor, sparse_counts, torch_module, unpack_codes)

__all__ = ["DecodedTensor", "TensorDecoder"]

_Q8_SATURATE = {"float32": float(np.finfo(np.float32).max), "float16": F16_MAX}


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
            numel, body = body_spec(header.dtype, header.shape, header.codec, header.block, header.topk)
        except ValueError as e:
            raise ProtocolError(f"{what}: {e}") from None
        if type(header.stream) is not int or not 0 <= header.stream < U32:
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
        self.topk: int = header.topk
        self.nbytes: int = body
        self.allow_nonfinite = allow_nonfinite
        self._array = array
        self._flat = array.reshape(-1)
        self._numel = numel
        raw_bytes = self._flat.view(np.uint8)
        k = wire.itemsize
        self._scales: np.ndarray | None = None
        self._indices: np.ndarray | None = None
        self._codes: np.ndarray | None = None
        if self.codec == "sparse":
            chunks, kept = sparse_counts(numel, self.block, self.topk)
            self._indices = np.empty(kept, dtype="<u2")
            self._codes = np.empty(-(-kept // 4), dtype=np.uint8)
            self._scales = np.empty(2 * chunks, dtype="<f4")
            allocated += self._indices.nbytes + self._codes.nbytes + self._scales.nbytes
            regions = [self._indices.view(np.uint8), self._codes, self._scales.view(np.uint8)]
        elif self.codec == "q8":
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
            self._regions.append((offset, region.data))
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
        if is_torch_tensor(out):
            torch = torch_module()
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
        elif self.codec == "sparse":
            self._expand_sparse()
        if self._check_as_received:
            bad = self._nonfinite
        elif self.codec == "sparse":  # every value is a chunk's magnitude, with a sign
            assert self._scales is not None
            bad = not self.allow_nonfinite and not bool(np.isfinite(self._scales).all())
        else:
            bad = not self.allow_nonfinite and self.dtype in FLOAT_DTYPES and not self._all_finite()
        if bad:
            raise ProtocolError(f"{self._what} contains NaN/Inf")
        self._result = DecodedTensor(self.name, self.dtype, self._array)
        return self._result

    def _store(self, start: int, values: np.ndarray) -> None:
        stop = start + values.shape[0]
        if self.dtype == "bfloat16":
            self._flat[start:stop] = f32_to_bf16(values)
        else:
            with np.errstate(over="ignore"):
                self._flat[start:stop] = values

    def _expand_float16(self) -> None:
        n, k = self._numel, self._flat.itemsize
        half = self._flat.view(np.uint8)[(k - 2) * n :].view(np.float16)
        for i in range(0, n, CONVERT_STEP):
            # astype copies this step's input before _store can overwrite it;
            # later input lies beyond what this step writes (k*j <= (k-2)*n + 2*j).
            self._store(i, half[i : i + CONVERT_STEP].astype(np.float32))

    def _expand_q8(self) -> None:
        assert self._scales is not None
        n, k, block = self._numel, self._flat.itemsize, self.block
        values = self._flat.view(np.uint8)[(k - 1) * n :].view(np.int8)
        limit = _Q8_SATURATE.get(self.dtype)
        step = max(1, CONVERT_STEP // block) * block
        for i in range(0, n, step):
            j = min(i + step, n)
            scales = self._scales[i // block : -(-j // block)]
            # 127 * (scale rounded up) may land just above the dtype's largest
            # finite value: compute such steps in float64 and saturate.
            near_max = limit is not None and float(np.fmax.reduce(np.abs(scales))) * 127 > limit * 0.999
            calc = np.float64 if self.dtype == "float64" or near_max else np.float32
            x = values[i:j].astype(calc)  # copied before it is overwritten, as above
            np.multiply(x, np.repeat(scales.astype(calc), block)[: j - i], out=x)
            if near_max and limit is not None:
                np.clip(x, -limit, limit, out=x)
            self._store(i, x)

    def _expand_sparse(self) -> None:
        """Check the indices (within their chunk, strictly increasing) and magnitudes (not negative), then
        scatter: every element not sent is 0. ProtocolError naming the first bad chunk."""
        assert self._indices is not None and self._codes is not None and self._scales is not None
        n, block, topk = self._numel, self.block, self.topk
        full = n // block  # whole chunks; a last short one keeps min(topk, its length)
        idx = self._indices
        rows = idx[: full * topk].reshape(full, topk).astype(np.int32)
        ok_rows = (rows < block).all(axis=1) & (np.diff(rows, axis=1) > 0).all(axis=1) if full else np.ones(0, bool)
        if not ok_rows.all():
            raise ProtocolError(f"{self._what}: sparse chunk {int(np.argmin(ok_rows))}: indices must be strictly "
                                f"increasing and below {block}")
        if n > full * block:
            last = idx[full * topk :].astype(np.int32)
            if not ((last < n - full * block).all() and (np.diff(last) > 0).all()):
                raise ProtocolError(f"{self._what}: sparse chunk {full}: indices must be strictly increasing and "
                                    f"below {n - full * block}")
        with np.errstate(invalid="ignore"):
            negative = self._scales < 0
        if negative.any():
            raise ProtocolError(f"{self._what}: sparse chunk {int(np.argmax(negative)) // 2}: a negative magnitude")
        self._flat.fill(0)
        kept = idx.shape[0]
        step = max(1, CONVERT_STEP // topk) * topk  # whole chunks' entries at a time: bounded temporaries
        for i in range(0, kept, step):
            j = min(i + step, kept)
            chunk = np.arange(i, j) // topk
            codes = unpack_codes(self._codes[i // 4 : -(-j // 4)], j - i + i % 4)[i % 4 :]
            values = self._scales[2 * chunk + (codes & 1)].astype(np.float64 if self.dtype == "float64" else np.float32)
            values[codes >= 2] *= -1
            positions = chunk.astype(np.int64) * block + idx[i:j]
            if self.dtype == "bfloat16":
                self._flat[positions] = f32_to_bf16(values)
            else:
                with np.errstate(over="ignore"):
                    self._flat[positions] = values

    def _all_finite(self) -> bool:
        flat = self._flat
        for i in range(0, flat.shape[0], CONVERT_STEP):
            if not self._finite(flat[i : i + CONVERT_STEP]):
                return False
        return True

    def _finite(self, part: np.ndarray) -> bool:
        if self.dtype == "bfloat16":
            return not ((part.view(np.uint16) & 0x7F80) == 0x7F80).any()
        return bool(np.isfinite(part).all())

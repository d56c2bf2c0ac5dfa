"""Turning one tensor into a `TensorHeader` and the chunks of its body; the codecs are `protocol.tensor_codec`.

Memory: the encoder yields views of the tensor itself for raw data and converts
the other codecs one ~1 MiB step at a time, so sending holds no second
full-size copy of the tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from protocol.limits import DEFAULT_CHUNK_SIZE
from protocol.schema.tensor import TensorHeader
from protocol.tensor_codec import (CONVERT_STEP, DTYPES, U32, bf16_to_f32, body_spec, codec_params,
                                   is_torch_tensor, pack_codes, quantize, sparsify, to_float16, torch_module)

__all__ = ["EncodedTensor", "TensorEncoder"]


def _flatten(tensor: Any) -> tuple[np.ndarray, str, list[int], Any]:
    """(flat C-contiguous wire-dtype array, dtype name, shape, object keeping memory alive)."""
    if is_torch_tensor(tensor):
        torch = torch_module()
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


def _header(tensor: "TensorEncoder | EncodedTensor", stream: int) -> TensorHeader:
    """The message announcing `tensor`'s body on chunk stream `stream` (an encoder's or an encoded body's)."""
    if type(stream) is not int or not 0 <= stream < U32:
        raise ValueError(f"stream must be a u32, got {stream!r}")
    return TensorHeader(stream=stream, name=tensor.name, dtype=tensor.dtype, shape=list(tensor.shape),
                        codec=tensor.codec, nbytes=tensor.nbytes, block=tensor.block, topk=tensor.topk)


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
        block: int | None = None,
        topk: int | None = None,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError("tensor name must be a str")
        if type(chunk_size) is not int or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        flat, dtype, shape, keepalive = _flatten(tensor)
        default_block, default_topk = codec_params(codec) if isinstance(codec, str) else (0, 0)
        block = (block if block is not None else default_block) if codec in ("q8", "sparse") else 0
        topk = (topk if topk is not None else default_topk) if codec == "sparse" else 0
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.codec = codec
        self.block = block
        self.topk = topk
        self.chunk_size = chunk_size
        self.nbytes = body_spec(dtype, shape, codec, block, topk)[1]
        self._flat = flat
        self._keepalive = keepalive

    def header(self, stream: int) -> TensorHeader:
        """The message announcing this tensor's body on chunk stream `stream`."""
        return _header(self, stream)

    def chunks(self) -> Iterator[memoryview]:
        """The body, in pieces of at most `chunk_size` bytes."""
        if self.codec == "raw" or (self.codec == "float16" and self.dtype == "float16"):
            yield from _split(self._flat.view(np.uint8).data, self.chunk_size)
        elif self.codec == "float16":
            step = min(CONVERT_STEP, max(1, self.chunk_size // 2))
            for i in range(0, self._flat.shape[0], step):
                half = to_float16(self._as_float(i, i + step))
                yield from _split(half.view(np.uint8).data, self.chunk_size)
        elif self.codec == "sparse":
            yield from self._sparse_chunks()
        else:
            yield from self._q8_chunks()

    def encoded(self) -> "EncodedTensor":
        """This tensor's body encoded once, to send as often as wanted: a sparse update pushed to every partner
        costs one encoding, not one per partner (peer/averaging/pushes.py)."""
        body = np.frombuffer(b"".join(bytes(c) for c in self.chunks()), dtype=np.uint8)
        return EncodedTensor(self.name, self.dtype, list(self.shape), self.codec, self.block, self.topk, body)

    def _as_float(self, start: int, stop: int) -> np.ndarray:
        part = self._flat[start:stop]
        return bf16_to_f32(part) if self.dtype == "bfloat16" else part

    def _q8_chunks(self) -> Iterator[memoryview]:
        block = self.block
        step = max(1, min(self.chunk_size, CONVERT_STEP) // block) * block
        scales = []
        for i in range(0, self._flat.shape[0], step):
            q, s = quantize(self._as_float(i, i + step), block)
            scales.append(s)
            yield from _split(q.view(np.uint8).data, self.chunk_size)
        if scales:
            yield from _split(np.concatenate(scales).view(np.uint8).data, self.chunk_size)

    def _sparse_chunks(self) -> Iterator[memoryview]:
        """Indices, packed codes, magnitudes (tensor_codec's layout): a few percent of the tensor, so the three
        parts are gathered over the steps and sent after."""
        block = self.block
        step = max(1, CONVERT_STEP // block) * block
        idx, codes, scales = [], [], []
        for i in range(0, self._flat.shape[0], step):
            a, c, s = sparsify(self._as_float(i, i + step), block, self.topk)
            idx.append(a)
            codes.append(c)
            scales.append(s)
        if not idx:
            return
        for part in (np.concatenate(idx), pack_codes(np.concatenate(codes)), np.concatenate(scales)):
            yield from _split(part.view(np.uint8).data, self.chunk_size)


class EncodedTensor:
    """A tensor's header fields and its whole body, already encoded (`TensorEncoder.encoded`): `header` and
    `chunks` as an encoder's, so a session sends it the same way, without encoding it again."""

    def __init__(self, name: str, dtype: str, shape: list[int], codec: str, block: int, topk: int, body: np.ndarray):
        if body.nbytes != body_spec(dtype, shape, codec, block, topk)[1]:
            raise ValueError(f"an encoded body of {body.nbytes} bytes for a {codec} {dtype}{shape} tensor")
        self.name, self.dtype, self.shape, self.codec, self.block, self.topk = name, dtype, shape, codec, block, topk
        self.nbytes = body.nbytes
        self._body = body

    def header(self, stream: int) -> TensorHeader:
        return _header(self, stream)

    def chunks(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[memoryview]:
        yield from _split(self._body.data, chunk_size)

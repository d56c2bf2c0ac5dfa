"""The data-plane header announcing one tensor's body on a chunk stream.

The header travels as an ordinary message; the body follows as KIND_CHUNK
frames on `stream`. Everything the receiver needs to bound and preallocate the
body is here, and `protocol.tensor_codec.TensorDecoder` checks it all before
allocating a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Message

__all__ = ["TensorHeader"]


@dataclass(frozen=True, slots=True)
class TensorHeader(Message):
    """A tensor named `name` follows on chunk stream `stream`.

    `dtype` is the tensor's dtype (e.g. "float32"), `codec` how its body is
    encoded ("raw", "float16", "q8"), `nbytes` the exact body length and
    `block` the q8 quantization block in elements (0 for other codecs).
    """

    TYPE = "tensor"
    stream: int
    name: str
    dtype: str
    shape: list[int]
    codec: str
    nbytes: int
    block: int = 0

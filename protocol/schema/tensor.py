"""The data-plane messages: the header announcing one tensor's body on a chunk stream, and its cancel.

The header travels as an ordinary message; the body follows as KIND_CHUNK
frames on `stream`. Everything the receiver needs to bound and preallocate the
body is here, and `protocol.tensor_decoder.TensorDecoder` checks it all before
allocating a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Message

__all__ = ["TensorCancel", "TensorHeader"]


@dataclass(frozen=True, slots=True)
class TensorHeader(Message):
    """A tensor named `name` follows on chunk stream `stream`.

    `dtype` is the tensor's dtype (e.g. "float32"), `codec` how its body is
    encoded ("raw", "float16", "q8", "sparse"), `nbytes` the exact body length,
    `block` the q8 quantization block or the sparse chunk in elements (0 for
    other codecs) and `topk` the entries a sparse chunk keeps (0 for others).
    """

    TYPE = "tensor"
    stream: int
    name: str
    dtype: str
    shape: list[int]
    codec: str
    nbytes: int
    block: int = 0
    topk: int = 0


@dataclass(frozen=True, slots=True)
class TensorCancel(Message):
    """The tensor announced on `stream` will not be finished: its sender gave up part-way.

    Why: without it the receiver would hold the half-received tensor (and its share of the session's
    in-flight budget) and whoever waits for it would wait out a deadline. Sent after the last chunk
    frame that did go out, so everything of the stream is in before it.
    """

    TYPE = "tensor_cancel"
    stream: int
    reason: str = ""

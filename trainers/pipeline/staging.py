"""Activations between the wire and a stage's device: on a GPU, through one pinned staging buffer each way.

Why: a tensor arrives in the session's receive buffer (ordinary, pageable host memory) and leaves from
views of a host tensor. A copy between pageable memory and a GPU is staged by the CUDA driver through its
own pinned bounce buffer in pieces, and blocks the copying thread throughout. Copying once into page-locked
memory instead lets the transfer run as one DMA, asynchronously, while the next tensor is staged; on the
way out, the device writes straight into a page-locked host tensor that the encoder then sends from
(views of its memory for raw, one ~1 MiB conversion step at a time for the other codecs), so no further
host copy is made.

The staging buffers come from torch's caching host allocator (`pin_memory=True`): it records the copy's
stream on the buffer, so a buffer freed while its copy is still in flight is not handed out again before
that copy ends, and a pipeline's same-shaped tensors reuse the same few blocks instead of page-locking
fresh memory every call. What it caches is bounded by what is in flight at once: a stage's calls hold
their inputs and outputs only until they are sent.

On the CPU both directions are free: inputs are used where they are, outputs only made contiguous.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """Received (CPU) tensors on `device`: staged through pinned memory and copied asynchronously to a GPU;
    the stage's kernels, queued behind the copies on the same stream, see the data."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    moved = []
    for t in tensors:
        staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        staged.copy_(t)  # the one host copy: pageable receive buffer -> page-locked staging buffer
        moved.append(staged.to(device, non_blocking=True))
    return moved


def to_wire(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """A stage's outputs as contiguous CPU tensors ready for the encoder, once the device has finished them:
    on a GPU each is copied into a pinned host tensor, all copies queued before one wait."""
    if device.type != "cuda":
        return [t.detach().contiguous() for t in tensors]
    staged = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        staged.append(host)
    torch.cuda.current_stream(device).synchronize()  # the bytes are in `host` before the encoder reads them
    return staged


def is_pinned(t: Tensor) -> bool:
    """Whether `t` is in page-locked host memory (False where no CUDA is built in)."""
    return torch.cuda.is_available() and t.device.type == "cpu" and t.is_pinned()

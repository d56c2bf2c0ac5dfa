"""Recycled receive buffers for incoming tensors.

Why: a large tensor received into fresh memory costs page faults and kernel zeroing on every transfer,
about as much as the copy itself. A decoded tensor is instead a view of a pooled bytearray; when that
array and every view of it are gone, `weakref.finalize` hands the bytearray back for the next tensor of
the same size.

A fresh buffer is an anonymous mmap, not a zero-filled bytearray: the kernel commits its pages as chunks
are written into them, so the event loop never spends time (or memory) zero-filling a tensor before its
bytes arrive.

One pool serves every session of a daemon (`TransportConfig.receive_pool`), so what it keeps idle is
bounded per daemon, not per session: a pool per session kept up to 256 MiB idle in each, and a pipeline
stage's peer, holding two sessions with its stage partner, sat on 256 MiB of 64 MiB matrices its memory
budget never counted (its cgroup killed it in CI, 2026-11-29). The pipeline's memory model keeps
MAX_IDLE_BYTES beside a stage with its averaging's copies (trainers/pipeline/memory.py, `sharing_bytes`).
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref
from typing import Any


MAX_IDLE_BYTES = 128 << 20
"""What a daemon's pool keeps idle at most: two buffers of a 4096² float32 matrix, a big model's usual largest
tensor, so an exchange of the same group next time reuses them; a bigger tensor is received into fresh memory."""
IDLE_PER_SIZE = 2  # an exchange's tensors of one shape, received again while the previous ones are still held


class ReceiveBufferPool:
    """Idle receive buffers by size, shared by a daemon's sessions; idle memory is bounded by `max_idle_bytes`
    (IDLE_PER_SIZE buffers a size)."""

    MIN_BYTES = 1 << 20  # below this, allocation is cheap and pooling not worth it

    def __init__(self, max_idle_bytes: int = MAX_IDLE_BYTES):
        self._idle: dict[int, list[mmap.mmap]] = {}
        self._idle_bytes = 0
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()  # arrays may die (and give back) in worker threads

    def array(self, dtype, shape) -> Any:
        """An uninitialised array of `dtype` and `shape` on a pooled buffer, or None if it is too small to pool."""
        import numpy as np

        count = math.prod(shape)
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes < self.MIN_BYTES:
            return None
        with self._lock:
            free = self._idle.get(nbytes)
            backing = free.pop() if free else None
            if backing is not None:
                self._idle_bytes -= nbytes
        if backing is None:
            backing = mmap.mmap(-1, nbytes)  # committed page by page as it is written
        flat = np.frombuffer(backing, dtype=dtype, count=count)
        # Every view of `flat` (the reshape below, slices of it, torch.from_numpy) has `flat` as its
        # base, so `flat` dies only when nothing can see the buffer anymore.
        weakref.finalize(flat, self._give_back, backing)
        return flat.reshape(shape)

    def _give_back(self, backing: mmap.mmap) -> None:
        n = len(backing)
        with self._lock:
            if self._idle_bytes + n <= self.max_idle_bytes and len(self._idle.get(n, ())) < IDLE_PER_SIZE:
                self._idle.setdefault(n, []).append(backing)
                self._idle_bytes += n

"""Shared memory between a training process and the daemon of its host: one segment per tensor group.

Why a memfd passed over the control socket (SCM_RIGHTS) and not a named file in /dev/shm: a memfd has no
name, so nothing can leak when either process is killed (the memory is freed when the last mapping and
descriptor go), no other process can open it, and the daemon gets exactly the segment the client made.

Layout: the group's tensors one after another, each at a `ALIGN`-byte offset, in the order of its specs;
both sides compute the same layout from the specs (`layout`), and the daemon checks the segment's size
against it before it maps a byte.

The lock: a trainer's optimizer step and the daemon's in-place update of an exchange must not interleave
inside one tensor (both read-modify-write it). Both sides take `SegmentLock`: a thread lock for threads of
one process, then flock(2) on the segment for the two processes. flock locks belong to an open file
description, and a descriptor passed over a socket shares the sender's, so the daemon re-opens the memfd
through /proc/self/fd to get its own. The kernel drops a killed process's flock, so a crashed client never
leaves the daemon waiting on it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

ALIGN = 64  # bytes: a cache line, so no two tensors share one (and vector loads stay aligned)
# Longest the daemon waits for a client's step to release the lock: then an exchange not yet committed fails,
# and a committed one's update is owed and added at the next lock (peer/averaging/shared.py): never half-applied.
LOCK_WAIT_S = 10.0
_POLL_FIRST_S, _POLL_MAX_S = 0.0002, 0.005  # flock is polled (a blocked flock cannot be given up): short at first

# dtypes a segment may hold: what numpy can view in place (bfloat16 has no numpy dtype; keep a float32
# master copy of such parameters, as mixed-precision recipes do)
SEGMENT_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


class LockTimeout(TimeoutError):
    """The other process held a segment's lock past LOCK_WAIT_S."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a segment."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[list[Slot], int]:
    """The slots of (name, dtype, shape) specs, packed in order at ALIGN-byte offsets, and the total size."""
    slots, offset = [], 0
    for name, dtype, shape in specs:
        if dtype not in SEGMENT_DTYPES:
            raise ValueError(f"tensor {name!r} is {dtype}: a shared segment holds {', '.join(SEGMENT_DTYPES)} "
                             "(for bfloat16 parameters keep a float32 master copy)")
        count = 1
        for d in shape:
            count *= int(d)
        nbytes = count * np.dtype(SEGMENT_DTYPES[dtype]).itemsize
        slots.append(Slot(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN if nbytes else 0
    return slots, max(offset, 1)  # mmap refuses length 0


class Segment:
    """A mapped memfd: its mapping, its descriptor (for flock) and numpy views of its slots."""

    def __init__(self, fd: int, slots: list[Slot], size: int):
        self.fd = fd
        self.slots = slots
        self.size = size
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.lock = SegmentLock(fd)

    @classmethod
    def create(cls, name: str, slots: list[Slot], size: int) -> "Segment":
        """A new zero-filled segment (the client's side)."""
        fd = os.memfd_create(f"peertrain:{name}"[:200], os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(fd, slots, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, received_fd: int, slots: list[Slot], size: int) -> "Segment":
        """The daemon's side: check the received descriptor is a segment of the expected size, re-open it as
        our own open file description (for flock: see the module docstring), and map it. Closes `received_fd`."""
        try:
            st = os.fstat(received_fd)
            if not _is_memfd(received_fd):
                raise ValueError("the descriptor sent is not a memfd segment")
            if st.st_size != size:
                raise ValueError(f"the segment holds {st.st_size} bytes, its tensors need {size}")
            fd = os.open(f"/proc/self/fd/{received_fd}", os.O_RDWR | os.O_CLOEXEC)
        finally:
            os.close(received_fd)
        try:
            return cls(fd, slots, size)
        except BaseException:
            os.close(fd)
            raise

    def arrays(self) -> dict[str, np.ndarray]:
        """A numpy view of every slot (writes go to the shared memory)."""
        return {s.name: np.frombuffer(self.map, dtype=SEGMENT_DTYPES[s.dtype], count=s.nbytes // np.dtype(
            SEGMENT_DTYPES[s.dtype]).itemsize, offset=s.offset).reshape(s.shape) for s in self.slots}

    def tensors(self) -> dict[str, "object"]:
        """A torch view of every slot (the client re-homes its parameters onto these)."""
        import torch

        out = {}
        for s in self.slots:
            dt = getattr(torch, s.dtype)
            count = s.nbytes // torch.empty((), dtype=dt).element_size()
            t = torch.frombuffer(self.map, dtype=dt, count=count, offset=s.offset) if count else torch.empty(0, dtype=dt)
            out[s.name] = t.view(s.shape)
        return out

    def close(self) -> None:
        """Drop our descriptor. The mapping goes when the last view of it is gone (numpy and torch views keep
        the mmap object alive; unmapping under them would crash the process)."""
        self.lock.close()


def _is_memfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except OSError:
        return False


class SegmentLock:
    """Mutual exclusion over one segment, across threads (a lock) and processes (flock on our own open file
    description). `acquire` gives up after LOCK_WAIT_S (LockTimeout) rather than hang the daemon on a client
    that holds it, e.g. one stopped in a debugger."""

    def __init__(self, fd: int, wait_s: float = LOCK_WAIT_S):
        self._fd = fd
        self._thread_lock = threading.Lock()
        self.wait_s = wait_s
        self.closed = False

    def acquire(self) -> None:
        deadline = time.monotonic() + self.wait_s
        if not self._thread_lock.acquire(timeout=self.wait_s):
            raise LockTimeout(f"segment lock not released by another thread within {self.wait_s:.0f}s")
        try:
            pause = _POLL_FIRST_S
            while not self.closed:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    pass
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EINTR):
                        raise
                if time.monotonic() > deadline:
                    raise LockTimeout(f"the other process held its tensors' lock for more than {self.wait_s:.0f}s "
                                      "(an optimizer step that long, or a process stopped while holding it)")
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
        except BaseException:
            self._thread_lock.release()
            raise

    def release(self) -> None:
        try:
            if not self.closed:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def __enter__(self) -> "SegmentLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def close(self) -> None:
        """Close the descriptor once no thread holds the lock; later acquires are thread-only (the other
        process is gone, or we are)."""
        with self._thread_lock:
            if not self.closed:
                self.closed = True
                os.close(self._fd)

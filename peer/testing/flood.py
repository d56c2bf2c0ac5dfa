"""A connection flood from one source address, as an attacker outside the swarm would send it, and a
sampler of a process's open descriptors, for the flood attacks (`peer.testing.attacks_liveness`) and
`peer bench hostile`.

`Flood` opens TCP connections to a listener at a fixed rate from a thread, each bound to a chosen source
address (all of 127/8 is loopback on Linux, so one host can play attackers at 127.0.1.1 and an honest
peer at 127.0.2.1, in different /24s), sends a fixed payload (nothing, or a circuit hello's magic) and
holds it until the victim closes it or `held` newer ones push it out. Each is closed with a reset
(SO_LINGER 0), so neither end keeps a TIME_WAIT entry and the source's ports never run out. Raw
non-blocking sockets in a thread, not trio: thousands a second from Python need no more than a
`connect` and a `send` each, and the attacker's own trio loop stays free for the honest peer it runs.

`FdPeak` samples `/proc/PID/fd` in a thread: the victim's descriptors are what a flood makes it hold.

`delayed_path` gives the honest peer a real network's round trip: on loopback a handshake is over in a
millisecond, before a flood's next connections reach the listener, while across the internet it waits a
round trip or two for the other side, and that is the window in which a flood pushed it out.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

TICK_S = 0.005  # the flood opens its connections in batches this often: smooth enough at thousands a second
CATCH_UP_S = 0.05  # a flood thread that fell behind (a loaded host) opens at most this many seconds' worth at once
FD_SAMPLE_S = 0.02  # /proc/PID/fd is listed this often: a few hundred µs for a few thousand entries
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux: pick the port at connect
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends a reset
PATH_QUEUE = 64  # chunks in flight per direction of a delayed path; past it reading waits (backpressure)


@dataclass
class FloodStats:
    opened: int = 0  # connections whose connect did not fail at once
    failed: int = 0  # connect or send errors (refused, no port left, reset before the payload)
    closed_by_victim: int = 0  # seen closed (EOF or reset) by the victim while held
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.opened / self.seconds if self.seconds else 0.0


class Flood:
    """`with Flood(host, port, source=..., rate=...)`: connections from `source` at `rate` a second, each
    sending `payload` and held until the victim closes it or `held` newer ones exist; all closed on exit."""

    def __init__(self, host: str, port: int, *, source: str, rate: float, payload: bytes = b"", held: int = 2000):
        self.addr, self.source, self.rate, self.payload, self.held = (host, port), source, rate, payload, held
        self.stats = FloodStats()
        self._open: deque[socket.socket] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"flood-{source}", daemon=True)

    def __enter__(self) -> "Flood":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _one(self) -> None:
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError:  # out of descriptors: the reaping below frees them
            self.stats.failed += 1
            return
        try:
            s.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            s.bind((self.source, 0))
            s.setblocking(False)
            err = s.connect_ex(self.addr)
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, os.strerror(err))
            if self.payload:  # on loopback the connect has completed unless the accept queue is full
                s.send(self.payload)
        except OSError:
            self.stats.failed += 1
            s.close()
            return
        self.stats.opened += 1
        self._open.append(s)

    def _reap(self) -> None:
        """Close what the victim closed (so our count is what it could still hold) and the oldest past `held`."""
        keep: deque[socket.socket] = deque()
        for s in self._open:
            try:
                gone = s.recv(1) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                self.stats.closed_by_victim += 1
                s.close()
            else:
                keep.append(s)
        while len(keep) > self.held:
            keep.popleft().close()
        self._open = keep

    def _run(self) -> None:
        t0 = time.monotonic()
        reaped = t0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                due = int((now - t0) * self.rate) - self.stats.opened - self.stats.failed
                for _ in range(max(0, min(due, int(self.rate * CATCH_UP_S) + 1))):
                    self._one()
                if now - reaped > 0.1 or len(self._open) > 2 * self.held:
                    self._reap()
                    reaped = now
                self._stop.wait(TICK_S)
        finally:
            self.stats.seconds = time.monotonic() - t0
            for s in self._open:
                s.close()
            self._open.clear()


def open_fds(pid: int) -> int | None:
    """How many descriptors `pid` has open now; None if it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class FdPeak:
    """`with FdPeak(pid) as fds:` samples pid's open descriptors; `fds.start`, `fds.peak` after."""

    def __init__(self, pid: int):
        self.pid = pid
        self.start = self.peak = open_fds(pid) or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name=f"fds-{pid}", daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, open_fds(self.pid) or 0)
            if self._stop.wait(FD_SAMPLE_S):
                return

    def __enter__(self) -> "FdPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@asynccontextmanager
async def delayed_path(host: str, port: int, *, source: str, one_way_s: float) -> AsyncIterator[int]:
    """A port on 127.0.0.1 whose connections reach (host, port) from `source`, every byte `one_way_s` late
    in each direction (a round trip of twice that); yields the port. Ends with the block."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def pump(src: trio.SocketStream, dst: trio.SocketStream, path: trio.CancelScope) -> None:
        """src to dst, each chunk delivered `one_way_s` after it came; a reset on either side ends the path."""
        send, recv = trio.open_memory_channel[tuple[float, bytes]](PATH_QUEUE)

        async def read() -> None:
            async with send:
                while data := await src.receive_some(65536):
                    await send.send((trio.current_time() + one_way_s, data))

        async def write() -> None:
            async with recv:
                async for at, data in recv:
                    await trio.sleep_until(at)
                    await dst.send_all(data)
            await dst.send_eof()

        try:
            async with trio.open_nursery() as n:
                n.start_soon(read)
                n.start_soon(write)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            path.cancel()

    async def carry(near: trio.SocketStream) -> None:
        try:
            far = await trio.open_tcp_stream(host, port, local_address=source)
        except OSError:
            await near.aclose()
            return
        try:
            async with trio.open_nursery() as n:
                n.start_soon(pump, near, far, n.cancel_scope)
                n.start_soon(pump, far, near, n.cancel_scope)
        finally:
            with trio.CancelScope(shield=True):
                await near.aclose()
                await far.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, carry, listeners)
        try:
            yield listeners[0].socket.getsockname()[1]
        finally:
            nursery.cancel_scope.cancel()

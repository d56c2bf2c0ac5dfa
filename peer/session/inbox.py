"""A session's queue of messages for the application, bounded by count and by decoded bytes.

Why bytes: a count alone lets a peer pin `max_queued_messages` maximum-size messages (a 1 MiB message
can decode to many MiB of Python objects). The reader waits (so the remote is backpressured over TCP)
while the messages queued would pass `WireLimits.max_queued_message_bytes`; one message is always let
through an empty queue, so the bound is the limit plus one message (itself bounded by the wire limits).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import trio

from protocol.limits import WireLimits
from protocol.messages import Envelope


def decoded_size(obj: Any) -> int:
    """Bytes a decoded message holds as Python objects (`sys.getsizeof` over every container and field)."""
    total, stack = 0, [obj]
    while stack:
        o = stack.pop()
        total += sys.getsizeof(o)
        if isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
    return total


class Inbox:
    """The receiving end the application reads (`receive`, `async for`); the reader `put`s."""

    def __init__(self, limits: WireLimits):
        self._send, self._recv = trio.open_memory_channel[tuple[Envelope, int]](limits.max_queued_messages)
        self.max_bytes = limits.max_queued_message_bytes
        self.queued_bytes = 0
        self._room = trio.Event()
        self._closed = False

    async def put(self, env: Envelope) -> None:
        """Queue `env`, first waiting while it would pass the byte bound (backpressure)."""
        size = decoded_size(env.message)
        while self.queued_bytes and self.queued_bytes + size > self.max_bytes:
            if self._closed:
                raise trio.ClosedResourceError("session closed")
            self._room = trio.Event()
            await self._room.wait()
        self.queued_bytes += size
        try:
            self._send.send_nowait((env, size))
        except trio.WouldBlock:
            await self._send.send((env, size))  # the count bound: wait as well

    def close(self) -> None:
        self._closed = True
        self._send.close()
        self._room.set()

    async def receive(self) -> Envelope:
        env, size = await self._recv.receive()
        self.queued_bytes -= size
        self._room.set()
        return env

    def __aiter__(self) -> Inbox:
        return self

    async def __anext__(self) -> Envelope:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

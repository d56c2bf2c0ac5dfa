"""Forwarding bytes between the two connections of a relay circuit, within the relay's caps.

The relay reads whatever arrives on one side and writes it to the other, never looking inside: the two
peers' handshake and sealed frames pass through as opaque bytes. Each circuit stops at its byte cap or
its duration; all circuits of one relay share one token bucket, so relaying can never take more than
`[relay] max_bandwidth_mib_s` of the relay's own link.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from peer.token_bucket import TokenBucket


CHUNK = 64 * 1024
"""Bytes read per turn: large enough that Python's per-call cost is small next to the link (a 64 KiB
chunk per turn moves hundreds of MB/s on one core), small enough that a circuit holds at most 2 x 64 KiB
of the relay's memory (one chunk per direction) and circuits sharing the bucket take fine-grained turns."""


@dataclass
class CircuitStats:
    bytes_forwarded: int = 0
    ended: str = ""  # why forwarding stopped


async def splice(a: trio.SocketStream, b: trio.SocketStream, *, max_bytes: int, max_seconds: float,
                 bucket: TokenBucket, stats: CircuitStats,
                 tap: Callable[[str, bytes], None] | None = None) -> None:
    """Forward a <-> b until one side closes, `max_bytes` have passed (both directions together) or
    `max_seconds` have elapsed; then both are closed. `tap(direction, chunk)` sees every forwarded chunk
    (tests use it to check that the relay only ever sees ciphertext)."""

    async def pump(src: trio.SocketStream, dst: trio.SocketStream, direction: str, cancel: trio.CancelScope) -> None:
        try:
            while True:
                data = await src.socket.recv(CHUNK)
                if not data:
                    stats.ended = stats.ended or f"{direction}: closed by the sender"
                    break
                if stats.bytes_forwarded + len(data) > max_bytes:
                    stats.ended = stats.ended or f"byte cap reached ({max_bytes} bytes)"
                    break
                await bucket.take(len(data))
                if tap is not None:
                    tap(direction, data)
                await dst.send_all(data)
                stats.bytes_forwarded += len(data)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            stats.ended = stats.ended or f"{direction}: {exc or type(exc).__name__}"
        cancel.cancel()

    with trio.move_on_after(max_seconds) as timer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, a, b, "a->b", nursery.cancel_scope)
            nursery.start_soon(pump, b, a, "b->a", nursery.cancel_scope)
    if timer.cancelled_caught:
        stats.ended = stats.ended or f"duration cap reached ({max_seconds:g} s)"
    with trio.CancelScope(shield=True):
        await a.aclose()
        await b.aclose()

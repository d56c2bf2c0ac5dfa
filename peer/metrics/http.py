"""A minimal HTTP/1.0 server for one resource, `GET /metrics`, in trio.

Why not prometheus_client's `start_http_server`: it runs a thread the daemon's nursery does not own (no
structured stop, no deadlines), and its server has no bound on a request's size, time or connections. This
one answers one request per connection and closes it (Connection: close), which is all a scraper needs, and
holds what a client can make it hold to the limits below. The body is made by `render()` on the trio thread,
so it reads the daemon's state without locks. A bad or hostile request gets an error status or a closed
connection; nothing it does escapes the connection's task.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import trio

log = logging.getLogger("peertrain.metrics")

# A scraper's request is a few hundred bytes; a longer head (request line and headers) is not a scraper.
MAX_HEAD_BYTES = 8 * 1024
# A scraper sends its whole request at once; one that trickles it (slowloris) loses its slot after this.
READ_DEADLINE_S = 5.0
# The body is tens of KB; a client that stops reading it is dropped after this.
SEND_DEADLINE_S = 10.0
# Prometheus scrapes one at a time; room for a few curls besides, and no more work for a flood.
MAX_CONNECTIONS = 8
METRICS_PATH = "/metrics"
_REQUEST_LINE = re.compile(r"([A-Z]{1,16}) (\S{1,2048}) HTTP/\d\.\d")


@dataclass
class ServerStats:
    """For `peer status` (under `metrics`): what clients asked of the server and what it refused."""

    scrapes: int = 0  # 200s
    errors: int = 0  # 4xx and 5xx answered
    refused: int = 0  # connections closed unanswered: over MAX_CONNECTIONS
    dropped: int = 0  # connections closed unanswered: deadline passed, closed early, or a head past the bound


class _Answer(Exception):
    """Ends a request early with an error status."""

    def __init__(self, status: HTTPStatus, headers: tuple[str, ...] = ()):
        super().__init__(status.phrase)
        self.status, self.headers = status, headers


def response(status: HTTPStatus, body: bytes, content_type: str, headers: tuple[str, ...] = ()) -> bytes:
    lines = [f"HTTP/1.0 {status.value} {status.phrase}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", "Connection: close", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def read_head(stream: trio.abc.ReceiveStream) -> bytes:
    """The request's head, up to its blank line; never holds more than MAX_HEAD_BYTES."""
    buf = bytearray()
    while True:
        ends = [i for i in (buf.find(b"\r\n\r\n"), buf.find(b"\n\n")) if i >= 0]
        if ends:
            return bytes(buf[:min(ends)])
        if len(buf) >= MAX_HEAD_BYTES:
            raise _Answer(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
        chunk = await stream.receive_some(MAX_HEAD_BYTES - len(buf))
        if not chunk:
            raise EOFError("closed before the end of the request head")
        buf += chunk


def route(head: bytes) -> None:
    """Check the request line: only GET /metrics passes (a query string is ignored); raises _Answer."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r").decode("latin-1")
    m = _REQUEST_LINE.fullmatch(line)
    if m is None:
        raise _Answer(HTTPStatus.BAD_REQUEST)
    method, target = m.group(1), m.group(2)
    if target.split("?", 1)[0] != METRICS_PATH:
        raise _Answer(HTTPStatus.NOT_FOUND)
    if method != "GET":
        raise _Answer(HTTPStatus.METHOD_NOT_ALLOWED, ("Allow: GET",))


class MetricsServer:
    """Serves `render()` (bytes of `content_type`) at GET /metrics on the given listeners until cancelled."""

    def __init__(self, render: Callable[[], bytes], content_type: str):
        self.render = render
        self.content_type = content_type
        self.stats = ServerStats()
        self.active = 0

    async def serve(self, listeners: list[trio.SocketListener]) -> None:
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.abc.Stream) -> None:
        if self.active >= MAX_CONNECTIONS:
            self.stats.refused += 1
            await trio.aclose_forcefully(stream)
            return
        self.active += 1
        try:
            reply = await self._answer(stream)
            if reply is not None:
                with trio.move_on_after(SEND_DEADLINE_S):
                    await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.stats.dropped += 1
        except Exception:  # a bug must not take the daemon down: this connection just ends
            log.exception("metrics request failed unexpectedly")
        finally:
            self.active -= 1
            await trio.aclose_forcefully(stream)

    async def _answer(self, stream: trio.abc.Stream) -> bytes | None:
        """The bytes to send back, or None to close without a word."""
        try:
            with trio.fail_after(READ_DEADLINE_S):
                route(await read_head(stream))
        except _Answer as ans:
            self.stats.errors += 1
            return response(ans.status, f"{ans.status.value} {ans.status.phrase}\n".encode(),
                            "text/plain; charset=utf-8", ans.headers)
        except (trio.TooSlowError, EOFError):
            self.stats.dropped += 1
            return None
        try:
            body = self.render()
        except Exception:
            log.exception("cannot render metrics")
            self.stats.errors += 1
            return response(HTTPStatus.INTERNAL_SERVER_ERROR, b"500 Internal Server Error\n",
                            "text/plain; charset=utf-8")
        self.stats.scrapes += 1
        return response(HTTPStatus.OK, body, self.content_type)

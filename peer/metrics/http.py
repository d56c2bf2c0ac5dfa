"""A minimal HTTP/1.0 server for a fixed table of read-only resources, in trio: `GET /metrics` for
Prometheus (peer/metrics/service.py) and the dashboard's page and feed (peer/dashboard/service.py), each on
its own listener with its own route table, all under the one set of limits below.

Why not prometheus_client's `start_http_server` or an HTTP framework: they run threads the daemon's nursery
does not own (no structured stop, no deadlines), and bound neither a request's size, its time nor the
connections. This one answers one request per connection and closes it (Connection: close), which is all a
scraper or a polling page needs, and holds what a client can make it hold to the limits below. Handlers run
on the trio thread, so they read the daemon's state without locks. A bad or hostile request gets an error
status or a closed connection; nothing it does escapes the connection's task. Only GET exists: nothing a
client sends can change the daemon.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs

import trio

from peer.config import parse_hostport
from peer.nat.addresses import format_hostport

log = logging.getLogger("peertrain.http")

# A scraper's or a browser's request is a few hundred bytes (a browser's up to ~2 KB with its cookies for
# the host); a longer head (request line and headers) is neither.
MAX_HEAD_BYTES = 8 * 1024
# A client sends its whole request at once; one that trickles it (slowloris) loses its slot after this.
READ_DEADLINE_S = 5.0
# The body is tens of KB; a client that stops reading it is dropped after this. A handler that takes longer
# to make its body (it should take milliseconds) answers 503 instead.
SEND_DEADLINE_S = 10.0
# Prometheus scrapes one at a time, a dashboard polls one request at a time per open tab: room for a few
# curls and tabs besides, and no more work for a flood.
MAX_CONNECTIONS = 8
# When every place is taken, a connection open at least this long gives its place to the newcomer: ours answer in
# milliseconds, so only a client that trickles its request or stops reading is that old, and 8 such clients
# re-opening as they were dropped used to keep every honest one out.
EVICT_AFTER_S = 1.0
# Query fields one request may carry (the dashboard's page sends one, its token): more is not a client of ours.
MAX_QUERY_FIELDS = 16
METRICS_PATH = "/metrics"
_REQUEST_LINE = re.compile(r"([A-Z]{1,16}) (\S{1,2048}) HTTP/\d\.\d")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")


@dataclass
class ServerStats:
    """For `peer status` (under the service's name): what clients asked of the server and what it refused."""

    ok: int = 0  # 200s
    errors: int = 0  # 4xx and 5xx answered
    refused: int = 0  # connections closed unanswered: over MAX_CONNECTIONS, none old enough to give way
    evicted: int = 0  # connections closed unanswered to make room: open over EVICT_AFTER_S when it was full
    dropped: int = 0  # connections closed unanswered: deadline passed, closed early, or a head past the bound
    unauthorized: int = 0  # 401s: no token, or a wrong one (also counted in errors)


@dataclass(frozen=True)
class Request:
    """A parsed request head: what a handler may read (all of it within MAX_HEAD_BYTES)."""

    method: str
    path: str
    query: dict[str, str] = field(default_factory=dict)  # each field's first value
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names; a repeated one keeps its last


@dataclass(frozen=True)
class Reply:
    body: bytes
    content_type: str
    headers: tuple[str, ...] = ()


Handler = Callable[[Request], Awaitable[Reply]]


class Answer(Exception):
    """Ends a request early with an error status (raised by the parser or a handler)."""

    def __init__(self, status: HTTPStatus, headers: tuple[str, ...] = ()):
        super().__init__(status.phrase)
        self.status, self.headers = status, headers


def response(status: HTTPStatus, body: bytes, content_type: str, headers: tuple[str, ...] = ()) -> bytes:
    lines = [f"HTTP/1.0 {status.value} {status.phrase}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", "Connection: close", "Cache-Control: no-store", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def read_head(stream: trio.abc.ReceiveStream) -> bytes:
    """The request's head, up to its blank line; never holds more than MAX_HEAD_BYTES."""
    buf = bytearray()
    while True:
        ends = [i for i in (buf.find(b"\r\n\r\n"), buf.find(b"\n\n")) if i >= 0]
        if ends:
            return bytes(buf[:min(ends)])
        if len(buf) >= MAX_HEAD_BYTES:
            raise Answer(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
        chunk = await stream.receive_some(MAX_HEAD_BYTES - len(buf))
        if not chunk:
            raise EOFError("closed before the end of the request head")
        buf += chunk


def parse(head: bytes) -> Request:
    """The request line and headers; raises Answer(400) for anything malformed."""
    lines = head.decode("latin-1").replace("\r\n", "\n").split("\n")
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None:
        raise Answer(HTTPStatus.BAD_REQUEST)
    path, _, qs = m.group(2).partition("?")
    try:
        query = {k: v[0] for k, v in parse_qs(qs, max_num_fields=MAX_QUERY_FIELDS).items()}
    except ValueError:  # more fields than MAX_QUERY_FIELDS
        raise Answer(HTTPStatus.BAD_REQUEST) from None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or _HEADER_NAME.fullmatch(name) is None:
            raise Answer(HTTPStatus.BAD_REQUEST)
        headers[name.lower()] = value.strip()
    return Request(m.group(1), path, query, headers)


def route(head: bytes, routes: dict[str, Handler]) -> tuple[Request, Handler]:
    """The request and the handler of its path: 404 for a path not in `routes` (a query string is not part
    of the path), 405 for a method other than GET; raises Answer."""
    req = parse(head)
    handler = routes.get(req.path)
    if handler is None:
        raise Answer(HTTPStatus.NOT_FOUND)
    if req.method != "GET":
        raise Answer(HTTPStatus.METHOD_NOT_ALLOWED, ("Allow: GET",))
    return req, handler


def host_is_literal(req: Request) -> bool:
    """The Host a browser sent names this machine by address or as localhost. A page of another site whose
    name was made to resolve to 127.0.0.1 (DNS rebinding) sends its own name, and the browser would let it read
    the answer, since to the browser it is that site's own origin. A request without Host is no browser's."""
    host = req.headers.get("host", "")
    if not host:
        return True
    name = host[1:host.find("]")] if host.startswith("[") else host.rpartition(":")[0] if host.count(":") == 1 else host
    if name.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def bearer_token(req: Request) -> str:
    """The token a request carries: `Authorization: Bearer TOKEN`, else `?token=TOKEN` (a browser opening a
    link can send no header)."""
    scheme, _, value = req.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return req.query.get("token", "")


def token_matches(given: str, expected: str) -> bool:
    """Constant time in the token's contents: a wrong guess says nothing about how much of it was right."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape"))


class HttpServer:
    """Serves `routes` (path -> handler) to GET requests on the given listeners until cancelled; with a
    `token`, only to requests that carry it (bearer_token)."""

    def __init__(self, routes: dict[str, Handler], *, token: str = "", name: str = "http",
                 literal_hosts: bool = False):
        self.routes = dict(routes)
        self.token = token
        self.name = name  # in log lines: which server failed
        # a browser's page without a token: answer only a Host that is an address or localhost (host_is_literal)
        self.literal_hosts = literal_hosts and not token
        self.stats = ServerStats()
        self.open: dict[trio.CancelScope, float] = {}  # each connection's scope and when it opened (trio clock)

    @property
    def active(self) -> int:
        return len(self.open)

    def _make_room(self) -> bool:
        """Close the oldest connection open over EVICT_AFTER_S; False if none is."""
        now = trio.current_time()
        scope, opened = min(self.open.items(), key=lambda kv: kv[1])
        if now - opened < EVICT_AFTER_S:
            return False
        scope.cancel()
        del self.open[scope]  # its handler's finally finds it gone
        self.stats.evicted += 1
        return True

    async def serve(self, listeners: list[trio.SocketListener]) -> None:
        await trio.serve_listeners(self.handle, listeners)

    @staticmethod
    async def open_listeners(listen: str, *, what: str) -> tuple[list[trio.SocketListener], tuple[str, int]]:
        """Listeners on `listen` (HOST:PORT; port 0 picks a free one) and the address bound; an OSError that
        names the config key `what` when the address cannot be had."""
        host, port = parse_hostport(listen, what=what)
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise OSError(exc.errno, f"{what}: cannot listen on {format_hostport(host, port)}: {exc.strerror}") from None
        return listeners, tuple(listeners[0].socket.getsockname()[:2])

    async def handle(self, stream: trio.abc.Stream) -> None:
        if self.active >= MAX_CONNECTIONS and not self._make_room():
            self.stats.refused += 1
            await trio.aclose_forcefully(stream)
            return
        scope = trio.CancelScope()
        self.open[scope] = trio.current_time()
        try:
            with scope:
                reply = await self._answer(stream)
                if reply is not None:
                    with trio.move_on_after(SEND_DEADLINE_S):
                        await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.stats.dropped += 1
        except Exception:  # a bug must not take the daemon down: this connection just ends
            log.exception("%s request failed unexpectedly", self.name)
        finally:
            self.open.pop(scope, None)
            await trio.aclose_forcefully(stream)

    def _error(self, ans: Answer) -> bytes:
        self.stats.errors += 1
        if ans.status == HTTPStatus.UNAUTHORIZED:
            self.stats.unauthorized += 1
        return response(ans.status, f"{ans.status.value} {ans.status.phrase}\n".encode(),
                        "text/plain; charset=utf-8", ans.headers)

    async def _answer(self, stream: trio.abc.Stream) -> bytes | None:
        """The bytes to send back, or None to close without a word."""
        try:
            with trio.fail_after(READ_DEADLINE_S):
                req, handler = route(await read_head(stream), self.routes)
            if self.literal_hosts and not host_is_literal(req):
                raise Answer(HTTPStatus.FORBIDDEN)
            if self.token and not token_matches(bearer_token(req), self.token):
                raise Answer(HTTPStatus.UNAUTHORIZED, ('WWW-Authenticate: Bearer realm="peertrain"',))
        except Answer as ans:
            return self._error(ans)
        except (trio.TooSlowError, EOFError):
            self.stats.dropped += 1
            return None
        try:
            with trio.fail_after(SEND_DEADLINE_S):
                reply = await handler(req)
        except Answer as ans:
            return self._error(ans)
        except trio.TooSlowError:
            log.warning("%s: %s took over %.0f s to answer", self.name, req.path, SEND_DEADLINE_S)
            return self._error(Answer(HTTPStatus.SERVICE_UNAVAILABLE))
        except Exception:
            log.exception("%s: cannot answer %s", self.name, req.path)
            return self._error(Answer(HTTPStatus.INTERNAL_SERVER_ERROR))
        self.stats.ok += 1
        return response(HTTPStatus.OK, reply.body, reply.content_type, reply.headers)


def fixed(render: Callable[[], bytes], content_type: str) -> Handler:
    """A handler answering `render()` (called on the trio thread at each request), whatever the query."""
    async def handler(req: Request) -> Reply:
        return Reply(render(), content_type)
    return handler


class MetricsServer(HttpServer):
    """Serves `render()` (bytes of `content_type`) at GET /metrics."""

    def __init__(self, render: Callable[[], bytes], content_type: str):
        super().__init__({METRICS_PATH: fixed(render, content_type)}, name="metrics")

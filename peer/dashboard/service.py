"""The daemon service behind `[dashboard] listen`: the page at GET / and its feed at GET /api/status, served
by the daemon's one bounded HTTP server code (peer/metrics/http.py) with this route table on its own
listener.

The page is one HTML document with its script and style inlined (read from static/ once, at start), so a
token in the page's URL covers everything the browser fetches: the document, then the feed, which the
page's script asks for with the token as a bearer header. Its Content-Security-Policy allows only that
script and style (by hash) and requests to this origin: nothing else runs or loads, even if a peer's ID or
reason were to carry markup (the script also only ever writes text, never HTML).
"""

from __future__ import annotations

import base64
import hashlib
import logging
from importlib import resources
from typing import TYPE_CHECKING

import trio

from peer.dashboard import feed
from peer.metrics.http import HttpServer, Reply, Request
from peer.nat.addresses import format_hostport
from peer.topology.service import TopologyService

if TYPE_CHECKING:
    from peer.services import DaemonContext

log = logging.getLogger("peertrain.dashboard")

PAGE_PATH, FEED_PATH = "/", "/api/status"
_SAFE = ("X-Content-Type-Options: nosniff", "X-Frame-Options: DENY", "Referrer-Policy: no-referrer")


def _static(name: str) -> str:
    return resources.files("peer.dashboard").joinpath("static", name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def page() -> tuple[bytes, tuple[str, ...]]:
    """The page (static/index.html with dashboard.css and dashboard.js inlined) and its security headers."""
    css, js = _static("dashboard.css"), _static("dashboard.js")
    html = _static("index.html").replace("/*STYLE*/", css).replace("/*SCRIPT*/", js)
    csp = (f"Content-Security-Policy: default-src 'none'; script-src {_sha256(js)}; style-src {_sha256(css)}; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode(), (csp, *_SAFE)


class DashboardService:
    name = "dashboard"

    def __init__(self, daemon: DaemonContext, topology: TopologyService):
        self.daemon = daemon
        self.topology = topology
        self.page, self.page_headers = page()
        self.server = HttpServer({PAGE_PATH: self._page, FEED_PATH: self._feed},
                                 token=daemon.config.dashboard.token, name="dashboard", literal_hosts=True)
        self.bound: tuple[str, int] = ("", 0)

    async def _page(self, req: Request) -> Reply:
        return Reply(self.page, "text/html; charset=utf-8", self.page_headers)

    async def _feed(self, req: Request) -> Reply:
        # the two dicts `peer status --json` and `peer status --topology` show, trimmed (feed.py)
        graph = await self.topology.topology()
        return Reply(feed.encode(feed.build(self.daemon.status(), graph)), "application/json", _SAFE)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners, self.bound = await self.server.open_listeners(self.daemon.config.dashboard.listen,
                                                                 what="[dashboard] listen")
        log.info("dashboard at %s", self.url())
        task_status.started()
        await self.server.serve(listeners)

    def url(self) -> str:
        """The page's address (never with the token: it goes into logs and `peer status`)."""
        return f"http://{format_hostport(*self.bound)}{PAGE_PATH}" if self.bound[0] else ""

    def status(self) -> dict:
        s = self.server.stats
        return {"listen": format_hostport(*self.bound) if self.bound[0] else "", "url": self.url(),
                "token": bool(self.server.token), "pages": s.ok, "errors": s.errors, "unauthorized": s.unauthorized,
                "refused": s.refused, "evicted": s.evicted, "dropped": s.dropped}

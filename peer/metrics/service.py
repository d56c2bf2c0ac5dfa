"""The daemon service behind `[metrics] listen`: its own Prometheus registry and the HTTP server for it.

A registry per daemon (never prometheus_client's global one): two daemons in one process, as in tests,
export only their own figures, and nothing outlives the daemon. The collector reads the daemon at scrape
time, so this service keeps no copy of any figure; it only owns the listening socket.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from peer.metrics.collector import DaemonCollector
from peer.metrics.http import METRICS_PATH, MetricsServer
from peer.nat.addresses import format_hostport

if TYPE_CHECKING:
    from peer.services import DaemonContext

log = logging.getLogger("peertrain.metrics")


class MetricsService:
    name = "metrics"

    def __init__(self, daemon: DaemonContext):
        self.daemon = daemon
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(daemon))
        self.server = MetricsServer(lambda: generate_latest(self.registry), CONTENT_TYPE_LATEST)
        self.bound: tuple[str, int] = ("", 0)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners, self.bound = await self.server.open_listeners(self.daemon.config.metrics.listen,
                                                                 what="[metrics] listen")
        log.info("Prometheus metrics at http://%s%s", format_hostport(*self.bound), METRICS_PATH)
        task_status.started()
        await self.server.serve(listeners)

    def status(self) -> dict:
        s = self.server.stats
        return {"listen": format_hostport(*self.bound) if self.bound[0] else "", "path": METRICS_PATH, "scrapes": s.ok,
                "errors": s.errors, "refused": s.refused, "dropped": s.dropped}

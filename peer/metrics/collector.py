"""What a Prometheus scrape sees: one custom collector that reads the daemon's state when scraped.

The daemon already keeps every figure (`peer status --json` shows them), so nothing is counted twice: a
scrape calls `daemon.status()` once and turns that snapshot into metric families. Nothing here holds state
between scrapes, and nothing is global (prometheus_client's default registry is not used): each daemon
registers this collector in its own `CollectorRegistry` (peer/metrics/service.py).

Naming follows Prometheus: a `peertrain_` prefix, `_total` on counters, base units (`_seconds`, `_bytes`,
`_ratio`). A per-peer series carries the peer's full ID in its `peer` label (the short form can collide);
how many there are is bounded by the membership table. A value the status lacks (no trainer, a figure
not measured yet, None) is left out rather than reported as 0.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# The trainer's published figures exported as gauges: status key -> (metric name, help). A trainer hosted
# in the daemon or attached to it later publishes them into the same `trainer` status dict.
TRAINER_GAUGES = {
    "step": ("peertrain_trainer_step", "Optimizer steps this peer's trainer has taken."),
    "samples_per_s": ("peertrain_trainer_samples_per_second", "Training samples per second (the trainer's own measure)."),
    "loss": ("peertrain_trainer_loss", "Latest training loss the trainer published."),
    "accuracy": ("peertrain_trainer_accuracy_ratio", "Latest held-out accuracy, 0 to 1."),
    "consensus_distance": ("peertrain_trainer_consensus_distance",
                           "Relative distance |x_other - x_own| / |x_own| at this peer's last averaging exchange."),
}


def number(v: Any) -> float | None:
    """A status value as a sample value, or None for what is not a number (None, a string, a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _gauge(name: str, doc: str, value: Any) -> Iterator[Metric]:
    v = number(value)
    if v is not None:
        yield GaugeMetricFamily(name, doc, value=v)


def _counter(name: str, doc: str, value: Any) -> Iterator[Metric]:
    v = number(value)
    if v is not None:
        yield CounterMetricFamily(name, doc, value=v)


class DaemonCollector(Collector):
    """Metric families from one snapshot of `daemon.status()`, taken on the daemon's (trio) thread."""

    def __init__(self, daemon):
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        st = self.daemon.status()
        yield from daemon_families(st)
        yield from peer_families(st.get("peers") or [])
        yield from gossip_families(st.get("gossip") or {})
        yield from topology_families(st.get("topology") or {})
        yield from trainer_families(st.get("trainer") or {})
        yield from pipeline_families(st.get("pipeline") or {})


def daemon_families(st: dict) -> Iterator[Metric]:
    info = GaugeMetricFamily("peertrain_info", "This daemon: peertrain version, peer ID and swarm (always 1).",
                             labels=["version", "peer_id", "swarm"])
    info.add_metric([str(st.get("version", "")), str(st.get("peer_id", "")), str(st.get("swarm", ""))], 1.0)
    yield info
    yield from _gauge("peertrain_uptime_seconds", "Seconds since this daemon started.", st.get("uptime_s"))
    yield from _gauge("peertrain_start_time_seconds", "When this daemon started, in seconds since the epoch.",
                      st.get("started_at"))
    peers = st.get("peers") or []
    yield from _gauge("peertrain_peers_connected", "Peers with an open session.", st.get("connected"))
    yield from _gauge("peertrain_peers_known", "Peers in the membership table (connected, connecting, "
                      "discovered or dead).", len(peers))
    sessions = GaugeMetricFamily("peertrain_sessions", "Open sessions by the path they take (direct, relayed, "
                                 "punched) and who dialed (out: we did).", labels=["path", "direction"])
    counts: dict[tuple[str, str], int] = {}
    for p in peers:
        if p.get("state") == "connected" and p.get("direction"):
            key = (str(p.get("path") or "direct"), str(p["direction"]))
            counts[key] = counts.get(key, 0) + 1
    for key, n in sorted(counts.items()):
        sessions.add_metric(list(key), n)
    yield sessions
    listener = st.get("listener") or {}
    for key, doc in (("accepted", "Inbound connections accepted by the listener."),
                     ("refused", "Inbound connections refused (connection caps) before a handshake."),
                     ("handshake_failures", "Inbound handshakes that failed or passed their deadline."),
                     ("evicted", "Idle sessions closed to make room for a new connection.")):
        yield from _counter(f"peertrain_listener_{key}_total", doc, listener.get(key))
    yield from _gauge("peertrain_bans", "Peers banned from averaging with us for now.", len(st.get("bans") or []))


def peer_families(peers: list[dict]) -> Iterator[Metric]:
    sent = CounterMetricFamily("peertrain_peer_sent_bytes", "Bytes sent to a peer over all its sessions "
                               "(label peer: its full peer ID).", labels=["peer"])
    received = CounterMetricFamily("peertrain_peer_received_bytes", "Bytes received from a peer over all "
                                   "its sessions (label peer: its full peer ID).", labels=["peer"])
    rtt = GaugeMetricFamily("peertrain_peer_rtt_seconds", "Round-trip time to a connected peer (heartbeats).",
                            labels=["peer"])
    for p in peers:
        pid = str(p.get("peer_id", ""))
        out, inn = number(p.get("bytes_out")), number(p.get("bytes_in"))
        if out or inn:  # a peer we never exchanged a byte with adds no series
            sent.add_metric([pid], out or 0.0)
            received.add_metric([pid], inn or 0.0)
        ms = number(p.get("rtt_ms"))
        if ms is not None and p.get("state") == "connected":
            rtt.add_metric([pid], ms / 1000)
    by_path = CounterMetricFamily("peertrain_path_bytes", "Bytes sent and received with all peers, by the path "
                                  "their sessions took (direct, relayed, punched).", labels=["path"])
    totals: dict[str, float] = {}
    for p in peers:
        for path, n in (p.get("bytes_by_path") or {}).items():
            if (v := number(n)) is not None:
                totals[str(path)] = totals.get(str(path), 0.0) + v
    for path, n in sorted(totals.items()):
        by_path.add_metric([path], n)
    yield from (sent, received, rtt, by_path)


def gossip_families(g: dict) -> Iterator[Metric]:
    if not g:
        return
    for key, name, doc in (
            ("exchanges", "completed", "Averaging exchanges completed, initiated or served."),
            ("served", "served", "Averaging exchanges completed that a peer initiated with us."),
            ("failed", "failed", "Averaging exchanges that failed (deadline, closed session, abort, bad message)."),
            ("rejected", "rejected", "Averaging offers refused, ours by peers and theirs by us.")):
        yield from _counter(f"peertrain_exchanges_{name}_total", doc, g.get(key))
    clipped = g.get("clipped")
    if isinstance(clipped, dict):
        yield from _counter("peertrain_exchanges_clipped_total", "Averaging exchanges whose download was clipped "
                            "to the robust radius (a peer's model too far from ours).",
                            sum(v for v in map(number, clipped.values()) if v is not None))
    yield from _counter("peertrain_exchange_sent_bytes_total", "Tensor bytes sent in completed averaging "
                        "exchanges (as many arrive: exchanges are symmetric).", g.get("bytes_sent"))
    yield from _gauge("peertrain_exchanges_in_flight", "Averaging exchanges under way.", g.get("inflight"))
    h = g.get("exchange_seconds")
    if h:
        buckets = [(floatToGoString(le), n) for le, n in zip(h["le"], h["counts"])] + [("+Inf", h["count"])]
        yield HistogramMetricFamily("peertrain_exchange_duration_seconds", "Seconds a completed averaging "
                                    "exchange took, initiated or served.", buckets=buckets, sum_value=h["sum"])


def topology_families(t: dict) -> Iterator[Metric]:
    if not t:
        return
    yield from _gauge("peertrain_topology_degree", "Gossip neighbours of this peer.", t.get("degree"))
    yield from _gauge("peertrain_topology_spectral_gap", "Spectral gap of the mixing matrix of the graph this "
                      "peer knows (0 to 1; larger mixes faster).", t.get("spectral_gap"))
    yield from _gauge("peertrain_topology_view_peers", "Peers in this peer's view of the gossip graph.",
                      t.get("view_nodes"))
    yield from _counter("peertrain_topology_rewiring_moves_total", "Rewiring moves this peer made.", t.get("moves"))


def trainer_families(tr: dict) -> Iterator[Metric]:
    for key, (name, doc) in TRAINER_GAUGES.items():
        yield from _gauge(name, doc, tr.get(key))


def pipeline_families(p: dict) -> Iterator[Metric]:
    """The swarm pipeline as this daemon sees it: its stage server's queue and work, its driver's microbatches,
    each stage's capacity and which is the bottleneck."""
    if not p:
        return
    srv = p.get("server") or {}
    yield from _gauge("peertrain_pipeline_queue", "Stage calls this daemon holds now (received, queued or computing).",
                      srv.get("queue"))
    yield from _counter("peertrain_pipeline_calls_served_total", "Stage calls this daemon's stage answered.",
                        srv.get("served"))
    d = p.get("driver") or {}
    if d:
        mbs = CounterMetricFamily("peertrain_pipeline_microbatches", "Microbatches this daemon drove, by result "
                                  "(done; failed after every retry; retried: re-sent at least once).", labels=["result"])
        for key in ("done", "failed", "retried"):
            if (v := number(d.get(key))) is not None:
                mbs.add_metric([key], v)
        yield mbs
    cap = GaugeMetricFamily("peertrain_pipeline_stage_capacity", "Samples per second a stage can take, from its "
                            "peers' measured rates (label stage).", labels=["stage"])
    for entry in p.get("stage_map") or []:
        if (v := number(entry.get("capacity"))) is not None:
            cap.add_metric([str(entry.get("stage"))], v)
    yield cap
    yield from _gauge("peertrain_pipeline_bottleneck_stage", "The stage with the least capacity.", p.get("bottleneck"))

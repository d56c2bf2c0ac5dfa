"""Prometheus metrics (`[metrics] listen`, peer/metrics/): two real daemons averaging, scraped over real
HTTP and parsed with prometheus_client's own parser; the HTTP server's limits, in process and against the
daemon; the collector leaving out what a status lacks."""

from __future__ import annotations

import math
import socket
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from peer.metrics.collector import DaemonCollector
from peer.metrics.http import EVICT_AFTER_S, MAX_CONNECTIONS, MAX_HEAD_BYTES, READ_DEADLINE_S, HttpServer, MetricsServer
from peer.testing.swarm import swarm_config
from tests.daemons import rank_env, unique_swarm

HTTP_TIMEOUT = 5.0  # one request to a daemon on a loaded 2-core machine


def samples(text: str) -> dict[str, list]:
    """Sample name -> its samples, from an exposition parsed the way Prometheus' client library parses it."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(found: dict, name: str, **labels) -> float:
    matching = [s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, (name, labels, found.get(name))
    return matching[0]


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        return samples(r.read().decode())


def raw_request(addr: tuple[str, int], data: bytes) -> bytes:
    """Send raw bytes; what comes back before the server closes (b"" for a connection closed unanswered;
    a server that answers before reading everything resets the connection, which may cut its answer off)."""
    chunks: list[bytes] = []
    with socket.create_connection(addr, timeout=HTTP_TIMEOUT) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)  # nothing more is coming: the server need not wait for it
        except OSError:  # it answered and closed already: read what it said
            pass
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
    return b"".join(chunks)


def http_status(url: str, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=HTTP_TIMEOUT) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


# ---- two daemons, scraped over HTTP -----------------------------------------------------------------

@pytest.mark.slow
def test_two_averaging_daemons_export_their_state_and_survive_bad_requests(cluster):
    cfg = swarm_config(swarm=unique_swarm("m"), trainer="trainers.consensus", topology={"kind": "full"},
                       options={"size": 1024, "rounds": 0, "interval": 0.02, "world": 2}).replace(
        metrics={"listen": "127.0.0.1:0"})
    ds = [cluster.start(f"m{i}", config=cfg, env=rank_env(i, 2)) for i in range(2)]
    # the bound port (port 0 picked one) is in `peer status --json` under metrics.listen
    listen = [d.wait_until(lambda st: st.get("metrics", {}).get("listen"), timeout=30, what="metrics to listen")
              for d in ds]
    ids = [d.peer_id for d in ds]

    def settled(st: dict) -> bool:  # averaging, an RTT measured, the gap solved, the trainer's step published
        return (st["gossip"]["exchanges"] >= 3 and st["topology"]["spectral_gap"] > 0
                and st.get("trainer", {}).get("step") is not None
                and any(p["rtt_ms"] is not None for p in st["peers"]))
    for d in ds:
        d.wait_until(settled, timeout=20, what="exchanges, an RTT, the spectral gap and a step")
    urls = [f"http://{a}/metrics" for a in listen]

    for me, (d, url) in enumerate(zip(ds, urls)):
        other = ids[1 - me]
        m = scrape(url)
        assert value(m, "peertrain_info", peer_id=ids[me], swarm=cfg.daemon.swarm) == 1
        assert value(m, "peertrain_uptime_seconds") > 0
        assert value(m, "peertrain_peers_connected") == 1 and value(m, "peertrain_peers_known") == 1
        assert sum(s.value for s in m["peertrain_sessions"]) == 1
        assert value(m, "peertrain_peer_sent_bytes_total", peer=other) > 0
        assert value(m, "peertrain_peer_received_bytes_total", peer=other) > 0
        assert 0 <= value(m, "peertrain_peer_rtt_seconds", peer=other) < HTTP_TIMEOUT
        done = value(m, "peertrain_exchanges_completed_total")
        assert done >= 3 and value(m, "peertrain_exchanges_served_total") <= done
        assert value(m, "peertrain_exchanges_failed_total") >= 0
        assert value(m, "peertrain_exchange_sent_bytes_total") >= done * 1024 * 4  # float32 vector of 1024
        buckets = [(float(s.labels["le"]), s.value) for s in m["peertrain_exchange_duration_seconds_bucket"]]
        counts = [n for _, n in sorted(buckets)]
        assert counts == sorted(counts) and buckets[-1][0] == math.inf  # cumulative, ending in +Inf
        assert counts[-1] == value(m, "peertrain_exchange_duration_seconds_count") == done  # one snapshot
        assert value(m, "peertrain_exchange_duration_seconds_sum") > 0
        assert value(m, "peertrain_topology_degree") == 1
        assert 0 < value(m, "peertrain_topology_spectral_gap") <= 1
        assert value(m, "peertrain_bans") == 0
        assert value(m, "peertrain_trainer_step") >= 0  # the consensus job publishes its step...
        assert "peertrain_trainer_loss" not in m  # ...and no loss: left out, not 0 or NaN
        assert value(m, "peertrain_listener_accepted_total") >= 0

    # Bad requests: each gets an error status or a closed connection, and the daemon keeps serving.
    host, port = listen[0].rsplit(":", 1)
    addr = (host, int(port))
    assert raw_request(addr, b"\x00\xff garbage \r\n\r\n").startswith(b"HTTP/1.0 400 ")
    big = raw_request(addr, b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n\r\n")
    assert big == b"" or big.startswith(b"HTTP/1.0 431 "), big[:80]
    assert raw_request(addr, b"GET /metrics HTTP/1.1\r\n") == b""  # closed before the head ended
    assert http_status(urls[0].replace("/metrics", "/")) == 404
    assert http_status(urls[0] + "x") == 404
    assert http_status(urls[0], "POST") == 405
    assert http_status(urls[0], "HEAD") == 405
    assert http_status(urls[0] + "?name[]=x") == 200  # a query string is ignored
    m = scrape(urls[0])
    assert value(m, "peertrain_peers_connected") == 1
    st = ds[0].status()["metrics"]
    assert st["errors"] >= 6 and st["scrapes"] >= 3, st


# ---- the HTTP server, in process ----------------------------------------------------------------------

async def _exchange(server: HttpServer, request: bytes, *, close_after: bool = True) -> bytes:
    """Run one connection through `server.handle` over an in-memory stream; what the client got back."""
    client, srv = trio.testing.memory_stream_pair()
    got = bytearray()
    async with trio.open_nursery() as n:
        n.start_soon(server.handle, srv)
        if request:
            await client.send_all(request)
        if close_after:
            await client.send_eof()
        while chunk := await client.receive_some():
            got += chunk
    return bytes(got)


def _server() -> MetricsServer:
    return MetricsServer(lambda: b"peertrain_up 1\n", "text/plain; version=0.0.4; charset=utf-8")


def test_the_server_answers_get_metrics_and_nothing_else():
    async def main():
        s = _server()
        ok = await _exchange(s, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n")
        assert ok.startswith(b"HTTP/1.0 200 OK\r\n") and ok.endswith(b"\r\n\r\npeertrain_up 1\n")
        assert b"Connection: close\r\n" in ok and b"Content-Length: 15\r\n" in ok
        assert (await _exchange(s, b"GET /metrics HTTP/1.0\n\n")).startswith(b"HTTP/1.0 200 ")  # bare LFs
        assert (await _exchange(s, b"GET /other HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 404 ")
        nope = await _exchange(s, b"DELETE /metrics HTTP/1.1\r\n\r\n")
        assert nope.startswith(b"HTTP/1.0 405 ") and b"Allow: GET\r\n" in nope
        for bad in (b"GET /metrics\r\n\r\n", b"get /metrics HTTP/1.1\r\n\r\n", b"\r\n\r\n", b"GET  HTTP/1.1\r\n\r\n",
                    b"GET /metrics HTTP/1.1 extra\r\n\r\n", bytes(range(256)) + b"\r\n\r\n"):
            assert (await _exchange(s, bad)).startswith(b"HTTP/1.0 400 "), bad
        assert s.stats.ok == 2 and s.stats.errors == 8
    trio.run(main)


def test_the_server_bounds_the_head_the_time_and_the_connections():
    async def main():
        s = _server()
        # a head past MAX_HEAD_BYTES: 431 after reading at most that much
        big = await _exchange(s, b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * MAX_HEAD_BYTES, close_after=False)
        assert big.startswith(b"HTTP/1.0 431 ")
        # one that never ends its head: dropped, unanswered, at the read deadline (a mock clock jumps to it)
        t0 = trio.current_time()
        assert await _exchange(s, b"GET /metrics HTTP/1.1\r\n", close_after=False) == b""
        assert trio.current_time() - t0 >= READ_DEADLINE_S
        # closed early: nothing to answer
        assert await _exchange(s, b"GET /met") == b""
        assert s.stats.dropped == 2 and s.active == 0
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_slow_clients_holding_every_place_give_way_to_a_new_one():
    """MAX_CONNECTIONS clients that trickle their heads (slowloris, re-opening as they are dropped) kept every
    honest client out: a connection open over EVICT_AFTER_S now gives its place to a newcomer; younger ones
    do not, so a flood of new connections is still refused."""
    async def main():
        s = _server()
        async with trio.open_nursery() as n:
            slow = []
            for _ in range(MAX_CONNECTIONS):
                client, srv = trio.testing.memory_stream_pair()
                n.start_soon(s.handle, srv)
                await client.send_all(b"GET /metrics HTTP/1.1\r\n")  # and never the blank line
                slow.append(client)
            await trio.testing.wait_all_tasks_blocked()
            assert s.active == MAX_CONNECTIONS
            assert await _exchange(s, b"GET /metrics HTTP/1.1\r\n\r\n") == b""  # all young: refused
            assert s.stats.refused == 1
            await trio.sleep(EVICT_AFTER_S)
            ok = await _exchange(s, b"GET /metrics HTTP/1.1\r\n\r\n")
            assert ok.startswith(b"HTTP/1.0 200 ") and s.stats.evicted == 1 and s.active == MAX_CONNECTIONS - 1
            assert await slow[0].receive_some() == b""  # the oldest was closed unanswered
            n.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_failing_render_is_a_500_and_the_server_goes_on():
    calls = []

    def render() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return b"ok\n"

    async def main():
        s = MetricsServer(render, "text/plain")
        assert (await _exchange(s, b"GET /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 500 ")
        assert (await _exchange(s, b"GET /metrics HTTP/1.1\r\n\r\n")).endswith(b"\r\n\r\nok\n")
    trio.run(main)


# ---- the collector: what a status lacks is left out ------------------------------------------------

def _render(status: dict) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(DaemonCollector(SimpleNamespace(status=lambda: status)))
    return samples(generate_latest(registry).decode())


def test_the_collector_leaves_out_what_the_status_lacks():
    bare = {"peer_id": "p", "swarm": "s", "version": "0.1.0", "uptime_s": 1.5, "connected": 0, "peers": []}
    m = _render(bare)  # no listener, gossip, topology or trainer: only what is there
    assert value(m, "peertrain_info", peer_id="p", swarm="s", version="0.1.0") == 1
    assert value(m, "peertrain_uptime_seconds") == 1.5 and value(m, "peertrain_bans") == 0
    assert not any(n.startswith(("peertrain_exchange", "peertrain_topology", "peertrain_trainer")) for n in m)

    m = _render(dict(bare, trainer={"state": "running", "step": 7, "loss": None, "accuracy": 0.5,
                                     "samples_per_s": float("nan"), "consensus_distance": "n/a"}))
    assert value(m, "peertrain_trainer_step") == 7 and value(m, "peertrain_trainer_accuracy_ratio") == 0.5
    assert math.isnan(value(m, "peertrain_trainer_samples_per_second"))  # a diverged figure shows as it is
    assert "peertrain_trainer_loss" not in m and "peertrain_trainer_consensus_distance" not in m


def test_paths_clips_and_the_pipeline_are_exported_from_the_status():
    st = {"peer_id": "p", "swarm": "s", "version": "0.1.0", "connected": 2,
          "peers": [{"peer_id": "a", "state": "connected", "bytes_by_path": {"direct": 10, "relayed": 5}},
                    {"peer_id": "b", "state": "dead", "bytes_by_path": {"direct": 7, "punched": "x"}}],
          "gossip": {"exchanges": 3, "clipped": {"a": 2, "b": 1}},
          "pipeline": {"stage_map": [{"stage": 0, "capacity": 12.5}, {"stage": 1, "capacity": 3.0}], "bottleneck": 1,
                       "server": {"queue": 4, "served": 9}, "driver": {"done": 6, "failed": 1, "retried": 2}}}
    m = _render(st)
    assert value(m, "peertrain_path_bytes_total", path="direct") == 17
    assert value(m, "peertrain_path_bytes_total", path="relayed") == 5 and "punched" not in str(m["peertrain_path_bytes_total"])
    assert value(m, "peertrain_exchanges_clipped_total") == 3
    assert value(m, "peertrain_pipeline_queue") == 4 and value(m, "peertrain_pipeline_calls_served_total") == 9
    assert [value(m, "peertrain_pipeline_microbatches_total", result=r) for r in ("done", "failed", "retried")] == [6, 1, 2]
    assert value(m, "peertrain_pipeline_stage_capacity", stage="1") == 3.0
    assert value(m, "peertrain_pipeline_bottleneck_stage") == 1
    assert not any(n.startswith("peertrain_pipeline") for n in _render(dict(st, pipeline={})))

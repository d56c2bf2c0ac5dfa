"""The dashboard's parts without a process: the feed's bounds and schema for a swarm of thousands, the training
curve's bound, the HTTP server's token and limits on the dashboard's routes, the page's self-contained
CSP, and the config rules for `[dashboard]`."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest
import trio
import trio.testing

from peer.config import Config, ConfigError
from peer.dashboard import feed
from peer.dashboard.service import page
from peer.metrics.http import MAX_HEAD_BYTES, READ_DEADLINE_S, HttpServer, Reply, fixed
from peer.peer_curves import PEER_CURVE_POINTS, PeerCurves
from peer.training_curve import MAX_POINTS, TrainingCurve
from protocol.schema.training import TrainingFigures
from tests.dashboard_feed import check_feed
from tests.test_metrics_prometheus import _exchange

TOKEN = "s3cret-token-0123456789"


# ---- the feed ---------------------------------------------------------------------------------------------

def _pid(i: int) -> str:
    return f"p{i:019d}"


def big_status(n: int) -> tuple[dict, dict]:
    """A status and topology graph of a swarm of `n` peers as a hostile or huge swarm could make them: long
    reasons, NaN figures, a ban for every tenth peer, four pipeline stages of n/4 peers each."""
    me = _pid(0)
    peers = [{"peer_id": _pid(i), "state": "connected" if i % 3 else "dead", "path": "relayed" if i % 5 == 0 else "direct",
              "via": _pid(1) if i % 5 == 0 else "", "address": f"10.0.{i // 256}.{i % 256}:7100", "rtt_ms": float("nan") if i == 7 else i / 10,
              "bytes_in": i * 1000, "bytes_out": i * 900, "bytes_by_path": {"direct": i}} for i in range(1, n)]
    st = {"peer_id": me, "swarm": "s", "version": "0.1.0", "listen": "127.0.0.1:7100", "uptime_s": 12.5,
          "connected": sum(p["state"] == "connected" for p in peers), "peers": peers,
          "nat": {"reachability": "nat", "reason": "x" * 10_000, "advertised": [f"a{i}" for i in range(100)],
                  "relays": [{"peer_id": _pid(i), "address": "r"} for i in range(100)], "punches": {"attempts": 3}},
          "gossip": {"by_peer": {_pid(i): {"exchanges": i, "clip_rate": 0.5} for i in range(1, n)}},
          "bans": [{"peer": _pid(i), "until": 1.0, "reason": "lied " * 200} for i in range(1, n, 10)],
          "topology": {"kind": "rewired", "degree": 4, "spectral_gap": 0.2, "moves": 9, "last_move": "m" * 5000,
                       "connected_view": True, "neighbours": [{"peer_id": _pid(i)} for i in range(1, 5)],
                       # more peers and points than a daemon holds (peer/peer_curves.py), as if its bounds broke
                       "peer_training": {"total": n - 1, "peers": {
                           _pid(i): {"step": 9, "loss": 1.0, "curve": [[1.0 + k, float("nan") if k == 3 else 1 / (k + 1), None]
                                                                      for k in range(1000)]}
                           for i in range(1, min(n, 200))}}},
          "trainer": {"trainer": "t", "state": "running", "step": 5, "loss": float("inf"), "accuracy": 0.5,
                      "curve": [[1.0 + i, 2.0 / (i + 1), None] for i in range(10_000)] + [[2e4, float("nan"), 0.9]]},
          "pipeline": {"pipeline": "p", "stages": 4, "my_stage": 0, "role": "server+driver", "bottleneck": 2,
                       "stage_map": [{"stage": s, "capacity": 10.0 + s, "peers": [{"peer_id": _pid(i), "samples_per_s": 1.0,
                                                                                   "queue": 1, "me": i == 0, "moving_to": None}
                                                                                  for i in range(s, n, 4)]} for s in range(4)],
                       "moves": [{"at": 1.0, "to": i, "why": "w" * 1000} for i in range(500)],
                       "driver": {"done": 10, "failed": 1, "retried": 2, "resent": 3, "in_flight": 4},
                       "server": {"served": 5, "failed": 0, "queue": 2}}}
    nodes = [_pid(i) for i in range(n)]
    edges = [[_pid(i), _pid((i + k) % n)] for i in range(n) for k in (1, 2)]
    links = [{"a": min(e), "b": max(e), "bandwidth_bps": 1e8, "rtt_s": 0.01} for e in edges]
    return st, {"nodes": nodes, "edges": edges, "links": links, "spectral_gap": 0.2}


@pytest.mark.parametrize("n", [1, 4, 5000])
def test_the_feed_is_bounded_strict_json_with_counts_whatever_the_swarm(n):
    st, topo = big_status(n)
    f = feed.build(st, topo)
    body = feed.encode(f)
    assert len(body) < feed.MAX_FEED_BYTES, len(body)
    f = json.loads(body)  # strict JSON: NaN and infinities became null
    check_feed(f)
    assert f["peers"]["total"] == n - 1 and f["peers"]["shown"] == min(n - 1, feed.MAX_PEER_ROWS)
    assert f["graph"]["nodes_total"] == n and len(f["graph"]["nodes"]) == min(n, feed.MAX_GRAPH_NODES)
    assert len(f["graph"]["edges"]) <= feed.MAX_GRAPH_EDGES
    assert f["training"]["loss"] is None and len(f["training"]["curves"][_pid(0)]) <= MAX_POINTS + 1
    curves = f["training"]["curves"]
    assert list(curves)[0] == _pid(0) and len(curves) == min(n, feed.MAX_CURVES)  # this daemon's first
    assert f["training"]["curves_total"] == min(n, 200)
    assert all(len(c) <= PEER_CURVE_POINTS + 1 for pid, c in curves.items() if pid != _pid(0))
    assert all(len(s) <= feed.MAX_TEXT for s in (f["reachability"]["reason"], f["graph"]["last_move"]))
    assert f["pipeline"]["bottleneck"] == 2 and len(f["pipeline"]["stage_map"]) == 4
    assert all(len(s["peers"]) <= feed.MAX_STAGE_PEERS for s in f["pipeline"]["stage_map"])
    assert len(f["pipeline"]["moves"]) == min(500, feed.MAX_MOVES) and len(f["bans"]["rows"]) <= feed.MAX_BANS
    if n == 5000:
        rows = f["peers"]["rows"]
        assert all(r["state"] == "connected" for r in rows)  # connected first, most traffic first
        assert [r["bytes_in"] for r in rows] == sorted((r["bytes_in"] for r in rows), reverse=True)
        node_ids = {x["id"] for x in f["graph"]["nodes"]}
        assert {_pid(i) for i in range(5)} <= node_ids  # this daemon and its neighbours are always drawn
        assert f["bans"]["total"] == len(range(1, n, 10))


def test_the_feed_of_a_bare_daemon_has_every_key():
    f = json.loads(feed.encode(feed.build({"peer_id": "me", "peers": []}, {})))
    check_feed(f)
    assert f["training"] is None and f["pipeline"] is None and [n["id"] for n in f["graph"]["nodes"]] == ["me"]


def test_edge_weights_are_metropolis_from_the_view_degrees():
    st = {"peer_id": "a", "peers": []}
    f = feed.build(st, {"nodes": ["a", "b", "c"], "edges": [["a", "b"], ["b", "c"]]})
    assert [e["weight"] for e in f["graph"]["edges"]] == [round(1 / 3, 4), round(1 / 3, 4)]  # b has degree 2


# ---- the training curve ------------------------------------------------------------------------------------

def test_the_curve_keeps_the_whole_run_within_its_bound():
    c = TrainingCurve(max_points=8)
    for i in range(1000):
        c.add(float(i), 1.0 / (i + 1), None if i % 2 else 0.5)
    pts = c.status()
    assert len(pts) <= 9 and pts[0][0] == 0.0 and pts[-1][0] == 999.0  # first and latest publish kept
    times = [p[0] for p in pts]
    assert times == sorted(times) and c.stride >= 64
    c.add(1000.0, float("nan"), None)  # nothing finite: not a point
    c.add(1001.0, None, float("inf"))
    assert c.status()[-1][0] == 999.0
    assert len(TrainingCurve().status()) == 0 and MAX_POINTS >= 100


def test_a_daemon_without_a_trainer_draws_the_others_curves():
    st = {"peer_id": "me", "peers": [], "topology": {"peer_training": {"peers": {
        "a": {"curve": [[1.0, 2.0, None], [2.0, 1.0, 0.5]]}, "me": {"curve": [[1.0, 9.0, None]]}}}}}
    f = json.loads(feed.encode(feed.build(st, {})))
    check_feed(f)
    assert f["training"]["curves"] == {"a": [[1.0, 2.0, None], [2.0, 1.0, 0.5]]}  # never a curve under my ID from others


# ---- other peers' curves (peer/peer_curves.py) ----------------------------------------------------------------

def _figures(step: int, loss: float | None = 1.0) -> TrainingFigures:
    return TrainingFigures(step=step, loss=loss, accuracy=None, samples_per_s=None)


def test_a_peer_curve_gains_a_point_only_at_a_newer_step():
    c = PeerCurves()
    c.heard("a", None, now=1.0)  # a record without figures holds nothing
    assert "a" not in c
    c.heard("a", _figures(1, 2.0), now=1.0)
    c.heard("a", _figures(1, 2.0), now=2.0)  # the same figures, re-broadcast: no point
    c.heard("a", _figures(2, 1.0), now=3.0)
    st = c.status(now=4.0)["peers"]["a"]
    assert st["curve"] == [[1.0, 2.0, None], [3.0, 1.0, None]] and st["step"] == 2 and st["heard_s"] == 1.0
    c.heard("a", _figures(0, 5.0), now=5.0)  # an earlier step: a new run, a new curve
    assert c.status(now=5.0)["peers"]["a"]["curve"] == [[5.0, 5.0, None]]


def test_peer_curves_are_bounded_in_peers_and_points_and_released_with_their_record():
    c = PeerCurves(max_peers=4, max_points=8, stale_after=100.0)
    for step in range(1, 500):  # six training peers, room for four: the first four keep theirs whole
        for i in range(6):
            c.heard(_pid(i), _figures(step, 1.0 / step), now=float(step + i / 10))
    st = c.status(now=500.0)
    assert list(st["peers"]) == [_pid(3), _pid(2), _pid(1), _pid(0)]  # most recently heard first
    assert st["refused"] == 2 * 499 and st["dropped"] == 0
    assert all(1 < len(p["curve"]) <= 9 and p["curve"][0][0] < 2 for p in st["peers"].values())  # from step 1
    for step in range(500, 700):  # peer 0 falls silent: past stale_after, a newcomer takes its place
        for i in range(1, 6):
            c.heard(_pid(i), _figures(step), now=float(step))
    assert _pid(0) not in c and _pid(4) in c and c.dropped == 1 and len(c) == 4
    c.retain({_pid(1), _pid(4)})  # the record book forgot the others
    assert len(c) == 2 and set(c.status()["peers"]) == {_pid(1), _pid(4)}


def test_a_peer_status_of_full_curves_stays_small():
    c = PeerCurves()
    for step in range(1, 2000):
        for i in range(c.max_peers + 10):  # the last ten are refused: every curve is live
            c.heard(_pid(i), TrainingFigures(step, 1.0 / step + 1e-9 * i, 0.123456789, 123.456), now=1.7e9 + step)
    body = json.dumps(c.status(now=1.8e9))
    assert len(c) == c.max_peers and len(body) < 256 * 1024, len(body)


# ---- the HTTP server with a token -----------------------------------------------------------------------------

def _dashboard_like(token: str = TOKEN) -> HttpServer:
    async def boom(req):
        raise RuntimeError("a bug")

    return HttpServer({"/": fixed(lambda: b"<html>", "text/html"), "/api/status": fixed(lambda: b"{}", "application/json"),
                       "/boom": boom}, token=token, name="dashboard")


def test_a_token_is_required_by_header_or_query_and_a_wrong_one_is_refused():
    async def main():
        s = _dashboard_like()
        no = await _exchange(s, b"GET /api/status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert no.startswith(b"HTTP/1.0 401 ") and b"WWW-Authenticate: Bearer" in no and not no.endswith(b"{}")
        assert (await _exchange(s, b"GET /api/status?token=wrong HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 401 ")
        wrong_len = f"GET / HTTP/1.1\r\nAuthorization: Bearer {TOKEN}x\r\n\r\n".encode()
        assert (await _exchange(s, wrong_len)).startswith(b"HTTP/1.0 401 ")
        ok = await _exchange(s, f"GET /api/status HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        assert ok.startswith(b"HTTP/1.0 200 ") and ok.endswith(b"\r\n\r\n{}")
        assert (await _exchange(s, f"GET /?token={TOKEN} HTTP/1.1\r\n\r\n".encode())).endswith(b"<html>")
        # write methods do not exist, token or not; unknown paths are 404 before the token is looked at
        assert (await _exchange(s, f"POST /api/status?token={TOKEN} HTTP/1.1\r\n\r\n".encode())).startswith(b"HTTP/1.0 405 ")
        assert (await _exchange(s, b"GET /favicon.ico HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 404 ")
        assert (await _exchange(s, f"GET /boom?token={TOKEN} HTTP/1.1\r\n\r\n".encode())).startswith(b"HTTP/1.0 500 ")
        assert (await _exchange(s, b"GET /?" + b"&".join(b"a%d=1" % i for i in range(40)) + b" HTTP/1.1\r\n\r\n")
                ).startswith(b"HTTP/1.0 400 ")  # past MAX_QUERY_FIELDS
        assert (await _exchange(s, b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")).startswith(b"HTTP/1.0 400 ")
        assert s.stats.unauthorized == 3 and s.stats.ok == 2
    trio.run(main)


def test_a_tokenless_dashboard_answers_only_a_host_that_is_an_address_or_localhost():
    """DNS rebinding: a page of evil.example whose name was made to resolve to 127.0.0.1 sends Host:
    evil.example, and the browser would let that page read the answer. A token closes it anyway."""
    async def main():
        s = HttpServer({"/api/status": fixed(lambda: b"{}", "application/json")}, literal_hosts=True)
        for host in ("127.0.0.1:8787", "localhost:8787", "LOCALHOST", "[::1]:8787", "10.0.0.7"):
            got = await _exchange(s, f"GET /api/status HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.0 200 "), host
        assert (await _exchange(s, b"GET /api/status HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.0 200 ")  # no Host
        for host in ("evil.example:8787", "evil.example", "127.0.0.1.evil.example", "localhost.evil.example:1"):
            got = await _exchange(s, f"GET /api/status HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert got.startswith(b"HTTP/1.0 403 ") and not got.endswith(b"{}"), host
        with_token = HttpServer({"/": fixed(lambda: b"ok", "text/plain")}, token=TOKEN, literal_hosts=True)
        got = await _exchange(with_token, f"GET /?token={TOKEN} HTTP/1.1\r\nHost: dash.example\r\n\r\n".encode())
        assert got.endswith(b"ok")  # behind a token, a name is fine (a reverse proxy, a LAN name)
    trio.run(main)


def test_the_dashboard_routes_are_cut_like_metrics():
    async def main():
        s = _dashboard_like()
        big = await _exchange(s, b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * MAX_HEAD_BYTES, close_after=False)
        assert big.startswith(b"HTTP/1.0 431 ")
        t0 = trio.current_time()
        assert await _exchange(s, b"GET /api/status HTTP/1.1\r\n", close_after=False) == b""  # slowloris
        assert trio.current_time() - t0 >= READ_DEADLINE_S
        assert s.stats.dropped == 1
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_handler_past_its_deadline_is_a_503():
    async def slow(req):
        await trio.sleep(3600)
        return Reply(b"late", "text/plain")

    async def main():
        s = HttpServer({"/": slow})
        assert (await _exchange(s, b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.0 503 ")
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# ---- the page ------------------------------------------------------------------------------------------------

def test_the_page_is_self_contained_and_its_csp_allows_only_its_own_script_and_style():
    html, headers = page()
    text = html.decode()
    csp = next(h for h in headers if h.startswith("Content-Security-Policy: "))
    script = re.search(r"<script>(.*)</script>", text, re.S).group(1)
    style = re.search(r"<style>(.*)</style>", text, re.S).group(1)
    for body in (script, style):
        assert "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'" in csp
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp and "connect-src 'self'" in csp
    assert not re.search(r"(src|href)=\"(https?:)?//", text)  # no CDN, nothing loaded from elsewhere
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script  # peers' strings are only ever text
    assert "X-Frame-Options: DENY" in headers and "Referrer-Policy: no-referrer" in headers


# ---- config ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("listen", ["127.0.0.1:0", "[::1]:8470", "localhost:8470", "127.0.0.2:0"])
def test_a_loopback_dashboard_needs_no_token(listen):
    assert Config().replace(dashboard={"listen": listen}).dashboard.listen == listen


@pytest.mark.parametrize("listen", ["0.0.0.0:8470", "192.168.1.5:0", "[::]:8470", "myhost:8470"])
def test_a_dashboard_on_another_address_needs_a_token(listen):
    with pytest.raises(ConfigError, match=r"\[dashboard\] token"):
        Config().replace(dashboard={"listen": listen})
    assert Config().replace(dashboard={"listen": listen, "token": TOKEN}).dashboard.token == TOKEN


@pytest.mark.parametrize("token", ["short", "x" * 15, "has a space in it ok", "tab\there-0123456789"])
def test_a_weak_or_odd_token_is_refused(token):
    with pytest.raises(ConfigError, match=r"\[dashboard\] token"):
        Config().replace(dashboard={"listen": "0.0.0.0:0", "token": token})


def test_the_dashboard_port_is_its_own():
    with pytest.raises(ConfigError, match=r"\[dashboard\] listen: port 7100 is \[daemon\] listen's"):
        Config().replace(dashboard={"listen": "127.0.0.1:7100"})
    with pytest.raises(ConfigError, match=r"\[metrics\] listen's"):
        Config().replace(metrics={"listen": "127.0.0.1:9100"}, dashboard={"listen": "127.0.0.1:9100"})
    with pytest.raises(ConfigError, match=r"\[dashboard\] listen: expected HOST:PORT"):
        Config().replace(dashboard={"listen": "8470"})
    assert not Config().dashboard.listen  # off by default

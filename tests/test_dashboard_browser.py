"""The dashboard in a real browser: headless Chromium (Debian's chromium and chromium-driver; `./dev` installs
them when it can) driven by Selenium opens node1's page while real daemons train, and waits, bounded, until
the page shows what the swarm is: 4 peers, the gossip graph's 4 nodes and 4 edges (a ring), loss curves of
at least 3 points for at least 2 peers (its own and others', from their signed records); for a 4-stage pipeline, 4 stage boxes and a bottleneck. A screenshot of each is saved
under the test's tmp_path (its path is printed). Without a browser these tests still check the feed's
schema and the Grafana board's metrics against the running daemons, then skip, saying why.

Also against a real daemon: a dashboard on a non-loopback address refuses requests without its token, and
oversized or slow requests are cut like /metrics'.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from peer.metrics.http import MAX_HEAD_BYTES, READ_DEADLINE_S
from peer.testing.swarm import rank_env, swarm_config, unique_swarm
from tests.dashboard_feed import check_feed
from tests.test_metrics_prometheus import raw_request, samples

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
GRAFANA = REPO / "configs" / "grafana-peertrain.json"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# Root on a closed network: no sandbox (root), no GPU, and nothing that would reach for the internet.
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,1400")
START_S = 90.0  # 4 daemons start, connect and publish a few figures: ~10 s here, generous for a loaded CI host
PAGE_S = 60.0  # the page polls every 1.5 s: it shows a state within a few polls of the daemon having it
HTTP_TIMEOUT = 10.0
TOKEN = "dashboard-test-token-0123456789"
DIGITS = dict(model="digits_cnn", mode="adpsgd", world=4, target_accuracy=0.95, eval_every=20)
# The pipeline tests' tiny transformer (tests/test_pipeline_swarm.py), 4 stages, each daemon driving a little.
PIPE = dict(d_model=32, n_layers=2, n_heads=2, block=16, microbatch=8, batch_size=16, stages=4, dropout=0.0,
            lr=3e-3, grad_clip=0.0, seed=0, join_wait=60.0, samples=160)

# What the page exposes for a test to read (stable ids and data attributes of peer/dashboard/static/).
PAGE_STATE_JS = """
const d = (id, k) => document.getElementById(id).dataset[k];
return {updates: Number(document.body.dataset.updates || 0), nodes: Number(d("graph", "nodes")),
        edges: Number(d("graph", "edges")), points: Number(d("loss", "points")), curves: Number(d("loss", "curves")),
        loss_lines: new Set(Array.from(document.querySelectorAll("#loss polyline.loss-line"), (e) => e.dataset.peer)).size,
        legend: document.querySelectorAll("#loss-legend .curve-key").length,
        rows: document.querySelectorAll("tr.peer-row").length, total: Number(d("peer-count", "total")),
        stages: Number(d("stages", "stages")), bottleneck: d("stages", "bottleneck"),
        bottleneck_boxes: document.querySelectorAll(".stage.bottleneck").length,
        me: (document.getElementById("me-id") || {}).textContent || "",
        error: document.getElementById("error").textContent};
"""


def browser_missing() -> str | None:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        return f"no headless browser: {CHROMIUM} and {CHROMEDRIVER} are needed (Debian: apt-get install chromium chromium-driver; ./dev does it as root)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


@contextmanager
def chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="peertrain-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in (*CHROME_FLAGS, f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    drv = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    try:
        drv.set_page_load_timeout(HTTP_TIMEOUT)
        drv.set_script_timeout(HTTP_TIMEOUT)
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_page(drv, predicate, *, what: str, shot: Path, timeout: float = PAGE_S) -> dict:
    """Poll the page's state until `predicate(state)`; a screenshot either way (`shot`), its path printed."""
    deadline = time.monotonic() + timeout
    state: dict = {}
    try:
        while time.monotonic() < deadline:
            state = drv.execute_script(PAGE_STATE_JS)
            if predicate(state):
                return state
            time.sleep(0.25)
        raise AssertionError(f"the page did not show {what} within {timeout:g}s; it shows {state}; browser log: "
                             f"{drv.get_log('browser')}")
    finally:
        drv.save_screenshot(str(shot))
        print(f"dashboard screenshot: {shot}")


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=HTTP_TIMEOUT) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def grafana_metrics() -> set[str]:
    """Every metric name the Grafana board queries (the JSON must parse)."""
    board = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs and board["uid"] and board["__inputs"][0]["pluginId"] == "prometheus"
    return {m for e in exprs for m in re.findall(r"\bpeertrain_[a-z_]+", e)}


def start_swarm(cluster, cfg, node1_cfg, n: int = 4):
    return [cluster.start(f"node{i + 1}", config=node1_cfg if i == 0 else cfg, env=rank_env(i, n)) for i in range(n)]


def listening(d, key: str) -> str:
    return d.wait_until(lambda st: (st.get(key) or {}).get("listen"), timeout=START_S, what=f"{key} to listen")


def curve(st: dict | None) -> list:
    return ((st or {}).get("trainer") or {}).get("curve") or []


def others_curves(st: dict | None) -> dict:
    """Other peers' curves node1 holds, from the figures their topology records carry."""
    return (((st or {}).get("topology") or {}).get("peer_training") or {}).get("peers") or {}


def test_four_training_daemons_on_node1s_dashboard(cluster, tmp_path):
    cfg = swarm_config(swarm=unique_swarm("dash"), trainer="trainers.gossip_sgd", options=DIGITS,
                       topology={"kind": "ring"})
    node1 = cfg.replace(dashboard={"listen": "127.0.0.1:0"}, metrics={"listen": "127.0.0.1:0"})
    ds = start_swarm(cluster, cfg, node1)
    base = f"http://{listening(ds[0], 'dashboard')}"
    metrics = f"http://{listening(ds[0], 'metrics')}/metrics"
    cluster.wait_connected()
    cluster.wait(lambda sts: sts[0]["topology"]["view_edges"] == 4 and len(curve(sts[0])) >= 3
                 and sts[0].get("gossip", {}).get("exchanges", 0) >= 1
                 and any(len(c["curve"]) >= 2 for c in others_curves(sts[0]).values()),
                 timeout=START_S, what="node1 to know the ring, average, publish 3 figures and hear another peer's 2",
                 interval=0.5)
    # peer status --json: the others' figures, each in range, none under node1's own ID
    mine = ds[0].status()
    theirs = others_curves(mine)
    assert theirs and mine["peer_id"] not in theirs and set(theirs) <= {d.status()["peer_id"] for d in ds[1:]}
    for c in theirs.values():
        assert c["step"] >= 0 and (c["loss"] is None or c["loss"] >= 0) and c["heard_s"] >= 0

    code, headers, body = get(base + "/api/status")
    assert code == 200 and headers["Content-Type"] == "application/json"
    feed = json.loads(body)
    check_feed(feed)
    assert feed["peers"]["total"] == 3 and feed["graph"]["nodes_total"] == 4 and feed["graph"]["edges_total"] == 4
    assert feed["training"]["curves_total"] >= 2 and list(feed["training"]["curves"])[0] == feed["me"]["peer_id"]
    code, headers, body = get(base + "/")
    assert code == 200 and b"peertrain dashboard" in body and "default-src 'none'" in headers["Content-Security-Policy"]

    # the Grafana board: it parses, and every metric it queries (but the pipeline's) is on a training daemon
    found = set(samples(urllib.request.urlopen(metrics, timeout=HTTP_TIMEOUT).read().decode()))
    missing = {m for m in grafana_metrics() if not m.startswith("peertrain_pipeline_")} - found
    assert not missing, f"the Grafana board queries metrics node1 does not export: {sorted(missing)}"

    if (why := browser_missing()) is not None:
        pytest.skip(why + " (the feed and the Grafana board were checked)")
    with chromium() as drv:
        drv.get(base + "/")
        state = wait_page(drv, lambda s: s["nodes"] == 4 and s["edges"] == 4 and s["points"] >= 3 and s["rows"] == 3
                          and s["total"] == 3 and s["curves"] >= 2 and s["loss_lines"] >= 2 and s["legend"] >= 2,
                          what="4 peers (node1 and 3 rows), a ring of 4 and loss curves of 2 peers or more",
                          shot=tmp_path / "dashboard-digits.png")
        assert state["error"] == "" and state["me"] == feed["me"]["peer_id"], state
        assert drv.find_elements("css selector", "circle.loss-point")  # the curve's points are drawn


def test_a_four_stage_pipeline_on_node1s_dashboard(cluster, tmp_path):
    cfg = swarm_config(swarm=unique_swarm("dashp"), trainer="trainers.swarm_pipeline", options=PIPE,
                       topology={"record_interval": 1.0})
    node1 = cfg.replace(dashboard={"listen": "127.0.0.1:0"}, metrics={"listen": "127.0.0.1:0"})
    ds = start_swarm(cluster, cfg, node1)
    base = f"http://{listening(ds[0], 'dashboard')}"
    metrics = f"http://{listening(ds[0], 'metrics')}/metrics"

    def covered(sts) -> bool:
        p = (sts[0] or {}).get("pipeline") or {}
        return (len(p.get("stage_map") or []) == 4 and p.get("bottleneck") is not None
                and (p.get("driver") or {}).get("done", 0) >= 1)
    cluster.wait(covered, timeout=START_S + 60, what="node1 to see 4 stages and drive a microbatch", interval=0.5)
    code, _, body = get(base + "/api/status")
    feed = json.loads(body)
    check_feed(feed)
    assert feed["pipeline"]["stages"] == 4 and feed["pipeline"]["bottleneck"] in range(4)
    found = set(samples(urllib.request.urlopen(metrics, timeout=HTTP_TIMEOUT).read().decode()))
    missing = {m for m in grafana_metrics() if m.startswith("peertrain_pipeline_")} - found
    assert not missing, f"the Grafana board queries pipeline metrics node1 does not export: {sorted(missing)}"

    if (why := browser_missing()) is not None:
        pytest.skip(why + " (the feed and the Grafana board's pipeline metrics were checked)")
    with chromium() as drv:
        drv.get(base + "/")
        state = wait_page(drv, lambda s: s["stages"] == 4 and s["bottleneck"] != "" and s["bottleneck_boxes"] == 1
                          and s["nodes"] == 4, what="4 stages with a bottleneck", shot=tmp_path / "dashboard-pipeline.png")
        assert state["error"] == "", state
        assert drv.find_element("id", "bottleneck").text == "bottleneck"


def test_a_dashboard_off_loopback_needs_its_token_and_cuts_bad_requests(cluster, tmp_path):
    cfg = swarm_config(swarm=unique_swarm("dasht"), mdns=False).replace(
        dashboard={"listen": "0.0.0.0:0", "token": TOKEN})
    d = cluster.start("node1", config=cfg)
    port = int(listening(d, "dashboard").rsplit(":", 1)[1])
    base = f"http://127.0.0.1:{port}"
    assert get(base + "/api/status")[0] == 401
    assert get(base + "/")[0] == 401
    assert get(base + "/api/status?token=" + TOKEN[:-1] + "x")[0] == 401
    assert get(base + "/api/status", {"Authorization": "Bearer nope"})[0] == 401
    code, _, body = get(base + "/api/status", {"Authorization": f"Bearer {TOKEN}"})
    assert code == 200
    check_feed(json.loads(body))
    assert get(base + "/?token=" + TOKEN)[0] == 200
    # no write action: other methods are refused, token or not
    req = urllib.request.Request(base + "/api/status", method="POST", data=b"{}",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=HTTP_TIMEOUT)
    assert err.value.code == 405
    # oversized and slow requests are cut like /metrics': a head past the bound, one that never ends
    big = raw_request(("127.0.0.1", port), b"GET / HTTP/1.1\r\nX-Pad: " + b"a" * (2 * MAX_HEAD_BYTES) + b"\r\n\r\n")
    assert big == b"" or big.startswith(b"HTTP/1.0 431 "), big[:80]
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=READ_DEADLINE_S + HTTP_TIMEOUT) as s:
        s.sendall(b"GET /api/status HTTP/1.1\r\n")  # and nothing more
        assert s.recv(1024) == b""  # closed unanswered at the read deadline
    assert READ_DEADLINE_S - 0.5 <= time.monotonic() - t0 < READ_DEADLINE_S + HTTP_TIMEOUT
    st = d.status()["dashboard"]
    assert st["token"] is True and TOKEN not in json.dumps(d.status()) and st["unauthorized"] >= 4, st

    if (why := browser_missing()) is not None:
        pytest.skip(why + " (the token and the limits were checked)")
    with chromium() as drv:  # the page passes its URL's token on to the feed
        drv.get(f"{base}/?token={TOKEN}")
        state = wait_page(drv, lambda s: s["updates"] >= 2 and s["nodes"] == 1, what="its own status, twice",
                          shot=tmp_path / "dashboard-token.png")
        assert state["error"] == "", state

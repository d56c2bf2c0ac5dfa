"""`[membership] views = "auto"` in real daemons (issue 38): a swarm that grows past `auto_peers` (set low
here) switches from the full view to partial views while it runs and stays one connected graph, `peer
status` saying which mode is in effect; and a mixed swarm, an auto daemon beside a `views = "full"` one,
keeps one connected gossip graph with no session closed for a view message."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from peer.cli.status_view import render_status
from peer.membership.view_driver import SESSION_IDLE_S
from peer.testing.swarm import swarm_config
from peer.testing.views import settled
from tests.daemons import unique_swarm

pytestmark = pytest.mark.slow

THRESHOLD = 4  # [membership] auto_peers here: 3 daemons stay full, the 4th takes every one past it
MIN_DEGREE, MAX_DEGREE = 2, 8  # [topology]'s defaults


def _config(swarm: str, join: list[str], views: str = "auto"):
    return swarm_config(swarm=swarm, mdns=False, join=join, membership={"views": views, "auto_peers": THRESHOLD})


def _gossip_graph_connected(sts: list[dict | None], n: int) -> bool:
    """The topology neighbours (what averaging reads), edges listed by both ends, form one graph of n."""
    if len(sts) != n or not all(sts):
        return False
    nbrs = {s["peer_id"]: {x["peer_id"] for x in s["topology"]["neighbours"]} for s in sts if s}
    seen, stack = {next(iter(nbrs))}, [next(iter(nbrs))]
    while stack:
        p = stack.pop()
        for q in nbrs[p]:
            if q in nbrs and p in nbrs[q] and q not in seen:
                seen.add(q)
                stack.append(q)
    return len(seen) == n


def _no_session_closed_for_a_view_message(cluster) -> None:
    logs = cluster.log_tails(100_000)
    for bad in ("bad view message", "not a view message", "internal error handling", "protocol error"):
        assert bad not in logs, bad


def test_a_growing_swarm_switches_to_partial_views_and_stays_connected(cluster):
    swarm = unique_swarm()
    first = cluster.start("a1", config=_config(swarm, []))
    listen = first.wait_ready()["listen"]
    ds = [first] + [cluster.start(f"a{i}", config=_config(swarm, [listen])) for i in (2, 3)]
    for d in ds:
        d.wait_ready()
    # three: below the threshold, the full view as ever (a full mesh, no partial view in the status)
    cluster.wait(lambda sts: all(s and s["connected"] == 2 for s in sts), timeout=30, what="a full mesh of 3")
    sts = cluster.statuses()
    assert all(s["topology"]["view_mode"].startswith("auto (full") and "views" not in s["topology"] for s in sts)
    ds += [cluster.start(f"a{i}", config=_config(swarm, [listen])) for i in (4, 5)]
    for d in ds[3:]:
        d.wait_ready()
    cluster.wait(lambda sts: all(s and s["topology"]["view_mode"].startswith("auto (partial") for s in sts),
                 timeout=30, what="every daemon to switch to partial views")
    cluster.wait(lambda sts: settled(sts, 5, MIN_DEGREE, MAX_DEGREE), timeout=60, interval=0.5,
                 what="the switched views to form one connected graph")
    # the full view's proposed edges are dropped once the views hold theirs: the neighbours are the views'

    def neighbours_are_the_views(sts) -> bool:
        return all({n["peer_id"] for n in s["topology"]["neighbours"]} == set(s["topology"]["views"]["active"])
                   for s in sts)
    cluster.wait(neighbours_are_the_views, timeout=30, interval=0.5, what="topology neighbours to be the views")
    assert _gossip_graph_connected(cluster.statuses(), 5)
    _no_session_closed_for_a_view_message(cluster)
    console = Console(file=io.StringIO(), width=160)
    console.print(render_status(cluster.statuses()[0]))
    assert "auto (partial since" in console.file.getvalue()


def test_a_mixed_swarm_keeps_one_graph(cluster):
    """Four auto daemons past the threshold and one `views = "full"`: the full one ignores their view
    messages (sessions stay up), its edge proposals are accepted by switched daemons (the bridge), and
    the gossip graph of all five stays connected."""
    swarm = unique_swarm()
    first = cluster.start("m1", config=_config(swarm, []))
    listen = first.wait_ready()["listen"]
    ds = [first] + [cluster.start(f"m{i}", config=_config(swarm, [listen])) for i in (2, 3, 4)]
    ds.append(cluster.start("full", config=_config(swarm, [listen], views="full")))
    for d in ds:
        d.wait_ready()
    cluster.wait(lambda sts: sum(bool(s and s["topology"]["view_mode"].startswith("auto (partial")) for s in sts) == 4,
                 timeout=30, what="the four auto daemons to switch")
    full = ds[-1].status()
    assert full["topology"]["view_mode"] == "full"
    cluster.wait(lambda sts: _gossip_graph_connected(sts, 5), timeout=60, interval=0.5,
                 what="one gossip graph of the four partial views and the full-view daemon")
    # and it stays so past SESSION_IDLE_S, when the partial views close the sessions they do not need (the
    # full-view daemon dials them again; its edges keep theirs)
    time.sleep(SESSION_IDLE_S + 5)
    cluster.wait(lambda sts: _gossip_graph_connected(sts, 5), timeout=30, interval=0.5,
                 what="the gossip graph of five to stay connected")
    sts = cluster.statuses()
    print({s["peer_id"][:8]: (s["topology"]["view_mode"][:14], sorted(n["peer_id"][:8] for n in s["topology"]["neighbours"]),
                              s["connected"]) for s in sts if s})
    _no_session_closed_for_a_view_message(cluster)

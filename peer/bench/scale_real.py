"""`peer bench scale --real N`: the partial-view rules in N real daemons on loopback, beside the simulator's
figures for the same N, so the two can be compared (issue 30 asks them to agree within 25%).

Every daemon runs with `[membership] views = "partial"` and mDNS off, and joins through the first one
(`--join`). The bench waits until the active views form one connected graph with every degree within
`[topology] min_degree..max_degree` (`connect_seconds`), lets it settle, then counts each daemon's view
bytes over a steady window. Per-peer figures, as the simulator reports them where they are measurable:

  * `state_bytes_per_peer`: the largest `Views.state_bytes()` (the same function the simulator calls);
  * `control_bits_per_s_per_peer`: view-message bits a daemon sends per second over the window (framed as
    on the wire); the simulator's `control_bits_per_s_views_only` is the figure to compare (the daemon has
    no gap-estimate rounds yet); `session_bits_per_s_per_peer` is everything a daemon sends (heartbeats and
    topology records included), for scale;
  * connectivity and degrees of the graph the active views form; `known_peers_max` and `sessions_max`,
    what a daemon holds of the swarm (its peer table and its open sessions).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from peer.config import Config
from peer.testing.swarm import LocalSwarm, swarm_config, unique_swarm
from peer.testing.views import settled, view_graph
from peer.topology.local_gap import GapConfig

READY_TIMEOUT = 120.0  # N daemons importing torch at once on 2 cores: tens of seconds
MEMBERSHIP = {"views": "partial"}


def partial_config(swarm: str, join: list[str], **kw) -> Config:
    """A daemon on loopback with partial views, joining through `join` (mDNS off: the views find the rest)."""
    membership = {**MEMBERSHIP, **kw.pop("membership", {})}
    return swarm_config(swarm=swarm, mdns=False, join=join, membership=membership, **kw)


def _sent(statuses: list[dict]) -> dict[str, tuple[int, int]]:
    """Per daemon: view bytes sent, and all session bytes sent (to every peer, live and ended sessions)."""
    return {s["peer_id"]: (s["topology"]["views"]["sent_bytes"], sum(p["bytes_out"] for p in s["peers"]))
            for s in statuses}


def run_real(n: int, root: Path, *, settle: float, steady: float, timeout: float,
             log: Callable[[str], None] = lambda what: None) -> dict:
    cfg0 = Config()
    lo, hi = cfg0.topology.min_degree, cfg0.topology.max_degree
    swarm = unique_swarm("scale")
    with LocalSwarm(root) as ls:
        t0 = time.monotonic()
        # one gap-estimate epoch a steady window, as the simulator runs one in its own (wall-clock epochs:
        # a window of that length holds one epoch's start; its 60 rounds may run past the window's end)
        gap = {"membership": {"gap_every": max(steady, GapConfig.rounds * GapConfig.round_interval)}}
        first = ls.start("node1", config=partial_config(swarm, [], **gap))
        listen = first.wait_ready(timeout=READY_TIMEOUT)["listen"]
        for i in range(2, n + 1):
            ls.start(f"node{i}", config=partial_config(swarm, [listen], **gap))
        ls.wait(lambda sts: all(sts), timeout=READY_TIMEOUT, what=f"{n} daemons to answer", interval=1.0)
        started = time.monotonic() - t0
        log(f"{n} daemons up in {started:.0f} s")
        t1 = time.monotonic()
        ls.wait(lambda sts: settled(sts, n, lo, hi), timeout=timeout, interval=1.0,
                what=f"{n} daemons' partial views to form one connected graph, degrees {lo}..{hi}")
        connect = time.monotonic() - t1
        log(f"connected graph after {connect:.0f} s more")
        time.sleep(settle)
        before = ls.statuses()
        tw = time.monotonic()
        time.sleep(steady)
        after = ls.statuses()
        window = time.monotonic() - tw
        s0, s1 = _sent([s for s in before if s]), _sent([s for s in after if s])
        common = [p for p in s1 if p in s0]
        view_bits = [8 * (s1[p][0] - s0[p][0]) / window for p in common]
        all_bits = [8 * (s1[p][1] - s0[p][1]) / window for p in common]
        g = view_graph(after)
        states = [s["topology"]["views"]["state_bytes"] for s in after if s]
        return {
            "daemons": n,
            "start_seconds": round(started, 1),
            "connect_seconds": round(connect, 1),
            "state_bytes_per_peer": g["state_bytes_max"],
            "state_bytes_mean": round(statistics.mean(states)) if states else None,
            "control_bits_per_s_per_peer": round(statistics.mean(view_bits), 1) if view_bits else None,
            "control_bits_per_s_max": round(max(view_bits), 1) if view_bits else None,
            "session_bits_per_s_per_peer": round(statistics.mean(all_bits), 1) if all_bits else None,
            "steady_window_seconds": round(window, 1),
            "connected_at_end": g["connected"],
            "largest_component": g["largest_component"],
            "mean_degree": g["mean_degree"],
            "degree_min_max": g["degree_min_max"],
            "edges_one_sided": g["edges_one_sided"],
            "passive_max": g["passive_max"],
            "known_peers_max": g["known_peers_max"],
            "sessions_max": g["sessions_max"],
        }


def compare(real: dict, sim: dict) -> dict:
    """real / simulated for the figures both measure alike (1.0: the same): state with the gap estimator's
    (both run it), and traffic as view messages and gap rounds: the simulator's control figure also prices
    each dial's handshake, which the daemon's view-byte counters do not see, so those bytes are left out."""
    by_type = sim.get("steady_bytes_by_message", {})
    peers, steady = sim.get("peers") or 0, sim.get("steady_seconds") or 0
    messages = sum(v for k, v in by_type.items() if k.startswith("view_"))
    # the gap rounds are counted per peer, apart from the messages by type: all control less the views'
    gap_bits = (sim.get("control_bits_per_s_per_peer") or 0.0) - (sim.get("control_bits_per_s_views_only") or 0.0)
    sim_bits = 8 * messages / (peers * steady) + gap_bits if peers and steady else None
    pairs = {"state_bytes_per_peer": sim.get("state_bytes_per_peer"),
             "control_bits_per_s_per_peer": sim_bits, "mean_degree": sim.get("mean_degree")}
    out: dict = {"simulated_view_message_bits_per_s_per_peer": None if sim_bits is None else round(sim_bits, 1)}
    for name, b in pairs.items():
        a = real.get(name)
        out[name] = round(a / b, 3) if a is not None and b else None
    return out


def real_figures(args) -> dict:
    """The real run of `peer bench scale --real N`, in --logs or a temp dir (removed)."""
    say = (lambda what: None) if args.json else (lambda what: print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True))
    if args.logs:
        return run_real(args.real, Path(args.logs), settle=args.settle, steady=args.real_steady,
                        timeout=args.real_timeout, log=say)
    with tempfile.TemporaryDirectory(prefix="peer-bench-scale-") as d:
        return run_real(args.real, Path(d), settle=args.settle, steady=args.real_steady,
                        timeout=args.real_timeout, log=say)

"""The dashboard's JSON feed: the daemon's status (what `peer status --json` shows) and its gossip graph (what
`peer status --topology` shows), trimmed to a size that does not grow with the swarm.

One source: nothing here measures or keeps anything; it reads the two dicts the CLI reads and picks from
them. A swarm of thousands of peers still gives a feed of tens of KB, since every list is cut to a top-N
with the full count beside it (`total`/`shown`), every string to MAX_TEXT characters, and every number that
is not finite becomes null (the feed is strict JSON: a browser's JSON.parse refuses NaN).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from peer.topology.mixing import metropolis_weight
from peer.peer_curves import PEER_CURVE_POINTS
from peer.training_curve import MAX_POINTS
from protocol.schema.pipeline import MAX_STAGES

SCHEMA = 1  # bumped when a key changes meaning; the page checks it
# Rows of the peer table: the connected peers with the most traffic first; a screen shows no more.
MAX_PEER_ROWS = 32
# Nodes of the drawn graph: this daemon, its neighbours, its sessions, then the best-connected; a circle of
# more than 64 nodes is unreadable anyway.
MAX_GRAPH_NODES = 64
# Edges among the drawn nodes (64 nodes of degree 8 have 256).
MAX_GRAPH_EDGES = 256
# Peers listed per pipeline stage, past moves shown, bans listed, reachability addresses and relays shown
# (stages: as many as a pipeline may have, MAX_STAGES).
MAX_STAGE_PEERS = 8
MAX_MOVES = 8
MAX_BANS = 16
MAX_ADDRESSES = 8
# Curves drawn: this daemon's and the others' most recently heard (peer/peer_curves.py holds up to 64); a
# chart of more lines is unreadable. Each other peer's curve is at most PEER_CURVE_POINTS + 1 points.
MAX_CURVES = 12
# Characters of any string taken from the status (a reason, a move's explanation, an address).
MAX_TEXT = 240
# What the feed stays under by construction (checked by the tests with a status of thousands of peers).
MAX_FEED_BYTES = 256 * 1024


def _num(v: Any, digits: int | None = None) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return round(float(v), digits) if digits is not None else v


def _text(v: Any) -> str:
    s = "" if v is None else str(v)
    return s if len(s) <= MAX_TEXT else s[: MAX_TEXT - 1] + "…"


def _int(v: Any) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0


def identity(st: dict) -> dict:
    return {"peer_id": _text(st.get("peer_id")), "swarm": _text(st.get("swarm")), "version": _text(st.get("version")),
            "listen": _text(st.get("listen")), "uptime_s": _num(st.get("uptime_s")), "connected": _int(st.get("connected"))}


def reachability(nat: dict) -> dict:
    relay = nat.get("relay_server") or {}
    punches = nat.get("punches") or {}
    return {"reachability": _text(nat.get("reachability") or "unknown"), "reason": _text(nat.get("reason")),
            "nat_mapping": _text(nat.get("nat_mapping")),
            "advertised": [_text(a) for a in (nat.get("advertised") or [])[:MAX_ADDRESSES]],
            "relays": [{"peer_id": _text(r.get("peer_id")), "address": _text(r.get("address"))}
                       for r in (nat.get("relays") or [])[:MAX_ADDRESSES]],
            "punches": {k: _int(punches.get(k)) for k in ("attempts", "succeeded", "failed")},
            "relaying": {"offering": bool(relay.get("offering")), "circuits": _int(relay.get("circuits")),
                         "reservations": _int(relay.get("reservations"))}}


def _bans(st: dict) -> dict[str, str]:
    """peer -> why it is banned, from averaging's bans and the pipeline's."""
    out: dict[str, str] = {}
    for b in list(st.get("bans") or []) + list((st.get("pipeline") or {}).get("bans") or []):
        if isinstance(b, dict) and b.get("peer"):
            out.setdefault(str(b["peer"]), _text(b.get("reason")))
    return out


def peers(st: dict, bans: dict[str, str]) -> dict:
    all_peers = [p for p in (st.get("peers") or []) if isinstance(p, dict)]
    by_peer = (st.get("gossip") or {}).get("by_peer") or {}
    by_state: dict[str, int] = {}
    for p in all_peers:
        key = _text(p.get("state"))[:32]
        by_state[key] = by_state.get(key, 0) + 1
    ranked = sorted(all_peers, key=lambda p: (p.get("state") != "connected",
                                              -(_int(p.get("bytes_in")) + _int(p.get("bytes_out"))), str(p.get("peer_id"))))
    rows = []
    for p in ranked[:MAX_PEER_ROWS]:
        pid = str(p.get("peer_id", ""))
        g = by_peer.get(pid) or {}
        rows.append({"peer_id": _text(pid), "state": _text(p.get("state")), "path": _text(p.get("path")),
                     "via": _text(p.get("via")), "address": _text(p.get("address")), "rtt_ms": _num(p.get("rtt_ms"), 3),
                     "bytes_in": _int(p.get("bytes_in")), "bytes_out": _int(p.get("bytes_out")),
                     "exchanges": _int(g.get("exchanges")), "clip_rate": _num(g.get("clip_rate"), 4),
                     "banned": _text(bans[pid]) if pid in bans else None})
    return {"total": len(all_peers), "shown": len(rows), "by_state": dict(list(sorted(by_state.items()))[:16]),
            "rows": rows}


def _stage_of(st: dict) -> dict[str, int]:
    out = {}
    for entry in ((st.get("pipeline") or {}).get("stage_map") or []):
        for p in entry.get("peers") or []:
            out[str(p.get("peer_id"))] = _int(entry.get("stage"))
    return out


def graph(st: dict, topo: dict) -> dict:
    """The gossip graph as this daemon knows it (its topology view), at most MAX_GRAPH_NODES nodes: this
    daemon, its neighbours, its sessions, then the nodes of highest degree."""
    me = str(st.get("peer_id", ""))
    t = st.get("topology") or {}
    all_nodes = [str(n) for n in (topo.get("nodes") or [])]
    all_edges = [(str(e[0]), str(e[1])) for e in (topo.get("edges") or []) if len(e) == 2]
    degree: dict[str, int] = {}
    for a, b in all_edges:
        degree[a], degree[b] = degree.get(a, 0) + 1, degree.get(b, 0) + 1
    neighbours = {str(n.get("peer_id")) for n in (t.get("neighbours") or [])}
    states = {str(p.get("peer_id")): str(p.get("state")) for p in (st.get("peers") or []) if isinstance(p, dict)}
    connected = {p for p, s in states.items() if s == "connected"}
    order = sorted(set(all_nodes) | {me}, key=lambda n: (n != me, n not in neighbours, n not in connected,
                                                          -degree.get(n, 0), n))
    chosen = order[:MAX_GRAPH_NODES]
    shown = set(chosen)
    stage_of = _stage_of(st)
    nodes = [{"id": _text(n), "me": n == me, "neighbour": n in neighbours,
              "state": "self" if n == me else _text(states.get(n, "known")), "stage": stage_of.get(n),
              "degree": degree.get(n, 0)} for n in sorted(chosen)]
    links = {(str(link.get("a")), str(link.get("b"))): link for link in (topo.get("links") or []) if isinstance(link, dict)}
    edges = []
    for a, b in sorted(all_edges):
        if a in shown and b in shown and len(edges) < MAX_GRAPH_EDGES:
            link = links.get((min(a, b), max(a, b))) or {}
            edges.append({"a": _text(a), "b": _text(b), "bandwidth_bps": _num(link.get("bandwidth_bps")),
                          "rtt_s": _num(link.get("rtt_s"), 6),
                          "weight": round(metropolis_weight(max(1, degree.get(a, 0)), max(1, degree.get(b, 0))), 4)})
    return {"kind": _text(t.get("kind")), "nodes_total": len(set(all_nodes) | {me}), "edges_total": len(all_edges),
            "nodes": nodes, "edges": edges, "spectral_gap": _num(topo.get("spectral_gap", t.get("spectral_gap"))),
            "degree": _int(t.get("degree")), "moves": _int(t.get("moves")), "last_move": _text(t.get("last_move")),
            "connected_view": bool(t.get("connected_view"))}


def _curve(points: Any, most: int) -> list[list[float | None]]:
    """A curve's last `most` [time, loss, accuracy] points, each number finite or null."""
    return [[_num(x) for x in p[:3]] for p in (points if isinstance(points, list) else [])[-most:]
            if isinstance(p, list) and len(p) >= 3]


def training(st: dict) -> dict | None:
    """This daemon's trainer's figures, and the loss curves to draw: its own and those of the peers most
    recently heard, from the figures their signed records carry (`topology.peer_training`)."""
    tr = st.get("trainer")
    others = ((st.get("topology") or {}).get("peer_training") or {}).get("peers")
    others = others if isinstance(others, dict) else {}
    if not isinstance(tr, dict) and not others:
        return None
    tr = tr if isinstance(tr, dict) else {}
    me = str(st.get("peer_id", ""))
    curves = {_text(me): _curve(tr.get("curve"), MAX_POINTS + 1)} if tr else {}
    for pid, p in others.items():
        if len(curves) >= MAX_CURVES:
            break
        if isinstance(p, dict) and str(pid) != me:
            curves[_text(pid)] = _curve(p.get("curve"), PEER_CURVE_POINTS + 1)
    return {"trainer": _text(tr.get("trainer")), "state": _text(tr.get("state")), "step": _num(tr.get("step")),
            "loss": _num(tr.get("loss")), "accuracy": _num(tr.get("accuracy")),
            "samples_per_s": _num(tr.get("samples_per_s"), 3), "target_accuracy": _num(tr.get("target_accuracy")),
            # this daemon's curve first (when it trains), then the others' (`curves_total` counts them all)
            "curves": curves, "curves_total": len(others) + (1 if tr else 0)}


def _stage(v: Any) -> int | None:
    """A stage number, or None (the status says -1 or None for none)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _move(m: Any) -> dict:
    """One of this daemon's stage moves: its first few fields, each as short text (when, what, why)."""
    if not isinstance(m, dict):
        return {"what": _text(m)[:120]}
    return {str(k)[:32]: (_num(v, 3) if isinstance(v, (int, float)) and not isinstance(v, bool) else _text(v)[:120])
            for k, v in list(m.items())[:8]}


def pipeline(st: dict) -> dict | None:
    p = st.get("pipeline")
    if not p:
        return None
    smap = []
    for entry in (p.get("stage_map") or [])[:MAX_STAGES]:
        ps = entry.get("peers") or []
        smap.append({"stage": _int(entry.get("stage")), "capacity": _num(entry.get("capacity"), 3),
                     "peers_total": len(ps),
                     "peers": [{"peer_id": _text(x.get("peer_id")), "samples_per_s": _num(x.get("samples_per_s"), 3),
                                "queue": _int(x.get("queue")), "me": bool(x.get("me")),
                                "moving_to": _stage(x.get("moving_to"))}
                               for x in ps[:MAX_STAGE_PEERS]]})
    d, srv = p.get("driver") or {}, p.get("server") or {}
    moves = p.get("moves") or []
    return {"pipeline": _text(p.get("pipeline")), "stages": _int(p.get("stages")), "my_stage": _stage(p.get("my_stage")),
            "role": _text(p.get("role")), "bottleneck": _stage(p.get("bottleneck")),
            "stage_map": smap, "moves_total": len(moves), "moves": [_move(m) for m in moves[-MAX_MOVES:]],
            "driver": {k: _int(d.get(k)) for k in ("done", "retried", "failed", "resent", "in_flight")} if d else None,
            "server": {"served": _int(srv.get("served")), "failed": _int(srv.get("failed")), "queue": _int(srv.get("queue"))}}


def build(st: dict, topo: dict, *, now: float | None = None) -> dict:
    """The feed from one status (`Daemon.status()`) and its topology graph (the `topology` command's answer)."""
    bans = _bans(st)
    return {"schema": SCHEMA, "generated_at": round(time.time() if now is None else now, 3),
            "me": identity(st), "reachability": reachability(st.get("nat") or {}), "peers": peers(st, bans),
            "graph": graph(st, topo), "training": training(st), "pipeline": pipeline(st),
            "bans": {"total": len(bans), "rows": [{"peer_id": _text(p), "reason": r}
                                                  for p, r in sorted(bans.items())[:MAX_BANS]]}}


def encode(feed: dict) -> bytes:
    """Strict JSON (no NaN): what the page parses."""
    return json.dumps(feed, allow_nan=False, separators=(",", ":"), default=str).encode()

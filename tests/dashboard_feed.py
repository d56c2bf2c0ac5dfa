"""The dashboard feed's schema (peer/dashboard/feed.py), checked by the unit tests on built feeds and by the
browser tests on a real daemon's /api/status."""

from __future__ import annotations

NUM = (int, float)
OPT_NUM = (int, float, type(None))

TOP = {"schema": int, "generated_at": NUM, "me": dict, "reachability": dict, "peers": dict, "graph": dict,
       "training": (dict, type(None)), "pipeline": (dict, type(None)), "bans": dict}
ME = {"peer_id": str, "swarm": str, "version": str, "listen": str, "uptime_s": OPT_NUM, "connected": int}
REACH = {"reachability": str, "reason": str, "nat_mapping": str, "advertised": list, "relays": list,
         "punches": dict, "relaying": dict}
PEERS = {"total": int, "shown": int, "by_state": dict, "rows": list}
ROW = {"peer_id": str, "state": str, "path": str, "via": str, "address": str, "rtt_ms": OPT_NUM, "bytes_in": int,
       "bytes_out": int, "exchanges": int, "clip_rate": OPT_NUM, "banned": (str, type(None))}
GRAPH = {"kind": str, "nodes_total": int, "edges_total": int, "nodes": list, "edges": list, "spectral_gap": OPT_NUM,
         "degree": int, "moves": int, "last_move": str, "connected_view": bool}
NODE = {"id": str, "me": bool, "neighbour": bool, "state": str, "stage": (int, type(None)), "degree": int}
EDGE = {"a": str, "b": str, "bandwidth_bps": OPT_NUM, "rtt_s": OPT_NUM, "weight": NUM}
TRAINING = {"trainer": str, "state": str, "step": OPT_NUM, "loss": OPT_NUM, "accuracy": OPT_NUM,
            "samples_per_s": OPT_NUM, "target_accuracy": OPT_NUM, "curves": dict,
            "curves_total": int}
PIPELINE = {"pipeline": str, "stages": int, "my_stage": (int, type(None)), "role": str, "bottleneck": (int, type(None)),
            "stage_map": list, "moves_total": int, "moves": list, "driver": (dict, type(None)), "server": dict}
STAGE = {"stage": int, "capacity": OPT_NUM, "peers_total": int, "peers": list}
BANS = {"total": int, "rows": list}


def _keys(what: str, d: dict, spec: dict) -> None:
    assert isinstance(d, dict), (what, d)
    assert set(d) == set(spec), (what, sorted(set(d) ^ set(spec)))
    for k, tp in spec.items():
        assert isinstance(d[k], tp) and not (tp in (int, NUM) and isinstance(d[k], bool)), (what, k, d[k])


def check_feed(f: dict) -> None:
    """Every key the page reads is there with its type, and the lists are what their counts say."""
    _keys("feed", f, TOP)
    assert f["schema"] == 1
    _keys("me", f["me"], ME)
    _keys("reachability", f["reachability"], REACH)
    _keys("peers", f["peers"], PEERS)
    assert f["peers"]["shown"] == len(f["peers"]["rows"]) <= f["peers"]["total"]
    for r in f["peers"]["rows"]:
        _keys("peer row", r, ROW)
    g = f["graph"]
    _keys("graph", g, GRAPH)
    assert len(g["nodes"]) <= g["nodes_total"] and len(g["edges"]) <= g["edges_total"]
    ids = {n["id"] for n in g["nodes"]}
    for n in g["nodes"]:
        _keys("node", n, NODE)
    for e in g["edges"]:
        _keys("edge", e, EDGE)
        assert e["a"] in ids and e["b"] in ids and 0 < e["weight"] <= 1, e
    if f["training"] is not None:
        _keys("training", f["training"], TRAINING)
        assert len(f["training"]["curves"]) <= f["training"]["curves_total"]
        for points in f["training"]["curves"].values():
            for p in points:
                assert len(p) == 3 and isinstance(p[0], NUM) and all(isinstance(v, OPT_NUM) for v in p[1:]), p
    if f["pipeline"] is not None:
        _keys("pipeline", f["pipeline"], PIPELINE)
        for s in f["pipeline"]["stage_map"]:
            _keys("stage", s, STAGE)
            assert len(s["peers"]) <= s["peers_total"]
    _keys("bans", f["bans"], BANS)
    assert len(f["bans"]["rows"]) <= f["bans"]["total"]

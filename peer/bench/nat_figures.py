"""`peer bench nat`: the figures, as pure functions of daemon status dicts (tested on synthetic ones).

A "view" is one daemon's status entry for another peer (`status["peers"][i]`). Names are the bench's host
names ("public1", "lan1-a", ...); `site` maps a name to its site ("public", "lan1", ...) and `nat` a site to
its NAT ("none", "preserving", "random").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PATHS = ("direct", "punched", "relayed")
GOAL_CONNECT_S = 60.0
GOAL_PUNCHED_TO_DIRECT = 0.9  # punched within 10% of direct
GOAL_RELAY_LINK = 0.8
GOAL_DIRECT_BYTES = 0.9


def views_of(st: dict | None) -> dict[str, dict]:
    """peer ID -> this daemon's view of it."""
    return {p["peer_id"]: p for p in (st or {}).get("peers", [])}


def connected(view: dict | None) -> bool:
    return bool(view) and view.get("state") == "connected"


def pair_how(va: dict | None, vb: dict | None) -> str:
    """How a pair is connected, as both ends report it: 'punched' if either says so, else 'relayed' if
    either does, else 'direct'; 'failed' unless both list each other as connected."""
    if not (connected(va) and connected(vb)):
        return "failed"
    paths = {va.get("path"), vb.get("path")}
    for how in ("punched", "relayed"):
        if how in paths:
            return how
    return "direct"


def punchable(site_a: str, site_b: str, nat: dict[str, str]) -> bool:
    """Whether a pair can end up on a direct path: both ends public or behind a port-preserving NAT."""
    return all(nat[s] in ("none", "preserving") for s in (site_a, site_b))


@dataclass
class PairWatch:
    """First moment each pair was connected at both ends: how, and seconds from the later start."""

    names: list[str]
    first: dict[tuple[str, str], dict] = field(default_factory=dict)

    def pairs(self) -> list[tuple[str, str]]:
        return [(a, b) for i, a in enumerate(self.names) for b in self.names[i + 1:]]

    def update(self, statuses: dict[str, dict | None]) -> bool:
        """Look at one round of statuses (name -> status); True once every pair has been seen connected."""
        for a, b in self.pairs():
            if (a, b) in self.first or not statuses.get(a) or not statuses.get(b):
                continue
            sa, sb = statuses[a], statuses[b]
            va, vb = views_of(sa).get(sb["peer_id"]), views_of(sb).get(sa["peer_id"])
            how = pair_how(va, vb)
            if how == "failed":
                continue
            seconds = max(va["first_connected"], vb["first_connected"]) - max(sa["started_at"], sb["started_at"])
            self.first[(a, b)] = {"a": a, "b": b, "a_id": sa["peer_id"], "b_id": sb["peer_id"], "how": how,
                                  "seconds_to_session": round(seconds, 2)}
        return len(self.first) == len(self.pairs())

    def report(self, ids: dict[str, str]) -> list[dict]:
        """Every pair, the ones never connected as 'failed'."""
        return [self.first.get((a, b)) or {"a": a, "b": b, "a_id": ids.get(a, ""), "b_id": ids.get(b, ""),
                                           "how": "failed", "seconds_to_session": None}
                for a, b in self.pairs()]


def connect_summary(pairs: list[dict]) -> dict:
    ok = [p for p in pairs if p["how"] != "failed"]
    return {"pairs_connected_fraction": round(len(ok) / len(pairs), 3) if pairs else None,
            "max_seconds_to_session": max((p["seconds_to_session"] for p in ok), default=None),
            "pairs_by_how": {h: sum(1 for p in pairs if p["how"] == h) for h in (*PATHS, "failed")}}


def first_cross_lan_average(statuses: dict[str, dict], site: dict[str, str]) -> dict[str, float | None]:
    """For each peer behind NAT: seconds from its start to its first averaging exchange (either side
    initiating) with a peer on another LAN (not a public host); None if it had none."""
    ids = {st["peer_id"]: n for n, st in statuses.items() if st}
    out: dict[str, float | None] = {}
    for name, st in statuses.items():
        if site[name] == "public" or not st:
            continue
        firsts = [e["first_at"] for pid, e in st.get("gossip", {}).get("by_peer", {}).items()
                  if pid in ids and site[ids[pid]] not in ("public", site[name])
                  and e.get("exchanges") and e.get("first_at")]
        out[name] = round(min(firsts) - st["started_at"], 2) if firsts else None
    return out


def view_bytes(view: dict | None) -> dict[str, int]:
    by = (view or {}).get("bytes_by_path") or {}
    return {p: int(by.get(p, 0)) for p in PATHS}


@dataclass
class PeakBytes:
    """Each daemon's `bytes_by_path` for each peer, the peak per path over every poll. A pair's counts only
    grow, unless the bytes of a session that ended are not added to its total; the peak keeps them (all but
    the last poll interval's), and `lost` says where that happened."""

    ids: dict[str, str] = field(default_factory=dict)  # name -> peer ID
    peak: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)  # (name, peer ID) -> path -> bytes

    def update(self, statuses: dict[str, dict | None]) -> None:
        for name, st in statuses.items():
            if not st:
                continue
            self.ids[name] = st["peer_id"]
            for pid, view in views_of(st).items():
                old = self.peak.setdefault((name, pid), {p: 0 for p in PATHS})
                for p, n in view_bytes(view).items():
                    old[p] = max(old[p], n)

    def pair(self, a: str, b: str) -> dict[str, int]:
        """Bytes in+out by path of the pair, from a's view (each pair counted once)."""
        return dict(self.peak.get((a, self.ids.get(b, "")), {p: 0 for p in PATHS}))

    def lost(self, statuses: dict[str, dict | None]) -> list[str]:
        """'a-b: path' where the latest count is below the peak."""
        out = []
        names = {v: k for k, v in self.ids.items()}
        for name, st in statuses.items():
            for pid, view in views_of(st).items():
                now, top = view_bytes(view), self.peak.get((name, pid), {})
                out += [f"{name}-{names.get(pid, pid[:8])}: {p} {top[p] - now[p]}" for p in PATHS
                        if top.get(p, 0) > now[p]]
        return out


def direct_fraction(counts: PeakBytes, pairs: list[tuple[str, str]]) -> tuple[float | None, dict]:
    """(bytes on direct and punched paths) / (all bytes) over `pairs`, and the byte totals by path."""
    tot = {p: 0 for p in PATHS}
    for a, b in pairs:
        for p, n in counts.pair(a, b).items():
            tot[p] += n
    all_bytes = sum(tot.values())
    return (round((tot["direct"] + tot["punched"]) / all_bytes, 4) if all_bytes else None), tot


def mb_s(size_bytes: int, seconds: float) -> float:
    """An exchange's throughput: both directions' bytes over its seconds, in MB/s."""
    return 2 * size_bytes / seconds / 1e6


def relay_link_fraction(size_bytes: int, seconds: float, mbit: float) -> float:
    """A relayed exchange's share of the relay's link: the relay receives both directions on its one link."""
    return (2 * size_bytes * 8 / seconds) / (mbit * 1e6)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass
class ExchangeLog:
    """The initiator's exchanges with each peer, collected from polls of its status: every time a peer's
    `exchanges` count grows, its `last_s` is one sample, labelled with the session path it ran on. A sample
    whose session started after the exchange did (the path changed under it) is kept out, with a note."""

    counts: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[dict]] = field(default_factory=dict)
    excluded: list[dict] = field(default_factory=list)
    max_rtt_ms: dict[str, float] = field(default_factory=dict)  # heartbeat round trips seen while measuring

    def start(self, st: dict) -> None:
        """Counts at the start of measuring: exchanges before it are not samples."""
        for pid, e in st.get("gossip", {}).get("by_peer", {}).items():
            self.counts[pid] = e.get("exchanges", 0)

    def update(self, st: dict, now_wall: float) -> None:
        views = views_of(st)
        for pid, v in views.items():
            if v.get("rtt_ms") is not None:
                self.max_rtt_ms[pid] = max(self.max_rtt_ms.get(pid, 0.0), v["rtt_ms"])
        for pid, e in st.get("gossip", {}).get("by_peer", {}).items():
            n = e.get("exchanges", 0)
            if n <= self.counts.get(pid, 0):
                continue
            grew = n - self.counts.get(pid, 0)
            self.counts[pid] = n
            v = views.get(pid) or {}
            seconds = float(e.get("last_s") or 0)
            sample = {"seconds": seconds, "path": v.get("path", ""), "via": v.get("via", "")}
            began = now_wall - seconds
            if seconds <= 0 or not connected(v):
                self.excluded.append({**sample, "peer_id": pid, "why": "no session or no time"})
            elif (v.get("connected_since") or 0) > began + 0.5:
                self.excluded.append({**sample, "peer_id": pid, "why": "its session changed during the exchange"})
            else:
                if grew > 1:
                    sample["note"] = f"{grew - 1} earlier exchange(s) between polls not timed"
                self.samples.setdefault(pid, []).append(sample)

    def done(self, pids: list[str], k: int) -> bool:
        return all(len(self.samples.get(p, [])) >= k for p in pids)


def path_class(path: str, site_self: str, site_peer: str) -> str | None:
    """The throughput class of a sample: 'direct_public' (across the router to a public host), 'direct_lan'
    (to a LAN neighbour), 'punched', 'relayed'."""
    if path == "direct":
        return "direct_public" if site_peer == "public" else "direct_lan" if site_peer == site_self else None
    return path if path in ("punched", "relayed") else None


def exchange_figures(log: ExchangeLog, id_name: dict[str, str], site: dict[str, str], initiator: str,
                     expected: dict[str, str], size_bytes: int, mbit: float, final_paths: dict[str, str]) -> dict:
    """Throughput by path from the initiator's samples. `expected` names the path each peer should be on,
    `final_paths` what the initiator saw at the end; a sample counts only where all three agree."""
    by_class: dict[str, list[float]] = {}
    per_peer = []
    for pid, name in sorted(id_name.items(), key=lambda kv: kv[1]):
        if name == initiator:
            continue
        ss = log.samples.get(pid, [])
        good = [s["seconds"] for s in ss if s["path"] == expected[name] == final_paths.get(pid)]
        cls = path_class(expected[name], site[initiator], site[name])
        if cls and good:
            by_class.setdefault(cls, []).extend(good)
        med = median(good)
        via = ss[-1].get("via", "") if ss else ""
        per_peer.append({"peer": name, "peer_id": pid, "path": expected[name], "path_at_end": final_paths.get(pid, ""),
                         "via": id_name.get(via, via),
                         "class": cls, "exchanges_timed": len(good), "seconds": [round(s, 3) for s in good],
                         "median_s": round(med, 3) if med else None,
                         "mb_s": round(mb_s(size_bytes, med), 3) if med else None,
                         "max_rtt_ms": log.max_rtt_ms.get(pid),
                         "other_path_samples": [s for s in ss if s["path"] != expected[name]]})
    rate = {c: mb_s(size_bytes, m) for c, xs in by_class.items() if (m := median(xs))}
    relayed_s = median(by_class.get("relayed", []))
    public = rate.get("direct_public")
    return {
        "direct_mb_s": _r(public),
        "direct_lan_mb_s": _r(rate.get("direct_lan")),
        "punched_mb_s": _r(rate.get("punched")),
        "relayed_mb_s": _r(rate.get("relayed")),
        "punched_to_direct": _r(rate["punched"] / public) if public and rate.get("punched") else None,
        "relay_link_fraction": _r(relay_link_fraction(size_bytes, relayed_s, mbit)) if relayed_s else None,
        "link_mb_s_each_way": round(mbit / 8, 3),
        "per_peer": per_peer,
        "excluded": log.excluded,
    }


def goals(f: dict) -> dict:
    """The issue's goals, each with its figure's bound and whether this run met it."""
    ex = f.get("exchange") or {}

    def at_least(x: float | None, bound: float) -> bool:
        return x is not None and x >= bound

    connect_s = f.get("max_seconds_to_session")
    return {
        "every_pair_connected_within_60s": {
            "goal": f"pairs_connected_fraction = 1 and max_seconds_to_session <= {GOAL_CONNECT_S:g}",
            "met": f.get("pairs_connected_fraction") == 1 and connect_s is not None and connect_s <= GOAL_CONNECT_S},
        "punched_within_10pct_of_direct": {
            "goal": f"punched_to_direct >= {GOAL_PUNCHED_TO_DIRECT}",
            "met": at_least(ex.get("punched_to_direct"), GOAL_PUNCHED_TO_DIRECT)},
        "relayed_at_least_0.8_of_relay_link": {
            "goal": f"relay_link_fraction >= {GOAL_RELAY_LINK}",
            "met": at_least(ex.get("relay_link_fraction"), GOAL_RELAY_LINK)},
        "direct_bytes_at_least_90pct_where_punchable": {
            "goal": f"direct_bytes_fraction >= {GOAL_DIRECT_BYTES}",
            "met": at_least(f.get("direct_bytes_fraction"), GOAL_DIRECT_BYTES)},
    }


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)

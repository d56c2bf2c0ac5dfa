"""`peer bench nat`: real daemons in the internet lab (peer/testing/internet.py): how every pair connects
across NATs, how fast, and what each path carries.

The lab: 2 public hosts, lan1 and lan2 (2 hosts each) behind port-preserving NATs, lan3 (1 host) behind a
NAT that picks a random port per connection (so it cannot be punched); every end host's link is
tbf-limited to `--mbit` both ways. Every daemon hosts `trainers.consensus` on a full topology.

Phase 1 (connectivity): public1 (the bootstrap) starts, then the rest. Statuses are polled every 0.5 s: a
pair is connected once both ends list each other as connected; its seconds are the later first session of
the two ends minus the later start of the two daemons, its `how` the path both ends report then (punched
if either says punched, else relayed or direct). Then averaging goes on for `--settle` s more and we read
each NAT'd peer's seconds to its first averaging exchange with a peer on another LAN, and the share of
bytes on direct or punched paths (every pair's `bytes_by_path`, counted once) over the pairs that can be
punched (no lan3 end), and over all pairs for contrast.

Phase 2 (throughput by path): five of the daemons (PHASE2: both public hosts, lan1-a, lan2-a, lan3-a) restart
on their homes (they rejoin from their peer caches) with `--mib` vectors and one initiator (lan1-a), one
exchange at a time so nothing else shares the links; the LAN neighbours stay stopped, so lan1-a's random
choice of partner hits each path often enough in a few minutes. Once every pair is connected and lan1-a's
paths are the expected ones (direct to the public hosts, punched to lan2-a, relayed to lan3-a), we poll its
status and time every new exchange per peer (`gossip.by_peer[p].last_s`) until each peer has
EXCHANGES_PER_PEER of them. A sample counts only if the session it ran on is on the expected path, was there
before the exchange began, and still is at the end. The figures are in peer/bench/nat_figures.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import date

from peer.bench.hosts import DAEMON_PORT, run_root
from peer.bench.nat_figures import (ExchangeLog, PairWatch, PeakBytes, connect_summary, direct_fraction,
                                    exchange_figures, first_cross_lan_average, goals, pair_how, punchable, views_of)
from peer.testing.internet import DEFAULT_LANS, internet_available, internet_lab
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm

PREFIX = "ptn"  # lab namespaces: ptn{pid}...
POLL_S = 0.5
PHASE1_SIZE = 16384  # float32 elements: 64 KiB vectors, so averaging runs often without loading the links
PHASE2_TIMEOUT_S = 240.0  # measuring, after the paths are ready
PHASE2_START_DELAY_S = 15.0  # the initiator's first exchange: lets the punches happen on quiet links
EXCHANGES_PER_PEER = 2
INITIATOR = "lan1-a"
PHASE2 = ("public1", "public2", "lan1-a", "lan2-a", "lan3-a")
"""Phase 2's daemons: the initiator and one peer per path (two public hosts, which also relay), so its random
choice of partner hits each often enough in a few minutes. The others stay stopped."""
PHASE2_MEMBERSHIP = {"heartbeat_interval": 1.0, "dead_after": 6.0}
"""The daemon's defaults, not the swarm helper's faster failure detection (dead_after 4 s): a 64 MiB exchange
through a relay queues seconds of data ahead of the heartbeats (see docs/benchmarks.md)."""
STATUS_TIMEOUT_S = 10.0


def host_names(lab) -> dict[str, object]:
    """name -> lab host: public1, public2, lan1-a, lan1-b, ... in the lab's order."""
    out = {}
    for site in lab.sites.values():
        for j, h in enumerate(site.hosts):
            out[f"public{j + 1}" if site.name == "public" else f"{site.name}-{chr(ord('a') + j)}"] = h
    return dict(sorted(out.items(), key=lambda kv: kv[1].index))


class Bench:
    def __init__(self, args, lab, swarm: LocalSwarm):
        self.args, self.lab, self.swarm = args, lab, swarm
        self.hosts = host_names(lab)
        self.names = list(self.hosts)
        self.site = {n: lab.site_of(h).name for n, h in self.hosts.items()}
        self.nat = {s.name: s.nat for s in lab.sites.values()}
        self.daemons: dict = {}
        self.swarm_name = unique_swarm("nat")
        self.bootstrap = f"{self.hosts['public1'].ip}:{DAEMON_PORT}"
        self._pool = ThreadPoolExecutor(len(self.names))
        self.t0 = time.monotonic()
        self.notes: list[str] = []

    def config(self, name: str, options: dict, gossip: dict | None = None, membership: dict | None = None):
        return swarm_config(swarm=self.swarm_name, listen=f"0.0.0.0:{DAEMON_PORT}", interfaces=[],
                            join=[] if name == "public1" else [self.bootstrap],
                            topology={"kind": "full", "max_degree": 8}, gossip=gossip, membership=membership,
                            trainer="trainers.consensus", options={**options, "world": len(self.names)})

    def poll(self, names: list[str] | None = None) -> dict[str, dict | None]:
        names = names or self.names

        def one(name: str):
            d = self.daemons[name]
            d.check_alive()
            return d.try_status(timeout=STATUS_TIMEOUT_S)
        return dict(zip(names, self._pool.map(one, names)))

    def ids(self, sts: dict) -> dict[str, str]:
        return {n: st["peer_id"] for n, st in sts.items() if st}

    # ---- phase 1 -------------------------------------------------------------------------------------
    def phase1(self) -> dict:
        opts = {"size": PHASE1_SIZE, "rounds": 0, "mode": "one", "interval": 0.2, "track_error": False}
        for i, name in enumerate(self.names):
            self.daemons[name] = self.swarm.start(name, config=self.config(name, opts), host=self.hosts[name],
                                                  env=rank_env(i, len(self.names)))
        watch = PairWatch(self.names)
        peak = PeakBytes()
        t_start = time.monotonic()
        while True:
            sts = self.poll()
            peak.update(sts)
            if watch.update(sts) or time.monotonic() - t_start > self.args.connect_timeout:
                break
            time.sleep(POLL_S)
        connect_s = time.monotonic() - t_start
        while time.monotonic() - t_start < connect_s + self.args.settle:
            time.sleep(POLL_S)
            sts = self.poll()
            peak.update(sts)
            watch.update(sts)  # late pairs still get their (over-the-limit) seconds
        ids = self.ids(sts)
        pairs = watch.report(ids)
        for p in pairs:  # the path after settling beside the one at first session, and the bytes by path
            a, b = p["a"], p["b"]
            p["how_at_end"] = pair_how(views_of(sts[a]).get(ids.get(b)), views_of(sts[b]).get(ids.get(a)))
            p["bytes_by_path"] = peak.pair(a, b)
        possible = [(a, b) for a, b in watch.pairs() if punchable(self.site[a], self.site[b], self.nat)]
        frac, by_path = direct_fraction(peak, possible)
        frac_all, by_path_all = direct_fraction(peak, watch.pairs())
        lost = peak.lost(sts)
        if lost:
            self.notes.append(f"bytes_by_path fell between polls for {len(lost)} pair(s) (bytes of an ended session "
                              f"not added to the pair's total): the figures use each path's peak; {lost[:4]}")
        cross = first_cross_lan_average(sts, self.site)
        relayed_by_relays = sum((((st or {}).get("nat") or {}).get("relay_server") or {}).get("bytes_relayed", 0)
                                for n, st in sts.items() if self.site[n] == "public")
        return {
            "pairs": pairs, **connect_summary(pairs),
            "seconds_to_first_cross_lan_average": cross,
            "max_seconds_to_first_cross_lan_average": (max(cross.values()) if cross and None not in cross.values()
                                                       else None),
            "direct_bytes_fraction": frac, "direct_bytes_fraction_all_pairs": frac_all,
            "bytes_by_path_punchable_pairs": by_path, "bytes_by_path_all_pairs": by_path_all,
            # the relays' own count of what they forwarded, against the pairs' relayed bytes just above
            "relays_bytes_relayed": relayed_by_relays,
            "peers": [self.peer_summary(n, sts[n]) for n in self.names],
            "phase1_s": round(time.monotonic() - t_start, 1),
        }

    def peer_summary(self, name: str, st: dict | None) -> dict:
        nat = (st or {}).get("nat") or {}
        rs = nat.get("relay_server") or {}
        return {"name": name, "peer_id": (st or {}).get("peer_id"), "site": self.site[name],
                "nat": self.nat[self.site[name]], "reachability": nat.get("reachability"),
                "nat_mapping": nat.get("nat_mapping"), "relays_held": len(nat.get("relays") or []),
                "relay_server": {k: rs.get(k) for k in ("offering", "reservations", "circuits_total", "bytes_relayed",
                                                        "refused")},
                "punches": {k: (nat.get("punches") or {}).get(k) for k in ("attempts", "succeeded", "failed")},
                "reason": nat.get("reason"),
                "evidence": [{"address": e.get("address"), "ok": e.get("ok"), "asked": e.get("peer_id", "")[:8]}
                             for e in nat.get("evidence") or []],
                "exchanges": ((st or {}).get("gossip") or {}).get("exchanges")}

    # ---- phase 2 -------------------------------------------------------------------------------------
    def expected_path(self, name: str) -> str:
        s, mine = self.site[name], self.site[INITIATOR]
        if s == "public" or s == mine:
            return "direct"
        return "punched" if punchable(s, mine, self.nat) else "relayed"

    def phase2(self) -> dict:
        t_start = time.monotonic()
        self.swarm.stop()
        size = self.args.mib * (1 << 20) // 4
        gossip = {"exchange_timeout": max(60.0, 8 * 4 * size * 8 / (self.args.mbit * 1e6))}  # 4x the relayed ideal
        names = list(PHASE2)
        for name in names:
            me = name == INITIATOR
            opts = {"size": size, "rounds": 0, "mode": "one", "interval": 0.0, "track_error": False,
                    "initiate": me, "start_delay": min(PHASE2_START_DELAY_S, self.args.settle) if me else 0.0}
            self.swarm.restart(self.daemons[name], config=self.config(name, opts, gossip, PHASE2_MEMBERSHIP))
        expected = {n: self.expected_path(n) for n in names if n != INITIATOR}
        watch = PairWatch(names)
        deadline = time.monotonic() + self.args.connect_timeout + 60
        ready = False
        while time.monotonic() < deadline:
            sts = self.poll(names)
            ids = self.ids(sts)
            views = views_of(sts[INITIATOR])
            on_path = all(views.get(ids.get(n), {}).get("path") == p for n, p in expected.items())
            if watch.update(sts) and on_path and len(ids) == len(names):
                ready = True
                break
            time.sleep(POLL_S)
        ready_s = time.monotonic() - t_start
        if not ready:
            self.notes.append(f"phase 2: after {ready_s:.0f} s not every pair was connected on its expected path; "
                              f"measured anyway")
        ids = self.ids(sts)
        id_name = {v: k for k, v in ids.items()}
        log = ExchangeLog()
        log.start(sts[INITIATOR])
        others = [ids[n] for n in expected if n in ids]
        t_measure = time.monotonic()
        while time.monotonic() - t_measure < PHASE2_TIMEOUT_S and not log.done(others, EXCHANGES_PER_PEER):
            time.sleep(POLL_S)
            st = self.daemons[INITIATOR].try_status(timeout=STATUS_TIMEOUT_S)
            if st:
                log.update(st, time.time())
        if not log.done(others, EXCHANGES_PER_PEER):
            self.notes.append(f"phase 2: not every peer had {EXCHANGES_PER_PEER} timed exchanges within "
                              f"{PHASE2_TIMEOUT_S:.0f} s")
        sts = self.poll(names)
        final = {p["peer_id"]: p.get("path", "") for p in (sts[INITIATOR] or {}).get("peers", [])
                 if p.get("state") == "connected"}
        ex = exchange_figures(log, id_name, self.site, INITIATOR, expected, size * 4, self.args.mbit, final)
        ex["relay"] = [self.peer_summary(n, sts[n])["relay_server"] | {"name": n}
                       for n in names if self.site[n] == "public"]
        ex["daemons"] = names
        ex["failed_exchanges"] = ((sts[INITIATOR] or {}).get("gossip") or {}).get("failed")
        ex["ready_s"] = round(ready_s, 1)
        ex["measure_s"] = round(time.monotonic() - t_measure, 1)
        return ex


def human(out: dict) -> str:
    lines = [f"peer bench nat: {out['config']['mbit']} Mbit links, {out['config']['mib']} MiB exchanges "
             f"({out['wall_s']} s)", "", f"{'pair':<22} {'how':<9} {'s to session':>12}"]
    for p in out["pairs"]:
        s = p["seconds_to_session"]
        lines.append(f"{p['a'] + ' - ' + p['b']:<22} {p['how']:<9} {'-' if s is None else f'{s:.1f}':>12}")
    ex = out.get("exchange") or {}
    lines += ["", f"pairs connected {out['pairs_connected_fraction']}, max {out['max_seconds_to_session']} s; "
              f"first cross-LAN average max {out['max_seconds_to_first_cross_lan_average']} s",
              f"direct bytes {out['direct_bytes_fraction']} (all pairs {out['direct_bytes_fraction_all_pairs']})",
              f"MB/s: direct {ex.get('direct_mb_s')}, punched {ex.get('punched_mb_s')}, "
              f"relayed {ex.get('relayed_mb_s')}; punched/direct {ex.get('punched_to_direct')}, "
              f"relay link {ex.get('relay_link_fraction')}", ""]
    lines += [f"{'met' if g['met'] else 'MISSED':<7} {k} ({g['goal']})" for k, g in out["goals"].items()]
    lines += [f"note: {n}" for n in out["notes"]]
    return "\n".join(lines)


def check_args(args) -> str | None:
    if not args.mbit > 0:
        return "--mbit must be positive"
    if not 1 <= args.mib <= 1024:
        return "--mib must be in 1..1024"
    if not args.connect_timeout > 0:
        return "--connect-timeout must be positive"
    if not 0 <= args.settle <= 3600:
        return "--settle must be in 0..3600 seconds"
    return None


def run(args) -> int:
    problem = check_args(args)
    if problem:
        print(f"peer bench nat: {problem}", file=sys.stderr)
        return 2
    if not internet_available():
        print("peer bench nat needs root, iproute2 and iptables (NAT rules in network namespaces); "
              "run it as root on Linux", file=sys.stderr)
        return 2
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    out: dict = {"bench": "nat", "date": date.today().isoformat(),
                 "config": {"mbit": args.mbit, "mib": args.mib, "connect_timeout": args.connect_timeout,
                            "public": 2, "lans": [list(x) for x in DEFAULT_LANS], "initiator": INITIATOR,
                            "phase1_vector_bytes": PHASE1_SIZE * 4, "phase1_extra_s": args.settle,
                            "exchanges_per_peer": EXCHANGES_PER_PEER}}
    ok = False
    with ExitStack() as stack:
        root = run_root(stack, args.logs, "peertrain-nat-")
        lab = stack.enter_context(internet_lab(lans=DEFAULT_LANS, prefix=PREFIX, rate_mbit=args.mbit))
        swarm = stack.enter_context(LocalSwarm(root))
        b = Bench(args, lab, swarm)
        p1 = b.phase1()
        out.update({k: v for k, v in p1.items() if k != "peers"})
        out["peers"] = p1["peers"]
        out["exchange"] = b.phase2()
        out["notes"] = b.notes + [
            f"phase 2 runs {', '.join(PHASE2)} only: with the LAN neighbours stopped, each of the initiator's "
            f"peers is a different path and its random partner choice times each {EXCHANGES_PER_PEER} times in "
            "about 3 minutes (with all 7, ~5 minutes); membership at the daemon's defaults (dead_after 6 s)",
            "bytes_by_path counts every byte of a pair's sessions (averaging, heartbeats, peer exchange); "
            "relayed bytes before a punch succeeded count against direct_bytes_fraction",
            "direct_mb_s is to the public hosts (across the router, like a punched path); direct_lan_mb_s to "
            "the LAN neighbour",
            "mb_s counts both directions of an exchange (2 x size / seconds); each link carries "
            f"{args.mbit / 8:.2f} MB/s each way"]
        ok = out["pairs_connected_fraction"] == 1 and out["exchange"]["direct_mb_s"] is not None
        if not ok:
            print(swarm.log_tails(40), file=sys.stderr)
    out["goals"] = goals(out)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["load_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out) if args.json else human(out))
    return 0 if ok else 1

"""`peer bench sybil`: what colluders and many cheap keys do to the defences, each attack run in-process against
the real rules (issue 40). Simulated: no daemons, no sockets; the figures say what the rules allow, not what a
swarm of real daemons measured (the byzantine bench runs lying daemons: `peer bench byzantine`).

  * radius ratchet: two colluders among 8 averaging peers (degree 4) answer each partner with its own model
    moved 3.9 of its radii along one direction (peer/testing/averaging_sim.py); the largest radius honest peers
    announce, with them and in the same swarm without them (`radius_ratchet_max_ratio`, goal <= 2);
  * eclipse: 16 keys from 2 /24s ask a peer for urgent edges and say they are short, one a second for ten
    simulated minutes; 400 of their entries flood its passive view; forged walk ends aim its answers at a third
    party (peer/testing/views_attacks.py);
  * colluding stage servers: two servers of a stage answer alike, 1.5x (gross) or 1.05x (subtle); a driver's
    checks (peer/testing/verify_sim.py) at a stage it serves itself and at one it does not, over `--seeds` seeds;
  * ban flush: a live ban, then 2,000 strikes from fresh keys against the ban list (peer/averaging/bans.py).
"""

from __future__ import annotations

import json
import logging
import random
import time

GOALS = {
    "radius_ratchet_max_ratio": ("<=", 2.0),
    "eclipse_honest_active_fraction_min": (">=", 0.5),
    "colluding_servers_banned": ("==", True),
    "honest_servers_banned": ("==", 0),
    "ban_flush_lifted": ("==", False),
}
GROSS_LIE = 1.5  # outputs times 1.5: past verify.GROSS_NORM (log 1.5 = 0.41 > 0.2), what our own answer judges alone
SUBTLE_LIE = 1.05  # within what honest pairs differ by in real swarms: only a majority of three tells it
MICROBATCHES = 200  # per colluding-servers run: a stage's checks calibrate in ~10 and ban a liar within ~30
FLUSH_STRIKES = 2000  # fresh keys' strikes against a full ban list (MAX_TRACKED is 1024)


def ratchet(seeds: int) -> dict:
    from peer.testing.averaging_sim import ratchet_run

    honest, to_liars = [], []
    for seed in range(seeds):
        base_h, base_l, _ = ratchet_run(False, seed)
        att_h, att_l, struck = ratchet_run(True, seed)
        honest.append(att_h / base_h)
        to_liars.append(att_l / base_l)
    return {"radius_ratchet_max_ratio": round(max(honest), 2),
            "radius_to_colluders_max_ratio": round(max(to_liars), 2)}


def eclipse() -> dict:
    from peer.testing.views_attacks import forged_walk_ends, passive_flood, urgent_short_eclipse

    urgent = urgent_short_eclipse(seconds=600, keys=16, prefixes=2)
    flood = passive_flood(entries=400, prefixes=2)
    forged = forged_walk_ends(messages=100, seconds=1.0)
    return {"eclipse_honest_active_fraction_min": urgent["honest_active_fraction_min"],
            "eclipse_honest_edges_left": f"{urgent['honest_edges_left']} of {urgent['honest_edges_at_start']}",
            "passive_attacker_entries": f"{flood['attacker_passive_entries']} of {flood['passive_size']}",
            "forged_walk_ends_answered": f"{forged['answers_sent']} of {forged['forged_origins']} in 1 s"}


def colluding_servers(seeds: int) -> dict:
    from peer.testing.verify_sim import drive, inline_compute, pipeline

    layouts = {"stage_we_serve": [("me", 1.0), ("h2", 1.0), ("l1", GROSS_LIE), ("l2", GROSS_LIE)],
               "stage_we_serve_subtle": [("me", 1.0), ("h2", 1.0), ("l1", SUBTLE_LIE), ("l2", SUBTLE_LIE)],
               "stage_we_do_not_serve": [("h1", 1.0), ("h2", 1.0), ("h3", 1.0), ("l1", SUBTLE_LIE), ("l2", SUBTLE_LIE)]}
    out: dict = {}
    for name, stage in layouts.items():
        runs = []
        for seed in range(seeds):
            with inline_compute():
                driver, _ = pipeline({0: [("s0", 1.0)], 1: stage, 2: [("s2", 1.0)]})
                driver.verifier.rng = random.Random(seed)
                drive(driver, MICROBATCHES)
            banned = set(driver.verifier.stats.banned)
            runs.append({"colluders_banned": sorted(banned & {"l1", "l2"}),
                         "honest_banned": sorted(banned - {"l1", "l2"})})
        out[name] = runs
    served = out["stage_we_serve"]
    return {"colluding_servers_banned": all(r["colluders_banned"] == ["l1", "l2"] for r in served),
            "honest_servers_banned": sum(len(r["honest_banned"]) for r in served),
            "subtle_colluders_banned_at_a_stage_we_serve": sum(r["colluders_banned"] == ["l1", "l2"]
                                                                for r in out["stage_we_serve_subtle"]),
            "honest_servers_banned_at_stages_we_do_not_serve": sum(len(r["honest_banned"])
                                                                    for r in out["stage_we_do_not_serve"]),
            "runs": out}


def ban_flush() -> dict:
    from peer.averaging.bans import BAN_AFTER, BanList

    bans = BanList()
    for i in range(BAN_AFTER):
        bans.strike("liar", "a lie", float(i))
    for k in range(FLUSH_STRIKES):
        bans.strike(f"key{k}", "a cheap strike", 10.0 + k * 1e-3)
    return {"ban_flush_lifted": bans.banned("liar", 20.0) is None}


def met(figures: dict) -> dict:
    ops = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b, "==": lambda a, b: a == b}
    return {k: ops[op](figures[k], want) for k, (op, want) in GOALS.items() if k in figures}


def run(args) -> int:
    t0 = time.monotonic()
    quiet = logging.getLogger("peertrain")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the checks' verdicts, by the hundred: the JSON says what they came to
    figures: dict = {"simulated": True, "seeds": args.seeds}
    try:
        for part in (lambda: ratchet(args.seeds), eclipse, lambda: colluding_servers(args.seeds), ban_flush):
            figures.update(part())
    finally:
        quiet.setLevel(level)
    figures["goals"] = {k: f"{op} {want}" for k, (op, want) in GOALS.items()}
    figures["met"] = met(figures)
    figures["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(figures, indent=None if args.json else 2))
    return 0

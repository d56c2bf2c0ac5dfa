"""Attacks by many keys from few addresses on one peer's partial views (peer/membership/views.py), driven
in-process against a real `Views`: the views tests' and `peer bench sybil`'s eclipse. No daemons: the attackers'
messages are handed to `Views.handle` as its driver would, after `view_messages.check` (each names its sender)."""

from __future__ import annotations

import random

from peer.membership.views import Send, ViewConfig, Views
from peer.topology.local_rewire import LocalRewireConfig
from protocol.schema.views import Entry, Join, JoinWalk, NeighbourRequest, Seek, Shuffle, Status

QUIET = ViewConfig(rewire=LocalRewireConfig(interval=1e6))  # no rewiring moves: what the attack does, alone
ATTACKER_PREFIXES = ("203.0.113", "192.0.2")  # documentation /24s: the attackers' addresses


def honest_entry(i: int) -> Entry:
    """An honest peer, each in a /24 of its own."""
    return Entry(f"honest{i:014d}", (f"198.51.{i % 250 + 1}.7:7100",))


def key_entry(k: int, prefixes: int = 2) -> Entry:
    """The attacker's k-th key, at an address in one of `prefixes` /24s."""
    return Entry(f"sybil{k:015d}", (f"{ATTACKER_PREFIXES[k % prefixes]}.{k % 250 + 1}:7100",))


def urgent_short_eclipse(*, seconds: int = 600, keys: int = 16, prefixes: int = 2, seed: int = 0,
                         cfg: ViewConfig = QUIET) -> dict:
    """A victim at its target degree of honest neighbours; each second one of `keys` fresh keys asks it for an
    edge as urgent (below min_degree: taken above the target), sends it a seek walk's end naming another key
    (a peer one edge short: one above the target hands it a neighbour), and every key that is a neighbour says
    in its Status that it is short (one edge), for `seconds`. Returns the smallest share of honest neighbours
    seen, and the honest edges left at the end."""
    me = Entry("victim" + "0" * 14, ("198.51.100.1:7100",))
    v = Views(me, cfg, random.Random(seed))
    honest = [honest_entry(i) for i in range(1, cfg.target_degree + 1)]
    for h in honest:
        v.handle(h.peer_id, NeighbourRequest(h, cfg.target_degree - 1, False), 0.0)
        v.handle(h.peer_id, Status(cfg.target_degree, (me,), None), 0.0)
    attackers = [key_entry(k, prefixes) for k in range(keys)]
    honest_ids = {h.peer_id for h in honest}
    fraction = 1.0
    for t in range(1, seconds + 1):
        key = attackers[t % len(attackers)]
        v.handle(key.peer_id, NeighbourRequest(key, 0, True), float(t))
        v.handle(key.peer_id, Seek(attackers[(t + 1) % len(attackers)], 0), float(t))
        for p in [p for p in v.active if p.startswith("sybil")]:
            v.handle(p, Status(1, (me,), None), float(t))
        v.tick(float(t))
        fraction = min(fraction, sum(p in honest_ids for p in v.active) / max(1, len(v.active)))
    return {"honest_active_fraction_min": round(fraction, 3),
            "honest_edges_left": sum(p in honest_ids for p in v.active), "honest_edges_at_start": len(honest)}


def passive_flood(*, entries: int = 400, prefixes: int = 2, seed: int = 0, cfg: ViewConfig = QUIET) -> dict:
    """A full passive view of honest entries, each from its own /24; `entries` of the attacker's keys from
    `prefixes` /24s arrive, half in shuffles' samples, half as joiners. Returns how many places they hold."""
    v = Views(Entry("victim" + "0" * 14, ("198.51.100.1:7100",)), cfg, random.Random(seed))
    for i in range(1, cfg.passive_size + 1):
        v.learn(honest_entry(i))
    keys = [key_entry(k, prefixes) for k in range(entries)]
    for t in range(0, entries, 8):
        v.handle(keys[t].peer_id, Shuffle(keys[t], 0, tuple(keys[t + 1:t + 4]), 0), float(t))
        for k in keys[t + 4:t + 8]:
            v.handle(k.peer_id, Join(k), float(t))
    return {"attacker_passive_entries": sum(p.startswith("sybil") for p in v.passive),
            "passive_size": len(v.passive)}


def forged_walk_ends(*, messages: int = 100, seconds: float = 1.0, cfg: ViewConfig = QUIET) -> dict:
    """One neighbour forwards `messages` forged walk ends (a shuffle's and a join walk's each) within `seconds`,
    each naming another 'origin' at an address of a third party: each answer may be a dial there. Returns how
    many answers went out, and how many the bound held back."""
    v = Views(Entry("victim" + "0" * 14, ("198.51.100.1:7100",)), cfg, random.Random(0))
    forger = honest_entry(1)
    sent = 0
    for i in range(messages):
        origin = Entry(f"target{i:014d}", (f"192.0.2.{i % 250 + 1}:22",))
        now = seconds * i / messages
        out = v.handle(forger.peer_id, Shuffle(origin, 0, (), 4), now) + v.handle(forger.peer_id, JoinWalk(origin, 0), now)
        sent += sum(1 for a in out if isinstance(a, Send) and a.to.peer_id.startswith("target"))
    return {"forged_origins": 2 * messages, "answers_sent": sent, "held_back": v.forwarded_refused}

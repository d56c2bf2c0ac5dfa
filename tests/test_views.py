"""Partial views (peer/membership/views.py): bounded under any events, degree-preserving joins, swaps and leaves,
the repairs after failures, and the checks on what a peer may send. Swarm-sized scenarios are in
tests/test_scale_sim.py."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.bench.scale_sim import SimConfig, Simulator
from peer.membership.view_messages import BadMessage, check, wire_size
from peer.membership.views import MAX_SEEKERS, EdgeDown, EdgeUp, NeedContact, Send, ViewConfig, Views
from peer.testing.views_attacks import forged_walk_ends, passive_flood, urgent_short_eclipse
from peer.topology.local_gap import GapConfig
from peer.topology.local_rewire import LocalRewireConfig
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.views import (MAX_ENTRIES, Disconnect, Entry, Join, JoinReply, JoinWalk, NeighbourReply,
                                   NeighbourRequest, Seek, Shuffle, ShuffleReply, Status, SwapReply, SwapRequest,
                                   WalkEnd)

CFG = ViewConfig()
QUIET = ViewConfig(rewire=LocalRewireConfig(interval=1e6))  # no rewiring: a join's or a leave's own effect
STATE_LIMIT = 64 * 1024  # the per-peer state goal: what any sequence of events must stay under


def entry(i: int) -> Entry:
    return Entry(f"peer{i:016d}", (f"198.51.100.{i % 250 + 1}:7100",))


def assert_bounded(v: Views) -> None:
    c = v.cfg
    assert len(v.active) <= c.max_degree
    assert len(v.passive) <= c.passive_size
    assert len(v.pending) <= c.target_degree
    assert len(v.expected) <= c.max_degree
    assert len(v.leads) <= c.max_leads
    assert len(v.backoff) <= c.passive_size + c.max_leads
    assert len(v.seekers) <= MAX_SEEKERS
    assert not (set(v.active) & set(v.passive))
    assert v.me.peer_id not in v.active and v.me.peer_id not in v.passive
    assert v.state_bytes() < STATE_LIMIT


def swarm(n: int, seed: int = 0, settle: float = 60.0, cfg: ViewConfig = CFG) -> Simulator:
    """n simulated peers, joined one by one through a random live peer, then `settle` quiet seconds."""
    sim = Simulator(cfg, GapConfig(), SimConfig(seed=seed))
    first = sim.spawn()
    sim.join(first, None, measure=False)
    while len(sim.alive) < n:
        sim.run_until(sim.now + 0.2)
        p = sim.spawn()
        sim.join(p, sim.random_alive(exclude=p), measure=False)
    sim.run_until(sim.now + settle)
    return sim


def degrees(sim: Simulator) -> dict[str, int]:
    return {p.pid: p.views.degree for p in sim.alive}


def consistent(sim: Simulator) -> bool:
    """Every edge is listed by both its ends."""
    return all(p.pid in sim.peers[q].views.active for p in sim.alive for q in p.views.active)


def settled(sim: Simulator, want: dict[str, int], within: float) -> bool:
    """Run until every degree is as in `want` and every edge consistent (True), or `within` seconds pass."""
    end = sim.now + within
    while True:
        if degrees(sim) == want and consistent(sim):
            return True
        if sim.now >= end:
            return False
        sim.run_until(sim.now + 1)


def regular_swarm(n: int, seed: int) -> Simulator:
    """A swarm without rewiring, once it is 4-regular (its last joins' repairs done)."""
    sim = swarm(n, seed=seed, cfg=QUIET)
    assert settled(sim, {p: 4 for p in degrees(sim)}, within=120)
    return sim


# ---- the rules on their own ---------------------------------------------------------------------------

def test_view_config_is_range_checked():
    for bad in (dict(min_degree=5), dict(max_degree=3), dict(max_degree=33, target_degree=4), dict(passive_size=0),
                dict(walk_length=17), dict(shuffle_interval=float("nan")), dict(retry_after=-1.0),
                dict(shuffle_active=20, shuffle_passive=20), dict(split_cooldown=float("inf"))):
        with pytest.raises(ValueError):
            ViewConfig(**bad)


def test_messages_are_checked_against_their_sender_and_bounds():
    me = entry(1)
    check(NeighbourRequest(me, 3, False), me.peer_id)
    with pytest.raises(BadMessage, match="not the sender"):
        check(NeighbourRequest(me, 3, False), entry(2).peer_id)
    # the bounds are the schema's: a message out of them cannot be built (nor decoded: below)
    for bad in (lambda: JoinReply(tuple(entry(i) for i in range(MAX_ENTRIES + 1))),
                lambda: JoinWalk(me, 17), lambda: Seek(me, -1), lambda: NeighbourReply(True, 1 << 20),
                lambda: NeighbourRequest(me, 3, False, "x" * 65),
                lambda: Status(3, (), float("nan")), lambda: Status(3, (), 0.0),
                lambda: Disconnect(Entry("", ())), lambda: Disconnect(Entry("x" * 65, ())),
                lambda: Shuffle(me, 0, (Entry("p", tuple(f"a{i}" for i in range(5))),), 4),
                lambda: Shuffle(me, 0, (Entry("p", ("a" * 263,)),), 4)):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError, match="expected bool"):  # a field of the wrong type: refused on the way out
        DEFAULT_REGISTRY.encode(NeighbourReply(1, 3))  # type: ignore[arg-type]
    with pytest.raises(BadMessage, match="not a view message"):
        check(object(), me.peer_id)


def test_wire_size_is_the_framed_envelope():
    msg = Shuffle(entry(1), 0, tuple(entry(i) for i in range(7)), 4)
    encoded = len(DEFAULT_REGISTRY.encode(msg))
    # a u32 request id instead of 0 (4 bytes more), a frame header (9) and tag (16)
    assert wire_size(msg) == encoded + 4 + 9 + 16
    assert wire_size(Disconnect(None)) < 80


def test_a_join_into_a_regular_swarm_splits_edges_and_changes_no_other_degree():
    sim = regular_swarm(40, seed=3)
    before = degrees(sim)
    p = sim.spawn()
    sim.join(p, sim.random_alive(exclude=p))
    sim.run_until(sim.now + 20)
    after = degrees(sim)
    assert after[p.pid] == 4
    assert {q: after[q] for q in before} == before
    assert consistent(sim)
    assert p.connected_at is not None and p.connected_at - p.joined_at < 10


def test_a_graceful_leave_pairs_the_neighbours_up():
    sim = regular_swarm(40, seed=4)
    before = degrees(sim)
    p = sim.random_alive()
    sim.leave(p)
    assert settled(sim, {q: d for q, d in before.items() if q != p.pid}, within=10)


def test_a_crash_is_repaired_by_the_lost_neighbours_other_neighbours():
    sim = regular_swarm(60, seed=5)
    p = sim.random_alive()
    orphans = set(p.views.active)
    sim.crash(p)
    # the orphans pair up by sorted ID as soon as they notice, before any seek walk (10 s) could help
    end, whole = sim.now + sim.cfg.detect_s * 1.2 + 2, False
    while sim.now < end and not whole:
        sim.run_until(sim.now + 0.2)
        whole = all(sim.peers[q].views.degree == 4 for q in orphans)
    assert whole
    assert settled(sim, {q.pid: 4 for q in sim.alive}, within=30)  # and the repair edges mixed away


def test_rewiring_swaps_keep_every_degree():
    sim = regular_swarm(60, seed=6)
    before = degrees(sim)
    busy = ViewConfig(rewire=LocalRewireConfig(mix_probability=1.0, interval=5.0))
    for p in sim.alive:  # every peer mixes every ~5 s for a while
        p.views.cfg = busy
        p.views._next_rewire = sim.now + sim.rng.uniform(0, 5)
        sim._schedule_tick(p)
    sim.run_until(sim.now + 30)
    assert sum(sum(p.views.moves.values()) for p in sim.alive) >= 60
    for p in sim.alive:
        p.views.cfg = QUIET
        p.views._next_rewire = float("inf")
    assert settled(sim, before, within=120)


def test_a_peer_one_edge_short_finds_another_by_a_seek_walk():
    sim = regular_swarm(60, seed=7)
    a, b = sim.alive[3], sim.alive[17]
    # take one edge from each of a and b by hand (their neighbours keep theirs): both are one short
    for p in (a, b):
        q = next(iter(p.views.active))
        sim.peers[q].views.active.pop(p.pid)
        p.views.active.pop(q)
        for x in (p, sim.peers[q]):
            x.views._next_seek = sim.now
    a.views._repair(sim.now)
    for p in (a, b, *(sim.peers[q] for q in a.views.active)):
        sim._apply(p, p.views.tick(sim.now))
    sim.run_until(sim.now + 60)
    assert a.views.degree == 4 and b.views.degree == 4
    assert sum(1 for d in degrees(sim).values() if d != 4) <= 2 and consistent(sim)


def test_a_peer_with_nobody_left_to_ask_says_so_now_and_then():
    v = Views(entry(0), CFG, random.Random(0))
    v.join(entry(1), 0.0)
    v.unreachable(entry(1).peer_id, 5.0)  # the contact is gone, and with it all I knew
    said = [t for t in range(6, 120) if any(isinstance(a, NeedContact) for a in v.tick(float(t)))]
    assert said and said[0] <= 10 and all(b - a >= CFG.retry_after for a, b in zip(said, said[1:]))
    v.join(entry(2), 120.0)  # the daemon's answer: join again through another contact
    assert not any(isinstance(a, NeedContact) for t in range(121, 125) for a in v.tick(float(t)))


def test_unsolicited_answers_change_nothing():
    v = Views(entry(0), CFG, random.Random(0))
    stranger = entry(99)
    for msg in (NeighbourReply(True, 4), SwapReply(True, 4, entry(5)), ShuffleReply((entry(7),), 4),
                JoinReply((entry(8),)), WalkEnd(stranger)):
        v.handle(stranger.peer_id, msg, 1.0)
    assert not v.active and not v.expected
    assert "peer0000000000000007" not in v.passive and "peer0000000000000008" not in v.passive


def test_a_status_heals_an_edge_that_only_one_end_counts():
    """A Disconnect lost with a session leaves one end counting the edge: the next Status settles it."""
    from peer.membership.views import Neighbour

    me, them, other = entry(0), entry(1), entry(2)
    v = Views(me, QUIET, random.Random(0))
    # they count us, we do not: we tell them so
    out = v.handle(them.peer_id, Status(3, (me, other), None), 1.0)
    assert any(isinstance(a, Send) and isinstance(a.msg, Disconnect) and a.to.peer_id == them.peer_id for a in out)
    # we count them, they do not: the edge goes, and the repair looks for another
    v.active[them.peer_id] = Neighbour(them, 3, 0.0)
    out = v.handle(them.peer_id, Status(3, (other,), None), 2.0)
    assert them.peer_id not in v.active
    assert EdgeDown(them.peer_id, "not in their view") in out
    # a Status that lists us from a neighbour: just its figures
    v.active[them.peer_id] = Neighbour(them, 3, 0.0)
    assert not v.handle(them.peer_id, Status(5, (me, other), 1e9), 3.0) and v.active[them.peer_id].degree == 5


def test_keys_that_ask_urgently_and_say_they_are_short_take_no_honest_edge():
    """Issue 40's eclipse by the sender's word: 16 fresh keys from 2 /24s, one a second for ten minutes, each
    asking for an edge as urgent (below min_degree: taken above the target) and then saying in its Status that
    it is short. Any edge could be handed to a short neighbour, so each such key took one of the victim's honest
    edges: all four were gone within a minute. The edge handed over or dropped is now the youngest: the keys
    only hand each other on, and every honest edge stays."""
    got = urgent_short_eclipse(seconds=600, keys=16, prefixes=2)
    assert got["honest_edges_left"] == got["honest_edges_at_start"] and got["honest_active_fraction_min"] >= 0.8, got


def test_keys_from_two_prefixes_push_out_only_their_own_passive_entries():
    """A full passive view of honest entries from 30 prefixes; 400 entries of fresh keys from 2 /24s arrive by
    shuffles and joins. Evicting at random, they held every place; now only what their prefixes held."""
    got = passive_flood(entries=400, prefixes=2)
    assert got["passive_size"] == CFG.passive_size and got["attacker_passive_entries"] <= 4, got


def test_sends_that_only_a_forwarded_message_vouches_for_are_bounded():
    """A shuffle's origin and a join walk's newcomer are the forwarding peer's word: each answer may be a dial to
    addresses a stranger chose. A burst of FORWARDED_DIALS, then one per FORWARDED_DIAL_S."""
    from peer.membership.views import FORWARDED_DIAL_S, FORWARDED_DIALS

    got = forged_walk_ends(messages=100, seconds=0.5)
    assert got["answers_sent"] == FORWARDED_DIALS and got["held_back"] == 200 - FORWARDED_DIALS, got
    v = Views(entry(0), CFG, random.Random(0))
    forger = entry(1)
    for i in range(FORWARDED_DIALS):
        v.handle(forger.peer_id, JoinWalk(Entry(f"victim{i:014d}", ("192.0.2.1:22",)), 0), 0.0)
    later = v.handle(forger.peer_id, Shuffle(Entry("victim" + "9" * 14, ("192.0.2.9:22",)), 0, (), 4),
                     FORWARDED_DIAL_S)
    assert any(isinstance(a, Send) for a in later)  # a token back after FORWARDED_DIAL_S
    # its own shuffle, first hop: the sender vouches for itself, no token taken
    own = v.handle(forger.peer_id, Shuffle(forger, 0, (), 4), FORWARDED_DIAL_S)
    assert any(isinstance(a, Send) and a.to == forger for a in own)


# ---- bounded whatever happens -------------------------------------------------------------------------

def _messages(ids: st.SearchStrategy[int]) -> st.SearchStrategy:
    e = ids.map(entry)
    entries = st.lists(e, max_size=MAX_ENTRIES).map(tuple)
    degree = st.integers(0, 40)
    return st.one_of(
        st.builds(Join, e), st.builds(JoinReply, entries), st.builds(JoinWalk, e, st.integers(0, 16)),
        st.builds(WalkEnd, e), st.builds(Seek, e, st.integers(0, 16)),
        st.builds(NeighbourRequest, e, degree, st.booleans(), st.none() | e.map(lambda x: x.peer_id)),
        st.builds(NeighbourReply, st.booleans(), degree),
        st.builds(SwapRequest, e, degree, st.none() | e), st.builds(SwapReply, st.booleans(), degree, st.none() | e),
        st.builds(Disconnect, st.none() | e), st.builds(Shuffle, e, st.integers(0, 16), entries, degree),
        st.builds(ShuffleReply, entries, degree),
        st.builds(Status, degree, st.lists(e, max_size=MAX_ENTRIES).map(tuple),
                  st.none() | st.floats(1.0, 1e12)))


EVENTS = st.lists(st.tuples(st.sampled_from(["msg", "msg", "msg", "down", "unreachable", "tick"]),
                            st.integers(1, 80), _messages(st.integers(1, 80)), st.floats(0.0, 20.0)),
                  max_size=120)


@settings(max_examples=100)
@given(EVENTS)
def test_any_sequence_of_messages_and_events_keeps_one_peers_views_bounded(events):
    """Whatever peers send (each message in its checked range, from its sender) and whatever fails, a peer's
    views stay in their bounds, and the EdgeUp / EdgeDown it reports are exactly its active view's changes."""
    v = Views(entry(0), CFG, random.Random(1))
    now = 0.0
    v.join(entry(1), now)
    for kind, who, msg, dt in events:
        now += dt
        sender = entry(who).peer_id
        before = set(v.active)
        if kind == "msg":
            for field in ("entry",):  # the sender is who the entry says (check would refuse otherwise)
                if hasattr(msg, field):
                    sender = getattr(msg, field).peer_id
            try:
                check(msg, sender)
            except BadMessage:
                continue
            actions = v.handle(sender, msg, now)
        elif kind == "down":
            actions = v.link_down(sender, now)
        elif kind == "unreachable":
            actions = v.unreachable(sender, now)
        else:
            actions = v.tick(now)
        ups = {a.peer for a in actions if isinstance(a, EdgeUp)}
        downs = {a.peer for a in actions if isinstance(a, EdgeDown)}
        assert (before | ups) - downs == set(v.active), (kind, msg)
        assert all(isinstance(a, (Send, EdgeUp, EdgeDown, NeedContact)) for a in actions)
        assert all(a.to.peer_id != v.me.peer_id for a in actions if isinstance(a, Send))
        assert_bounded(v)
        if kind == "tick":
            assert v.next_tick() > now  # a tick leaves nothing overdue


OPS = st.lists(st.one_of(st.tuples(st.just("join"), st.integers(0, 10**6)),
                         st.tuples(st.just("crash"), st.integers(0, 10**6)),
                         st.tuples(st.just("leave"), st.integers(0, 10**6)),
                         st.tuples(st.just("run"), st.integers(1, 45))), max_size=30)


@settings(max_examples=25)
@given(OPS, st.integers(0, 1000))
def test_views_stay_bounded_under_any_joins_leaves_crashes_and_shuffles(ops, seed):
    sim = swarm(24, seed=seed, settle=5.0)
    for op, k in ops:
        if op == "join":
            p = sim.spawn()
            sim.join(p, sim.alive[k % (len(sim.alive) - 1)] if len(sim.alive) > 1 else None)
        elif op in ("crash", "leave") and len(sim.alive) > 2:
            (sim.crash if op == "crash" else sim.leave)(sim.alive[k % len(sim.alive)])
        elif op == "run":
            sim.run_until(sim.now + k)  # shuffles every ~30 s, rewiring, repairs
        for p in sim.alive:
            assert_bounded(p.views)


# ---- on the wire: each a message of the registry, decoded and bounded by its schema ---------------------------

def _one_of_each(me: Entry) -> list:
    e = entry(7)
    return [Join(me), JoinReply((e, entry(8))), JoinWalk(e, 3), WalkEnd(me), Seek(e, 2),
            NeighbourRequest(me, 3, True, "peer0000000000000009"), NeighbourRequest(me, 0, False, None),
            NeighbourReply(False, 4), SwapRequest(me, 4, e), SwapRequest(me, 4, None), SwapReply(True, 4, e),
            SwapReply(False, 4, None), Disconnect(e), Disconnect(None), Shuffle(e, 0, (entry(8),), 4),
            ShuffleReply((), 4), Status(4, (e,), 1.25e8), Status(0, (), None)]


def test_every_view_message_survives_the_wire():
    me = entry(1)
    for msg in _one_of_each(me):
        assert DEFAULT_REGISTRY.decode(DEFAULT_REGISTRY.encode(msg), DEFAULT_LIMITS).message == msg
        check(msg, me.peer_id)


def _raw(kind: str, body: object) -> bytes:
    import msgpack

    return msgpack.packb({"t": kind, "v": 1, "r": 0, "q": 0, "b": body}, use_bin_type=True)


E1 = {"peer_id": "peer0000000000000001", "addresses": []}


@pytest.mark.parametrize("kind, body, why", [
    ("view_nope", {}, "unknown message type"),
    ("view_join", [1, 2], "body must be a map"),
    ("view_join", {}, "entry: missing required field"),
    ("view_join", {"entry": "peer0000000000000001"}, "entry: expected map"),
    ("view_join", {"entry": {"peer_id": "", "addresses": []}}, "a peer ID of 1..64 characters"),
    ("view_join", {"entry": {"peer_id": "p" * 65, "addresses": []}}, "a peer ID of 1..64 characters"),
    ("view_walk_end", {"entry": {"peer_id": "peer0000000000000001", "addresses": ["a"] * 5}}, "more than 4"),
    ("view_walk_end", {"entry": {"peer_id": "peer0000000000000001", "addresses": ["a" * 263]}}, "over 262"),
    ("view_shuffle", {"origin": E1, "ttl": 0, "degree": 1, "entries": [E1] * 33}, "more than 32"),
    ("view_shuffle_reply", {"entries": [E1, None], "degree": 1}, r"entries\[1\]: expected map"),
    ("view_seek", {"origin": E1, "ttl": 17}, "ttl 17 outside"),
    ("view_seek", {"origin": E1, "ttl": 1.0}, "ttl: expected int"),
    ("view_swap", {"entry": E1, "degree": (1 << 16) + 1, "drop": None}, "degree 65537 outside"),
    ("view_neighbour", {"entry": E1, "degree": 1, "urgent": True, "lost": "x" * 65}, "lost: a peer ID"),
    ("view_status", {"degree": 1, "neighbours": [], "fastest_bps": float("nan")}, "NaN"),
    ("view_status", {"degree": 1, "neighbours": [], "fastest_bps": -1.0}, "fastest_bps"),
    ("view_neighbour_reply", {"accepted": 1, "degree": 1}, "expected bool"),
])
def test_a_message_out_of_bounds_is_refused_by_the_wire(kind, body, why):
    with pytest.raises(ProtocolError, match=why):
        DEFAULT_REGISTRY.decode(_raw(kind, body), DEFAULT_LIMITS)


def test_a_message_naming_another_peer_is_a_bad_message():
    msg = DEFAULT_REGISTRY.decode(_raw("view_join", {"entry": E1}), DEFAULT_LIMITS).message
    check(msg, E1["peer_id"])
    with pytest.raises(BadMessage, match="not the sender"):
        check(msg, "peer0000000000000002")


def test_the_largest_view_message_fits_a_sessions_burst():
    """A message at every bound (a shuffle of 32 entries of maximal IDs and addresses, and its origin) is
    still one the per-session budget takes at once (its burst, 64 KiB), and far under a message's limit."""
    from peer.membership.view_driver import VIEW_BURST_BYTES
    from protocol.bounds import MAX_ADDRESS_CHARS, MAX_PEER_ID_CHARS

    big = Entry("p" * MAX_PEER_ID_CHARS, tuple("a" * MAX_ADDRESS_CHARS for _ in range(4)))
    size = wire_size(Shuffle(big, 16, (big,) * MAX_ENTRIES, 1 << 16))
    assert size <= VIEW_BURST_BYTES
    assert size < DEFAULT_LIMITS.max_message_bytes


def test_an_entry_leaves_room_for_relayed_addresses():
    from peer.membership.view_driver import _entry_addresses

    direct = [f"198.51.100.{i}:7100" for i in range(6)]
    relayed = [f"198.51.100.9:7100/relay/r{i}" for i in range(3)]
    assert _entry_addresses(direct, []) == tuple(direct[:4])
    assert _entry_addresses(direct, relayed) == (*direct[:2], *relayed[:2])
    assert _entry_addresses([], relayed) == tuple(relayed)  # a peer behind NAT: its relays are its way in
    assert _entry_addresses(direct[:1], relayed[:1]) == (direct[0], relayed[0])


def test_a_refusing_token_bucket_takes_nothing_when_short():
    from peer.token_bucket import TokenBucket

    t = [0.0]
    b = TokenBucket(1000, clock=lambda: t[0])
    assert b.try_take(int(b.capacity))
    assert not b.try_take(10)
    t[0] += 0.5
    assert b.try_take(400) and not b.try_take(200)  # 500 refilled, 400 taken: 100 left
    sans_io = TokenBucket(0.2, 8, now=100.0)  # the views' forwarded sends: `now` said, no clock
    assert all(sans_io.try_take(1, 100.0) for _ in range(8)) and not sans_io.try_take(1, 104.0)
    assert sans_io.try_take(1, 105.0) and not sans_io.try_take(1, 105.0)
    with pytest.raises(TypeError, match="no clock"):
        sans_io.try_take(1)
    for rate, capacity in ((0, 1), (1, 0), (float("nan"), 1), (1, float("inf"))):
        with pytest.raises(ValueError, match="token bucket"):
            TokenBucket(rate, capacity)


def test_groups_that_joined_through_different_contacts_merge_once_they_learn_of_each_other():
    """Peers found by mDNS at once may join through different contacts and settle into separate groups at
    their target degree; what the driver hands `Views.learn` (the mDNS peers) lets shuffles and mixes join
    them into one graph."""
    sim = Simulator(CFG, GapConfig(), SimConfig(seed=9))
    groups: list[list] = [[], []]
    for g in groups:
        first = sim.spawn()
        sim.join(first, None, measure=False)
        g.append(first)
        for _ in range(5):
            sim.run_until(sim.now + 0.2)
            p = sim.spawn()
            sim.join(p, first, measure=False)
            g.append(p)
    sim.run_until(sim.now + 60)

    def components() -> int:
        seen: set[str] = set()
        count = 0
        for p in sim.alive:
            if p.pid in seen:
                continue
            count += 1
            stack = [p.pid]
            seen.add(p.pid)
            while stack:
                for q in sim.peers[stack.pop()].views.active:
                    if q not in seen:
                        seen.add(q)
                        stack.append(q)
        return count
    assert components() == 2  # nothing joins them on their own
    for g, other in ((groups[0], groups[1]), (groups[1], groups[0])):
        for p in g:
            p.views.learn(sim.rng.choice(other).entry)
    end = sim.now + 600
    while components() > 1 and sim.now < end:
        sim.run_until(sim.now + 5)
    assert components() == 1 and consistent(sim)
    for p in sim.alive:
        assert_bounded(p.views)

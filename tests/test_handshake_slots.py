"""The listener's fairness rule for handshake slots (peer/session/handshake_slots.py), alone: under any
sequence of arrivals and releases the caps hold and nothing leaks, and a flood from a few prefixes never
pushes out a newcomer from another one (issue 29: a one-IP flood once kept an honest peer out for as long
as it lasted). Also the log throttle the listener writes a flood's failures through."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.logs import Throttle
from peer.session.handshake_slots import (MAX_HANDSHAKES, MAX_HANDSHAKES_PER_IP, MAX_HANDSHAKES_PER_PREFIX,
                                          HandshakeSlots, source_of)

SMALL = dict(total=8, per_prefix=4, per_ip=2)  # small caps: hypothesis reaches every rule in a few steps
CAPS = st.sampled_from([SMALL, dict(total=6, per_prefix=3, per_ip=3), dict(total=5, per_prefix=5, per_ip=1),
                        dict(total=MAX_HANDSHAKES, per_prefix=MAX_HANDSHAKES_PER_PREFIX, per_ip=MAX_HANDSHAKES_PER_IP)])
HONEST = "10.9.9.9"  # a prefix no flood below uses


def flood_ip(prefix: int, host: int) -> str:
    return f"10.0.{prefix}.{host}"


def check_caps(slots: HandshakeSlots, held: dict) -> None:
    """The caps hold, and the slots are exactly the holders the caller thinks are in."""
    assert len(slots) == len(held) <= slots.total
    for holder, ip in held.items():
        assert holder in slots
        assert slots.held_by_ip(ip) <= slots.per_ip
        assert slots.held_by_prefix(ip) <= slots.per_prefix
        assert slots.held_by_ip(ip) == sum(1 for a in held.values() if a == ip)
        assert slots.held_by_prefix(ip) == sum(1 for a in held.values() if source_of(a)[1] == source_of(ip)[1])


def assert_empty(slots: HandshakeSlots) -> None:
    assert len(slots) == 0
    assert not slots._where and not slots._by_ip and not slots._by_prefix and not slots._prefix_count


# steps: ("arrive", prefix, host) or ("release", index into the holders now in)
steps = st.lists(st.one_of(st.tuples(st.just("arrive"), st.integers(0, 3), st.integers(1, 4)),
                           st.tuples(st.just("release"), st.integers(0, 200))), max_size=150)


@given(caps=CAPS, steps=steps)
def test_caps_hold_every_newcomer_gets_a_slot_and_released_slots_are_free(caps, steps):
    slots: HandshakeSlots[int] = HandshakeSlots(**caps)
    held: dict[int, str] = {}
    for n, step in enumerate(steps):
        if step[0] == "arrive":
            ip = flood_ip(step[1], step[2])
            pushed = slots.admit(ip, n)
            assert n in slots  # a newcomer is never refused
            if pushed is not None:
                assert pushed in held and pushed not in slots
                del held[pushed]
            held[n] = ip
        elif held:
            holder = sorted(held)[step[1] % len(held)]
            assert slots.release(holder) and not slots.release(holder)  # freed once
            del held[holder]
        check_caps(slots, held)
    for holder in list(held):
        slots.release(holder)
    assert_empty(slots)


@given(caps=CAPS, flood_prefixes=st.integers(1, 6), data=st.data())
def test_a_flood_from_fewer_prefixes_than_slots_never_pushes_out_a_newcomer_from_another(caps, flood_prefixes, data):
    """The honest peer comes at any point of the flood (after any arrivals and releases from it) and stays
    through any number of arrivals after it, from at most total - 2 prefixes (see the module's docstring)."""
    slots: HandshakeSlots[object] = HandshakeSlots(**caps)
    prefixes = min(flood_prefixes, slots.total - 2)
    arrival = st.tuples(st.integers(0, max(0, prefixes - 1)), st.integers(1, 8), st.booleans())
    before, after = data.draw(st.lists(arrival, max_size=80)), data.draw(st.lists(arrival, min_size=1, max_size=120))
    held: list[int] = []

    def flood(arrivals, start: int) -> None:
        for i, (prefix, host, release) in enumerate(arrivals, start):
            pushed = slots.admit(flood_ip(prefix, host), i)
            assert pushed != "honest", f"the honest handshake was pushed out by {flood_ip(prefix, host)}"
            if pushed is not None:
                held.remove(pushed)
            held.append(i)
            if release and held:  # some flood connections end by themselves (a reset, their deadline)
                slots.release(held.pop(0))

    flood(before, 0)
    pushed = slots.admit(HONEST, "honest")  # it may push out a flood connection (never refused)
    if pushed is not None:
        held.remove(pushed)
    assert "honest" in slots
    flood(after, 10_000)
    assert "honest" in slots
    assert slots.release("honest")


@pytest.mark.parametrize("flood", ["one IP", "one /24"])
def test_a_flood_holds_at_most_its_share_and_pushes_out_only_its_own(flood):
    slots: HandshakeSlots[object] = HandshakeSlots()
    honest = [("10.0.1.200", "same /24, other IP"), ("10.0.2.1", "other /24")]
    if flood == "one /24":
        honest = honest[1:]  # a /24 flood pushes out the oldest of its own prefix: a peer there too, by design
    for ip, name in honest:
        assert slots.admit(ip, name) is None
    for i in range(10_000):
        ip = "10.0.1.1" if flood == "one IP" else f"10.0.1.{i % 100 + 1}"
        pushed = slots.admit(ip, i)
        assert pushed is None or isinstance(pushed, int)
    cap = MAX_HANDSHAKES_PER_IP if flood == "one IP" else MAX_HANDSHAKES_PER_PREFIX
    assert len(slots) == cap + len(honest) and all(name in slots for _, name in honest)


def test_full_slots_push_out_the_largest_prefix_and_between_equals_the_oldest():
    slots: HandshakeSlots[str] = HandshakeSlots(**SMALL)  # 8 in all, 4 per /24, 2 per IP
    for name, ip in [("a1", "10.0.1.1"), ("a2", "10.0.1.2"), ("a3", "10.0.1.2"), ("b1", "10.0.2.1"),
                     ("c1", "10.0.3.1"), ("d1", "10.0.4.1"), ("e1", "10.0.5.1"), ("f1", "10.0.6.1")]:
        assert slots.admit(ip, name) is None
    # full: prefix 10.0.1 holds the most (3), its IP .2 the most (2): a2, the older of .2, goes
    assert slots.admit("10.0.7.1", "g1") == "a2"
    # now every prefix but 10.0.1 (2) holds 1: 10.0.1 again, IPs .1 and .2 hold 1 each: the oldest, a1
    assert slots.admit("10.0.8.1", "h1") == "a1"
    # all prefixes hold 1: oldest first among them (a distributed flood is as bad as before)
    assert slots.admit("10.0.9.1", "i1") == "a3"
    assert slots.admit("10.0.10.1", "j1") == "b1"
    # a source at its own cap pushes out its own oldest first, whatever the total
    assert slots.admit("10.0.10.1", "j2") == "c1"
    # 10.0.10.1 now holds its 2: its next pushes out its own oldest, whatever the rest
    assert slots.admit("10.0.10.1", "j3") == "j1"
    assert len(slots) == 8


def test_a_source_at_its_cap_pushes_out_its_own_oldest():
    slots: HandshakeSlots[str] = HandshakeSlots(**SMALL)
    assert slots.admit("10.0.1.1", "x1") is None and slots.admit("10.0.1.1", "x2") is None
    assert slots.admit("10.0.1.1", "x3") == "x1"  # per IP (2)
    assert slots.admit("10.0.1.2", "y1") is None and slots.admit("10.0.1.2", "y2") is None
    assert slots.admit("10.0.1.3", "z1") == "x2"  # per /24 (4): .1 and .2 hold 2 each, .1's is the oldest
    assert slots.held_by_prefix("10.0.1.99") == 4 and slots.held_by_ip("10.0.1.3") == 1


def test_prefixes_are_a_slash_24_or_a_slash_64_and_mapped_addresses_are_ipv4():
    assert source_of("192.0.2.77") == ("192.0.2.77", "192.0.2.0/24")
    assert source_of("::ffff:192.0.2.77") == ("192.0.2.77", "192.0.2.0/24")
    assert source_of("2001:db8:1:2:aaaa::1") == ("2001:db8:1:2:aaaa::1", "2001:db8:1::/48")
    assert source_of("fe80::1%eth0")[1] == "fe80::/48"
    slots: HandshakeSlots[int] = HandshakeSlots(**SMALL)
    slots.admit("::ffff:192.0.2.1", 1)
    assert slots.held_by_ip("192.0.2.1") == 1 and slots.held_by_prefix("192.0.2.200") == 1


def test_caps_must_nest():
    for caps in (dict(total=4, per_prefix=8, per_ip=2), dict(total=8, per_prefix=2, per_ip=4),
                 dict(total=8, per_prefix=4, per_ip=0)):
        with pytest.raises(ValueError):
            HandshakeSlots(**caps)
    with pytest.raises(ValueError, match="already"):
        s: HandshakeSlots[int] = HandshakeSlots(**SMALL)
        s.admit("10.0.0.1", 1)
        s.admit("10.0.0.2", 1)


def test_the_log_throttle_lets_one_line_per_kind_through_and_counts_the_rest():
    now = [0.0]
    t = Throttle(10.0, clock=lambda: now[0])
    assert t.allow("timeout") == 0 and t.allow("failed") == 0
    assert [t.allow("timeout") for _ in range(5)] == [None] * 5
    now[0] = 10.0
    assert t.allow("timeout") == 5 and t.allow("timeout") is None
    assert Throttle.more(5) == " (and 5 more like it since)" and Throttle.more(0) == ""

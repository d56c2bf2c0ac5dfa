"""Units of issue 18: the circuit hello and NAT messages at decode, relayed addresses, the relay's splice
and bandwidth bucket, the relay's refusal rules, the reachability verdict, and which of two sessions
both ends keep."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
import trio.testing

from peer.config import RelaySection
from peer.membership.service import Membership
from peer.nat.addresses import RelayedAddress, parse_address, parse_relayed
from peer.nat.reachability import Evidence, Reachability
from peer.nat.relay import RelayServer
from peer.nat.splice import CHUNK, CircuitStats, splice
from peer.token_bucket import TokenBucket
from peer.session.router import Router
from protocol import circuit
from protocol.errors import ProtocolError
from protocol.limits import MiB, WireLimits
from protocol.refusal import Code, Refusal
from protocol.schema import (DEFAULT_REGISTRY, DialBackReply, DialBackRequest, DialBackResult, PunchOffer, RelayAck,
                             RelayConnectReply, RelayReservation)
from protocol.schema.nat import NOT_TRIED


# ---- the wire ---------------------------------------------------------------------------------------------

def test_a_circuit_hello_is_never_mistaken_for_a_handshake():
    token = bytes(range(16))
    data = circuit.hello(token)
    assert circuit.is_circuit(data[:circuit.PEEK_BYTES]) and circuit.parse_hello(data) == token
    # a handshake starts with a big-endian u32 length of at most 4096: its first byte is 0
    assert not circuit.is_circuit((4096).to_bytes(4, "big"))
    with pytest.raises(ValueError):
        circuit.hello(b"short")
    with pytest.raises(ValueError):
        circuit.parse_hello(b"PTRX" + token)




BAD = [
    ("relay_incoming", {"source": "p" * 20, "token": b"x" * 15}, "token"),
    ("relay_incoming", {"source": "", "token": b"x" * 16}, "source"),
    ("relay_connect_reply", {"ok": True, "reason": "", "token": b""}, "token"),
    ("relay_connect_reply", {"ok": False, "reason": "no", "token": b"x" * 16}, "refusal"),
    ("dialback", {"addresses": []}, "addresses"),
    ("dialback", {"addresses": ["1.2.3.4:5"] * 5}, "addresses"),
    ("dialback", {"addresses": ["x" * 300]}, "address"),
    ("punch_offer", {"address": ""}, "address"),
    ("relay_reservation", {"ok": True, "reason": "", "max_circuit_bytes": -1, "max_circuit_seconds": 1.0}, "limits"),
    ("relay_reservation", {"ok": True, "reason": "r" * 600, "max_circuit_bytes": 1, "max_circuit_seconds": 1.0}, "reason"),
    ("relay_reservation", {"ok": False, "code": "c" * 33}, "code"),
    ("relay_ack", {"ok": True, "code": "busy"}, "code"),
    ("relay_connect_reply", {"ok": False, "code": "x" * 100}, "code"),
    ("dialback_reply", {"results": [{"address": "1.2.3.4:5", "ok": True, "reason": "", "code": "busy"}]}, "code"),
]


@pytest.mark.parametrize("kind,body,what", BAD)
def test_nat_messages_out_of_range_are_refused_at_decode(kind, body, what):
    import msgpack

    raw = msgpack.packb({"t": kind, "v": 1, "r": 1, "q": 0, "b": body}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(raw, WireLimits())


def test_nat_messages_round_trip():
    for msg in (DialBackRequest(addresses=["10.0.0.1:7100"]), PunchOffer(address="[::1]:5"),
                RelayConnectReply(ok=True, token=b"t" * 16), RelayReservation(ok=False, reason="full"),
                RelayReservation.refused(Refusal(Code.BUSY, "full")), RelayAck.refused(Refusal(Code.NO_RESERVATION, "no")),
                DialBackReply(results=[DialBackResult("1.2.3.4:5", True, ""),
                                       DialBackResult.not_tried("1.2.3.4:6", Refusal(Code.TOO_SOON, "wait"))])):
        env = DEFAULT_REGISTRY.decode(DEFAULT_REGISTRY.encode(msg, rid=3), WireLimits())
        assert env.message == msg


def test_a_nat_refusal_reads_back_as_its_code_and_an_older_peers_as_unknown():
    assert RelayReservation.refused(Refusal(Code.BUSY, "full")).refusal() == Refusal(Code.BUSY, "full")
    assert RelayReservation(ok=True).refusal() is None
    assert RelayConnectReply(ok=False, reason="full").refusal() == Refusal(Code.UNKNOWN, "full")  # no code: older
    assert RelayAck(ok=False, code="a_newer_code", reason="why").refusal().code is Code.UNKNOWN
    tried, failed = DialBackResult("1.2.3.4:5", True, ""), DialBackResult("1.2.3.4:5", False, "timed out")
    assert tried.refusal() is None and failed.refusal() is None  # tried: evidence either way
    skipped = DialBackResult.not_tried("1.2.3.4:5", Refusal(Code.BUSY, "busy"))
    assert skipped.refusal() == Refusal(Code.BUSY, NOT_TRIED + "busy") and skipped.reason.startswith(NOT_TRIED)
    assert DialBackResult("1.2.3.4:5", False, NOT_TRIED + "busy").refusal().code is Code.UNKNOWN  # an older peer's


def test_relayed_addresses_parse_and_are_not_direct_ones():
    r = RelayedAddress("relayid12345678901", "203.0.113.5", 7100)
    assert parse_relayed(str(r)) == r and parse_address(str(r)) is None
    assert parse_relayed("[2001:db8::1]:7100/relay/abc") == RelayedAddress("abc", "2001:db8::1", 7100)
    assert parse_address("10.0.0.1:7100") == ("10.0.0.1", 7100)
    for bad in ("10.0.0.1:7100/relay/", "10.0.0.1/relay/x", "x:0/relay/y", "a@b:1", "1.2.3.4:7100/relay/a/b"):
        assert parse_relayed(bad) is None and parse_address(bad) is None


# ---- splice and bandwidth --------------------------------------------------------------------------------

def _pair():
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


def test_splice_forwards_both_ways_untouched_and_stops_at_its_byte_cap():
    trio.run(_splice_forwards_both_ways_untouched_and_stops_at_its_byte_cap)


async def _splice_forwards_both_ways_untouched_and_stops_at_its_byte_cap():
    left_peer, left_relay = _pair()
    right_relay, right_peer = _pair()
    seen: list[tuple[str, bytes]] = []
    stats = CircuitStats()
    payload = bytes(range(256)) * 1024  # 256 KiB
    async with trio.open_nursery() as n:
        n.start_soon(lambda: splice(left_relay, right_relay, max_bytes=len(payload) + 1000, max_seconds=30,
                                    bucket=TokenBucket(1e9, clock=trio.current_time), stats=stats, tap=lambda d, c: seen.append((d, c))))
        await left_peer.send_all(payload)
        got = b""
        while len(got) < len(payload):
            got += await right_peer.receive_some(65536)
        assert got == payload
        await right_peer.send_all(b"back")
        assert await left_peer.receive_some(10) == b"back"
        await left_peer.send_all(b"x" * 2000)  # over the cap: the circuit closes
        with trio.fail_after(5):
            while await right_peer.receive_some(65536):
                pass
    assert b"".join(c for d, c in seen if d == "a->b") == payload and "cap" in stats.ended
    assert stats.bytes_forwarded == len(payload) + 4


def test_splice_stops_at_its_duration_cap():
    trio.run(_splice_stops_at_its_duration_cap)


async def _splice_stops_at_its_duration_cap():
    a_peer, a_relay = _pair()
    b_relay, b_peer = _pair()
    stats = CircuitStats()
    with trio.fail_after(10):
        await splice(a_relay, b_relay, max_bytes=1 << 30, max_seconds=0.2, bucket=TokenBucket(1e9, clock=trio.current_time), stats=stats)
    assert "duration" in stats.ended


def test_bucket_rate_with_a_mock_clock():
    async def main() -> float:
        bucket = TokenBucket(1 * MiB, clock=trio.current_time)
        t0 = trio.current_time()
        for _ in range(48):
            await bucket.take(CHUNK)
        return trio.current_time() - t0

    took = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert 1.9 <= took <= 2.1  # 3 MiB at 1 MiB/s with one second's worth up front


# ---- the relay's refusals ----------------------------------------------------------------------------------

class FakeSession:
    def __init__(self, peer_id: str, path: str = "direct"):
        self.peer_id, self.path, self.short = peer_id, path, peer_id[:8]
        self.closed = trio.Event()
        self.replies: list = []

    async def reply(self, env, message) -> None:
        self.replies.append(message)


def test_relay_refuses_what_its_caps_and_role_do_not_allow():
    trio.run(_relay_refuses_what_its_caps_and_role_do_not_allow)


async def _relay_refuses_what_its_caps_and_role_do_not_allow():
    offering = [None]
    relay = RelayServer(RelaySection(max_reservations=1, max_circuits_per_peer=1), Router(), offering=lambda: offering[0])
    env = SimpleNamespace(message=None, rid=1)
    a, b, c = FakeSession("a" * 20), FakeSession("b" * 20), FakeSession("c" * 20, path="relayed")
    await relay._on_reserve(a, env)
    await relay._on_reserve(b, env)  # one reservation at most
    await relay._on_reserve(c, env)
    assert [r.ok for r in (a.replies[0], b.replies[0], c.replies[0])] == [True, False, False]
    assert "full" in b.replies[0].reason and "direct" in c.replies[0].reason
    assert b.replies[0].refusal().code is Code.BUSY and c.replies[0].refusal().code is Code.WRONG_PATH
    assert relay._connect_refusal(b, "z" * 20) == Refusal(Code.NO_RESERVATION, "no reservation for that peer here")
    assert relay._connect_refusal(a, a.peer_id) == Refusal(Code.BAD_INPUT, "a circuit to yourself")
    assert relay._connect_refusal(c, a.peer_id).code is Code.WRONG_PATH
    assert relay._connect_refusal(b, a.peer_id) is None
    relay._per_peer[a.peer_id] = 1
    refused = relay._connect_refusal(b, a.peer_id)
    assert refused.code is Code.BUSY and "already has 1" in refused.reason
    offering[0] = Refusal(Code.DISABLED, "not publicly reachable (nat)")
    assert relay._connect_refusal(b, a.peer_id) == offering[0]
    assert relay.status()["why_not"] == "not publicly reachable (nat)" and relay.stats.refused == 2
    a.closed.set()
    relay.forget(a.peer_id)
    assert not relay.reservations


# ---- reachability ----------------------------------------------------------------------------------------

def _reach() -> Reachability:
    from peer.config import NatSection

    m = SimpleNamespace(advertise_hosts=[], bound_hosts=[], observed_hosts=[])
    r = Reachability.__new__(Reachability)  # only the verdict's state: no router, no transport
    r.cfg, r.membership, r.verdict, r.reason, r.evidence, r.weak = NatSection(), m, "unknown", "", {}, False
    return r


def test_reachability_needs_two_distinct_ips_to_agree_unless_only_one_can_be_asked():
    trio.run(_reachability_needs_two_distinct_ips_to_agree_unless_only_one_can_be_asked)


async def _reachability_needs_two_distinct_ips_to_agree_unless_only_one_can_be_asked():
    r = _reach()
    now = trio.current_time()
    r.evidence["1.1.1.1"] = [Evidence("p1", "1.1.1.1", "9.9.9.9:7100", False, "timeout", now)]
    r._decide(needed=2)
    assert r.verdict == "unknown"
    r._decide(needed=1)
    assert r.verdict == "nat" and r.weak
    r.evidence["2.2.2.2"] = [Evidence("p2", "2.2.2.2", "9.9.9.9:7100", True, "", now)]
    r._decide(needed=2)
    assert r.verdict == "unknown"  # answers disagree: no verdict is kept against evidence
    r.evidence["3.3.3.3"] = [Evidence("p3", "3.3.3.3", "9.9.9.9:7100", True, "", now)]
    r._decide(needed=2)
    assert r.verdict == "public" and not r.weak and r.verified_hosts() == ["9.9.9.9"]
    del r.evidence["1.1.1.1"], r.evidence["2.2.2.2"]
    r._decide(needed=2)
    assert r.verdict == "public"  # one answer left, none against: the verdict is kept


class AskedSession:
    """A connected peer at `ip` that answers a dial-back request with `results`."""

    def __init__(self, peer_id: str, ip: str, results: list[DialBackResult]):
        self.peer_id, self.remote_addr, self.results = peer_id, (ip, 7100), results

    async def request(self, msg, timeout):
        return SimpleNamespace(message=DialBackReply(results=self.results))


def test_a_failed_address_listed_last_does_not_hide_a_success_at_another():
    """Regression: the evidence of an IP was overwritten by each result of its answer, so an advertised address
    that failed, listed after the observed one that worked, made that peer a vote against us."""
    trio.run(_a_failed_address_listed_last_does_not_hide_a_success_at_another)


async def _a_failed_address_listed_last_does_not_hide_a_success_at_another():
    r = _reach()
    r.transport = SimpleNamespace(handshake_timeout=1.0)
    observed, advertised = "9.9.9.9:7100", "8.8.8.8:7100"
    for peer, ip in (("p1", "1.1.1.1"), ("p2", "2.2.2.2")):
        await r._ask(AskedSession(peer, ip, [DialBackResult(observed, True, ""),
                                             DialBackResult(advertised, False, "timed out")]), [observed, advertised])
    r._decide(needed=2)
    assert r.verdict == "public" and r.verified_hosts() == ["9.9.9.9"]
    assert [(e["address"], e["ok"]) for e in r.status()["evidence"]] == [(observed, True), (advertised, False)] * 2
    # a refused (not tried) answer is no evidence: the IP's last real answer stands
    await r._ask(AskedSession("p1", "1.1.1.1", [DialBackResult.not_tried(observed, Refusal(Code.BUSY, "busy"))]),
                 [observed])
    assert len(r.evidence["1.1.1.1"]) == 2
    # a later answer replaces the IP's vote: both addresses failing there now is a vote against
    await r._ask(AskedSession("p1", "1.1.1.1", [DialBackResult(observed, False, "timed out")]), [observed])
    await r._ask(AskedSession("p2", "2.2.2.2", [DialBackResult(observed, False, "refused")]), [observed])
    r._decide(needed=2)
    assert r.verdict == "nat" and r.verified_hosts() == []


# ---- which session both ends keep ------------------------------------------------------------------------

def test_a_direct_session_is_preferred_over_a_relayed_one_by_both_ends():
    def session(initiator: bool, path: str, peer: str):
        return SimpleNamespace(initiator=initiator, path=path, peer_id=peer)

    for me, them in (("a" * 20, "b" * 20), ("b" * 20, "a" * 20)):
        m = SimpleNamespace(peer_id=me)
        relayed, direct = session(True, "relayed", them), session(False, "punched", them)
        assert Membership._preferred(m, relayed, direct) is direct
        assert Membership._preferred(m, direct, relayed) is direct

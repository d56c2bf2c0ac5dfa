"""Idle sessions give their slot to a newcomer (issue 15): which session is idle (`pick_idle`), and that
`serve` closes one for an authenticated newcomer when its slots are full, and refuses only when none is."""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from peer.membership.service import pick_idle
from peer.session.connect import EVICTED_REASON, ListenerStats, dial, fair_victim, open_listeners, serve
from peer.session.transport import SessionStats
from protocol.schema import Goodbye, Ping, Pong
from tests.test_transport import attempt, tcfg


@dataclass(eq=False)  # by identity, as sessions: a key of the listener's table
class FakeSession:
    peer_id: str
    last_useful: float
    closed: trio.Event = field(default_factory=trio.Event)

    @property
    def stats(self) -> SessionStats:
        return SessionStats(last_useful=self.last_useful)


def test_pick_idle_takes_the_longest_idle_and_never_a_neighbour_or_a_recently_useful_session():
    async def main():
        neighbour = FakeSession("n", last_useful=0.0)  # idle longest, but a neighbour
        old = FakeSession("old", last_useful=10.0)
        older = FakeSession("older", last_useful=5.0)
        fresh = FakeSession("fresh", last_useful=95.0)  # useful 5 s ago
        gone = FakeSession("gone", last_useful=1.0)
        gone.closed.set()  # being torn down: its slot is already freed
        keep = {"n"}.__contains__
        sessions = [neighbour, old, older, fresh, gone]
        assert pick_idle(sessions, now=100.0, idle_after=30.0, keep=keep) is older
        assert pick_idle([neighbour, fresh, gone], now=100.0, idle_after=30.0, keep=keep) is None
        assert pick_idle([old], now=39.9, idle_after=30.0, keep=keep) is None  # not idle for 30 s yet
        assert pick_idle([], now=100.0, idle_after=30.0, keep=keep) is None
    trio.run(main)


def test_serve_evicts_an_idle_session_for_a_newcomer_and_refuses_when_none_is_idle():
    idle_after = 0.5

    async def main():
        async with trio.open_nursery() as n:
            listeners, (_, port) = await open_listeners("127.0.0.1", 0)
            stats = ListenerStats()
            inbound = []

            async def hold(session):  # answers pings, like tests.test_transport.echo_server
                inbound.append(session)
                async with trio.open_nursery() as h:
                    h.start_soon(session.run)
                    async for env in session.incoming:
                        if isinstance(env.message, Ping) and env.rid:
                            await session.reply(env, Pong(echo=env.message.sent))
                    h.cancel_scope.cancel()

            kept: set[str] = set()

            def idle_victim(sessions):
                return pick_idle(sessions, now=trio.current_time(), idle_after=idle_after, keep=kept.__contains__)

            n.start_soon(lambda: serve(listeners, tcfg(), hold, max_connections=2, stats=stats, idle_victim=idle_victim))
            a = await dial("127.0.0.1", port, tcfg())  # stands for a topology neighbour
            b = await dial("127.0.0.1", port, tcfg())  # sends only heartbeats
            n.start_soon(a.run)
            n.start_soon(b.run)
            await trio.sleep(0.1)
            kept.add(next(s.peer_id for s in inbound if s.remote_addr[1] == a.sock.getsockname()[1]))
            assert await attempt(port, tcfg()) == "refused"  # b was admitted just now: not idle yet
            for _ in range(int(idle_after / 0.1) + 2):
                await b.send_message(Ping(sent=1.0))  # heartbeats do not count as useful
                await trio.sleep(0.1)
            assert await attempt(port, tcfg()) == "ok"
            with trio.fail_after(5):
                await b.closed.wait()
            assert not a.closed.is_set() and stats.evicted == 1
            evicted = next(s for s in inbound if s.close_reason == EVICTED_REASON)
            assert evicted.peer_id not in kept
            # a session that sent something useful just now is not idle: the newcomer is refused
            c = await dial("127.0.0.1", port, tcfg())
            n.start_soon(c.run)
            await trio.sleep(idle_after + 0.1)
            await c.send_message(Goodbye(reason="anything but a heartbeat"))
            await trio.sleep(0.1)
            assert await attempt(port, tcfg()) == "refused"
            assert not c.closed.is_set() and stats.evicted == 1
            n.cancel_scope.cancel()
    trio.run(main)


def test_a_full_listener_makes_room_from_the_prefix_holding_the_most():
    """4 IPs x 16 keys that send any cheap message (never idle) held every inbound place (issue 40): the newest
    session of the prefix holding the most gives way, when it holds at least two more than the newcomer's."""
    sessions: dict = {}
    for i in range(4):  # an attacker's four IPs in one /24, 16 sessions each: all 64 places
        for k in range(16):
            sessions[FakeSession(f"sybil{i}.{k}", 0.0)] = f"203.0.113.{i + 1}"
    victim = fair_victim(sessions, "198.51.100.7")
    assert victim is not None and victim.peer_id.startswith("sybil") and sessions[victim] == "203.0.113.1"
    assert victim.peer_id == "sybil0.15"  # the newest of the IP holding the most (a tie: the first)
    # four IPs in four /24s: still the prefix holding the most gives way to a fifth prefix
    spread = {FakeSession(f"s{i}.{k}", 0.0): f"10.{i}.0.1" for i in range(4) for k in range(16)}
    assert fair_victim(spread, "192.0.2.1") is not None
    # a fair share is kept: a newcomer's prefix that holds nearly as much as the biggest pushes no one out
    even = {FakeSession(f"p{i}.{k}", 0.0): f"10.{i}.0.1" for i in range(2) for k in range(32)}
    assert fair_victim(even, "10.0.0.9") is None  # its own prefix holds 32 already
    assert fair_victim({}, "10.0.0.1") is None
    # a local swarm (every session from 127.0.0.1) never evicts itself
    local = {FakeSession(f"l{k}", 0.0): "127.0.0.1" for k in range(64)}
    assert fair_victim(local, "127.0.0.1") is None
    # IPv6: one /48 is one source, however many /64s it spans
    v6 = {FakeSession(f"v{k}", 0.0): f"2001:db8:7:{k:x}::1" for k in range(64)}
    assert fair_victim(v6, "2001:db8:9::1") is not None and fair_victim(v6, "2001:db8:7:ffff::1") is None

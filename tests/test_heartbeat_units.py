"""Heartbeats (peer/membership/service.py, `Membership._heartbeat`): an idle session is pinged every interval,
a session whose peer answers our other requests is not pinged at all, and a peer that answers nothing is
dropped after `dead_after`. The session here is a stand-in recording requests; the clock is trio's mock."""

from __future__ import annotations

import types

import trio
import trio.testing

from peer.membership.peers import PeerInfo
from peer.membership.service import RTT_REFRESH_S, Membership
from peer.session.transport import SessionStats

INTERVAL, DEAD_AFTER = 1.0, 6.0


class Session:
    """What the heartbeat reads of a session: `request` (a ping), `stats.last_answered`, `aclose`."""

    def __init__(self, answers: bool):
        self.answers = answers
        self.pings = 0
        self.closed_reason = ""
        self.stats = SessionStats()
        self.short = "peer"

    async def request(self, msg, *, timeout: float):
        self.pings += 1
        if not self.answers:
            await trio.sleep(timeout)
            raise trio.TooSlowError
        await trio.sleep(0.01)  # the round trip
        self.stats.last_answered = trio.current_time()

    async def aclose(self, reason: str) -> None:
        self.closed_reason = reason


def run_heartbeat(session: Session, seconds: float, busy_every: float | None = None) -> None:
    owner = types.SimpleNamespace(cfg=types.SimpleNamespace(heartbeat_interval=INTERVAL, dead_after=DEAD_AFTER))

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(Membership._heartbeat, owner, session, PeerInfo("peer"))
            if busy_every is not None:  # replies to averaging or pipeline requests keep coming
                async def answers():
                    while True:
                        session.stats.last_answered = trio.current_time()
                        await trio.sleep(busy_every)
                n.start_soon(answers)
            await trio.sleep(seconds)
            n.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_idle_session_is_pinged_every_interval():
    s = Session(answers=True)
    run_heartbeat(s, 20.0)
    assert 17 <= s.pings <= 20 and not s.closed_reason


def test_a_session_busy_with_answered_requests_is_pinged_only_to_refresh_its_rtt():
    s = Session(answers=True)
    run_heartbeat(s, 20.0, busy_every=0.5)  # 20 pings idle; busy: the first (no RTT yet) and one per RTT_REFRESH_S
    assert 1 <= s.pings <= 1 + 20.0 / RTT_REFRESH_S and not s.closed_reason


def test_a_session_answering_now_and_then_is_pinged_in_its_gaps():
    s = Session(answers=True)
    run_heartbeat(s, 20.0, busy_every=3.0)
    assert 4 <= s.pings <= 14 and not s.closed_reason


def test_a_peer_that_answers_nothing_is_dropped_after_dead_after():
    s = Session(answers=False)
    run_heartbeat(s, DEAD_AFTER + 2 * INTERVAL + 0.5)
    assert "no heartbeat reply" in s.closed_reason

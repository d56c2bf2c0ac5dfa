"""Liveness and connection-slot attacks of issue 15 (registered in `peer.testing.attacks.SCENARIOS`):
a peer that keeps sending but never reads, and silent TCP connections that never start a handshake.

Their own module because they attack the session layer rather than a message handler; they register
with the same `@scenario` as the others, so `peer bench hostile` and the tests run them alike.
"""

from __future__ import annotations

import trio

from peer.session.transport import SessionClosed
from peer.testing.attacker import attacker_session
from peer.testing.attacks import Observed, answer_pings, dropped, my_id, scenario, victim_status
from protocol.schema import Ping, Pong

SILENT_CONNECTIONS = 50  # far above the daemon's 16 handshake slots: the oldest must give way
ADMIT_WITHIN_S = 2.0  # an honest handshake plus a ping on loopback, with room for a loaded machine
CHATTER_EVERY_S = 0.2  # the mute peer's small messages: it looks busy while reading nothing
DROP_WAIT_S = 30.0  # how long the scenario watches: past any sane dead_after + 5 s (the bench judges the figure)


@scenario("mute_peer", "drop", "a peer that keeps sending small messages and never reads a byte")
async def mute_peer(status: dict) -> Observed:
    wait = DROP_WAIT_S
    async with attacker_session(status) as honest, attacker_session(status, reading=False) as mute:
        obs = Observed(attacker=my_id(mute))
        async with trio.open_nursery() as n:
            n.start_soon(answer_pings, honest)

            async def chatter() -> None:
                try:
                    while True:
                        await mute.send_message(Ping(sent=1.0))
                        await trio.sleep(CHATTER_EVERY_S)
                except SessionClosed:
                    pass
            n.start_soon(chatter)
            obs.closed_after_s, obs.reason = await dropped(status, obs.attacker, wait)
            obs.ok = obs.closed_after_s is not None
            obs.reason = obs.reason or f"still connected after {wait:.0f} s"
            reply = await honest.request(Ping(sent=3.0), timeout=10)
            obs.facts["honest_pong"] = isinstance(reply.message, Pong)
            obs.facts["honest_state"] = next((p["state"] for p in (await victim_status(status))["peers"]
                                              if p["peer_id"] == my_id(honest)), None)
            n.cancel_scope.cancel()
    return obs


@scenario("slowloris", "bounded", f"{SILENT_CONNECTIONS} TCP connections that never start a handshake")
async def slowloris(status: dict) -> Observed:
    port = int(str(status["listen"]).rsplit(":", 1)[1])
    obs = Observed(attacker="(no identity: raw TCP)")
    silent = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(SILENT_CONNECTIONS)]
    try:
        t0 = trio.current_time()
        with trio.move_on_after(30):
            async with attacker_session(status) as honest:
                obs.facts["admitted_after_s"] = trio.current_time() - t0
                obs.facts["honest_pong"] = isinstance((await honest.request(Ping(sent=1.0), timeout=10)).message, Pong)
        took = obs.facts.get("admitted_after_s")
        obs.ok = took is not None and took < ADMIT_WITHIN_S and obs.facts.get("honest_pong", False)
        obs.reason = (f"an honest peer got in after {took:.2f} s" if took is not None
                      else "an honest peer was kept out for 30 s")
    finally:
        for s in silent:
            await s.aclose()
    return obs


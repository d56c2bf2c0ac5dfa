"""Liveness and connection-slot attacks of issues 15 and 29 (registered in `peer.testing.attacks.SCENARIOS`):
a peer that keeps sending but never reads, silent TCP connections that never start a handshake, and floods
of thousands of connections a second from one address, empty or opening a relay circuit, while an honest
peer at another prefix joins (`peer.testing.flood`).

Their own module because they attack the session layer rather than a message handler; they register
with the same `@scenario` as the others, so `peer bench hostile` and the tests run them alike.
"""

from __future__ import annotations

import trio

from peer.session.handshake_slots import MAX_HANDSHAKES
from peer.session.transport import SessionClosed
from peer.testing.attacker import attacker_session
from peer.testing.attacks import Observed, answer_pings, dropped, my_id, scenario, victim_status
from peer.testing.flood import FdPeak, Flood, delayed_path
from protocol.circuit import MAGIC
from protocol.schema import Ping, Pong

SILENT_CONNECTIONS = 50  # far above the 16 handshake slots one IP may hold: its oldest must give way
ADMIT_WITHIN_S = 2.0  # an honest handshake plus a ping on loopback, with room for a loaded machine
CHATTER_EVERY_S = 0.2  # the mute peer's small messages: it looks busy while reading nothing
DROP_WAIT_S = 30.0  # how long the scenario watches: past any sane dead_after + 5 s (the bench judges the figure)

FLOOD_RATE = 2000.0  # connections a second from one address: thousands, as one attacker's host sends them
FLOOD_SECONDS = 6.0  # the flood lasts this long: the honest peer's attempt runs inside it with room to spare
FLOOD_WARMUP_S = 1.0  # the honest peer comes this long after the flood started: every slot is contested by then
FLOOD_HELD = 2000  # connections the attacker holds at once (a second's worth), the oldest reset past that
FLOOD_SOURCE = "127.0.1.1"  # the attacker's address: all of 127/8 is loopback on Linux
HONEST_SOURCE = "127.0.2.1"  # the honest peer's: another /24 than the flood's
FD_SLACK = 16  # descriptors beyond the handshake slots: the honest session, status calls, streams being closed
HONEST_RTT_S = 0.05  # the honest peer's round trip to the victim, as across a continent (loopback has none)


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



async def _honest_during_flood(status: dict, *, payload: bytes) -> Observed:
    """A flood of connections from FLOOD_SOURCE sending `payload` (then nothing); FLOOD_WARMUP_S in, an
    honest peer at HONEST_SOURCE, HONEST_RTT_S away, dials, handshakes and pings, retrying until the flood
    ends. The victim's open descriptors are sampled all along (it runs on this host: its status names its pid)."""
    host, port = str(status["listen"]).rsplit(":", 1)
    obs = Observed(attacker=f"(no identity: raw TCP from {FLOOD_SOURCE})")
    facts = obs.facts
    attempts: list[str] = []
    path = delayed_path(host, int(port), source=HONEST_SOURCE, one_way_s=HONEST_RTT_S / 2)
    async with path as near_port:
        with FdPeak(int(status["pid"])) as fds, Flood(host, int(port), source=FLOOD_SOURCE, rate=FLOOD_RATE,
                                                       payload=payload, held=FLOOD_HELD) as flood:
            await _honest_try(dict(status, listen=f"127.0.0.1:{near_port}"), attempts, facts)
    listener = (await victim_status(status)).get("listener", {})
    facts.update({
        "honest_completed": "ok" in attempts, "honest_first_try": attempts[:1] == ["ok"],
        "honest_attempts": len(attempts), "honest_failures": [a for a in attempts if a != "ok"][:3],
        "victim_fds_start": fds.start, "victim_fds_max": fds.peak, "fd_bound": fds.start + MAX_HANDSHAKES + FD_SLACK,
        "flood_rate": round(flood.stats.rate), "flood_opened": flood.stats.opened, "flood_failed": flood.stats.failed,
        "flood_closed_by_victim": flood.stats.closed_by_victim,
        "handshakes_evicted": listener.get("handshakes_evicted"), "circuits_dropped": listener.get("circuits_dropped"),
    })
    took = facts.get("honest_latency_s")
    # within the flood, on its first try; how long it took is a figure, not a verdict: past the slots, a
    # loaded host's kernel queues connections first come first served (docs/design.md, "Handshake slots")
    obs.ok = facts["honest_first_try"] and fds.peak <= facts["fd_bound"]
    obs.reason = (f"an honest peer got in after {took:.2f} s (attempt {len(attempts)})" if took is not None
                  else f"an honest peer was kept out for the whole flood ({len(attempts)} attempts)")
    obs.reason += f"; the victim held at most {fds.peak} descriptors ({fds.start} before)"
    return obs


async def _honest_try(status: dict, attempts: list[str], facts: dict) -> None:
    """The honest peer's side of a flood (see `_honest_during_flood`); returns when the flood is to end."""
    t_flood = trio.current_time()
    await trio.sleep(FLOOD_WARMUP_S)
    t0 = trio.current_time()
    with trio.move_on_after(FLOOD_SECONDS - FLOOD_WARMUP_S):
        while "ok" not in attempts:
            try:
                async with attacker_session(status) as honest:
                    if isinstance((await honest.request(Ping(sent=1.0), timeout=10)).message, Pong):
                        facts["honest_latency_s"] = round(trio.current_time() - t0, 3)
                        attempts.append("ok")
            except Exception as exc:  # refused, reset, timed out, closed: each is one failed attempt
                attempts.append(f"{type(exc).__name__}: {exc}"[:120])
                await trio.sleep(0.05)
    await trio.sleep(max(0.0, FLOOD_SECONDS - (trio.current_time() - t_flood)))  # the flood's full length


@scenario("connection_flood", "bounded", f"{FLOOD_RATE:.0f} empty TCP connections a second from one address "
          "while an honest peer at another /24 joins")
async def connection_flood(status: dict) -> Observed:
    return await _honest_during_flood(status, payload=b"")


@scenario("circuit_flood", "bounded", f"{FLOOD_RATE:.0f} TCP connections a second from one address opening a "
          "relay circuit hello and saying no more, while an honest peer at another /24 joins")
async def circuit_flood(status: dict) -> Observed:
    return await _honest_during_flood(status, payload=MAGIC)

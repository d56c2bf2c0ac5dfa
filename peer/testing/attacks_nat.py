"""Attacks on the NAT services of issue 18 (registered in `peer.testing.attacks.SCENARIOS`): the relay
and dial-back are services strangers in the swarm use, so each is tried as a hostile peer would.

- relay_abuse: circuits to peers with no reservation, then (if the victim relays) a reservation that
  never answers its RelayIncoming while another identity asks for ten circuits to it: the victim must
  refuse beyond its per-peer cap and release every pending circuit within its set-up time.
- dialback_elsewhere: dial-back requests naming addresses that are not the asker's (an amplifier aimed
  at a third party) and requests faster than one per 10 s: nothing may be dialed.
- circuit_token_guess: raw TCP connections opening with a circuit hello and random tokens: each is
  closed, nothing is forwarded, and an honest peer still gets in.
"""

from __future__ import annotations

import secrets

import trio

from peer.config import RelaySection
from peer.nat.relay import SETUP_SECONDS
from peer.testing.attacker import attacker_session
from peer.testing.attacks import Observed, answer_pings, my_id, scenario, victim_status
from protocol.circuit import hello
from protocol.schema import (DialBackReply, DialBackRequest, Ping, Pong, RelayConnect, RelayConnectReply,
                             RelayIncoming, RelayReservation, RelayReserve)

GUESSES = 20  # circuit hellos with random tokens
PER_PEER = RelaySection().max_circuits_per_peer  # the victim runs with the default caps
CIRCUITS_ASKED = 2 * PER_PEER  # circuits asked for to one reserved peer


@scenario("relay_abuse", "refuse", f"{CIRCUITS_ASKED} circuits to a reserved peer that never answers, and circuits "
          "to peers with no reservation")
async def relay_abuse(status: dict) -> Observed:
    async with attacker_session(status) as asker, attacker_session(status) as target:
        obs = Observed(attacker=my_id(asker))
        async with trio.open_nursery() as n:
            n.start_soon(answer_pings, asker)
            unknown = [(await asker.request(RelayConnect(target="x" * 20), timeout=10)).message for _ in range(5)]
            obs.facts["unreserved_refused"] = all(isinstance(r, RelayConnectReply) and not r.ok for r in unknown)
            ignored: list = []  # the target keeps the RelayIncoming requests and never answers them
            n.start_soon(answer_pings, target, ignored)
            reservation = (await target.request(RelayReserve(), timeout=10)).message
            obs.facts["reserved"] = isinstance(reservation, RelayReservation) and reservation.ok
            if obs.facts["reserved"]:
                replies: list = []

                async def ask() -> None:
                    replies.append((await asker.request(RelayConnect(target=my_id(target)), timeout=30)).message)

                async with trio.open_nursery() as asks:
                    for _ in range(CIRCUITS_ASKED):
                        asks.start_soon(ask)
                obs.facts["incoming_seen"] = sum(isinstance(m, RelayIncoming) for m in ignored)
                obs.facts["granted"] = sum(1 for r in replies if isinstance(r, RelayConnectReply) and r.ok)
                with trio.move_on_after(SETUP_SECONDS + 5):
                    while (await victim_status(status))["nat"]["relay_server"]["circuits"]:
                        await trio.sleep(0.2)
                obs.facts["circuits_left"] = (await victim_status(status))["nat"]["relay_server"]["circuits"]
            obs.facts["asker_alive"] = isinstance((await asker.request(Ping(sent=1.0), timeout=10)).message, Pong)
            n.cancel_scope.cancel()
    cap_ok = obs.facts.get("incoming_seen", 0) <= PER_PEER and obs.facts.get("granted", 0) == 0
    obs.ok = (obs.facts["unreserved_refused"] and obs.facts["asker_alive"]
              and (not obs.facts["reserved"] or (cap_ok and obs.facts["circuits_left"] == 0)))
    obs.reason = (f"refused; {obs.facts.get('incoming_seen', 0)} circuits reached the silent target, "
                  f"{obs.facts.get('circuits_left', 0)} left after {SETUP_SECONDS:g} s")
    return obs


@scenario("dialback_elsewhere", "refuse", "dial-back requests naming another IP's addresses, and too many requests")
async def dialback_elsewhere(status: dict) -> Observed:
    async with attacker_session(status) as s:
        obs = Observed(attacker=my_id(s))
        async with trio.open_nursery() as n:
            n.start_soon(answer_pings, s)
            elsewhere = [f"127.0.0.{i}:9" for i in (2, 3, 4, 5)]
            first = (await s.request(DialBackRequest(addresses=elsewhere), timeout=30)).message
            again = (await s.request(DialBackRequest(addresses=["127.0.0.1:9"]), timeout=30)).message
            n.cancel_scope.cancel()
    results = [r for reply in (first, again) if isinstance(reply, DialBackReply) for r in reply.results]
    obs.facts["reasons"] = [r.reason for r in results]
    obs.facts["codes"] = [r.code for r in results]
    obs.ok = len(results) == 5 and all(not r.ok and r.refusal() is not None for r in results)
    obs.reason = "; ".join(dict.fromkeys(obs.facts["reasons"]))[:300]
    return obs


@scenario("circuit_token_guess", "drop", f"{GUESSES} raw connections opening circuits with random tokens")
async def circuit_token_guess(status: dict) -> Observed:
    port = int(str(status["listen"]).rsplit(":", 1)[1])
    obs = Observed(attacker="(no identity: raw TCP)")
    closed = 0
    t0 = trio.current_time()
    for _ in range(GUESSES):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        try:
            await stream.send_all(hello(secrets.token_bytes(16)))
            with trio.move_on_after(5):
                if await stream.receive_some(1) == b"":
                    closed += 1
        except (trio.BrokenResourceError, OSError):
            closed += 1
        finally:
            await stream.aclose()
    obs.facts["closed"] = closed
    obs.closed_after_s = (trio.current_time() - t0) / GUESSES
    async with attacker_session(status) as honest:
        obs.facts["honest_pong"] = isinstance((await honest.request(Ping(sent=1.0), timeout=10)).message, Pong)
    relay = (await victim_status(status)).get("nat", {}).get("relay_server", {})
    obs.facts["circuits_total"] = relay.get("circuits_total", 0)
    obs.ok = closed == GUESSES and obs.facts["honest_pong"] and obs.facts["circuits_total"] == 0
    obs.reason = f"{closed} of {GUESSES} closed, {obs.closed_after_s:.3f} s each; {obs.facts['circuits_total']} circuits"
    return obs

"""Using relays: holding reservations while we are behind NAT, answering circuits to us, and dialing a
peer through its relay.

Reservations are made over sessions we dialed ourselves, to peers that accept (a relay offers only
while it is publicly reachable), so the address we advertise for the relay is one that worked for us.
Our relayed addresses ("relay-host:port/relay/<relay ID>", `addresses`) go into our signed peer record (the
NAT service gives them to membership, `ShapesAddresses`) and so reach the swarm by peer exchange.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable

import trio

from peer.config import NatSection
from peer.nat.addresses import RelayedAddress
from peer.session.connect import handshake_stream
from peer.session.transport import Session, SessionClosed
from protocol.circuit import READY, hello
from protocol.identity import short_id
from protocol.refusal import Code, Refusal
from protocol.schema import RelayAck, RelayConnect, RelayConnectReply, RelayIncoming, RelayReservation, RelayReserve

log = logging.getLogger("peertrain.relay")

ASK_TIMEOUT = 10.0
"""For a relay's answer to RelayConnect: it first asks the target (relay.ASK_SECONDS, 5 s), then answers."""
READY_TIMEOUT = 10.0  # from our circuit hello to the relay's READY: the other end must connect meanwhile
MAX_INCOMING = 8
"""Circuits to us being set up at once. A relay we trust enough to reserve with could still send many
RelayIncoming; each costs a TCP connection and a handshake for up to READY_TIMEOUT + handshake_timeout."""
REFUSED_BACKOFF = 60.0  # seconds before asking a relay that refused us again
TICK = 2.0  # seconds between looks at whether we hold enough reservations


class RelayRefused(ConnectionError):
    """The relay would not connect us: `refusal` says why, in its own words."""

    def __init__(self, refusal: Refusal):
        super().__init__(f"relay refused: {refusal.reason}")
        self.refusal = refusal


@dataclass
class Held:
    relay_id: str
    address: RelayedAddress
    session: Session
    since: float  # trio clock


async def open_circuit(host: str, port: int, token: bytes, *, connect_timeout: float) -> trio.SocketStream:
    """A TCP connection to the relay that has become one end of a circuit (after the relay's READY)."""
    with trio.fail_after(connect_timeout):
        stream = await trio.open_tcp_stream(host, port)
    try:
        await stream.send_all(hello(token))
        with trio.fail_after(READY_TIMEOUT):
            ready = await stream.receive_some(1)
        if ready != READY:
            raise ConnectionError("the relay closed the circuit before both ends were there")
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    return stream


class RelayClient:
    def __init__(self, cfg: NatSection, *, membership, transport, router, wanted: Callable[[], bool]):
        self.cfg = cfg
        self.membership = membership
        self.transport = transport
        self.wanted = wanted  # whether we need relays now (we are not publicly reachable)
        self.held: dict[str, Held] = {}
        self._published: list[str] = []  # our relayed addresses as `_publish` last saw the reservations
        self._refused_until: dict[str, float] = {}  # relay -> trio clock
        self._incoming = 0
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        router.register(RelayIncoming, self._on_incoming)

    def status(self) -> list[dict]:
        now = trio.current_time()
        return [{"peer_id": h.relay_id, "address": f"{h.address.host}:{h.address.port}", "since_s": round(now - h.since, 1)}
                for h in self.held.values()]

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._keep_reservations()
                with trio.move_on_after(TICK * random.uniform(0.75, 1.25)):
                    await self._wake.wait()
                self._wake = trio.Event()

    def wake(self) -> None:
        """Look at the reservations now (we just learned that we are behind NAT)."""
        self._wake.set()

    def addresses(self) -> list[str]:
        """Our relayed addresses: those of the reservations held, as of the last look at them."""
        return list(self._published)

    def _publish(self) -> None:
        self._published = [str(h.address) for h in self.held.values()]

    async def _keep_reservations(self) -> None:
        for relay_id in [r for r, h in self.held.items() if h.session.closed.is_set()]:
            log.info("lost relay %s (its session ended)", short_id(relay_id))
            del self.held[relay_id]
        if not self.wanted():
            self.held.clear()  # the relays drop them when the sessions end; we only stop advertising
            self._publish()
            return
        now = trio.current_time()
        candidates = [s for pid, s in self.membership.connected().items()
                      if pid not in self.held and s.path == "direct" and s.initiator
                      and self._refused_until.get(pid, 0.0) <= now]
        random.shuffle(candidates)
        for session in candidates:
            if len(self.held) >= self.cfg.relays:
                break
            try:
                reply = (await session.request(RelayReserve(), timeout=ASK_TIMEOUT)).message
            except (SessionClosed, trio.TooSlowError):
                continue
            if not isinstance(reply, RelayReservation) or not reply.ok:
                self._refused_until[session.peer_id] = now + REFUSED_BACKOFF
                log.debug("%s will not relay for us: %s", session.short,
                          reply.refusal() if isinstance(reply, RelayReservation) else "no answer")
                continue
            host, port = session.remote_addr
            self.held[session.peer_id] = Held(session.peer_id, RelayedAddress(session.peer_id, host, port), session, now)
            log.info("relay %s at %s:%d holds a reservation for us: peers can reach us through it",
                     session.short, host, port)
        self._publish()

    # ---- circuits to us -----------------------------------------------------------------------------
    async def _on_incoming(self, session, env) -> None:
        held = self.held.get(session.peer_id)
        msg: RelayIncoming = env.message
        if held is None or held.session is not session:
            await session.reply(env, RelayAck.refused(Refusal(Code.NO_RESERVATION, "we hold no reservation with you")))
            return
        if self._incoming >= MAX_INCOMING or self._nursery is None:
            await session.reply(env, RelayAck.refused(Refusal(Code.BUSY, f"busy ({MAX_INCOMING} circuits being set up)")))
            return
        self._incoming += 1
        await session.reply(env, RelayAck(ok=True))
        self._nursery.start_soon(self._accept, held, msg.source, msg.token)

    async def _accept(self, held: Held, source: str, token: bytes) -> None:
        try:
            session = await self._through(held.address, token, initiator=False, peer_id=source)
        except Exception as exc:  # OSError, timeouts, HandshakeError: the circuit is simply not made
            log.info("circuit from %s through %s failed: %s", short_id(source), short_id(held.relay_id),
                     exc or type(exc).__name__)
            return
        finally:
            self._incoming -= 1
        self.membership.adopt(session)

    async def _through(self, relayed: RelayedAddress, token: bytes, *, initiator: bool, peer_id: str) -> Session:
        """Our end of a circuit through `relayed`'s relay, with the handshake to `peer_id` run through it."""
        stream = await open_circuit(relayed.host, relayed.port, token, connect_timeout=self.transport.handshake_timeout)
        session = await handshake_stream(stream, self.transport, initiator=initiator, expected_peer_id=peer_id,
                                         remote_addr=(relayed.host, relayed.port))
        session.via, session.path = relayed.relay_id, "relayed"
        return session

    # ---- circuits from us ---------------------------------------------------------------------------
    async def dial_via(self, info, relayed: RelayedAddress) -> Session:
        """Membership's dialer for a relayed address: ask the relay, then handshake through the circuit."""
        relay = self.membership.connected().get(relayed.relay_id)
        if relay is None or relay.path == "relayed":
            self.membership.learn(relayed.relay_id, [(relayed.host, relayed.port)], source="pex")
            raise ConnectionError(f"not connected to relay {short_id(relayed.relay_id)} yet (dialing it)")
        try:
            reply = (await relay.request(RelayConnect(target=info.peer_id), timeout=ASK_TIMEOUT)).message
        except SessionClosed as exc:
            raise ConnectionError(f"relay {short_id(relayed.relay_id)} left: {exc}") from None
        if not isinstance(reply, RelayConnectReply) or not reply.ok:
            refused = reply.refusal() if isinstance(reply, RelayConnectReply) else None
            raise RelayRefused(refused or Refusal(Code.UNKNOWN, "no answer"))
        return await self._through(relayed, reply.token, initiator=True, peer_id=info.peer_id)

"""The relay: a publicly reachable daemon forwarding connections to peers that hold a reservation.

A peer behind NAT reserves (RelayReserve) over its own session with us; a peer that wants to reach it
asks us (RelayConnect); we tell the reserved peer (RelayIncoming) and hand both a one-time token; each
opens a fresh TCP connection to our listener with that token (`protocol.circuit`), and we join the two
(peer/nat/splice.py). The peers then run their own handshake through the circuit: we forward sealed
bytes and never hold a key.

A relay is a service strangers use, so everything a peer can make it hold is capped (`[relay]`):
reservations, circuits in total and per peer (counted from the request on, so pending ones count too),
seconds to set a circuit up, bytes and seconds per circuit, and bandwidth for all together.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import trio

from peer.config import RelaySection
from peer.nat.splice import CHUNK, CircuitStats, splice
from peer.token_bucket import TokenBucket
from protocol.circuit import READY
from protocol.identity import short_id
from protocol.limits import MiB
from protocol.refusal import Code, Refusal
from protocol.schema import RelayAck, RelayConnect, RelayConnectReply, RelayIncoming, RelayReservation, RelayReserve

log = logging.getLogger("peertrain.relay")

SETUP_SECONDS = 10.0
"""From a RelayConnect to both ends having arrived with their tokens: a reserved peer answers within
ASK_SECONDS and then needs one TCP connect to us; 10 s covers slow links, and bounds how long a
requester can make us hold a pending circuit (which counts against its per-peer cap)."""
ASK_SECONDS = 5.0  # for the reserved peer's RelayAck; a peer that does not answer in 5 s is not there


@dataclass
class Reservation:
    peer_id: str
    session: object
    since: float  # trio clock


@dataclass(eq=False)  # kept in a set, by identity
class Circuit:
    source: str
    target: str
    streams: dict[str, trio.SocketStream] = field(default_factory=dict)  # "source" / "target"
    settled: trio.Event = field(default_factory=trio.Event)  # both arrived, or gave up
    done: trio.Event = field(default_factory=trio.Event)
    failed: str = ""
    stats: CircuitStats = field(default_factory=CircuitStats)


@dataclass
class RelayStats:
    circuits_total: int = 0
    bytes_relayed: int = 0  # by circuits that ended
    refused: int = 0
    last_refusal: str = ""


class RelayServer:
    def __init__(self, cfg: RelaySection, router, *, offering: Callable[[], Refusal | None]):
        """`offering()` is None while we relay, else why not (relaying off, not publicly reachable)."""
        self.cfg = cfg
        self.offering = offering
        self.reservations: dict[str, Reservation] = {}
        self._tokens: dict[bytes, tuple[Circuit, str]] = {}
        self._circuits: set[Circuit] = set()  # pending or forwarding
        self._per_peer: Counter[str] = Counter()  # circuits per peer, as source or target
        rate = cfg.max_bandwidth_mib_s * MiB  # a burst of a second's worth, and at least one chunk a turn
        self.bucket = TokenBucket(rate, max(rate, CHUNK), clock=trio.current_time)
        self.stats = RelayStats()
        self.tap: Callable[[str, bytes], None] | None = None  # tests: see every forwarded chunk
        self._nursery: trio.Nursery | None = None
        router.register(RelayReserve, self._on_reserve)
        router.register(RelayConnect, self._on_connect)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the circuit set-ups (asking the reserved peer, then waiting for both ends)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def forget(self, peer_id: str) -> None:
        """The peer's session ended: so did its reservation."""
        r = self.reservations.get(peer_id)
        if r is not None and r.session.closed.is_set():
            del self.reservations[peer_id]

    def status(self) -> dict:
        live = sum(c.stats.bytes_forwarded for c in self._circuits)
        why_not = self.offering()
        return {"enabled": self.cfg.enabled, "offering": why_not is None, "why_not": why_not.reason if why_not else "",
                "reservations": len(self.reservations), "circuits": len(self._circuits),
                "circuits_total": self.stats.circuits_total, "bytes_relayed": self.stats.bytes_relayed + live,
                "refused": self.stats.refused, "last_refusal": self.stats.last_refusal}

    def _refuse(self, what: str, peer: str, refusal: Refusal) -> Refusal:
        self.stats.refused += 1
        self.stats.last_refusal = f"{what} from {short_id(peer)}: {refusal.reason}"
        log.info("refusing %s from %s: %s", what, short_id(peer), refusal.reason)
        return refusal

    # ---- reservations -------------------------------------------------------------------------------
    async def _on_reserve(self, session, env) -> None:
        why = self.offering()
        if why is None and session.path == "relayed":
            why = Refusal(Code.WRONG_PATH, "reserve over a direct session (circuits do not nest)")
        if why is None and session.peer_id not in self.reservations and len(self.reservations) >= self.cfg.max_reservations:
            why = Refusal(Code.BUSY, f"full ({self.cfg.max_reservations} reservations)")
        if why is not None:
            await session.reply(env, RelayReservation.refused(self._refuse("reservation", session.peer_id, why)))
            return
        self.reservations[session.peer_id] = Reservation(session.peer_id, session, trio.current_time())
        log.info("%s holds a relay reservation (%d in all)", session.short, len(self.reservations))
        await session.reply(env, RelayReservation(ok=True, max_circuit_bytes=self.cfg.max_circuit_mib * MiB,
                                                  max_circuit_seconds=self.cfg.max_circuit_seconds))

    # ---- circuits -----------------------------------------------------------------------------------
    def _connect_refusal(self, session, target: str) -> Refusal | None:
        why = self.offering()
        if why is not None:
            return why
        if session.path == "relayed":
            return Refusal(Code.WRONG_PATH, "ask over a direct session (circuits do not nest)")
        r = self.reservations.get(target)
        if r is None or r.session.closed.is_set():
            return Refusal(Code.NO_RESERVATION, "no reservation for that peer here")
        if target == session.peer_id:
            return Refusal(Code.BAD_INPUT, "a circuit to yourself")
        if len(self._circuits) >= self.cfg.max_circuits:
            return Refusal(Code.BUSY, f"full ({self.cfg.max_circuits} circuits)")
        for peer in (session.peer_id, target):
            if self._per_peer[peer] >= self.cfg.max_circuits_per_peer:
                return Refusal(Code.BUSY, f"{short_id(peer)} already has {self.cfg.max_circuits_per_peer} circuits here")
        return None

    async def _on_connect(self, session, env) -> None:
        target = env.message.target
        why = self._connect_refusal(session, target)
        if why is not None or self._nursery is None:
            why = why or Refusal(Code.TOO_SOON, "starting")
            await session.reply(env, RelayConnectReply.refused(self._refuse("circuit", session.peer_id, why)))
            return
        circuit = Circuit(source=session.peer_id, target=target)
        self._circuits.add(circuit)
        self._per_peer.update((circuit.source, circuit.target))
        self._nursery.start_soon(self._set_up, session, env, circuit)

    async def _set_up(self, session, env, circuit: Circuit) -> None:
        """Ask the target, answer the source, wait for both ends; release everything if it fails."""
        token_source, token_target = secrets.token_bytes(16), secrets.token_bytes(16)
        self._tokens[token_source] = (circuit, "source")
        self._tokens[token_target] = (circuit, "target")
        try:
            with trio.move_on_after(SETUP_SECONDS):
                target = self.reservations.get(circuit.target)
                reply = None
                if target is not None:
                    try:
                        reply = (await target.session.request(RelayIncoming(source=circuit.source, token=token_target),
                                                              timeout=ASK_SECONDS)).message
                    except Exception as exc:  # timeout, session gone: the target is not there
                        circuit.failed = f"the peer did not answer ({type(exc).__name__})"
                if not isinstance(reply, RelayAck) or not reply.ok:
                    declined = reply.refusal() if isinstance(reply, RelayAck) else None
                    if declined is not None:  # the target's own code: busy, or it holds no reservation with us
                        circuit.failed = circuit.failed or f"the peer declined: {declined.reason}"
                    else:  # a reservation that does not answer is as good as none
                        circuit.failed = circuit.failed or "the peer did not answer"
                        declined = Refusal(Code.NO_RESERVATION, circuit.failed)
                    await session.reply(env, RelayConnectReply.refused(Refusal(declined.code, circuit.failed)))
                    return
                await session.reply(env, RelayConnectReply(ok=True, token=token_source))
                await circuit.settled.wait()
            if len(circuit.streams) < 2:
                circuit.failed = circuit.failed or f"both ends did not arrive within {SETUP_SECONDS:g} s"
                circuit.settled.set()
                return
            await circuit.done.wait()  # the second end's task forwards; we keep the counts until it ends
        except Exception as exc:  # the source's session ended while we answered it
            circuit.failed = circuit.failed or f"{type(exc).__name__}: {exc}"
        finally:
            self._tokens.pop(token_source, None)
            self._tokens.pop(token_target, None)
            if circuit.failed:
                log.info("circuit %s -> %s not made: %s", short_id(circuit.source), short_id(circuit.target), circuit.failed)
            circuit.settled.set()
            self._circuits.discard(circuit)
            self._per_peer.subtract((circuit.source, circuit.target))
            self._per_peer += Counter()  # drop zero counts

    def expecting_circuits(self) -> bool:
        """Whether a circuit is being set up (a token is out): else the listener closes a circuit hello at once."""
        return bool(self._tokens)

    async def accept_circuit(self, stream: trio.SocketStream, token: bytes) -> None:
        """A connection that said a circuit hello with `token` (the listener read it, in a handshake slot)."""
        found = self._tokens.pop(token, None)
        if found is None:
            log.info("circuit connection with an unknown or used token; closed")
            return
        circuit, role = found
        circuit.streams[role] = stream
        if len(circuit.streams) < 2:
            await circuit.settled.wait()  # the other end's task forwards both; this one only holds its stream
            if not circuit.failed:
                await circuit.done.wait()
            return
        circuit.settled.set()
        a, b = circuit.streams["source"], circuit.streams["target"]
        self.stats.circuits_total += 1
        log.info("relaying %s <-> %s", short_id(circuit.source), short_id(circuit.target))
        try:
            for s in (a, b):
                await s.send_all(READY)
            await splice(a, b, max_bytes=self.cfg.max_circuit_mib * MiB, max_seconds=self.cfg.max_circuit_seconds,
                         bucket=self.bucket, stats=circuit.stats, tap=self.tap)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            circuit.stats.ended = circuit.stats.ended or str(exc)
        finally:
            self.stats.bytes_relayed += circuit.stats.bytes_forwarded
            log.info("circuit %s <-> %s ended after %d bytes: %s", short_id(circuit.source), short_id(circuit.target),
                     circuit.stats.bytes_forwarded, circuit.stats.ended or "closed")
            circuit.done.set()

"""Establishing sessions: `dial` a peer, or `serve` a listener, running the sans-I/O handshake from
`protocol.handshake` under a deadline before a byte of application data moves, then wrapping the socket
in a `Session`. The listener bounds what strangers can hold: handshakes in progress (`MAX_HANDSHAKES`,
oldest evicted), sessions in total and per IP (`max_connections`), and it frees a slot held by an idle
session for a newcomer (`idle_victim`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import trio

from peer.session.transport import Session, TransportConfig, send_all
from protocol.circuit import PEEK_BYTES, is_circuit
from protocol.errors import HandshakeError, ProtocolError
from protocol.handshake import Handshake
from protocol.identity import short_id

log = logging.getLogger("peertrain.transport")

EVICTED_REASON = "evicted: idle, slot needed"

async def _recv_exactly(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = await sock.recv(n - len(data))
        if not chunk:
            raise HandshakeError("connection closed before the handshake")
        data += chunk
    return data


async def _run_handshake(stream: trio.SocketStream, hs: Handshake, timeout: float, initial: bytes = b""):
    sock = stream.socket
    with trio.fail_after(timeout):
        if initial:
            hs.receive_data(initial)
        out = hs.data_to_send()
        if out:
            await send_all(sock, memoryview(out))
        while not hs.complete:
            data = await sock.recv(65536)
            if not data:
                raise HandshakeError("connection closed during the handshake")
            hs.receive_data(data)
            out = hs.data_to_send()
            if out:
                await send_all(sock, memoryview(out))
    return hs.result()


def _handshake_for(cfg: TransportConfig, *, initiator: bool, expected_peer_id: str | None,
                   observed: tuple[str, int] | None = None, dialed: str | None = None) -> Handshake:
    """Our handshake, with what the app payload says beside `cfg.app_payload` (like libp2p's identify):
    `time`, our wall clock (the peer learns how far our clocks differ); as responder `observed` and
    `observed_port`, where we see the initiator from (its address behind any NAT: what it may advertise,
    and whether its NAT keeps ports); as initiator `dialed`, the address we reached the responder at
    (a listener on 0.0.0.0 learns an address that works from outside). Circuits through a relay send
    neither: the relay's address would say nothing about the peer."""
    payload = dict(cfg.app_payload, time=time.time())
    if observed is not None:
        payload.update(observed=observed[0], observed_port=observed[1])
    if dialed is not None:
        payload["dialed"] = dialed
    return Handshake(
        initiator=initiator, identity=cfg.identity, swarm=cfg.swarm, psk=cfg.psk, ciphers=cfg.ciphers,
        app_payload=payload, expected_peer_id=expected_peer_id, allowed_peer_ids=cfg.allowed_peer_ids)


async def handshake_stream(stream: trio.SocketStream, cfg: TransportConfig, *, initiator: bool,
                           expected_peer_id: str | None, remote_addr: tuple[str, int],
                           dialed: str | None = None) -> Session:
    """Run the handshake over a connected stream (a dial, a relay circuit, a punched connection) and
    wrap it in a Session; the stream is closed if the handshake fails or is cancelled."""
    try:
        result = await _run_handshake(stream, _handshake_for(cfg, initiator=initiator, expected_peer_id=expected_peer_id,
                                                             dialed=dialed), cfg.handshake_timeout)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    return Session(stream, result=result, cfg=cfg, initiator=initiator, remote_addr=remote_addr)


async def dial(host: str, port: int, cfg: TransportConfig, *, expected_peer_id: str | None = None,
               connect_timeout: float = 5.0) -> Session:
    """Connect and handshake as initiator. Raises OSError, trio.TooSlowError or HandshakeError."""
    with trio.fail_after(connect_timeout):
        stream = await trio.open_tcp_stream(host, port)
    return await handshake_stream(stream, cfg, initiator=True, expected_peer_id=expected_peer_id,
                                  remote_addr=(host, port), dialed=f"{host}:{port}")


MAX_HANDSHAKES = 16
"""Inbound handshakes in progress at once, apart from the session slots (`max_connections`). When full,
the oldest is dropped for the newcomer: connections that never finish a handshake (slowloris) then only
push out each other, while an honest handshake, which takes milliseconds, is done long before 16 newer
connections arrive. 16 also admits a burst of peers joining at once."""


@dataclass
class ListenerStats:
    accepted: int = 0
    refused: int = 0
    handshake_failures: int = 0
    handshakes_evicted: int = 0  # the oldest handshake dropped for a newer connection (MAX_HANDSHAKES)
    evicted: int = 0  # idle sessions closed for a newcomer (serve's `idle_victim`)
    per_ip: dict[str, int] = field(default_factory=dict)


async def open_listeners(host: str, port: int) -> tuple[list[trio.SocketListener], tuple[str, int]]:
    """Bind the TCP listener first, so the daemon knows its real port (port 0 = pick one) before serving."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}"
                      + ("; another program (or daemon) uses that port: pick another with --listen HOST:PORT or use port 0"
                         if exc.errno == 98 else "")) from None
    bound = listeners[0].socket.getsockname()[:2]
    return listeners, (bound[0], bound[1])


async def serve(listeners: list[trio.SocketListener], cfg: TransportConfig, on_session: Callable[[Session], Any], *,
                max_connections: int = 64, max_connections_per_ip: int = 16,
                max_handshakes: int = MAX_HANDSHAKES, stats: ListenerStats | None = None,
                idle_victim: Callable[[list[Session]], Session | None] | None = None,
                on_circuit: Callable[[trio.SocketStream], Awaitable[None]] | None = None,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections, handshake each under a deadline, hand sessions to `on_session`.

    `on_session(session)` is awaited in the connection's own task and owns the session until it
    returns (then the session is closed). One misbehaving connection never affects the listener or
    other connections: session limits are checked before the handshake (and counted once it is done),
    handshakes have their own slots (`max_handshakes`, oldest evicted when full) and a deadline.

    When the session slots (total, or this IP's) are full, `idle_victim(sessions)` picks one of those
    inbound sessions that may go (idle, by its owner's judgement) or None; a newcomer is refused only when
    none may. It is asked before the handshake (is there one?) and the session is closed only after it,
    so an unauthenticated connection never evicts anyone.

    A connection that opens with a relay circuit hello (`protocol.circuit`) instead of a handshake goes to
    `on_circuit(stream)` (the relay, which bounds circuits itself) and holds no session slot.
    """
    stats = stats if stats is not None else ListenerStats()
    active = 0  # sessions
    sessions: dict[Session, str] = {}  # inbound sessions holding a slot -> their IP
    handshaking: dict[trio.CancelScope, None] = {}  # in the order they started

    def competitors(ip: str) -> list[Session] | None:
        """None while a slot is free for `ip`; else the sessions one of which must go to free one."""
        if stats.per_ip.get(ip, 0) >= max_connections_per_ip:
            return [s for s, a in sessions.items() if a == ip]
        if active >= max_connections:
            return list(sessions)
        return None

    def release(session: Session) -> bool:
        nonlocal active
        ip = sessions.pop(session, None)
        if ip is None:
            return False
        active -= 1
        stats.per_ip[ip] -= 1
        if not stats.per_ip[ip]:
            del stats.per_ip[ip]
        return True

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal active
        try:
            remote = stream.socket.getpeername()[:2]
        except OSError:
            await stream.aclose()
            return
        ip = remote[0]
        if len(handshaking) >= max_handshakes:
            stats.handshakes_evicted += 1
            oldest = next(iter(handshaking))
            del handshaking[oldest]
            oldest.cancel()
        scope = trio.CancelScope()
        handshaking[scope] = None
        result = None
        circuit = refused = False
        try:
            with scope, trio.fail_after(cfg.handshake_timeout):
                prefix = await _recv_exactly(stream.socket, PEEK_BYTES)
                if on_circuit is not None and is_circuit(prefix):
                    circuit = True
                else:
                    full = competitors(ip)
                    refused = full is not None and (idle_victim is None or idle_victim(full) is None)
                    if not refused:
                        hs = _handshake_for(cfg, initiator=False, expected_peer_id=None, observed=(remote[0], remote[1]))
                        result = await _run_handshake(stream, hs, cfg.handshake_timeout, initial=prefix)
        except trio.TooSlowError:
            log.warning("handshake from %s:%d timed out after %.1fs; dropped", remote[0], remote[1], cfg.handshake_timeout)
        except (ProtocolError, OSError, trio.BrokenResourceError) as exc:
            log.warning("handshake from %s:%d failed: %s", remote[0], remote[1], exc)
        finally:
            handshaking.pop(scope, None)
        if circuit:
            try:
                await on_circuit(stream)
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
            return
        if refused:
            stats.refused += 1
            log.warning("refusing connection from %s: connection limit reached (%d total, %d from this IP), none idle",
                        ip, active, stats.per_ip.get(ip, 0))
            await stream.aclose()
            return
        if result is None:
            stats.handshake_failures += 1
            if scope.cancelled_caught:
                log.warning("handshake from %s:%d dropped for a newer connection (%d in progress)",
                            remote[0], remote[1], max_handshakes)
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        full = competitors(ip)  # checked again: others may have come, or the idle one woken up, meanwhile
        if full is not None:
            victim = idle_victim(full) if idle_victim is not None else None
            if victim is None:
                stats.refused += 1
                log.warning("refusing session from %s: connection limit reached, none idle", ip)
                with trio.CancelScope(shield=True):
                    await stream.aclose()
                return
            release(victim)  # its slot is the newcomer's now, before its task has wound down
            stats.evicted += 1
            log.warning("closing session with %s: %s (for %s from %s)", victim.short, EVICTED_REASON,
                        short_id(result.peer_id), ip)
            await victim.aclose(EVICTED_REASON)
        session = None
        try:
            session = Session(stream, result=result, cfg=cfg, initiator=False, remote_addr=remote)
            sessions[session] = ip
            active += 1
            stats.per_ip[ip] = stats.per_ip.get(ip, 0) + 1
            stats.accepted += 1
            await on_session(session)
        finally:
            if session is not None:
                release(session)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async with trio.open_nursery() as nursery:
        task_status.started()
        await trio.serve_listeners(handle, listeners, handler_nursery=nursery)

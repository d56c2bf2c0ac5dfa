"""Establishing sessions: `dial` a peer, or `serve` a listener, running the sans-I/O handshake from
`protocol.handshake` under a deadline before a byte of application data moves, then wrapping the socket
in a `Session`. The listener bounds what strangers can hold: handshakes and circuit hellos in progress
(`HandshakeSlots`: per IP, per prefix and in total, a flood pushing out only its own), sessions in total
and per IP (`max_connections`), and it frees a slot held by an idle session for a newcomer (`idle_victim`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import trio

from peer.logs import Throttle
from peer.session.handshake_slots import HandshakeSlots, source_of
from peer.session.transport import Session, TransportConfig, send_all
from protocol.circuit import HELLO_BYTES, PEEK_BYTES, is_circuit, parse_hello
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
        app_payload=payload, expected_peer_id=expected_peer_id, allowed_peer_ids=cfg.allowed_peer_ids,
        min_identity_bits=cfg.identity_bits)


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
               connect_timeout: float = 5.0, local_address: str | None = None) -> Session:
    """Connect and handshake as initiator (from `local_address`, if given, else the kernel's choice).
    Raises OSError, trio.TooSlowError or HandshakeError."""
    with trio.fail_after(connect_timeout):
        stream = await trio.open_tcp_stream(host, port, local_address=local_address)
    return await handshake_stream(stream, cfg, initiator=True, expected_peer_id=expected_peer_id,
                                  remote_addr=(host, port), dialed=f"{host}:{port}")


LOG_EVERY_S = 10.0
"""Per kind of failed inbound connection (timed out, failed, pushed out, stray circuit), one log line this
often: a flood causes thousands a second, and each line says how many more there were."""


@dataclass
class ListenerStats:
    accepted: int = 0
    refused: int = 0
    handshake_failures: int = 0
    handshakes_evicted: int = 0  # handshakes pushed out of their slot for a newer connection (HandshakeSlots)
    circuits_dropped: int = 0  # circuit hellos while no circuit was being set up here (not a relay, or idle)
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


def fair_victim(sessions: dict[Session, str], ip: str) -> Session | None:
    """When every session slot is taken and none is idle: the newest session of the prefix (IPv4 /24, IPv6 /48:
    `source_of`) holding the most, from its IP holding the most, if that prefix holds at least two more than
    `ip`'s. Sessions that send any cheap message are never idle, so without this 4 IPs x 16 keys held every
    inbound place; now each prefix can hold about its share of them against a newcomer from another."""
    by_prefix: dict[str, list[tuple[Session, str]]] = {}
    for session, addr in sessions.items():
        by_prefix.setdefault(source_of(addr)[1], []).append((session, addr))
    if not by_prefix:
        return None
    mine = len(by_prefix.get(source_of(ip)[1], ()))
    biggest = max(by_prefix.values(), key=len)
    if len(biggest) < mine + 2:
        return None
    per_ip: dict[str, int] = {}
    for _, addr in biggest:
        per_ip[addr] = per_ip.get(addr, 0) + 1
    crowded = max(per_ip, key=per_ip.__getitem__)
    return [session for session, addr in biggest if addr == crowded][-1]  # dicts keep admission order


async def serve(listeners: list[trio.SocketListener], cfg: TransportConfig, on_session: Callable[[Session], Any], *,
                max_connections: int = 64, max_connections_per_ip: int = 16,
                slots: HandshakeSlots | None = None, stats: ListenerStats | None = None,
                idle_victim: Callable[[list[Session]], Session | None] | None = None,
                on_circuit: Callable[[trio.SocketStream, bytes], Awaitable[None]] | None = None,
                circuits_expected: Callable[[], bool] = lambda: True,
                task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accept connections, handshake each under a deadline, hand sessions to `on_session`.

    `on_session(session)` is awaited in the connection's own task and owns the session until it
    returns (then the session is closed). One misbehaving connection never affects the listener or
    other connections: session limits are checked before the handshake (and counted once it is done),
    handshakes have their own slots (`slots`: a newcomer always gets one, and pushes out the oldest of the
    source holding the most, see `peer/session/handshake_slots.py`) and a deadline.

    When the session slots (total, or this IP's) are full, `idle_victim(sessions)` picks one of those
    inbound sessions that may go (idle, by its owner's judgement) or None; a newcomer is refused only when
    none may. It is asked before the handshake (is there one?) and the session is closed only after it,
    so an unauthenticated connection never evicts anyone.

    A connection that opens with a relay circuit hello (`protocol.circuit`) instead of a handshake says
    its token in a handshake slot, under the same deadline, and then goes to `on_circuit(stream, token)`
    (the relay, which bounds circuits itself) holding no slot; it is closed at once, after 4 bytes, while
    `circuits_expected()` is false (no circuit is being set up here: not a relay, or an idle one).
    """
    stats = stats if stats is not None else ListenerStats()
    slots = slots if slots is not None else HandshakeSlots()
    quiet = Throttle(LOG_EVERY_S)
    active = 0  # sessions
    sessions: dict[Session, str] = {}  # inbound sessions holding a slot -> their IP

    def competitors(ip: str) -> list[Session] | None:
        """None while a slot is free for `ip`; else the sessions one of which must go to free one."""
        if stats.per_ip.get(ip, 0) >= max_connections_per_ip:
            return [s for s, a in sessions.items() if a == ip]
        if active >= max_connections:
            return list(sessions)
        return None

    def victim_for(ip: str, full: list[Session]) -> Session | None:
        """Who gives way to an authenticated newcomer from `ip` when `full` hold every slot: an idle one (the
        owner's judgement), else, when all slots are taken, the newest session of the prefix holding the most,
        if that is at least two more than the newcomer's holds (fair_victim)."""
        victim = idle_victim(full) if idle_victim is not None else None
        if victim is None and active >= max_connections and stats.per_ip.get(ip, 0) < max_connections_per_ip:
            victim = fair_victim(sessions, ip)
        return victim

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

    def warn(kind: str, msg: str, *args) -> None:
        more = quiet.allow(kind)
        if more is not None:
            log.warning(msg + Throttle.more(more), *args)

    async def handle(stream: trio.SocketStream) -> None:
        nonlocal active
        try:
            remote = stream.socket.getpeername()[:2]
        except OSError:
            await stream.aclose()
            return
        ip = remote[0]
        scope = trio.CancelScope()
        pushed = slots.admit(ip, scope)
        if pushed is not None:
            stats.handshakes_evicted += 1
            pushed.cancel()
        result = token = None
        stray = refused = False
        try:
            with scope, trio.fail_after(cfg.handshake_timeout):
                prefix = await _recv_exactly(stream.socket, PEEK_BYTES)
                if is_circuit(prefix):
                    if on_circuit is None or not circuits_expected():
                        stray = True
                    else:
                        token = parse_hello(prefix + await _recv_exactly(stream.socket, HELLO_BYTES - PEEK_BYTES))
                else:
                    full = competitors(ip)
                    refused = full is not None and victim_for(ip, full) is None
                    if not refused:
                        hs = _handshake_for(cfg, initiator=False, expected_peer_id=None, observed=(remote[0], remote[1]))
                        result = await _run_handshake(stream, hs, cfg.handshake_timeout, initial=prefix)
        except trio.TooSlowError:
            warn("timeout", "handshake from %s:%d timed out after %.1fs; dropped", remote[0], remote[1],
                 cfg.handshake_timeout)
        except (ProtocolError, OSError, trio.BrokenResourceError) as exc:
            warn("failed", "handshake from %s:%d failed: %s", remote[0], remote[1], exc)
        finally:
            slots.release(scope)
        if token is not None:
            try:
                await on_circuit(stream, token)
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()
            return
        if stray:
            stats.circuits_dropped += 1
            warn("circuit", "circuit hello from %s:%d, but no circuit is being set up here; closed", remote[0], remote[1])
            await stream.aclose()
            return
        if refused:
            stats.refused += 1
            warn("refused", "refusing connection from %s: connection limit reached (%d total, %d from this IP), none idle",
                 ip, active, stats.per_ip.get(ip, 0))
            await stream.aclose()
            return
        if result is None:
            stats.handshake_failures += 1
            if scope.cancelled_caught:
                warn("pushed", "handshake from %s:%d pushed out for a newer connection (%d in progress, %d from "
                     "its IP, %d from its prefix)", remote[0], remote[1], len(slots), slots.held_by_ip(ip),
                     slots.held_by_prefix(ip))
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        full = competitors(ip)  # checked again: others may have come, or the idle one woken up, meanwhile
        if full is not None:
            victim = victim_for(ip, full)
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

"""Hole punching: turning a relayed session into a direct one by a simultaneous TCP open.

Both peers sit behind NATs that drop unsolicited inbound connections, but let in packets that match a
connection their side started. If each dials the other's outside address at about the same time, each
NAT sees its own side's SYN first, so the other side's SYN counts as an answer; TCP's simultaneous open
then makes one connection. Coordination runs over the relayed session (DCUtR's recipe, libp2p):

  dialer of the relayed session (B)          the other peer (A)
  bind a fresh port pB
  PunchOffer(B's outside IP:pB)  ---------->  bind a fresh port pA
                                 <----------  PunchOffer(A's outside IP:pA)   (B measures the round trip)
  PunchSync                      ---------->  dial B now
  wait half the round trip, dial A

Each side dials from its bound port, again and again for PUNCH_WINDOW seconds. The outside port equals
the local one only behind a NAT that keeps ports (Linux MASQUERADE does when it can); a NAT that picks a
new port per destination cannot be punched this way, and the pair stays relayed (`peer doctor` says so).
B runs the handshake as initiator on the new connection; membership then keeps the direct session and
closes the relayed one. A failure keeps the relayed session and is retried with backoff.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import trio

from peer.nat.addresses import format_hostport, ip_literal, parse_address
from peer.session.connect import dial, handshake_stream
from protocol.identity import short_id
from protocol.refusal import Code, Refusal
from protocol.schema import ErrorReply, PunchOffer, PunchSync

log = logging.getLogger("peertrain.nat")

PUNCH_WINDOW = 8.0
"""Seconds both sides keep dialing: the first SYN of each side is often dropped by the other NAT (its
own SYN has not left yet), and the kernel resends after 1 s, then 3 s; 8 s covers those and a skew
between the two starts of up to a few seconds."""
ATTEMPT = 1.5  # one connect() before it is retried: long enough for the kernel's first SYN resend (1 s)
SYNC_WAIT = 5.0  # the offered side waits this long for PunchSync before it gives up
ASK_TIMEOUT = 5.0  # for the other side's PunchOffer
MAX_PUNCHES = 4  # punches at once (each holds a socket and a relayed session's attention)
FIRST_BACKOFF, MAX_BACKOFF = 30.0, 900.0  # a failed pair tries again after 30 s, doubling to 15 min
RECENT = 16  # punch outcomes kept for `peer status`


@dataclass
class Outcome:
    peer_id: str
    ok: bool
    reason: str
    seconds: float
    at: float


@dataclass
class Punch:
    session: object
    sync: trio.Event = field(default_factory=trio.Event)


def bound_socket(family: int = socket.AF_INET) -> trio.socket.SocketType:
    """A socket that may share its port with the punch's listener and earlier attempts."""
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


async def punch_port() -> trio.socket.SocketType:
    """A listening socket on a fresh port: the port both our SYNs leave from and theirs may arrive at."""
    listener = bound_socket()
    try:
        await listener.bind(("", 0))
        listener.listen(4)
    except BaseException:
        listener.close()
        raise
    return listener


async def connections(listener: trio.socket.SocketType, remote: tuple[str, int], window: float,
                      send: trio.MemorySendChannel) -> None:
    """Every TCP connection between our punch port and `remote` within `window` seconds, whichever way it
    forms: our connect() (a simultaneous open, or their listener answering) or our listener accepting
    their SYN once our own SYN has opened our NAT. Both are needed: on a path where one side's SYN
    arrives before the other's has left, that SYN meets a listener instead of a refusal."""
    port = listener.getsockname()[1]
    last = "no attempt"

    async def accept() -> None:
        while True:
            conn, addr = await listener.accept()
            if addr[:2] == remote:  # anyone else is not the peer we are punching to
                await send.send(trio.SocketStream(conn))
            else:
                conn.close()

    async def dial() -> None:
        nonlocal last
        while True:
            sock = bound_socket(listener.family)
            try:
                await sock.bind(("", port))
                with trio.move_on_after(ATTEMPT):
                    await sock.connect(remote)
                    await send.send(trio.SocketStream(sock))
                    sock = None
                    return
                last = "timed out"
            except OSError as exc:
                last = exc.strerror or type(exc).__name__
                await trio.sleep(0.1)
            finally:
                if sock is not None:
                    sock.close()

    with trio.move_on_after(window):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept)
            nursery.start_soon(dial)
    raise TimeoutError(f"no connection to {format_hostport(*remote)} within {window:g} s ({last})")


class HolePuncher:
    def __init__(self, *, membership, transport, router, public_ip: Callable[[], str | None], enabled: bool,
                 mapping: Callable[[], str] = lambda: "unknown"):
        self.membership = membership
        self.transport = transport
        self.public_ip = public_ip
        self.mapping = mapping  # our NAT's port mapping (peer/nat/service.py): "random" cannot be punched
        self.enabled = enabled
        self._active: dict[str, Punch] = {}
        self._backoff: dict[str, tuple[int, float]] = {}  # peer -> (failures in a row, next try, trio clock)
        self._dialed: dict[str, frozenset] = {}  # peer -> the direct addresses last tried over its relayed session
        self._upgrading: set[str] = set()  # peers being dialed directly (at most MAX_PUNCHES: see consider)
        self.attempts = self.succeeded = self.failed = 0
        self.recent: deque[Outcome] = deque(maxlen=RECENT)
        self._nursery: trio.Nursery | None = None
        router.register(PunchOffer, self._on_offer)
        router.register(PunchSync, self._on_sync)

    def status(self) -> dict:
        now = trio.current_time()
        return {"enabled": self.enabled, "attempts": self.attempts, "succeeded": self.succeeded, "failed": self.failed,
                "recent": [{"peer_id": o.peer_id, "ok": o.ok, "reason": o.reason, "seconds": round(o.seconds, 2),
                            "age_s": round(now - o.at, 1)} for o in self.recent]}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the punches; every few seconds starts one for each relayed session we dialed whose
        backoff has passed (a new relayed session is punched at once)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                for session in list(self.membership.connected().values()):
                    self.consider(session)
                await trio.sleep(2.0)

    def consider(self, session) -> None:
        """Over a relayed session whose pair is due: dial the peer directly if it now advertises a direct
        address (a public peer met through a relay before its own address was proven), else punch if we
        dialed the relayed session."""
        pid = session.peer_id
        if (self._nursery is None or session.path != "relayed" or pid in self._active or pid in self._upgrading
                or len(self._active) + len(self._upgrading) >= MAX_PUNCHES
                or self._backoff.get(pid, (0, 0.0))[1] > trio.current_time()):
            return
        info = self.membership.peers.get(pid)
        addresses = list(info.addresses) if info is not None else []
        if addresses and frozenset(addresses) != self._dialed.get(pid):
            self._dialed[pid] = frozenset(addresses)  # each set of addresses is tried once
            if len(self._dialed) > 4096:
                self._dialed.pop(next(iter(self._dialed)))
            self._upgrading.add(pid)  # apart from punches: the peer's own punch offer is not declined as busy
            self._nursery.start_soon(self._upgrade, session, addresses)
        elif self.enabled and session.initiator and self.mapping() != "random":
            self._active[pid] = Punch(session)
            self._nursery.start_soon(self._initiate, session)

    async def _upgrade(self, session, addresses: list[tuple[str, int]]) -> None:
        pid, t0 = session.peer_id, trio.current_time()
        reason = "no address answered"
        for host, port in addresses:
            try:
                direct = await dial(host, port, self.transport, expected_peer_id=pid,
                                    connect_timeout=self.transport.handshake_timeout)
            except Exception as exc:  # OSError, timeouts, a handshake with someone else
                reason = f"{format_hostport(host, port)}: {type(exc).__name__}: {exc}"[:200]
                continue
            self.membership.adopt(direct)
            reason = ""
            break
        self._upgrading.discard(pid)
        now = trio.current_time()
        self.recent.append(Outcome(pid, not reason, f"direct dial: {reason}" if reason else "direct dial", now - t0, now))
        if not reason:
            log.info("dialed %s directly (it was relayed): switching to the direct session", short_id(pid))

    def _done(self, pid: str, ok: bool, reason: str, t0: float) -> None:
        self._active.pop(pid, None)
        now = trio.current_time()
        self.recent.append(Outcome(pid, ok, reason, now - t0, now))
        if ok:
            self.succeeded += 1
            self._backoff.pop(pid, None)
            log.info("hole punched to %s in %.2f s: switching to the direct session", short_id(pid), now - t0)
            return
        self.failed += 1
        failures = self._backoff.get(pid, (0, 0.0))[0] + 1
        delay = min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (failures - 1))
        self._backoff[pid] = (failures, now + delay)
        if len(self._backoff) > 4096:
            self._backoff.pop(next(iter(self._backoff)))
        log.info("hole punch to %s failed (%s); staying relayed, next try in %.0f s", short_id(pid), reason, delay)

    def _my_address(self, sock) -> str | None:
        ip = self.public_ip()
        return format_hostport(ip, sock.getsockname()[1]) if ip else None

    @staticmethod
    def _their_address(text: str) -> tuple[str, int] | None:
        hp = parse_address(text)
        return hp if hp is not None and ip_literal(hp[0]) is not None else None

    async def _initiate(self, session) -> None:
        """The dialer of the relayed session decides: the first connection that forms is the one, the
        handshake runs on it with us as initiator, and any other is closed."""
        pid, t0 = session.peer_id, trio.current_time()
        self.attempts += 1
        reason = "cancelled"
        listener = await punch_port()
        try:
            mine = self._my_address(listener)
            if mine is None:
                reason = "our outside address is not known yet"
                return
            sent = trio.current_time()
            reply = (await session.request(PunchOffer(address=mine), timeout=ASK_TIMEOUT)).message
            rtt = trio.current_time() - sent
            if not isinstance(reply, PunchOffer):
                reason = f"declined: {reply.refusal().reason if isinstance(reply, ErrorReply) else type(reply).__name__}"
                return
            theirs = self._their_address(reply.address)
            if theirs is None:
                reason = f"unusable address {reply.address!r}"
                return
            await session.send_message(PunchSync())
            await trio.sleep(rtt / 2)
            stream = await self._first_connection(listener, theirs)
            direct = await handshake_stream(stream, self.transport, initiator=True, expected_peer_id=pid, remote_addr=theirs)
            direct.path = "punched"
            self.membership.adopt(direct)
            reason = ""
        except Exception as exc:  # OSError, timeouts, a declined or vanished session, a failed handshake
            reason = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            listener.close()
            self._done(pid, not reason, reason, t0)

    @staticmethod
    async def _first_connection(listener, theirs: tuple[str, int]) -> trio.SocketStream:
        send, receive = trio.open_memory_channel(8)
        failed: list[TimeoutError] = []
        stream = None
        async with trio.open_nursery() as nursery:
            async def find() -> None:
                async with send:
                    try:
                        await connections(listener, theirs, PUNCH_WINDOW, send)
                    except TimeoutError as exc:
                        failed.append(exc)
            nursery.start_soon(find)
            with contextlib.suppress(trio.EndOfChannel):
                stream = await receive.receive()
            nursery.cancel_scope.cancel()
        while (extra := _next_or_none(receive)) is not None:  # a second connection that formed meanwhile
            await extra.aclose()
        if stream is None:
            raise failed[0] if failed else TimeoutError(f"no connection to {format_hostport(*theirs)}")
        return stream

    # ---- the offered side -----------------------------------------------------------------------------
    async def _on_offer(self, session, env) -> None:
        pid = session.peer_id
        why = None
        if not self.enabled:
            why = Refusal(Code.DISABLED, "hole punching is off here")
        elif session.path != "relayed" or session.initiator:
            why = Refusal(Code.WRONG_PATH, "offer over a relayed session you dialed")
        elif pid in self._active or len(self._active) >= MAX_PUNCHES or self._nursery is None:
            why = Refusal(Code.BUSY, f"busy (a punch with you already runs, or {MAX_PUNCHES} punches do)")
        elif self._backoff.get(pid, (0, 0.0))[1] > trio.current_time():
            # an offer aims our SYNs: as rare as our own tries
            why = Refusal(Code.TOO_SOON, "too soon after the last failed punch")
        elif self.mapping() == "random":
            why = Refusal(Code.CANNOT_WORK, "our NAT gives each destination a new port: a punch cannot work")
        theirs = self._their_address(env.message.address)
        if why is None and theirs is None:
            why = Refusal(Code.BAD_INPUT, f"unusable address {env.message.address!r}")
        listener = None
        mine = None
        if why is None:
            listener = await punch_port()
            mine = self._my_address(listener)
            why = None if mine else Refusal(Code.TOO_SOON, "our outside address is not known yet")
        if why is not None:
            if listener is not None:
                listener.close()
            await session.reply(env, ErrorReply.of(why))
            return
        punch = self._active[pid] = Punch(session)
        self.attempts += 1
        self._nursery.start_soon(self._respond, punch, listener, theirs, trio.current_time())
        await session.reply(env, PunchOffer(address=mine))

    async def _on_sync(self, session, env) -> None:
        punch = self._active.get(session.peer_id)
        if punch is not None and punch.session is session:
            punch.sync.set()

    async def _respond(self, punch: Punch, listener, theirs: tuple[str, int], t0: float) -> None:
        """The offered side follows: it answers the handshake on whichever connection the dialer chose
        (a responder handshake races on each that forms; the first to complete wins)."""
        pid = punch.session.peer_id
        reason = "cancelled"
        try:
            with trio.move_on_after(SYNC_WAIT):
                await punch.sync.wait()
            if not punch.sync.is_set():
                reason = "no sync from the peer"
                return
            won: list = []
            send, receive = trio.open_memory_channel(8)
            with trio.move_on_after(PUNCH_WINDOW + self.transport.handshake_timeout):
                async with trio.open_nursery() as nursery:
                    async def find() -> None:
                        async with send:
                            with contextlib.suppress(TimeoutError):
                                await connections(listener, theirs, PUNCH_WINDOW, send)

                    async def answer(stream) -> None:
                        with contextlib.suppress(Exception):
                            won.append(await handshake_stream(stream, self.transport, initiator=False,
                                                              expected_peer_id=pid, remote_addr=theirs))
                            nursery.cancel_scope.cancel()

                    nursery.start_soon(find)
                    async for stream in receive:
                        nursery.start_soon(answer, stream)
            if not won:
                reason = f"no connection from {format_hostport(*theirs)} completed a handshake"
                return
            won[0].path = "punched"
            self.membership.adopt(won[0])
            reason = ""
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            listener.close()
            self._done(pid, not reason, reason, t0)


def _next_or_none(receive: trio.MemoryReceiveChannel):
    try:
        return receive.receive_nowait()
    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
        return None

"""Membership's dialer: which known peers and `--join` addresses to dial now, and the backoff after a failure.

A peer is dialed at its addresses in turn, then through its relays; a failure backs the peer off
exponentially with jitter, and a failed address that others told us backs its host off too, which no
new record resets (records from others may name anyone). At most MAX_DIALS_IN_PROGRESS dials run at
once and no more than `max_connections` sessions are made; a peer learned second-hand and never reached
is forgotten after FORGET_AFTER_FAILURES failures. A dial that succeeds hands its session to
`Membership.own_session`.

Its own module because it is the half of membership that makes connections rather than keeping them:
`Dialer` is a base class of `peer.membership.service.Membership`, the same object and state (the peer
table, the bootstrap targets, the per-host backoff) seen from the dialing side.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Awaitable, Callable

import trio

from peer.membership.peers import (FORGET_AFTER_FAILURES, MAX_DIALS_IN_PROGRESS, MAX_PEERS, BootstrapTarget,
                                   HostBackoff, PeerInfo)
from peer.nat.addresses import RelayedAddress
from peer.nat.explain import explain_dial_error
from peer.session.connect import dial
from peer.session.transport import Session, TransportConfig
from protocol import identity as ident
from protocol.errors import HandshakeError, ProtocolError

if TYPE_CHECKING:  # for the annotation of `cfg` only
    from peer.config import MembershipSection

log = logging.getLogger("peertrain.membership")


class Dialer:
    """The dial loop and its backoff, on the state `Membership.__init__` sets up (below); a session made
    is handed to `_start_session`."""

    cfg: MembershipSection
    transport: TransportConfig
    peer_id: str
    peers: dict[str, PeerInfo]
    bootstrap: list[BootstrapTarget]
    host_backoff: dict[str, HostBackoff]
    dial_relayed: Callable[[PeerInfo, RelayedAddress], Awaitable[Session]] | None
    _wake: trio.Event
    _leaving: bool
    _start_session: Callable[[Session], None]

    def stop_dialing(self) -> None:
        """We are leaving: make no new connections. Sessions we have stay up for the goodbye; peers that
        leave with us would otherwise be re-dialed, and each failure logged, while we shut down."""
        self._leaving = True
        self._wake.set()

    async def _dial_loop(self, nursery: trio.Nursery) -> None:
        while not self._leaving:
            now = trio.current_time()
            n_sessions = sum(1 for p in self.peers.values() if p.session is not None)
            n_dials = sum(1 for p in self.peers.values() if p.dialing) + sum(1 for t in self.bootstrap if t.dialing)
            for target in self.bootstrap:
                if target.dialing or target.next_attempt > now or n_dials >= MAX_DIALS_IN_PROGRESS:
                    continue
                if target.peer_id and self.peers.get(target.peer_id) and self.peers[target.peer_id].session:
                    continue
                target.dialing = True
                n_dials += 1
                nursery.start_soon(self._dial_bootstrap, target)
            for info in list(self.peers.values()):
                if info.session is None and not info.dialing and info.failures >= FORGET_AFTER_FAILURES \
                        and not info.last_seen:
                    # learned second-hand (cache, peer exchange) and never reached: stop trying
                    del self.peers[info.peer_id]
                    continue
                if (info.session is None and not info.dialing and info.next_attempt <= now
                        and n_sessions < self.cfg.max_connections and n_dials < MAX_DIALS_IN_PROGRESS
                        and (self._dialable(info, now) or (info.relayed and self.dial_relayed is not None))):
                    info.dialing = True
                    n_sessions += 1
                    n_dials += 1
                    nursery.start_soon(self._dial_peer, info)
            self._wake = trio.Event()
            with trio.move_on_after(0.25):
                await self._wake.wait()

    def _dialable(self, info: PeerInfo, now: float) -> list[tuple[str, int]]:
        """The peer's addresses we may dial now: first-hand ones, and others' whose host is not backing off."""
        return [a for a in info.addresses
                if a in info.firsthand or self.host_backoff.get(a[0], HostBackoff()).next_attempt <= now]

    def _host_failed(self, host: str) -> None:
        hb = self.host_backoff.get(host)
        if hb is None:
            if len(self.host_backoff) >= MAX_PEERS:  # forget the host whose backoff ends first
                self.host_backoff.pop(min(self.host_backoff, key=lambda h: self.host_backoff[h].next_attempt))
            hb = self.host_backoff[host] = HostBackoff()
        hb.failures += 1
        hb.next_attempt = trio.current_time() + self._backoff(hb.failures)

    def _backoff(self, failures: int) -> float:
        delay = min(self.cfg.reconnect_max, self.cfg.reconnect_min * (2 ** min(failures, 16)))
        return delay * random.uniform(0.5, 1.5)

    async def _dial_peer(self, info: PeerInfo) -> None:
        try:
            # The larger ID waits a moment so that simultaneous discovery rarely makes two sessions.
            if info.failures == 0 and self.peer_id > info.peer_id:
                await trio.sleep(random.uniform(0.2, 0.6))
            if info.session is not None:  # an inbound session arrived meanwhile
                return
            if info.state != "dead":
                info.state = "connecting"
            for host, port in list(info.addresses):
                if (host, port) not in self._dialable(info, trio.current_time()):
                    continue  # its host failed meanwhile (another dial): wait for its backoff
                try:
                    session = await dial(host, port, self.transport, expected_peer_id=info.peer_id,
                                         connect_timeout=self.cfg.handshake_timeout)
                except (OSError, trio.TooSlowError, ProtocolError) as exc:
                    level = logging.WARNING if isinstance(exc, HandshakeError) else logging.DEBUG
                    log.log(level, "dial %s at %s:%d failed: %s", ident.short_id(info.peer_id), host, port,
                            exc or type(exc).__name__)
                    if (host, port) not in info.firsthand:
                        self._host_failed(host)
                    continue
                self.host_backoff.pop(host, None)
                self._start_session(session)
                return
            for relayed in list(info.relayed) if self.dial_relayed is not None else []:
                try:
                    session = await self.dial_relayed(info, relayed)
                except (OSError, trio.TooSlowError, ProtocolError) as exc:
                    log.info("dial %s through relay %s failed: %s", ident.short_id(info.peer_id),
                             ident.short_id(relayed.relay_id), exc or type(exc).__name__)
                    continue
                self._start_session(session)
                return
            info.failures += 1
            info.next_attempt = trio.current_time() + self._backoff(info.failures)
            if info.state == "connecting" and info.session is None:
                info.state = "discovered" if not info.last_seen else "dead"
        finally:
            info.dialing = False

    async def _dial_bootstrap(self, target: BootstrapTarget) -> None:
        try:
            session = await dial(target.host, target.port, self.transport,
                                 connect_timeout=self.cfg.handshake_timeout)
        except (OSError, trio.TooSlowError, ProtocolError) as exc:
            target.failures += 1
            target.next_attempt = trio.current_time() + self._backoff(target.failures)
            problem = explain_dial_error(exc, target.host, target.port, timeout=self.cfg.handshake_timeout)
            changed = (problem.cause, problem.fix) != (target.cause, target.fix)
            target.cause, target.fix = problem.cause, problem.fix
            level = logging.WARNING if changed or isinstance(exc, HandshakeError) else logging.DEBUG
            log.log(level, "cannot reach bootstrap peer %s:%d: %s; try: %s (retrying with backoff)",
                    target.host, target.port, problem.cause, problem.fix)
            return
        finally:
            target.dialing = False
        target.failures = 0
        target.cause = target.fix = ""
        target.peer_id = session.peer_id
        self._start_session(session)

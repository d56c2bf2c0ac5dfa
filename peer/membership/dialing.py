"""Membership's dialer: which known peers and `--join` addresses to dial now, and the backoff after a failure.

A peer is dialed at its addresses in turn, then through its relays; a failure backs the peer off
exponentially with jitter, and a failed address that others told us backs its host off too, which no
new record resets (records from others may name anyone). At most MAX_DIALS_IN_PROGRESS dials run at
once and no more than `max_connections` sessions are made; a peer learned second-hand and never reached
is forgotten after FORGET_AFTER_FAILURES failures. A dial that succeeds hands its session to
`Membership.own_session`.

Its own module because it is the half of membership that makes connections rather than keeping them:
`Membership` (peer/membership/service.py) owns a `Dialer` and shares its peer table with it; the dialer
owns the bootstrap targets, the per-host backoff and when to dial next.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

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


DialRelayed = Callable[[PeerInfo, RelayedAddress], Awaitable[Session]]
"""How to dial a peer through one of its relays (the NAT service's relay client, peer/nat/)."""


class DialPolicy(Protocol):
    """What the dialer asks its owner (membership, from its view mode and the NAT service) each round."""

    def wants_dial(self, peer_id: str) -> bool:
        """Dial this known peer now? (Partial views: only the peers a message or a lookup waits for.)"""
        ...

    def wants_contact(self) -> bool:
        """Dial the bootstrap (`--join`) targets now? (Partial views: only while they need a contact.)"""
        ...

    def dial_relayed(self) -> DialRelayed | None:
        """How to dial through a relay; None: we cannot."""
        ...


class DialEverything:
    """The policy of a dialer on its own (tests): every peer, the bootstrap targets, no relays."""

    def wants_dial(self, peer_id: str) -> bool:
        return True

    def wants_contact(self) -> bool:
        return True

    def dial_relayed(self) -> DialRelayed | None:
        return None


class Dialer:
    """Dials the peers of `peers` (membership's table, shared: the dialer marks entries dialing, counts
    their failures and forgets the unreachable second-hand ones) and the `bootstrap` targets, with
    backoff; each session made is handed to `start_session`. Whom it may dial, `policy` says."""

    def __init__(self, cfg: MembershipSection, transport: TransportConfig, *, peer_id: str,
                 peers: dict[str, PeerInfo], bootstrap: list[BootstrapTarget],
                 start_session: Callable[[Session], None], policy: DialPolicy | None = None):
        self.cfg = cfg
        self.transport = transport
        self.peer_id = peer_id
        self.peers = peers
        self.bootstrap = bootstrap
        self.host_backoff: dict[str, HostBackoff] = {}  # at most MAX_PEERS hosts
        self.policy: DialPolicy = policy if policy is not None else DialEverything()
        self._start_session = start_session
        self._wake = trio.Event()
        self._stopped = False

    def wake(self) -> None:
        """Something changed (a peer learned, a session ended): look for what to dial now."""
        self._wake.set()

    def stop(self) -> None:
        """Make no new connections (dials in flight finish); `run` returns once they have."""
        self._stopped = True
        self._wake.set()

    def bootstrap_status(self) -> list[dict]:
        """`peer status`'s view of the `--join` addresses (and `peer doctor`'s)."""
        out = []
        for t in self.bootstrap:
            info = self.peers.get(t.peer_id) if t.peer_id else None
            state = ("connected" if info is not None and info.session is not None else
                     "failing" if t.failures else "pending")
            out.append({"address": f"{t.host}:{t.port}", "peer_id": t.peer_id, "state": state,
                        "failures": t.failures, "cause": t.cause, "fix": t.fix})
        return out

    async def run(self) -> None:
        """Dial until stopped; the dials it starts run in its own nursery."""
        async with trio.open_nursery() as nursery:
            await self._dial_loop(nursery)

    async def _dial_loop(self, nursery: trio.Nursery) -> None:
        while not self._stopped:
            now = trio.current_time()
            n_sessions = sum(1 for p in self.peers.values() if p.session is not None)
            n_dials = sum(1 for p in self.peers.values() if p.dialing) + sum(1 for t in self.bootstrap if t.dialing)
            for target in self.bootstrap if self.policy.wants_contact() else ():
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
                if not self.policy.wants_dial(info.peer_id):
                    continue
                if (info.session is None and not info.dialing and info.next_attempt <= now
                        and n_sessions < self.cfg.max_connections and n_dials < MAX_DIALS_IN_PROGRESS
                        and (self._dialable(info, now) or (info.relayed and self.policy.dial_relayed() is not None))):
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
        hb.next_attempt = trio.current_time() + self.backoff(hb.failures)

    def backoff(self, failures: int) -> float:
        """Seconds to wait before the next try after `failures` failures in a row (exponential, jittered)."""
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
            dial_relayed = self.policy.dial_relayed()
            for relayed in list(info.relayed) if dial_relayed is not None else []:
                try:
                    session = await dial_relayed(info, relayed)
                except (OSError, trio.TooSlowError, ProtocolError) as exc:
                    log.info("dial %s through relay %s failed: %s", ident.short_id(info.peer_id),
                             ident.short_id(relayed.relay_id), exc or type(exc).__name__)
                    continue
                self._start_session(session)
                return
            info.failures += 1
            info.next_attempt = trio.current_time() + self.backoff(info.failures)
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
            target.next_attempt = trio.current_time() + self.backoff(target.failures)
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

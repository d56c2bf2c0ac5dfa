"""Reaching a peer we have no session with, for another service, under partial views: one bounded lookup.

Under `[membership] views = "partial"` the dialer dials only the peers a view message waits for (the
`ViewDriver`'s outbox). A stage server that our pipeline picked, and that the views never brought us a
session with, is reached here: its addresses (the ones its signed stage announcement names) are learned like
a view entry's, the dialer dials it with its usual limits (MAX_DIALS_IN_PROGRESS at once, per-host backoff
for addresses others told us), and the caller waits for the session until a deadline. At most
MAX_REACHING peers are being reached at once; a caller over that bound is told so at once (`ReachBusy`), not
queued. One dial per peer asked for: callers asking for a peer already being reached wait on the same dial.

The sessions so made are like any other: the view driver closes them once idle, unless a service says it
still needs them (`KeepsSessions`, peer/services.py). See docs/design.md, "Partial views".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import trio

from protocol import identity as ident

if TYPE_CHECKING:
    from peer.membership.peers import PeerInfo
    from peer.session.transport import Session

log = logging.getLogger("peertrain.membership")

MAX_REACHING = 4
"""Peers being reached for other services at once (per daemon): half the dialer's 8 dials in progress, so the
views' own dials (shuffles, edge requests) always find room; a pipeline driver needs a session with one
server per stage it calls, and picks connected ones first once their calls are timed."""
POLL_S = 0.25  # how often a waiting caller looks whether the dialer gave up (it tells no one; the dialer's own tick)


class Dialing(Protocol):
    """What a lookup uses of membership (peer/membership/service.py)."""

    peer_id: str  # ours

    def connected(self) -> Mapping[str, Session]: ...

    def peer_info(self, peer_id: str) -> PeerInfo | None: ...

    def learn_addresses(self, peer_id: str, texts: list[str], *, source: str) -> None: ...

    def dial_soon(self) -> None: ...


class Unreachable(Exception):
    """The peer was not reached by the deadline, or the dialer is backing off from it: why."""


class ReachBusy(Unreachable):
    """MAX_REACHING peers are being reached already: try another peer, or later (nothing is wrong with this one)."""


class Reach:
    """Reaches peers for other services through membership's dialer (see the module docstring)."""

    def __init__(self, m: Dialing, *, timeout: float):
        self.m = m
        self.timeout = timeout  # a dial (handshake_timeout) plus a round trip: the views' request_timeout
        self.pending: dict[str, trio.Event] = {}  # peer -> set when its session comes up
        self.reached = 0  # sessions made through a lookup
        self.failed = 0  # lookups that ended without a session
        self.busy = 0  # lookups refused: MAX_REACHING were pending

    def wanted(self, peer_id: str) -> bool:
        """Whether the dialer should dial `peer_id` (and the views not forget it): someone waits for it."""
        return peer_id in self.pending

    def session_changed(self, peer_id: str, session: Session | None) -> None:
        """Membership's watcher (through the view driver): a session came up."""
        ev = self.pending.get(peer_id)
        if ev is not None and session is not None:
            ev.set()

    def status(self) -> dict:
        return {"pending": len(self.pending), "reached": self.reached, "failed": self.failed, "busy": self.busy}

    async def session(self, peer_id: str, addresses: list[str], *,
                      on_reached: Callable[[], None] | None = None) -> Session:
        """The session with `peer_id`, dialed at `addresses` (direct or relayed, as the peer itself announced
        them) if we have none. Raises `ReachBusy` when MAX_REACHING lookups are pending, `Unreachable` when
        the dialer gave up or `timeout` passed. `on_reached` runs once if this call's dial made the session."""
        s = self.m.connected().get(peer_id)
        if s is not None:
            return s
        if peer_id == self.m.peer_id:
            raise Unreachable("that is us")
        ev = self.pending.get(peer_id)
        mine = ev is None
        if mine:
            if len(self.pending) >= MAX_REACHING:
                self.busy += 1
                raise ReachBusy(f"{MAX_REACHING} peers are being reached already")
            info = self.m.peer_info(peer_id)
            if info is not None and info.failures and not info.dialing and info.session is None \
                    and info.next_attempt > trio.current_time():
                raise Unreachable(f"backing off after {info.failures} failed dials")
            ev = self.pending[peer_id] = trio.Event()
            self.m.learn_addresses(peer_id, addresses, source="view")
            if self.m.peer_info(peer_id) is None:
                del self.pending[peer_id]
                raise Unreachable("no address we may dial (or our peer table is full)")
            self.m.dial_soon()
        why = f"no session within {self.timeout:.0f} s"
        try:
            with trio.move_on_after(self.timeout):
                started = False
                while not ev.is_set():
                    info = self.m.peer_info(peer_id)
                    if info is None:
                        why = "forgotten by the dialer (no address worked)"
                        break
                    started = started or info.dialing or info.session is not None
                    if started and not info.dialing and info.session is None:
                        why = "every address failed"
                        break
                    with trio.move_on_after(POLL_S):
                        await ev.wait()
        finally:
            if mine:
                self.pending.pop(peer_id, None)
        s = self.m.connected().get(peer_id)
        if s is None:
            if mine:
                self.failed += 1
                log.info("could not reach %s for a service: %s", ident.short_id(peer_id), why)
            raise Unreachable(why)
        if mine:
            self.reached += 1
            if on_reached is not None:
                on_reached()
        return s

"""`[membership] views = "auto"` (the default): the full view while the swarm is small, partial views past it.

`AutoView` is membership's `ViewMode` (peer/membership/view_mode.py). It runs a `FullView` until the swarm
it knows (us, the peers we have a session with, and those whose signed record is current) reaches
`[membership] auto_peers` (`AUTO_SWITCH_PEERS`), or until an authenticated peer sends it a partial-view
message; then, once and for good (`AutoSwitch`, peer/membership/auto_switch.py), it stops the full view's
loop, starts a `ViewDriver` in the nursery membership gave it, puts the peers it has sessions with in the
new passive view and joins through one of them (the sender of that message, else a `--join` peer, else
any). Every call membership and the services make goes to whichever mode is in effect.

Mixed swarms: a daemon still on the full view (or configured `views = "full"`) ignores view messages (no
handler: the router logs and drops them, the session stays up), and an auto daemon that gets one switches
and answers it. A peer record sent to a switched daemon is ignored the same way. See docs/design.md,
"Auto views".
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from peer.config import Config
from peer.config.checks import partial_views_refusal
from peer.membership.auto_switch import AutoSwitch
from peer.membership.view_driver import ViewDriver, gap_config, view_config
from peer.membership.view_messages import BadMessage, check
from peer.membership.view_mode import FullView, ViewMode
from peer.session.transport import SessionClosed
from protocol.schema.views import Status

if TYPE_CHECKING:
    from peer.membership.service import Membership
    from peer.session.transport import Session

log = logging.getLogger("peertrain.membership")

GREET_TIMEOUT_S = 5.0  # a greeting is one small message: a session that takes longer to take it gets none
CHECK_EVERY_S = 1.0  # how often the full view's swarm size is compared with the threshold (a count of a dict)


class AutoView:
    """Membership's view mode under `views = "auto"` (see the module docstring)."""

    def __init__(self, m: Membership, config: Config):
        self.m = m
        self._config = config
        self.switch = AutoSwitch(threshold=config.membership.auto_peers,
                                 possible=partial_views_refusal(config.topology) is None)
        self.full = FullView(m, register=False)
        self.partial: ViewDriver | None = None
        self._contact: str | None = None  # whom the switched views join through
        self._wanted = trio.Event()  # the switch was decided: run() starts the driver
        self._running = trio.Event()  # the driver runs: its messages can go out
        for cls, handler in self.full.handlers().items():
            m.router.register(cls, self._full_message(cls, handler))
        # the view messages' handlers, made once to learn their types; the driver made at the switch gets them
        for cls in ViewDriver.message_types():
            m.router.register(cls, self._on_view_message)

    @property
    def mode(self) -> ViewMode:
        return self.partial if self.partial is not None and self._running.is_set() else self.full

    @property
    def chooses_edges(self) -> bool:
        return self.mode.chooses_edges

    def members(self) -> int:
        """The swarm as the full view knows it: us, the peers we have a session with, and those whose signed
        record is current (peer exchange spreads every member's)."""
        now = time.time()
        return 1 + sum(1 for p in self.m.known_peers().values()
                       if p.state == "connected" or (p.record is not None and p.record.expires > now))

    # ---- the switch -----------------------------------------------------------------------------------
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as full:
                nursery.start_soon(self._watch_size, full)
                await self.full.run()  # until the switch cancels it
            driver = self.partial
            assert driver is not None
            nursery.start_soon(driver.run)
            await driver.running.wait()
            self._running.set()
            sessions = list(self.m.connected())
            random.shuffle(sessions)
            boot = [p for p in self.m.bootstrap_ids() if p in sessions]
            contact = self._contact or (boot[0] if boot else sessions[0] if sessions else None)
            driver.take_over(contact, sessions)
            log.info("views: switched to partial views (%s); joining through %s", self.switch.reason,
                     contact[:8] if contact else "a contact found later")

    async def _watch_size(self, full: trio.CancelScope) -> None:
        while not self._wanted.is_set():
            with trio.move_on_after(CHECK_EVERY_S):
                await self._wanted.wait()
            if not self._wanted.is_set() and self.switch.size(self.members(), time.time()):
                self._start_switch(None)
        full.cancel()

    def _start_switch(self, contact: str | None) -> None:
        """The switch was decided: make the driver now (its handlers answer from here on), run it in run()."""
        self._contact = contact
        self.partial = ViewDriver(self.m, view_config(self._config), gap=gap_config(self._config), register=False)
        self._wanted.set()

    # ---- messages ---------------------------------------------------------------------------------------
    def _full_message(self, cls: type, handler: Callable[[Session, Any], Awaitable[None]]
                      ) -> Callable[[Session, Any], Awaitable[None]]:
        async def route(session: Session, env: Any) -> None:
            if self.partial is None:
                await handler(session, env)
            else:  # switched: as a partial-view daemon, we ignore a full-view peer's records
                log.debug("views: %s from %s ignored (partial views)", cls.__name__, session.short)
        return route

    async def _on_view_message(self, session: Session, env: Any) -> None:
        if self.partial is None:
            # only a view message its sender may send switches us (a gap round goes to neighbours we would
            # already have); any other is ignored, as a full view ignores them all
            if not (self._may_send(env.message, session.peer_id)
                    and self.switch.view_message(session.peer_id, time.time())):
                log.debug("views: %s from %s ignored (%s)", type(env.message).__name__, session.short,
                          self.switch.describe(self.members()))
                return
            self._start_switch(session.peer_id)
        await self._running.wait()  # run() starts the driver at once (it holds membership's nursery)
        assert self.partial is not None
        await self.partial.handlers()[type(env.message)](session, env)

    @staticmethod
    def _may_send(msg: object, sender: str) -> bool:
        try:
            check(msg, sender)
        except BadMessage:
            return False
        return True

    # ---- the view mode: whichever is in effect ----------------------------------------------------------
    async def greet(self, session: Session) -> None:
        await self.mode.greet(session)
        driver = self.partial
        if driver is not None and self._running.is_set() and session.peer_id not in driver.views.active:
            # A daemon that joins after we switched dials us on the full view and, alone with us, never counts
            # past auto_peers (we send no records any more): a Status (no neighbours, so a partial daemon that
            # is not our neighbour ignores it, and a `views = "full"` one has no handler for it) is a view
            # message its sender may send, and switches an auto daemon, which then joins through us.
            with trio.move_on_after(GREET_TIMEOUT_S):
                try:
                    await driver.write(session, Status(degree=driver.views.degree, neighbours=(), fastest_bps=None))
                except SessionClosed:
                    pass

    async def leave(self) -> None:
        await self.mode.leave()

    def wants_dial(self, peer_id: str) -> bool:
        return self.mode.wants_dial(peer_id)

    def wants_contact(self) -> bool:
        return self.mode.wants_contact()

    def dial_addresses(self) -> list[str]:
        return self.mode.dial_addresses()

    def can_reach(self, addresses: list[str]) -> bool:
        return self.mode.can_reach(addresses)

    async def reach_session(self, peer_id: str, addresses: list[str], *,
                            on_reached: Callable[[], None] | None = None) -> Session | None:
        return await self.mode.reach_session(peer_id, addresses, on_reached=on_reached)

    def reach_status(self) -> dict[str, Any] | None:
        return self.mode.reach_status()

    def status_fields(self) -> dict[str, Any]:
        return {**self.mode.status_fields(), "view_mode": self.switch.describe(self.members())}

"""The view modes membership runs in, behind one interface: the full view, partial views, and "auto".

`[membership] views` picks one per daemon ("auto", the default: the full view until the swarm is big, then
partial views: `AutoView`, peer/membership/auto_view.py). The full view (`FullView`, here) dials and keeps every peer it
hears of and floods signed peer records (peer exchange); partial views (`ViewDriver`,
peer/membership/view_driver.py) keep a bounded active view that is the gossip graph, and dial only what their
messages need. Membership, the topology service and the pipeline service call the mode through `ViewMode`
and never branch on which one runs.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from peer.session.fanout import Fanout
from peer.session.transport import SessionClosed
from protocol import identity as ident
from protocol.schema import PeerExchange, PeerRecord

if TYPE_CHECKING:
    from peer.membership.service import Membership
    from peer.session.transport import Session

log = logging.getLogger("peertrain.membership")

MAX_PEX_RECORDS = 256  # records in one peer exchange: ours and those of the peers we have a session with


class ViewMode(Protocol):
    """What membership and the services ask of the view mode."""

    @property
    def chooses_edges(self) -> bool:
        """True: the views choose the gossip edges and bound what spreads: the topology service proposes and
        probes nothing, accepts only full-view peers' proposals (a bridge in a mixed swarm), and sends records
        along its edges only (ours, and the stage records pipelines use). "auto" turns it True once, while
        running (the topology service reads it each time)."""
        ...

    async def run(self) -> None:
        """Spread what this mode spreads (peer records, or view messages), until cancelled."""
        ...

    async def greet(self, session: Session) -> None:
        """A session came up (run in its nursery): say what a new session is told."""
        ...

    async def leave(self) -> None:
        """We are leaving (bounded): what the mode does before the goodbyes."""
        ...

    def wants_dial(self, peer_id: str) -> bool:
        """Whether the dialer should dial this known peer now."""
        ...

    def wants_contact(self) -> bool:
        """Whether the dialer should dial the `--join` addresses now."""
        ...

    def dial_addresses(self) -> list[str]:
        """Where a peer without a session with us dials us (a stage server's announcement); none: peers
        learn our addresses some other way."""
        ...

    def can_reach(self, addresses: list[str]) -> bool:
        """Whether `reach_session` makes a session with a peer announced at `addresses`."""
        ...

    async def reach_session(self, peer_id: str, addresses: list[str], *,
                            on_reached: Callable[[], None] | None = None) -> Session | None:
        """The session with `peer_id`, made (one bounded lookup) if we have none and this mode reaches
        peers on request; None if it does not. Raises peer.membership.reach.Unreachable if it tried and failed."""
        ...

    def reach_status(self) -> dict[str, Any] | None:
        """The lookups' figures for `peer status`, if this mode makes any."""
        ...

    def status_fields(self) -> dict[str, Any]:
        """What the mode adds to the topology's status: {"view_mode": what runs}, and under partial views
        {"views": ...}."""
        ...


class FullView:
    """The full view: every peer we hear of is dialed and kept, and signed peer records are flooded (peer
    exchange, to every session every `pex_interval` and at once to a new one)."""

    chooses_edges = False

    def __init__(self, m: Membership, *, register: bool = True):
        self.m = m
        self._fanout = Fanout()
        if register:  # (partial views ignore a full-view peer's records; an `AutoView` registers for us)
            for cls, handler in self.handlers().items():
                m.router.register(cls, handler)

    def handlers(self) -> dict[type, Callable[[Session, Any], Awaitable[None]]]:
        """The router's handlers of the full view's messages."""
        return {PeerExchange: self._on_pex}

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:  # owns the record sends: to every session at once (Fanout)
            while True:
                await trio.sleep(self.m.cfg.pex_interval * random.uniform(0.8, 1.2))
                self._fanout.send(nursery, list(self.m.connected().values()), PeerExchange(peers=self._records()))

    async def greet(self, session: Session) -> None:
        try:
            await session.send_message(PeerExchange(peers=self._records()))
        except SessionClosed:
            pass

    async def leave(self) -> None:
        pass

    def wants_dial(self, peer_id: str) -> bool:
        return True

    def wants_contact(self) -> bool:
        return True

    def dial_addresses(self) -> list[str]:
        return []  # a full view dials every peer it hears of anyway

    def can_reach(self, addresses: list[str]) -> bool:
        return False

    async def reach_session(self, peer_id: str, addresses: list[str], *,
                            on_reached: Callable[[], None] | None = None) -> Session | None:
        return self.m.connected().get(peer_id)  # every peer we hear of is dialed already: no lookup

    def reach_status(self) -> dict[str, Any] | None:
        return None

    def status_fields(self) -> dict[str, Any]:
        return {"view_mode": "full"}

    def _records(self) -> list[PeerRecord]:
        recs = [self.m.own_record()]
        for p in self.m.known_peers().values():
            if p.record is not None and p.state == "connected":
                recs.append(p.record)
        return recs[:MAX_PEX_RECORDS]

    async def _on_pex(self, session: Session, env) -> None:
        for rec in env.message.peers:
            why = self.m.valid_record(rec)
            if why is not None:
                log.debug("ignoring peer record for %s from %s: %s", ident.short_id(rec.peer_id), session.short, why)
                continue
            self.m.take_record(rec)

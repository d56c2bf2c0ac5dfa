"""Two-phase edge changes: an edge is agreed by both endpoints with propose → accept → commit.

A proposer adds the edge only after an accept, the acceptor only on a commit that names the proposal it
reserved a slot for; a commit that cannot be honoured is answered with a drop, so the two ends converge.
`Edges` holds my edges and the changes in flight, and speaks this protocol; which edges are wanted is
decided by the topology service's maintenance (peer/topology/service.py), which owns an `Edges`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from peer.session.transport import Session, SessionClosed
from protocol import identity as ident
from protocol.schema.topology import EdgeAccept, EdgeCommit, EdgeDrop, EdgePropose, EdgeReject

if TYPE_CHECKING:  # for annotations only
    from peer.config.sections import TopologySection

log = logging.getLogger("peertrain.topology")

RESERVATION_S = 15.0  # an accepted proposal holds its slot this long for the proposer's commit


@dataclass
class Neighbour:
    peer_id: str
    since: float
    degree: int = 0  # last degree the neighbour told us (records / exchanges)
    by_views: bool = False  # the partial views chose it (else a proposal agreed it)


class Edges:
    """My edges, the proposals in flight either way, and the propose → accept → commit protocol.

    It reads the degree bounds and kind from `cfg`, the sessions from `sessions()`, and (for a fixed kind)
    the wanted neighbours from `wanted_fixed()`. It calls `changed()` whenever my edges change (the
    service then issues a newer record) and `dropped_by_them()` when a neighbour dropped our edge."""

    def __init__(self, cfg: TopologySection, *, sessions: Callable[[], Mapping[str, Session]],
                 wanted_fixed: Callable[[], set[str]], changed: Callable[[], None],
                 dropped_by_them: Callable[[], None], set_by_views: Callable[[], bool] = lambda: False):
        self.cfg = cfg
        self._sessions = sessions
        self._wanted_fixed = wanted_fixed
        self._changed = changed
        self._dropped_by_them = dropped_by_them
        self.neighbours: dict[str, Neighbour] = {}
        self.reserved: dict[str, tuple[float, int]] = {}  # accepted, not yet committed: (deadline, proposal rid)
        self.pending_out: set[str] = set()  # our proposals awaiting an answer
        # partial views choose the edges (set_neighbour): propose none; "auto" makes it True while running
        self.set_by_views = set_by_views

    @property
    def degree(self) -> int:
        return len(self.neighbours)

    def _effective_degree(self) -> int:
        return len(self.neighbours) + len(self.reserved) + len(self.pending_out)

    # ---- our changes --------------------------------------------------------------------------------
    async def add(self, peer_id: str, reason: str) -> bool:
        """Propose an edge; add it only if the peer accepts. A refusal or timeout changes nothing."""
        session = self._sessions().get(peer_id)
        if self.set_by_views() or session is None or peer_id in self.neighbours or peer_id in self.pending_out:
            return False
        if self._effective_degree() >= self.cfg.max_degree:
            return False
        self.pending_out.add(peer_id)
        try:
            env = await session.request(EdgePropose(degree=self.degree, reason=reason), timeout=5.0)
            reply = env.message
            if not isinstance(reply, EdgeAccept):
                log.debug("edge to %s refused: %s", ident.short_id(peer_id), getattr(reply, "reason", reply))
                return False
            self.neighbours[peer_id] = Neighbour(peer_id, since=time.time(), degree=reply.degree + 1)
            self.reserved.pop(peer_id, None)
            await session.send_message(EdgeCommit(proposal=env.reply_to))
        except (trio.TooSlowError, SessionClosed):
            if peer_id in self.neighbours and session.closed.is_set():
                self.neighbours.pop(peer_id, None)
            return peer_id in self.neighbours
        finally:
            self.pending_out.discard(peer_id)
        log.info("edge to %s added (%s); degree %d", ident.short_id(peer_id), reason, self.degree)
        self._changed()
        return True

    async def drop(self, peer_id: str, reason: str) -> None:
        if self.neighbours.pop(peer_id, None) is None:
            return
        log.info("edge to %s dropped (%s); degree %d", ident.short_id(peer_id), reason, self.degree)
        self._changed()
        session = self._sessions().get(peer_id)
        if session is not None:
            try:
                await session.send_message(EdgeDrop(reason=reason))
            except SessionClosed:
                pass

    def set_neighbour(self, peer_id: str, degree: int) -> None:
        """Partial views made `peer_id` a neighbour (their own messages agreed the edge)."""
        if peer_id not in self.neighbours:
            self.neighbours[peer_id] = Neighbour(peer_id, since=time.time(), degree=degree, by_views=True)
            self._changed()
        else:
            self.neighbours[peer_id].by_views = True

    def unset_neighbour(self, peer_id: str, reason: str) -> None:
        """Partial views gave the edge to `peer_id` up."""
        if self.neighbours.pop(peer_id, None) is not None:
            log.debug("edge to %s gone (%s); degree %d", ident.short_id(peer_id), reason, self.degree)
            self._changed()

    def session_ended(self, peer_id: str) -> None:
        """The session with `peer_id` ended: its edge, and any slot reserved for it, are gone."""
        if self.neighbours.pop(peer_id, None) is not None:
            log.info("neighbour %s lost (session ended); degree %d", ident.short_id(peer_id), self.degree)
            self._changed()
        self.reserved.pop(peer_id, None)

    def remove_unlisted(self, peer_id: str) -> None:
        """The other end's fresh record does not list our edge: it is gone there, so it goes here too."""
        if self.neighbours.pop(peer_id, None) is not None:
            log.info("edge to %s removed: their record does not list it", ident.short_id(peer_id))
            self._changed()

    def expire_reservations(self, now: float) -> None:
        """Free the slots of accepted proposals whose commit did not come in time (trio clock)."""
        for pid, (deadline, _) in list(self.reserved.items()):
            if deadline < now:
                self.reserved.pop(pid, None)

    # ---- their changes (router handlers) ------------------------------------------------------------
    async def on_propose(self, session, env) -> None:
        peer_id = session.peer_id
        if peer_id in self.neighbours:
            await session.reply(env, EdgeAccept(degree=self.degree))
            return
        if not self.accepts(peer_id, env.message.degree):
            await session.reply(env, EdgeReject(reason=f"degree limit ({self._effective_degree()}/{self.cfg.max_degree})"
                                                if self._effective_degree() >= self.cfg.max_degree else "not wanted by this topology"))
            return
        self.reserved[peer_id] = (trio.current_time() + RESERVATION_S, env.rid)
        await session.reply(env, EdgeAccept(degree=self.degree))

    def accepts(self, peer_id: str, their_degree: int = 0) -> bool:
        """Under partial views too, by the rewired rule: only a full-view peer proposes, and its edge is what
        joins it to the partial views' graph in a mixed swarm (docs/design.md, "Auto views")."""
        if self._effective_degree() >= self.cfg.max_degree:
            return False
        if self.cfg.kind != "rewired":
            return peer_id in self._wanted_fixed()
        # one above target leaves room for swaps; beyond that only a peer below min_degree gets in
        return self._effective_degree() <= self.cfg.target_degree or their_degree < self.cfg.min_degree

    async def on_commit(self, session, env) -> None:
        """Only the proposer of an edge we accepted commits it: the commit must name the proposal we
        reserved a slot for (the only way to become our neighbour). Any other commit, or one arriving
        after the reservation expired, is answered with a drop, so both ends agree there is no edge."""
        peer_id = session.peer_id
        if peer_id in self.neighbours:
            return
        reservation = self.reserved.get(peer_id)
        if reservation is not None and reservation[1] == env.message.proposal:
            del self.reserved[peer_id]
            self.neighbours[peer_id] = Neighbour(peer_id, since=time.time())
            log.info("edge to %s added (accepted their proposal); degree %d", session.short, self.degree)
            self._changed()
        else:
            why = "no accepted proposal of theirs matches it (never made, or its reservation expired)"
            log.info("edge commit from %s refused: %s", session.short, why)
            await session.send_message(EdgeDrop(reason=f"commit refused: {why}"))

    async def on_drop(self, session, env) -> None:
        if self.neighbours.pop(session.peer_id, None) is not None:
            log.info("edge to %s dropped by them (%s); degree %d", session.short, env.message.reason, self.degree)
            self._changed()
            self._dropped_by_them()

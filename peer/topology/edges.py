"""Two-phase edge changes: an edge is agreed by both endpoints with propose → accept → commit.

A proposer adds the edge only after an accept, the acceptor only on a commit that names the proposal it
reserved a slot for; a commit that cannot be honoured is answered with a drop, so the two ends converge.
A part of the topology service (TopologyService inherits it, as it does records.py): which edges are
wanted is decided by its maintenance (peer/topology/service.py, also for the attributes used here).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import trio

from peer.session.transport import SessionClosed
from protocol import identity as ident
from protocol.schema.topology import EdgeAccept, EdgeCommit, EdgeDrop, EdgePropose, EdgeReject

log = logging.getLogger("peertrain.topology")

RESERVATION_S = 15.0  # an accepted proposal holds its slot this long for the proposer's commit


@dataclass
class Neighbour:
    peer_id: str
    since: float
    degree: int = 0  # last degree the neighbour told us (records / exchanges)


class EdgeChanges:
    """The edge half of TopologyService (see peer/topology/service.py for the attributes it uses)."""

    def _effective_degree(self) -> int:
        return len(self.neighbours) + len(self.reserved) + len(self.pending_out)

    async def add_edge(self, peer_id: str, reason: str) -> bool:
        """Propose an edge; add it only if the peer accepts. A refusal or timeout changes nothing."""
        session = self.membership.connected().get(peer_id)
        if session is None or peer_id in self.neighbours or peer_id in self.pending_out:
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
        self._bump()
        return True

    async def drop_edge(self, peer_id: str, reason: str) -> None:
        if self.neighbours.pop(peer_id, None) is None:
            return
        log.info("edge to %s dropped (%s); degree %d", ident.short_id(peer_id), reason, self.degree)
        self._bump()
        session = self.membership.connected().get(peer_id)
        if session is not None:
            try:
                await session.send_message(EdgeDrop(reason=reason))
            except SessionClosed:
                pass

    async def _on_propose(self, session, env) -> None:
        peer_id = session.peer_id
        if peer_id in self.neighbours:
            await session.reply(env, EdgeAccept(degree=self.degree))
            return
        if not self._accepts(peer_id, env.message.degree):
            await session.reply(env, EdgeReject(reason=f"degree limit ({self._effective_degree()}/{self.cfg.max_degree})"
                                                if self._effective_degree() >= self.cfg.max_degree else "not wanted by this topology"))
            return
        self.reserved[peer_id] = (trio.current_time() + RESERVATION_S, env.rid)
        await session.reply(env, EdgeAccept(degree=self.degree))

    def _accepts(self, peer_id: str, their_degree: int = 0) -> bool:
        if self._effective_degree() >= self.cfg.max_degree:
            return False
        if self.cfg.kind != "rewired":
            return peer_id in self._wanted_fixed()
        # one above target leaves room for swaps; beyond that only a peer below min_degree gets in
        return self._effective_degree() <= self.cfg.target_degree or their_degree < self.cfg.min_degree

    async def _on_commit(self, session, env) -> None:
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
            self._bump()
        else:
            why = "no accepted proposal of theirs matches it (never made, or its reservation expired)"
            log.info("edge commit from %s refused: %s", session.short, why)
            await session.send_message(EdgeDrop(reason=f"commit refused: {why}"))

    async def _on_drop(self, session, env) -> None:
        if self.neighbours.pop(session.peer_id, None) is not None:
            log.info("edge to %s dropped by them (%s); degree %d", session.short, env.message.reason, self.degree)
            self._bump()
            self._others_moved.set()

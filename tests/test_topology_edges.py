"""Two-phase edge changes (peer/topology/edges.py), alone: two `Edges` joined by in-memory sessions, no daemons."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import trio

from peer.config import from_mapping
from peer.topology.edges import RESERVATION_S, Edges
from protocol.messages import Envelope
from protocol.schema.topology import EdgeAccept, EdgeCommit, EdgeDrop, EdgePropose, EdgeReject

_rids = itertools.count(1)


class Line:
    """One end's session to the other: what it sends goes straight to the other end's handlers."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.short = peer_id
        self.closed = trio.Event()
        self.back: Line | None = None  # the other end's session to us
        self.handlers: dict[type, Callable] = {}  # the other end's
        self.replies: dict[int, Envelope] = {}  # our replies, by the rid they answer
        self.sent: list = []

    async def request(self, message, *, timeout: float) -> Envelope:
        rid = next(_rids)
        await self.handlers[type(message)](self.back, Envelope(message, rid, 0))
        return self.back.replies.pop(rid)

    async def reply(self, to: Envelope, message) -> None:
        self.replies[to.rid] = Envelope(message, next(_rids), to.rid)

    async def send_message(self, message) -> None:
        self.sent.append(message)
        handler = self.handlers.get(type(message))
        if handler is not None:
            await handler(self.back, Envelope(message, next(_rids), 0))


class End:
    """An `Edges` with a record of what it told its owner."""

    def __init__(self, me: str, **topology):
        self.me = me
        self.lines: dict[str, Line] = {}
        self.changes = 0
        self.drops_by_them = 0
        cfg = from_mapping({"topology": {"kind": "rewired", **topology}}).topology
        self.edges = Edges(cfg, sessions=lambda: self.lines, wanted_fixed=lambda: set(),
                           changed=self._changed, dropped_by_them=self._dropped)

    def _changed(self) -> None:
        self.changes += 1

    def _dropped(self) -> None:
        self.drops_by_them += 1

    def handlers(self) -> dict[type, Callable]:
        return {EdgePropose: self.edges.on_propose, EdgeCommit: self.edges.on_commit, EdgeDrop: self.edges.on_drop}


def join(a: End, b: End) -> tuple[Line, Line]:
    a_to_b, b_to_a = Line(b.me), Line(a.me)
    a_to_b.back, b_to_a.back = b_to_a, a_to_b
    a_to_b.handlers, b_to_a.handlers = b.handlers(), a.handlers()
    a.lines[b.me], b.lines[a.me] = a_to_b, b_to_a
    return a_to_b, b_to_a


def test_an_edge_is_added_at_both_ends_by_propose_accept_commit():
    async def main():
        a, b = End("a"), End("b")
        join(a, b)
        assert await a.edges.add("b", "test")
        assert set(a.edges.neighbours) == {"b"} and set(b.edges.neighbours) == {"a"}
        assert a.edges.neighbours["b"].degree == 1  # b's degree once it has the edge
        assert not b.edges.reserved and not a.edges.pending_out and a.changes == b.changes == 1
        assert not await a.edges.add("b", "again")  # already an edge: nothing changes
        await a.edges.drop("b", "test over")
        assert not a.edges.neighbours and not b.edges.neighbours and b.drops_by_them == 1
    trio.run(main)


def test_a_peer_at_its_degree_limit_refuses_and_nothing_changes():
    async def main():
        a, b, c = End("a"), End("b", max_degree=1, target_degree=1, min_degree=1), End("c")
        join(a, b)
        join(c, b)
        assert await c.edges.add("b", "first")
        assert not await a.edges.add("b", "second")
        assert not a.edges.neighbours and set(b.edges.neighbours) == {"c"} and not b.edges.reserved
        env = await c.lines["b"].request(EdgePropose(degree=0, reason="x"), timeout=1)  # c asks again: already one
        assert isinstance(env.message, EdgeAccept)
        a_to_b = a.lines["b"]
        env = await a_to_b.request(EdgePropose(degree=5, reason="x"), timeout=1)
        assert isinstance(env.message, EdgeReject) and env.message.reason == "degree limit (1/1)"
    trio.run(main)


def test_only_a_commit_naming_the_reserved_proposal_makes_an_edge():
    async def main():
        a, b = End("a"), End("b")
        a_to_b, b_to_a = join(a, b)
        await b.edges.on_commit(b_to_a, Envelope(EdgeCommit(proposal=12345), 1, 0))  # never proposed
        assert not b.edges.neighbours and isinstance(b_to_a.sent[-1], EdgeDrop)
        env = await a_to_b.request(EdgePropose(degree=0, reason="x"), timeout=1)
        assert isinstance(env.message, EdgeAccept) and "a" in b.edges.reserved
        await b.edges.on_commit(b_to_a, Envelope(EdgeCommit(proposal=env.reply_to + 1), 2, 0))  # not that one
        assert not b.edges.neighbours
        await b.edges.on_commit(b_to_a, Envelope(EdgeCommit(proposal=env.reply_to), 3, 0))
        assert set(b.edges.neighbours) == {"a"} and not b.edges.reserved and b.changes == 1
    trio.run(main)


def test_an_unanswered_reservation_expires_and_a_late_commit_is_refused():
    async def main():
        a, b = End("a"), End("b")
        a_to_b, b_to_a = join(a, b)
        env = await a_to_b.request(EdgePropose(degree=0, reason="x"), timeout=1)
        b.edges.expire_reservations(trio.current_time() + RESERVATION_S / 2)
        assert "a" in b.edges.reserved
        b.edges.expire_reservations(trio.current_time() + RESERVATION_S + 1)
        assert not b.edges.reserved
        await b.edges.on_commit(b_to_a, Envelope(EdgeCommit(proposal=env.reply_to), 1, 0))
        assert not b.edges.neighbours and not a.edges.neighbours  # the drop reached a, which had nothing either
    trio.run(main)


def test_a_session_that_ends_takes_its_edge_and_reservation():
    async def main():
        a, b, c = End("a"), End("b"), End("c")
        join(a, b)
        c_to_b, _ = join(c, b)
        assert await a.edges.add("b", "test")
        await c_to_b.request(EdgePropose(degree=0, reason="x"), timeout=1)
        changes = b.changes
        b.edges.session_ended("a")
        b.edges.session_ended("c")
        assert not b.edges.neighbours and not b.edges.reserved and b.changes == changes + 1
        b.edges.remove_unlisted("a")  # gone already: no second change
        assert b.changes == changes + 1
    trio.run(main)

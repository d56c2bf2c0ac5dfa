"""Others' topology records (peer/topology/records.py), alone: what a `RecordBook` admits, holds and
sends, and the view it makes, with signed records and no daemons."""

from __future__ import annotations

import dataclasses

import trio
from trio.testing import MockClock

from peer.topology.links import LinkStats
from peer.topology.records import MAX_VIEW_RECORDS, RECORD_TTL, RecordBook, signed_record
from protocol import identity as ident
from protocol.schema import DEFAULT_REGISTRY, TopologyRecords
from protocol.schema.topology import MAX_BANDWIDTH_BPS, MAX_RECORD_GROUPS, topology_record_signing_bytes


class Peer:
    def __init__(self):
        self.key = ident.generate_identity()
        self.id = ident.peer_id_of(self.key)

    def record(self, *neighbours: str, version: int = 1, groups: tuple[str, ...] = ()):
        return signed_record(self.key, self.id, version=version, neighbours=neighbours, links={}, stage=None,
                             groups=list(groups))


def book_of(me: str, neighbours: set[str] = frozenset()) -> RecordBook:
    return RecordBook(me, is_neighbour=lambda p: p in neighbours)


def test_our_record_is_signed_and_within_the_schema_s_bounds():
    me = Peer()
    links = {"b": LinkStats(bandwidth_bps=1e30, rtt_s=0.01), "c": LinkStats()}  # c: nothing measured yet
    rec = signed_record(me.key, me.id, version=3, neighbours={"c", "b"}, links=links, stage=None,
                        groups=[f"g{i}" for i in range(MAX_RECORD_GROUPS + 2)])
    assert ident.verify(rec.public_key, rec.signature, topology_record_signing_bytes(rec))
    assert rec.neighbours == ["b", "c"] and [lr.peer for lr in rec.links] == ["b"]
    assert rec.links[0].bandwidth_bps == MAX_BANDWIDTH_BPS and len(rec.groups) == MAX_RECORD_GROUPS
    DEFAULT_REGISTRY.encode(TopologyRecords(records=[rec]))  # the schema takes it


def test_a_record_enters_only_from_a_met_origin_or_through_a_neighbour():
    async def main():
        me, origin, stranger, neighbour = Peer(), Peer(), Peer(), Peer()
        book = book_of(me.id, {neighbour.id})
        assert book.receive([origin.record()], stranger.id) == [] and book.unvouched == 1
        assert book.receive([origin.record()], neighbour.id) != [] and book.get(origin.id) is not None
        other = Peer()
        book.met_session(other.id)
        assert book.receive([other.record()], stranger.id) != []  # met: its records enter from anyone
        assert book.receive([me.record()], neighbour.id) == []  # our own is never held
        assert book.unvouched == 1
    trio.run(main)


def test_only_a_newer_authentic_record_replaces_the_one_held():
    async def main():
        me, origin = Peer(), Peer()
        book = book_of(me.id)
        book.met_session(origin.id)
        newer = origin.record(version=5, groups=("g",))
        assert book.receive([newer], origin.id) == [newer]
        assert book.receive([origin.record(version=4)], origin.id) == []
        forged = dataclasses.replace(origin.record(version=9), groups=["h"])  # changed after signing
        assert book.receive([forged], origin.id) == []
        assert book.get(origin.id) == newer and book.holds(origin.id, "g") and book.holds(origin.id, "h") is False
        assert book.holds(me.id, "g") is None
    trio.run(main)


def test_the_book_holds_at_most_max_view_records_forgetting_the_stalest():
    async def main():
        me, neighbour = Peer(), Peer()
        book = book_of(me.id, {neighbour.id})
        peers = [Peer() for _ in range(MAX_VIEW_RECORDS + 3)]
        for p in peers:
            book.receive([p.record()], neighbour.id)
            await trio.sleep(1)  # distinct times seen (a mock clock's seconds)
        assert len(book.records) == len(book.seen) == len(book.wire_bytes) == MAX_VIEW_RECORDS
        assert all(book.get(p.id) is None for p in peers[:3]) and book.get(peers[-1].id) is not None
    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_records_leave_the_view_once_stale_unless_we_have_a_session():
    async def main():
        me, b, c = Peer(), Peer(), Peer()
        book = book_of(me.id)
        for p in (b, c):
            book.met_session(p.id)
        book.receive([b.record(me.id, c.id), c.record(b.id)], b.id)
        view = book.view([b.id], my_neighbours=[b.id], my_links={b.id: LinkStats(rtt_s=0.01)})
        assert view.nodes == {me.id, b.id, c.id} and view.has_edge(me.id, b.id) and view.has_edge(b.id, c.id)
        assert len(book.fresh()) == 2
        book.seen[b.id] = book.seen[c.id] = trio.current_time() - RECORD_TTL - 1
        view = book.view([b.id], my_neighbours=[b.id], my_links={})
        assert view.nodes == {me.id, b.id} and book.fresh() == []
    trio.run(main)


def test_an_edge_counts_only_if_both_ends_claim_it_or_one_record_is_unknown():
    async def main():
        me, b, c = Peer(), Peer(), Peer()
        book = book_of(me.id, {b.id})
        book.receive([b.record()], b.id)  # b does not list me
        view = book.view([b.id, c.id], my_neighbours=[b.id, c.id], my_links={})
        assert not view.has_edge(me.id, b.id) and view.has_edge(me.id, c.id)  # c: no record, my claim counts
    trio.run(main)


def test_a_broadcast_is_split_into_messages_under_the_limit():
    async def main():
        me, neighbour = Peer(), Peer()
        book = book_of(me.id, {neighbour.id})
        book.receive([Peer().record(*(Peer().id for _ in range(8))) for _ in range(40)], neighbour.id)
        limit = 4096
        messages = book.broadcast_messages(me.record(), limit)
        assert len(messages) > 1 and all(len(DEFAULT_REGISTRY.encode(m)) <= limit for m in messages)
        assert sum(len(m.records) for m in messages) == 41 and messages[0].records[0].peer_id == me.id
        assert book.broadcast_messages(me.record(), 10) == []  # not even ours fits: nothing is sent
    trio.run(main)

"""What a peer can make a session hold through tensor streams and queued messages (issue 15): nothing for
a stream nobody asked for, a header that contradicts its expectation refused before allocation, a given-up
stream freed at once, a daemon-wide tensor budget, queued messages bounded by decoded bytes."""

from __future__ import annotations

import numpy as np
import pytest
import trio

import peer.session.streams as streams_mod
from peer.session.groups import IncomingGroup
from peer.session.inbox import decoded_size
from peer.session.streams import TensorBudget
from protocol.errors import ProtocolError
from protocol.frames import KIND_CHUNK
from protocol.limits import GiB, MiB, WireLimits
from protocol.schema import TensorHeader
from protocol.schema.gossip import AverageOffer, TensorSpec
from protocol.tensor_encoder import TensorEncoder
from tests.test_session_groups import in_pair, until

BIG = TensorHeader(stream=1, name="w", dtype="float32", shape=[1 << 30], codec="raw", nbytes=4 * GiB)  # 4 GiB


def test_an_unsolicited_header_allocates_nothing_and_closes_the_session_after_its_lifetime(monkeypatch):
    monkeypatch.setattr(streams_mod, "PARKED_HEADER_SECONDS", 0.5)

    async def body(a, b):
        t0 = trio.current_time()
        await a.send_message(BIG)
        await until(lambda: 1 in b._streams)
        assert b._streams.inflight_bytes == 0 and b._streams.budget.used == 0 and b._streams[1].decoder is None
        await until(lambda: b.closed.is_set(), 5)
        assert "sent unasked" in b.close_reason and trio.current_time() - t0 < 3
    in_pair(body)


def test_more_unsolicited_headers_than_the_allowance_close_the_session_at_once():
    async def body(a, b):
        for stream in range(1, streams_mod.MAX_PARKED_HEADERS + 2):
            await a.send_message(TensorHeader(stream=stream, name="x", dtype="float32", shape=[4], codec="raw", nbytes=16))
        await until(lambda: b.closed.is_set(), 3)
        assert "nobody asked for" in b.close_reason and b._streams.budget.used == 0
    in_pair(body)


def test_a_header_that_arrives_before_its_expectation_waits_and_is_received():
    async def body(a, b):
        t = np.arange(1 << 20, dtype=np.float32)
        async with trio.open_nursery() as n:
            # header and chunks go out before the receiver knows of stream 5 (the send itself may wait:
            # a chunk for a parked stream holds the reader, so 4 MiB need not fit the socket buffers)
            n.start_soon(lambda: a.send_tensor("w", t, stream=5))
            await until(lambda: 5 in b._streams and b._streams[5].parked is not None, 5)
            got = await IncomingGroup(b, [5], [TensorSpec("w", "float32", [1 << 20])]).receive(timeout=5)
        assert np.array_equal(got[0], t) and not b.closed.is_set()
    in_pair(body)


@pytest.mark.parametrize("header", [
    TensorHeader(stream=3, name="w", dtype="float32", shape=[1 << 28], codec="raw", nbytes=1 << 30),  # wrong shape
    TensorHeader(stream=3, name="w", dtype="float64", shape=[8], codec="raw", nbytes=64),  # wrong dtype
    TensorHeader(stream=3, name="v", dtype="float32", shape=[8], codec="raw", nbytes=32),  # wrong name
])
def test_a_header_that_contradicts_its_expectation_is_refused_before_any_allocation(header):
    async def body(a, b):
        b.expect(3, TensorSpec("w", "float32", [8]))
        await a.send_message(header)
        with pytest.raises(ProtocolError, match="does not match 'w' float32\\[8\\]"):
            await b.receive_tensor(3, timeout=5)
        assert b._streams.inflight_bytes == 0 and b._streams.budget.used == 0
    in_pair(body)


def test_a_wrong_byte_count_is_refused_before_any_allocation():
    async def body(a, b):
        b.expect(3)
        await a.send_message(TensorHeader(stream=3, name="w", dtype="float32", shape=[1 << 28], codec="raw", nbytes=7))
        await until(lambda: b.closed.is_set(), 3)
        assert "body bytes" in b.close_reason and b._streams.budget.used == 0
    in_pair(body)


def test_a_stream_given_up_part_way_is_freed_at_once_and_its_rest_absorbed():
    async def body(a, b):
        t = np.ones(8 << 20, np.float32)  # 32 MiB
        enc = TensorEncoder("w", t, chunk_size=1 << 20)
        chunks = enc.chunks()
        b.expect(9)
        await a.send_message(enc.header(9))
        for _ in range(4):
            await a._send_frame(KIND_CHUNK, 9, next(chunks))
        with pytest.raises(trio.TooSlowError):
            await b.receive_tensor(9, timeout=0.3)
        assert b._streams.inflight_bytes == 0 and b._streams.budget.used == 0 and b._streams[9].decoder is None
        for chunk in chunks:
            await a._send_frame(KIND_CHUNK, 9, chunk)
        await until(lambda: not b._streams)
        assert not b.closed.is_set()
    in_pair(body)


def test_the_daemon_budget_is_shared_by_every_session():
    budget = TensorBudget(64 * MiB)

    async def body(a, b):
        b.expect(1)
        await a.send_message(TensorHeader(stream=1, name="w", dtype="float32", shape=[16 << 20], codec="raw", nbytes=64 * MiB))
        await until(lambda: b._streams.budget.used == 64 * MiB)
        b.expect(2)
        await a.send_message(TensorHeader(stream=2, name="v", dtype="float32", shape=[4], codec="raw", nbytes=16))
        await until(lambda: b.closed.is_set(), 3)
        assert "across all sessions" in b.close_reason and b._streams.budget.used == 0
    in_pair(body, tensor_budget=budget)
    assert budget.used == 0


def test_queued_messages_are_bounded_by_decoded_bytes():
    """Large messages nobody consumes: the reader pauses once the queue would pass its byte bound (far
    below the count bound), so the flood is backpressured over TCP instead of held."""
    limits = WireLimits(max_queued_message_bytes=1 * MiB)
    fat = AverageOffer(group="g", tensors=[TensorSpec("x" * 1000 + str(i), "float32", [1]) for i in range(50)],
                       streams=[], max_weight=0.1, rule="pairwise", codec="raw", step=0)
    size = decoded_size(fat)
    assert size > 50_000

    async def body(a, b):
        sent = 0
        with trio.move_on_after(3):  # the sender blocks once TCP buffers fill behind the paused reader
            for _ in range(200):  # ~10 MiB decoded if all were held
                await a.send_message(fat)
                sent += 1
        await until(lambda: b.incoming.queued_bytes > 0)
        assert b.incoming.queued_bytes <= limits.max_queued_message_bytes
        assert b.stats.messages_in < sent and not b.closed.is_set()
        await b.incoming.receive()  # the consumer catches up: reading resumes
        await until(lambda: b.stats.messages_in > limits.max_queued_message_bytes // size)
    in_pair(body, limits=limits)

"""Tensor groups (peer/session/groups.py) over a real encrypted loopback session: the spec check, the call-off
of a group cut short, discarding, the receive deadline."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from peer.averaging.shared import SharedTensors
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.connect import dial, open_listeners, serve
from peer.session.transport import TransportConfig
from protocol.errors import ProtocolError
from protocol.identity import generate_identity
from protocol.limits import WireLimits
from protocol.schema.gossip import TensorSpec


def tcfg(**kw) -> TransportConfig:
    return TransportConfig(identity=generate_identity(), swarm="groups", handshake_timeout=2.0, **kw)


async def connected(nursery, **theirs):
    """Two running ends of one session: (ours, theirs); `theirs` configures the second end."""
    listeners, (_, port) = await open_listeners("127.0.0.1", 0)
    box: dict = {}
    ready = trio.Event()

    async def on_session(session):
        box["theirs"] = session
        ready.set()
        await session.run()

    nursery.start_soon(lambda: serve(listeners, tcfg(**theirs), on_session))
    ours = await dial("127.0.0.1", port, tcfg())
    nursery.start_soon(ours.run)
    with trio.fail_after(5):
        await ready.wait()
    return ours, box["theirs"]


async def until(condition, timeout: float = 5) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


async def cancel_once_sent(scope: trio.CancelScope, session, nbytes: int) -> None:
    """Cancel `scope` as soon as `session` has written `nbytes` in all."""
    while session.stats.bytes_out < nbytes and not scope.cancel_called:
        await trio.sleep(0)
    scope.cancel()


def in_pair(body, **theirs):
    async def main():
        async with trio.open_nursery() as n:
            a, b = await connected(n, **theirs)
            await body(a, b)
            n.cancel_scope.cancel()
    trio.run(main)


SPECS = [TensorSpec("w", "float32", [40, 50]), TensorSpec("b", "float32", [50])]


def arrays(specs=SPECS, dtype=np.float32):
    return [np.arange(np.prod(s.shape), dtype=dtype).reshape(s.shape) for s in specs]


def test_a_group_arrives_whole_and_in_order():
    async def body(a, b):
        out = OutgoingGroup(a, SPECS)
        assert len(set(out.streams)) == 2
        sent = arrays()
        await out.send(sent)
        got = await IncomingGroup(b, out.streams, SPECS).receive(timeout=5)
        assert all(np.array_equal(x, y) for x, y in zip(got, sent))
        assert not b._streams and b._streams.inflight_bytes == 0
        with pytest.raises(ValueError, match="1 tensors for a group of 2"):
            await out.send(sent[:1])
    in_pair(body)


@pytest.mark.parametrize("sent_specs, dtype, expected", [
    ([SPECS[0], TensorSpec("b", "float32", [51])], np.float32, r"float32\[51\] does not match 'b' float32\[50\]"),
    (SPECS, np.float64, r"float64\[40, 50\] does not match 'w' float32\[40, 50\]"),
    ([SPECS[0], TensorSpec("bias", "float32", [50])], np.float32, r"'bias' float32\[50\] does not match 'b'"),
])
def test_a_tensor_that_does_not_match_its_spec_is_refused_naming_what_and_where(sent_specs, dtype, expected):
    """A peer chooses its headers: a tensor of another name, dtype or shape never reaches the caller, and the
    error says which tensor of the group, on which stream. Discarding the group then leaves nothing behind
    (the tensors already read are released, the rest dropped as they come)."""
    async def body(a, b):
        out = OutgoingGroup(a, sent_specs)
        await out.send(arrays(sent_specs, dtype))
        theirs = IncomingGroup(b, out.streams, SPECS)
        with pytest.raises(ProtocolError, match=expected) as err:
            await theirs.receive(timeout=5)
        bad = 1 if dtype is np.float32 else 0
        assert f"tensor {bad + 1} of 2 on stream {out.streams[bad]}:" in str(err.value)
        theirs.discard()
        await until(lambda: not b._streams)
        assert b._streams.inflight_bytes == 0 and not b.closed.is_set()
    in_pair(body)


def test_a_group_announced_with_the_wrong_number_of_streams_is_refused_and_can_be_dropped():
    async def body(a, b):
        three = [*SPECS, TensorSpec("c", "float32", [3])]
        out = OutgoingGroup(a, three)
        theirs = IncomingGroup(b, out.streams, SPECS)
        with pytest.raises(ProtocolError, match="3 tensor streams announced for a group of 2 tensors"):
            await theirs.receive(timeout=5)
        theirs.discard()
        await out.send(arrays(three))
        await until(lambda: not b._streams)
    in_pair(body)


def test_a_discarded_group_is_dropped_as_it_arrives():
    """A refused offer's tensors still come: discarded first, they are absorbed and nothing stays allocated."""
    async def body(a, b):
        out = OutgoingGroup(a, SPECS)
        IncomingGroup(b, out.streams, SPECS).discard()
        assert sorted(b._streams) == sorted(out.streams) and all(b._streams[s].discard for s in out.streams)
        await out.send(arrays())
        await until(lambda: not b._streams)
        assert b._streams.inflight_bytes == 0 and b.stats.tensors_in == 0
    in_pair(body)


def test_a_group_cut_short_calls_off_the_tensors_it_had_not_begun():
    """The sender is cancelled inside the first of three large tensors: that one is called off by the session,
    the two it never began by the group, so a receiver waiting for the last hears it at once instead of at its
    deadline, and the slots of the ones it discarded go with the call-off."""
    async def body(a, b):
        specs = [TensorSpec(f"t{i}", "float32", [8 << 20]) for i in range(3)]  # 32 MiB each
        out = OutgoingGroup(a, specs)
        got: dict = {}

        async def wait_for_the_last():
            try:
                await b.receive_tensor(out.streams[2], timeout=30)
            except ProtocolError as exc:
                got["last"] = str(exc)

        async with trio.open_nursery() as n:
            n.start_soon(wait_for_the_last)
            b.discard(out.streams[:2])
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as cut:
                n.start_soon(cancel_once_sent, cut, a, a.stats.bytes_out + (5 << 20))
                await out.send([np.ones(8 << 20, np.float32)] * 3)
            assert cut.cancelled_caught, "the whole group went out before the cancel: the test proved nothing"
            with trio.fail_after(5):
                while "last" not in got:
                    await trio.sleep(0.01)
        assert f"the tensor on stream {out.streams[2]} was abandoned by its sender (Cancelled)" in got["last"]
        await until(lambda: not b._streams)
        assert b._streams.inflight_bytes == 0 and not b.closed.is_set()
    in_pair(body)


def test_receive_waits_at_most_its_timeout_for_each_tensor_and_a_late_one_is_absorbed():
    async def body(a, b):
        out = OutgoingGroup(a, SPECS)
        first, second = arrays()
        await a.send_tensor("w", first, stream=out.streams[0])  # the second one is late
        theirs = IncomingGroup(b, out.streams, SPECS)
        t0 = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await theirs.receive(timeout=0.3)
        assert 0.3 <= trio.current_time() - t0 < 2
        assert list(b._streams) == [out.streams[1]] and b._streams[out.streams[1]].discard
        theirs.discard()  # nothing more to drop: the one waited for is marked, the first released
        assert list(b._streams) == [out.streams[1]]
        await a.send_tensor("b", second, stream=out.streams[1])
        await until(lambda: not b._streams)
        with pytest.raises(RuntimeError, match="already received or discarded"):
            await theirs.receive(timeout=1)
    in_pair(body)


def test_discarding_a_peers_stream_ids_holds_no_more_than_the_stream_limit():
    """The ids of a group come from the peer: a refused offer may name 100,000 streams. Discarding them marks
    no more streams than a session may have open, and marks for tensors that never come (here: all of them)
    give way to new streams instead of closing the session."""
    async def body(a, b):
        IncomingGroup(b, range(1000, 101_000), SPECS).discard()
        assert len(b._streams) == 8
        out = OutgoingGroup(a, SPECS)
        await out.send(arrays())
        got = await IncomingGroup(b, out.streams, SPECS).receive(timeout=5)
        assert np.array_equal(got[1], arrays()[1]) and not b.closed.is_set()
        assert len(b._streams) <= 8
    in_pair(body, limits=WireLimits(max_queued_messages=8))


@pytest.mark.parametrize("codec", ["float16", "q8"])
def test_as_sent_is_exactly_what_the_neighbour_decodes(codec):
    """Each side applies w * (received - as_sent(own)); the sum is kept only if as_sent(own) is bit for bit
    what the other side received."""
    async def body(a, b):
        x = np.random.default_rng(5).standard_normal((300, 70)).astype(np.float32)
        group = SharedTensors("g", {"x": x})
        out = OutgoingGroup(a, group.specs)
        await out.send([x], codec=codec)
        (received,) = await IncomingGroup(b, out.streams, group.specs).receive(timeout=5)
        (as_sent,) = group.as_sent([x.copy()], codec)
        assert not np.array_equal(as_sent, x)  # lossy
        np.testing.assert_array_equal(as_sent, received)
    in_pair(body)

"""The encrypted transport over real sockets on 127.0.0.1: handshakes, failures, limits, bulk tensors."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import trio

from peer.session.connect import ListenerStats, dial, handshake_stream, open_listeners, serve
from peer.session.handshake_slots import HandshakeSlots
from peer.session.transport import SessionClosed, TransportConfig
from protocol import circuit
from protocol.cipher import CIPHERS
from protocol.errors import HandshakeError, ProtocolError
from protocol.identity import generate_identity, peer_id_from_public_bytes, public_key_bytes
from protocol.limits import WireLimits
from protocol.schema import Ping, Pong

from tests.daemons import REPO


def tcfg(**kw) -> TransportConfig:
    kw.setdefault("identity", generate_identity())
    kw.setdefault("swarm", "test")
    kw.setdefault("handshake_timeout", 2.0)
    return TransportConfig(**kw)


async def echo_server(nursery, cfg, stats=None, discard=(), **serve_kw):
    """A listener whose sessions answer pings (and drop the tensors on the streams `discard`); returns its port.
    `serve_kw`: more of `serve`'s arguments (slots, on_circuit, ...)."""
    listeners, (host, port) = await open_listeners("127.0.0.1", 0)

    async def on_session(session):
        async with trio.open_nursery() as n:
            session.discard(discard)  # tensors nobody asked for are refused, so say these will be dropped
            n.start_soon(session.run)
            async for env in session.incoming:
                if isinstance(env.message, Ping):
                    await session.reply(env, Pong(echo=env.message.sent))
            n.cancel_scope.cancel()

    nursery.start_soon(lambda: serve(listeners, cfg, on_session, stats=stats if stats is not None else ListenerStats(),
                                     **serve_kw))
    return port


async def ping(session) -> None:
    async with trio.open_nursery() as n:
        n.start_soon(session.run)
        env = await session.request(Ping(sent=1.5), timeout=5)
        assert env.message == Pong(echo=1.5)
        await session.aclose()
        n.cancel_scope.cancel()


async def attempt(port, cfg, expected=None) -> str:
    """'ok' if a session to `port` answers a ping, 'refused' if the handshake or the session fails."""
    try:
        s = await dial("127.0.0.1", port, cfg, expected_peer_id=expected)
    except (HandshakeError, OSError, trio.BrokenResourceError):
        return "refused"
    result = "refused"
    async with trio.open_nursery() as n:
        n.start_soon(s.run)
        try:
            # the responder may refuse only after our last handshake message: the session then dies
            await s.request(Ping(sent=0.0), timeout=5)
            result = "ok"
        except SessionClosed:
            pass
        await s.aclose()
        n.cancel_scope.cancel()
    return result


def test_handshake_every_cipher_and_identity_is_proven():
    async def main():
        server_key = generate_identity()
        server_id = peer_id_from_public_bytes(public_key_bytes(server_key))
        for cipher in CIPHERS:
            async with trio.open_nursery() as n:
                port = await echo_server(n, tcfg(identity=server_key, ciphers=(cipher,)))
                s = await dial("127.0.0.1", port, tcfg(ciphers=(cipher,)), expected_peer_id=server_id)
                assert s.peer_id == server_id and s.cipher == cipher
                await ping(s)
                n.cancel_scope.cancel()
    trio.run(main)


@pytest.mark.parametrize("case", ["wrong_swarm_key", "missing_swarm_key", "wrong_swarm", "wrong_peer_id", "not_allowed"])
def test_handshake_failures_are_clean_and_listener_keeps_serving(case):
    async def main():
        stats = ListenerStats()
        server = dict(psk=b"k" * 32)
        client = dict(psk=b"k" * 32)
        expected = None
        if case == "wrong_swarm_key":
            client["psk"] = b"x" * 32
        elif case == "missing_swarm_key":
            client["psk"] = None
        elif case == "wrong_swarm":
            client["swarm"] = "other"
        elif case == "wrong_peer_id":
            expected = "a" * 20
        good_key = generate_identity()
        if case == "not_allowed":
            server["allowed_peer_ids"] = frozenset({peer_id_from_public_bytes(public_key_bytes(good_key))})
        async with trio.open_nursery() as n:
            port = await echo_server(n, tcfg(**server), stats)
            assert await attempt(port, tcfg(**client), expected) == "refused"
            # Exactly one failure in every case (the client that refused the server's identity hangs up
            # mid-handshake, which the server counts too), counted once the server's side has finished.
            with trio.fail_after(5):
                while stats.handshake_failures < 1:
                    await trio.sleep(0.01)
            assert (stats.handshake_failures, stats.accepted) == (1, 0)
            # a good client is still served, and counted as accepted, not failed
            await ping(await dial("127.0.0.1", port, tcfg(identity=good_key, psk=server["psk"])))
            n.cancel_scope.cancel()
        assert (stats.handshake_failures, stats.accepted) == (1, 1)
    trio.run(main)


def test_slowloris_and_garbage_are_dropped_within_deadline():
    async def main():
        stats = ListenerStats()
        async with trio.open_nursery() as n:
            port = await echo_server(n, tcfg(handshake_timeout=1.0), stats)
            idle = await trio.open_tcp_stream("127.0.0.1", port)  # says nothing at all
            garbage = await trio.open_tcp_stream("127.0.0.1", port)
            await garbage.send_all(os.urandom(5000))
            huge = await trio.open_tcp_stream("127.0.0.1", port)
            await huge.send_all(struct.pack(">I", 0xFFFFFFFF) + b"x" * 16)  # a 4 GB length prefix
            with trio.fail_after(4):
                for s in (idle, garbage, huge):  # each is closed by the server, within the deadline
                    try:
                        while await s.receive_some(65536):
                            pass
                    except trio.BrokenResourceError:
                        pass  # a reset: the server closed with our garbage unread (it reads only what it needs)
            await ping(await dial("127.0.0.1", port, tcfg()))
            n.cancel_scope.cancel()
        assert stats.handshake_failures == 3
    trio.run(main)


def test_connection_limit_per_ip():
    async def main():
        async with trio.open_nursery() as n:
            listeners, (_, port) = await open_listeners("127.0.0.1", 0)
            stats = ListenerStats()

            async def hold(session):
                await session.run()

            n.start_soon(lambda: serve(listeners, tcfg(), hold, max_connections_per_ip=2, stats=stats))
            held = [await dial("127.0.0.1", port, tcfg()) for _ in range(2)]
            assert await attempt(port, tcfg()) == "refused"
            assert stats.refused == 1
            for s in held:
                await s.aclose()
            n.cancel_scope.cancel()
    trio.run(main)


async def until(predicate, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def raw_from(source: str, port: int, payload: bytes = b"") -> trio.SocketStream:
    """A TCP connection to the listener from `source` (any 127.x.y.z is loopback), having sent `payload`."""
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    if payload:
        await stream.send_all(payload)
    return stream


@pytest.mark.parametrize("payload", [b"", circuit.MAGIC], ids=["empty", "circuit magic"])
def test_a_flood_from_one_address_never_pushes_out_a_handshake_from_another_prefix(payload):
    """Issue 29: handshake slots were one oldest-first queue, so a flood from one IP pushed out an honest
    peer's handshake before it finished. Here the honest connection from 127.0.2.1 (another /24) starts,
    then waits while 100 connections from 127.0.1.1 arrive (each pushing out an older one): its slot is
    kept and its handshake completes; the flood held at most its per-IP share, empty or opening a circuit
    (the relay expects circuits here, so circuit hellos wait in the slots like handshakes)."""
    async def main():
        slots: HandshakeSlots = HandshakeSlots(total=8, per_prefix=4, per_ip=2)
        stats = ListenerStats()
        key = generate_identity()
        async def on_circuit(stream, token):
            raise AssertionError("no complete circuit hello was sent")

        async with trio.open_nursery() as n:
            port = await echo_server(n, tcfg(identity=key, handshake_timeout=10.0), stats, slots=slots,
                                     on_circuit=on_circuit)
            honest = await raw_from("127.0.2.1", port)
            await until(lambda: slots.held_by_ip("127.0.2.1") == 1)
            flood = []
            for i in range(100):
                flood.append(await raw_from("127.0.1.1", port, payload))
                await until(lambda: len(slots) == min(i + 2, 3) and stats.handshakes_evicted == max(0, i - 1))
            assert slots.held_by_ip("127.0.1.1") == 2 and slots.held_by_ip("127.0.2.1") == 1
            session = await handshake_stream(honest, tcfg(), initiator=True,
                                             expected_peer_id=peer_id_from_public_bytes(public_key_bytes(key)),
                                             remote_addr=("127.0.0.1", port))
            await ping(session)
            assert stats.accepted == 1
            for s in flood:
                await s.aclose()
            await until(lambda: len(slots) == 0)
            n.cancel_scope.cancel()
    trio.run(main)


def test_circuit_hellos_are_closed_at_once_where_none_is_expected_and_delivered_where_one_is():
    """A daemon that is not setting up a circuit (not a relay, or an idle one) closes a connection after
    the 4 bytes of a circuit hello's magic, instead of holding it for the hello's deadline; where one is
    expected, the whole hello is read in a handshake slot and its token goes to the relay."""
    async def main():
        expected = False
        tokens: list[bytes] = []
        stats = ListenerStats()
        slots: HandshakeSlots = HandshakeSlots()
        async def on_circuit(stream, token):
            tokens.append(token)

        async with trio.open_nursery() as n:
            port = await echo_server(n, tcfg(handshake_timeout=30.0), stats, slots=slots, on_circuit=on_circuit,
                                     circuits_expected=lambda: expected)
            t0 = trio.current_time()
            for _ in range(20):
                stray = await raw_from("127.0.1.1", port, circuit.MAGIC)
                with trio.fail_after(5):
                    assert await stray.receive_some(1) == b""  # closed by the listener, long before 30 s
                await stray.aclose()
            assert stats.circuits_dropped == 20 and trio.current_time() - t0 < 5 and not tokens
            expected = True
            held = await raw_from("127.0.1.1", port, circuit.MAGIC)  # the rest of its hello never comes
            await until(lambda: len(slots) == 1)
            whole = await raw_from("127.0.1.2", port, circuit.hello(b"t" * 16))
            await until(lambda: tokens == [b"t" * 16])
            assert len(slots) == 1 and stats.circuits_dropped == 20  # the held one still waits in its slot
            for s in (held, whole):
                await s.aclose()
            await until(lambda: len(slots) == 0)
            n.cancel_scope.cancel()
    trio.run(main)


def test_tensors_roundtrip_codecs_and_nan_rejection_keeps_session():
    async def main():
        limits = WireLimits(max_frame_bytes=64 * 1024 + 64, max_message_bytes=64 * 1024)
        got = {}

        async def on_session(session):
            async with trio.open_nursery() as n:
                n.start_soon(session.run)
                for stream in (1, 2, 3, 4):
                    try:
                        got[stream] = (await session.receive_tensor(stream, timeout=10)).array
                    except Exception as exc:  # noqa: BLE001 - recorded for the assertions
                        got[stream] = exc
                got["inflight"] = session._streams.inflight_bytes  # every byte accounted for is released again
                n.cancel_scope.cancel()

        async with trio.open_nursery() as n:
            listeners, (_, port) = await open_listeners("127.0.0.1", 0)
            n.start_soon(lambda: serve(listeners, tcfg(limits=limits, chunk_bytes=64 * 1024), on_session))
            s = await dial("127.0.0.1", port, tcfg(limits=limits, chunk_bytes=64 * 1024))
            n.start_soon(s.run)
            a = np.random.default_rng(1).standard_normal((300, 700)).astype(np.float32)
            bad = a.copy()
            bad[3, 3] = np.nan
            await s.send_tensor("a", a)
            await s.send_tensor("bad", bad)  # rejected at the receiver, session survives
            await s.send_tensor("q", a, codec="q8")
            await s.send_tensor("h", a, codec="float16")
            with trio.fail_after(10):
                while len(got) < 5:
                    await trio.sleep(0.01)
            await s.aclose()
            n.cancel_scope.cancel()
        assert np.array_equal(got[1], a)
        assert "NaN" in str(got[2])
        assert got["inflight"] == 0
        block_max = np.abs(a).max()
        assert np.abs(got[3] - a).max() <= block_max / 254 + 1e-6
        assert np.abs(got[4] - a).max() < 1e-2
    trio.run(main)


RECEIVER = textwrap.dedent("""
    import hashlib, json, sys, trio
    from peer.session.connect import open_listeners, serve
    from peer.session.transport import TransportConfig
    from protocol.identity import generate_identity
    from protocol.schema import Ping, Pong

    async def main():
        cfg = TransportConfig(identity=generate_identity(), swarm="big")
        listeners, (_, port) = await open_listeners("127.0.0.1", 0)
        done = trio.Event()
        async def on_session(session):
            async with trio.open_nursery() as n:
                n.start_soon(session.run)
                t = await session.receive_tensor(1, timeout=120)
                digest = hashlib.sha256(t.array.tobytes()).hexdigest()
                print(json.dumps({"sha256": digest, "shape": list(t.array.shape), "dtype": t.dtype}), flush=True)
                env = await session.incoming.receive()
                await session.reply(env, Pong(echo=0.0))
                done.set()
                n.cancel_scope.cancel()
        async with trio.open_nursery() as n:
            n.start_soon(lambda: serve(listeners, cfg, on_session))
            print(json.dumps({"port": port}), flush=True)
            await done.wait()
            n.cancel_scope.cancel()
    trio.run(main)
""")


@pytest.mark.slow
def test_two_process_256mib_tensor_arrives_bit_exact():
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        a = np.random.default_rng(7).integers(0, 2**32, size=64 << 20, dtype=np.uint32).view(np.float32)
        a = np.nan_to_num(a, nan=0.5, posinf=1.0, neginf=-1.0)  # the receiver rejects non-finite floats
        want = hashlib.sha256(a.tobytes()).hexdigest()

        async def send():
            s = await dial("127.0.0.1", port, tcfg(swarm="big"))
            async with trio.open_nursery() as n:
                n.start_soon(s.run)
                await s.send_tensor("big", a)
                await s.request(Ping(sent=0.0), timeout=120)
                await s.aclose()
                n.cancel_scope.cancel()

        trio.run(send)
        result = json.loads(proc.stdout.readline())
        assert result == {"sha256": want, "shape": [64 << 20], "dtype": "float32"}
        assert a.nbytes == 256 << 20
    finally:
        proc.wait(30)
        if proc.returncode:
            print(proc.stderr.read(), file=sys.stderr)
    assert proc.returncode == 0


def test_tampered_stream_closes_session_with_reason():
    """A man in the middle flips one byte of a sealed frame: the receiver closes with an authentication error."""
    async def main():
        closed = trio.Event()
        reasons = []

        async def on_session(session):
            await session.run()
            reasons.append(session.close_reason)
            closed.set()

        async with trio.open_nursery() as n:
            listeners, (_, port) = await open_listeners("127.0.0.1", 0)
            n.start_soon(lambda: serve(listeners, tcfg(), on_session))
            s = await dial("127.0.0.1", port, tcfg())
            # seal a valid frame with the real writer, then corrupt it on the way out
            view = bytearray(s._writer.seal(1, 0, s.cfg.registry.encode(Ping(sent=1.0))))
            view[-3] ^= 0x01
            await s.stream.send_all(bytes(view))
            with trio.fail_after(5):
                await closed.wait()
            await s.aclose()
            n.cancel_scope.cancel()
        assert "authentication" in reasons[0]
    trio.run(main)


def test_timeouts_and_cancellation_leave_the_session_usable():
    """A receiver that gives up on a tensor, and a requester whose deadline passes before the reply,
    both leave the session healthy: late chunks are absorbed, late replies are ignored."""
    async def main():
        async def on_session(session):
            async with trio.open_nursery() as n:
                n.start_soon(session.run)
                async for env in session.incoming:
                    if isinstance(env.message, Ping):
                        if env.message.sent == 1.0:
                            await trio.sleep(0.5)  # answer too late for the first request
                        await session.reply(env, Pong(echo=env.message.sent))
                n.cancel_scope.cancel()

        async with trio.open_nursery() as n:
            listeners, (_, port) = await open_listeners("127.0.0.1", 0)
            n.start_soon(lambda: serve(listeners, tcfg(), on_session))
            s = await dial("127.0.0.1", port, tcfg())
            n.start_soon(s.run)
            with pytest.raises(trio.TooSlowError):
                await s.request(Ping(sent=1.0), timeout=0.1)
            env = await s.request(Ping(sent=2.0), timeout=5)  # the late reply to 1.0 is dropped, not mixed in
            assert env.message.echo == 2.0
            # a tensor wait that is cancelled midway: the stream is discarded, nothing leaks or breaks
            with trio.move_on_after(0.05):
                await s.receive_tensor(99, timeout=10)
            assert s._streams[99].discard
            assert not s.closed.is_set()
            env = await s.request(Ping(sent=3.0), timeout=5)
            assert env.message.echo == 3.0
            await s.aclose("test done")
            assert s.closed.is_set() and s.close_reason == "test done"
            with pytest.raises(SessionClosed):
                await s.request(Ping(sent=4.0), timeout=5)
            n.cancel_scope.cancel()
    trio.run(main)


def test_a_send_cancelled_mid_frame_does_not_break_the_session():
    """A sealed frame has spent its nonce, so a send cancelled half-way must still finish later: the tail
    goes out before the next frame and the remote keeps authenticating frames. An exchange whose deadline
    passes cancels its tensor sends; before this was handled that killed the whole session."""
    async def main():
        async with trio.open_nursery() as n:
            port = await echo_server(n, tcfg(), discard=range(1, 13))
            s = await dial("127.0.0.1", port, tcfg(chunk_bytes=4 << 20))
            n.start_soon(s.run)
            big = np.ones(16 << 20, np.float32)  # 64 MiB in 4 MiB frames
            cuts: list[int] = []  # bytes of a frame left unsent when a write was cancelled
            real_write = s._write

            async def write(view):
                try:
                    await real_write(view)
                except trio.Cancelled:
                    cuts.append(len(s._unsent))
                    raise

            s._write = write
            for attempt in range(12):
                threshold = s.stats.bytes_out + (attempt % 6 + 1) * (3 << 20) + 12345  # rarely on a frame edge
                async with trio.open_nursery() as inner:
                    async def cancel_when_past_threshold():
                        while s.stats.bytes_out < threshold:
                            await trio.sleep(0)
                        inner.cancel_scope.cancel()

                    inner.start_soon(cancel_when_past_threshold)
                    await s.send_tensor("t", big)
                    inner.cancel_scope.cancel()  # finished before the threshold: stop the watcher
                env = await s.request(Ping(sent=float(attempt)), timeout=10)
                assert env.message.echo == float(attempt) and not s.closed.is_set()
            assert sum(1 for c in cuts if c) >= 3, "never cancelled inside a frame; the test proved nothing"
            await s.aclose()
            n.cancel_scope.cancel()
    trio.run(main)


def test_a_tensor_abandoned_part_way_fails_at_the_receiver_at_once_and_frees_its_memory():
    """A sender cancelled part-way (an exchange's deadline, say) says so (`tensor_cancel`): the receiver's wait
    ends with the reason instead of at its deadline, the half-received tensor's budget is released, and the
    session carries on. A stream the receiver gave up on before its header came is forgotten once called off."""
    async def main():
        got: dict = {}

        async def on_session(session):
            async with trio.open_nursery() as n:
                n.start_soon(session.run)
                session.discard([7])  # a tensor it will not wait for, whose header never comes
                try:
                    await session.receive_tensor(1, timeout=30)
                except ProtocolError as exc:
                    got["error"] = exc
                    got["inflight"] = session._streams.inflight_bytes
                got["next"] = (await session.receive_tensor(2, timeout=10)).array
                got["open"] = sorted(session._streams)
                n.cancel_scope.cancel()

        async with trio.open_nursery() as n:
            listeners, (_, port) = await open_listeners("127.0.0.1", 0)
            n.start_soon(lambda: serve(listeners, tcfg(chunk_bytes=1 << 20), on_session))
            s = await dial("127.0.0.1", port, tcfg(chunk_bytes=1 << 20))
            n.start_soon(s.run)
            t = np.arange(4 << 20, dtype=np.float32)  # 16 chunks
            start = s.stats.bytes_out
            async with trio.open_nursery() as inner:
                async def cancel_part_way():
                    while s.stats.bytes_out < start + (5 << 20):
                        await trio.sleep(0)
                    inner.cancel_scope.cancel()

                inner.start_soon(cancel_part_way)
                await s.send_tensor("half", t, stream=1)
                raise AssertionError("the whole tensor went out before the cancel: the test proved nothing")
            await s.call_off([7], "never started")
            with trio.fail_after(5):
                while "error" not in got:  # (so stream 2's bytes are not yet counted when it looks)
                    await trio.sleep(0.01)
            await s.send_tensor("whole", t, stream=2)
            with trio.fail_after(5):
                while "next" not in got:
                    await trio.sleep(0.01)
            await s.aclose()
            n.cancel_scope.cancel()
        assert "'half' was abandoned by its sender" in str(got["error"])
        assert got["inflight"] == 0
        assert np.array_equal(got["next"], t)
        assert got["open"] == []  # stream 7's slot went with the call-off
    trio.run(main)


def test_receive_buffers_are_recycled_once_the_consumer_drops_them():
    import gc

    from peer.session.buffers import ReceiveBufferPool

    pool = ReceiveBufferPool(max_idle_bytes=8 << 20)
    a = pool.array(np.float32, (1 << 20,))  # 4 MiB
    addr_a = a.ctypes.data
    view = a[10:]
    del a
    gc.collect()
    b = pool.array(np.float32, (1 << 20,))
    addr_b = b.ctypes.data
    assert addr_b != addr_a  # a view still uses the first buffer: it is not handed out twice
    del view, b
    gc.collect()
    assert pool._idle_bytes == 8 << 20  # both came back, within the idle bound
    c = pool.array(np.float32, (1 << 20,))
    assert c.ctypes.data in (addr_a, addr_b)  # reused, no fresh pages
    assert pool.array(np.float32, (16,)) is None  # small tensors are not pooled


def test_every_session_of_a_daemon_shares_one_receive_pool_so_idle_buffers_are_bounded_per_daemon():
    """A pool per session kept up to 256 MiB idle in each (peer/session/buffers.py says what that cost): the
    sessions made with one config share its pool, and a copy of the config (dataclasses.replace) shares it too."""
    import dataclasses

    from peer.session.buffers import MAX_IDLE_BYTES
    from peer.session.streams import IncomingStreams

    cfg = tcfg()
    assert cfg.receive_pool is not None and cfg.receive_pool.max_idle_bytes == MAX_IDLE_BYTES
    assert dataclasses.replace(cfg, swarm="other").receive_pool is cfg.receive_pool
    a, b = (IncomingStreams(cfg.limits, None, name, cfg.tensor_budget, cfg.receive_pool) for name in "ab")
    assert a._pool is b._pool is cfg.receive_pool
    assert tcfg().receive_pool is not cfg.receive_pool  # another daemon, another pool


def test_together_raises_the_first_failure_even_when_several_tasks_fail():
    from peer.concurrency import together

    async def fail(exc):
        raise exc

    async def main():
        with pytest.raises(SessionClosed):
            await together(lambda: fail(SessionClosed("a")), lambda: fail(SessionClosed("b")))
        with pytest.raises(ValueError):
            await together(lambda: fail(ValueError("only one")), trio.sleep_forever)
    trio.run(main)


def test_a_send_to_a_peer_that_stopped_reading_closes_the_session_by_its_deadline():
    """The server never reads its session; our frames fill the buffers, and the one that cannot be
    written within `send_timeout` closes the session with the reason, instead of blocking forever."""
    async def main():
        async with trio.open_nursery() as n:
            listeners, (_, port) = await open_listeners("127.0.0.1", 0)
            n.start_soon(lambda: serve(listeners, tcfg(), lambda s: trio.sleep_forever()))
            s = await dial("127.0.0.1", port, tcfg())
            s.send_timeout = 0.5
            n.start_soon(s.run)
            t0 = trio.current_time()
            with pytest.raises(SessionClosed, match="stopped reading"):
                with trio.fail_after(30):
                    while True:  # 1 MiB tensors, none ever read
                        await s.send_tensor("t", np.zeros(1 << 18, dtype=np.float32))
            assert s.closed.is_set() and trio.current_time() - t0 < 30
            n.cancel_scope.cancel()
    trio.run(main)


def test_fanout_waits_on_no_session_and_skips_a_busy_one():
    async def main():
        from peer.session.fanout import Fanout
        async with trio.open_nursery() as n:
            listeners, (_, port) = await open_listeners("127.0.0.1", 0)
            got: list[str] = []

            async def collect(s):
                async with trio.open_nursery() as inner:
                    inner.start_soon(s.run)
                    async for env in s.incoming:
                        got.append(type(env.message).__name__)
            n.start_soon(lambda: serve(listeners, tcfg(), collect))
            a = await dial("127.0.0.1", port, tcfg())
            n.start_soon(a.run)
            fan = Fanout()
            fan._busy.add(a)  # a previous snapshot still being written to it
            assert fan.send(n, [a], Ping(sent=1.0)) == 1
            fan._busy.clear()
            assert fan.send(n, [a], Ping(sent=2.0)) == 0  # returns at once; the send runs in n
            with trio.fail_after(5):
                while got != ["Ping"]:
                    await trio.sleep(0.01)
            n.cancel_scope.cancel()
    trio.run(main)

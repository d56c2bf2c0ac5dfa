"""The control socket's framing (peer/control.py over protocol/frames.py's length prefix): the bytes on the
wire, the limit checked on the prefix before any body is read, never reading past one message, and a real
control server and client over a Unix socket."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest
import trio
import trio.testing

from peer.control import (MAX_REQUEST, ControlError, call, pack, receive_message, receive_message_blocking,
                          serve_control)
from peer.home import Home
from protocol.errors import LimitExceeded
from protocol.frames import LengthPrefixedReader


def test_pack_is_a_u32_length_then_msgpack():
    """The bytes older clients and daemons speak: unchanged."""
    obj = {"cmd": "status", "args": {}}
    body = msgpack.packb(obj, use_bin_type=True)
    assert pack(obj) == struct.pack(">I", len(body)) + body


def test_an_oversized_length_is_refused_before_the_body_is_read():
    async def main():
        send, receive = trio.testing.memory_stream_pair()
        await send.send_all(struct.pack(">I", MAX_REQUEST + 1))  # the prefix alone: no body will ever come
        with trio.fail_after(5):  # waiting for the body would hang here
            with pytest.raises(LimitExceeded):
                await receive_message(receive, LengthPrefixedReader(MAX_REQUEST))

    trio.run(main)


def test_the_blocking_reader_refuses_an_oversized_length_before_the_body_too():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(struct.pack(">I", 101))
        with pytest.raises(LimitExceeded):
            receive_message_blocking(b, LengthPrefixedReader(100))


def test_a_message_is_read_exactly_and_what_follows_is_left_on_the_socket():
    """A session command's stream is handed on after its request: nothing after the request may be read."""
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        a.sendall(pack({"cmd": "attach"}) + b"next")
        assert msgpack.unpackb(receive_message_blocking(b, LengthPrefixedReader(MAX_REQUEST))) == {"cmd": "attach"}
        assert b.recv(100) == b"next"
        a.close()
        assert receive_message_blocking(b, LengthPrefixedReader(MAX_REQUEST)) is None  # closed: no message


def test_a_message_split_into_single_bytes_arrives_whole():
    async def main():
        send, receive = trio.testing.memory_stream_pair()
        data = pack({"x": list(range(50))})
        reader = LengthPrefixedReader(MAX_REQUEST)

        async def dribble():
            for i in range(len(data)):
                await send.send_all(data[i:i + 1])
            await send.aclose()

        async with trio.open_nursery() as n:
            n.start_soon(dribble)
            assert msgpack.unpackb(await receive_message(receive, reader)) == {"x": list(range(50))}
            assert await receive_message(receive, reader) is None

    trio.run(main)


@pytest.mark.process  # a real Unix socket
def test_a_control_server_answers_a_client_and_drops_an_oversized_request(tmp_path):
    home = tmp_path / "h"
    home.mkdir(mode=0o700)
    path = Home(home).control_socket

    async def echo(args):
        return args

    async def main():
        async with trio.open_nursery() as n:
            await n.start(serve_control, path, {"echo": echo})
            got = await trio.to_thread.run_sync(lambda: call(home, "echo", {"a": 1}))
            assert got == {"a": 1}

            def oversized():
                s = socket.socket(socket.AF_UNIX)
                s.settimeout(5)
                with s:
                    s.connect(str(path))
                    s.sendall(struct.pack(">I", MAX_REQUEST + 1))
                    return s.recv(10)  # closed without a reply, at once

            assert await trio.to_thread.run_sync(oversized) == b""
            with pytest.raises(ControlError, match="unknown command"):
                await trio.to_thread.run_sync(lambda: call(home, "nope"))
            n.cancel_scope.cancel()

    trio.run(main)

"""The control socket: a Unix socket (mode 0600) in the home directory speaking length-prefixed msgpack.

Framing is the wire's one length prefix (protocol/frames.py: a u32 big-endian length, then the body), read
by its sans-I/O `LengthPrefixedReader`, which refuses a length over the reader's limit before waiting for
the body. The limits: MAX_REQUEST (what the daemon reads of a request) and MAX_RESPONSE (what `call` reads
of a reply) here; an attach session's own in peer/attach/wire.py.

`peer status`, `peer stop` and friends are clients. The socket file doubles as the "is a daemon running
here?" probe: a connect that is refused means a crashed daemon left it behind (stale), and it is removed.
Requests are tiny and local, so the client side is plain blocking sockets (no trio needed in the CLI).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgpack
import trio

from peer.home import Home
from protocol.errors import LimitExceeded
from protocol.frames import LengthPrefixedReader, encode_length_prefixed

log = logging.getLogger("peertrain.control")

MAX_REQUEST = 1 << 20  # a command and its arguments: tiny; the bound is what a local client can make us hold
MAX_RESPONSE = 64 << 20  # a reply (a full status with every peer's figures) the CLI accepts

Command = Callable[[dict], Awaitable[Any]]
# A command that keeps its connection (an attached training process, peer/attach/): it gets the request's
# args and the stream, sends its own replies, and returns when the session ends.
SessionCommand = Callable[[dict, trio.SocketStream], Awaitable[None]]


class ControlError(Exception):
    """No daemon answered at this home, or it answered with an error."""


class DaemonAlreadyRunning(ControlError):
    pass


def pack(obj: Any) -> bytes:
    """`obj` as one control-socket message: msgpack, length-prefixed (also an attach session's framing)."""
    return encode_length_prefixed(msgpack.packb(obj, use_bin_type=True))


async def receive_message(stream: trio.abc.ReceiveStream, reader: LengthPrefixedReader) -> bytes | None:
    """The next message from `stream`, or None if it ended first. Reads exactly what the message still
    needs, never past it: the bytes after a session command's request are the session's (peer/attach/)."""
    while (message := reader.next_message()) is None:
        chunk = await stream.receive_some(reader.needed())
        if not chunk:
            return None
        reader.feed(chunk)
    return message


def receive_message_blocking(sock: socket.socket, reader: LengthPrefixedReader) -> bytes | None:
    """`receive_message` for a blocking socket (the CLI, an attached process): no trio needed."""
    while (message := reader.next_message()) is None:
        chunk = sock.recv(reader.needed())
        if not chunk:
            return None
        reader.feed(chunk)
    return message


def claim_socket_path(path: Path) -> None:
    """Remove a stale socket left by a crashed daemon; refuse if a live daemon answers on it."""
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            log.info("removing stale control socket %s (left by a daemon that did not shut down)", path)
            path.unlink(missing_ok=True)
            return
        raise
    else:
        raise DaemonAlreadyRunning(
            f"a daemon is already running with this home ({path.parent}); stop it with `peer stop --home {path.parent}` "
            "or choose another --home")
    finally:
        probe.close()


async def serve_control(path: Path, commands: dict[str, Command], *, sessions: dict[str, SessionCommand] | None = None,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `commands` (one request, one reply) and `sessions` (commands that keep the connection) on the
    Unix socket at `path` until cancelled; removes the socket on exit."""
    sessions = sessions or {}
    claim_socket_path(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await sock.bind(str(path))
        os.chmod(path, 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()

        async def handle(stream: trio.SocketStream) -> None:
            async with stream:
                try:
                    with trio.fail_after(10):
                        body = await receive_message(stream, LengthPrefixedReader(MAX_REQUEST))
                    if body is None:
                        raise ValueError("connection closed")
                    request = msgpack.unpackb(body, raw=False)
                except (trio.TooSlowError, ValueError, LimitExceeded, trio.BrokenResourceError, OSError) as exc:
                    log.debug("bad control request: %s", exc)
                    return
                cmd = request.get("cmd") if isinstance(request, dict) else None
                args = request.get("args") if isinstance(request, dict) else None
                args = args if isinstance(args, dict) else {}
                if isinstance(cmd, str) and cmd in sessions:
                    try:
                        await sessions[cmd](args, stream)
                    except Exception:  # a bug in one session must not take the daemon down
                        log.exception("control session %s failed", cmd)
                    return
                fn = commands.get(cmd) if isinstance(cmd, str) else None
                if fn is None:
                    known = ', '.join(sorted(set(commands) | set(sessions)))
                    reply = {"ok": False, "error": f"unknown command {cmd!r}; known: {known}"}
                else:
                    try:
                        reply = {"ok": True, "result": await fn(args)}
                    except Exception as exc:
                        log.exception("control command %s failed", cmd)
                        reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                try:
                    await stream.send_all(pack(reply))
                except (trio.BrokenResourceError, OSError):
                    pass

        await trio.serve_listeners(handle, [listener])
    finally:
        sock.close()
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def call(home: Path, cmd: str, args: dict | None = None, *, timeout: float = 10.0) -> Any:
    """Blocking client: send one command to the daemon at `home` and return its result."""
    path = Home(Path(home)).control_socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no daemon is running with home {home} (start one with `peer start --home {home}`)") from None
        s.sendall(pack({"cmd": cmd, "args": args or {}}))
        body = receive_message_blocking(s, LengthPrefixedReader(MAX_RESPONSE))
        if body is None:
            raise ControlError("the daemon closed the control connection early")
        reply = msgpack.unpackb(body, raw=False)
    except LimitExceeded as exc:
        raise ControlError(f"the daemon's reply is too large: {exc}") from None
    except socket.timeout:
        raise ControlError(f"the daemon at {home} did not answer within {timeout:.0f}s") from None
    finally:
        s.close()
    if not reply.get("ok"):
        raise ControlError(reply.get("error", "unknown error"))
    return reply.get("result")

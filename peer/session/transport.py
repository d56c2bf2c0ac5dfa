"""Authenticated, encrypted sessions over TCP, on trio.

A `Session` is one authenticated, sealed TCP connection to a peer (`peer.session.connect` dials and
accepts them): one reader task turns sealed frames into messages and tensors, and any task may send
messages, make requests (replies are matched by request id) or stream tensors.

Why raw sockets and reused buffers: the reader `recv_into`s a buffer owned by `protocol.frames`, and a
tensor chunk is decrypted straight into the destination array, so a 1 GiB shard costs one cipher pass and
no extra allocations. The sender seals each chunk into one reused buffer. A send lock is held per frame,
not per tensor, so heartbeats and small messages interleave with bulk transfers.

The receiving side of tensor streams (slots, in-flight budget, eviction) is `peer.session.streams`; groups
of tensors sent or received together are `peer.session.groups`; snapshots to many sessions at once,
`peer.session.fanout`.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from peer.session.inbox import Inbox
from peer.session.buffers import ReceiveBufferPool
from peer.session.streams import IncomingStreams, Pending, TensorBudget
from protocol.cipher import CIPHERS, NullCipher
from protocol.errors import ProtocolError
from protocol.frames import KIND_CHUNK, KIND_MESSAGE, FrameReader, FrameWriter
from protocol.identity import short_id
from protocol.limits import DEFAULT_CHUNK_SIZE, WireLimits
from protocol.messages import Envelope, Registry
from protocol.schema import DEFAULT_REGISTRY, Ping, Pong, TensorCancel, TensorHeader
from protocol.tensor_decoder import DecodedTensor
from protocol.tensor_encoder import EncodedTensor, TensorEncoder

log = logging.getLogger("peertrain.transport")

SEND_TIMEOUT = 60.0
"""Seconds one frame may take to write before its session is closed ("peer stopped reading"), unless the
session's owner sets `Session.send_timeout` (membership sets it to `dead_after`: liveness is its call).
Why a deadline: without one, a peer that stops reading blocks every sender on that session forever (the
send lock is held by the stuck frame). 60 s lets a 4 MiB frame, the largest the limits allow, through a
0.6 Mbit/s link; a peer slower than that is of no use to training."""


HEARTBEATS = (Ping, Pong)
"""Messages that only keep a session alive. A session is as busy as its last message of another type
(`SessionStats.last_useful`): a peer that answers pings and sends nothing else holds a connection slot
for nothing, and `serve` may evict it for a newcomer (see `peer.membership.peers.pick_idle`)."""


class SessionClosed(Exception):
    """The session ended (remote closed, protocol error, or we closed it) while we waited on it."""


@dataclass(frozen=True)
class TransportConfig:
    """What every session of one daemon shares: who we are, which swarm, which limits."""

    identity: Any  # Ed25519PrivateKey
    swarm: str
    psk: bytes | None = None
    ciphers: tuple[str, ...] = CIPHERS
    allowed_peer_ids: frozenset[str] | None = None
    identity_bits: int = 0  # work each remote's identity key must carry ([membership] identity_bits)
    limits: WireLimits = field(default_factory=WireLimits)
    handshake_timeout: float = 5.0
    app_payload: dict = field(default_factory=dict)
    chunk_bytes: int = DEFAULT_CHUNK_SIZE
    registry: Registry = DEFAULT_REGISTRY
    # Benchmark baseline only: after a normal authenticated handshake, send frames unencrypted.
    # Never set by the daemon; both ends must set it. See protocol.cipher.NullCipher.
    insecure_plaintext_for_benchmark: bool = False
    # Tensor bytes in flight across every session made with this config (one per daemon); from `limits`.
    tensor_budget: TensorBudget | None = None
    # Idle receive buffers, shared by every session made with this config (one pool per daemon: buffers.py).
    receive_pool: ReceiveBufferPool | None = None

    def __post_init__(self) -> None:
        if self.tensor_budget is None:
            object.__setattr__(self, "tensor_budget", TensorBudget.for_limits(self.limits))
        if self.receive_pool is None:
            object.__setattr__(self, "receive_pool", ReceiveBufferPool())


@dataclass
class SessionStats:
    bytes_in: int = 0
    bytes_out: int = 0
    messages_in: int = 0
    messages_out: int = 0
    tensors_in: int = 0
    tensors_out: int = 0
    last_useful: float = 0.0  # trio.current_time() of the last message or tensor chunk that is not a heartbeat (HEARTBEATS)
    last_answered: float = 0.0  # trio.current_time() of the last reply to one of our requests (the peer reads and answers)


async def send_all(sock: trio.socket.SocketType, data: memoryview) -> None:
    """Write all of `data` to a raw socket (handshake messages, before a Session exists)."""
    view = memoryview(data).cast("B")
    while view:
        n = await sock.send(view)
        view = view[n:]


class Session:
    """One authenticated, encrypted connection to one peer.

    The owner must run `run()` in a nursery; it reads frames until the connection ends and then fails
    every waiter with `SessionClosed`. Non-reply messages arrive on `incoming` (bounded in count and
    decoded bytes: a slow consumer pauses reading, which backpressures the remote over TCP).
    """

    def __init__(self, stream: trio.SocketStream, *, result, cfg: TransportConfig, initiator: bool, remote_addr: tuple[str, int]):
        self.stream = stream
        self.sock = stream.socket
        self.cfg = cfg
        self.peer_id: str = result.peer_id
        self.remote_public_key: bytes = result.remote_public_key
        self.remote_app: dict = result.remote_app_payload
        self.cipher: str = "none (benchmark)" if cfg.insecure_plaintext_for_benchmark else result.cipher
        self.initiator = initiator
        self.remote_addr = remote_addr
        self.via = ""  # the relay's peer ID when this session runs through a relay circuit (peer/nat)
        self.path = "direct"  # "direct", "punched" (a direct session made by hole punching) or "relayed"
        # how far the remote's wall clock is ahead of ours, from the time it put in the handshake (None: not sent)
        remote_time = self.remote_app.get("time") if isinstance(self.remote_app, dict) else None
        self.clock_offset: float | None = (remote_time - time.time() if isinstance(remote_time, float)
                                           and math.isfinite(remote_time) else None)
        self.stats = SessionStats(last_useful=trio.current_time())
        self.opened_at = trio.current_time()
        limits = cfg.limits
        send_cipher, recv_cipher = result.send, result.recv
        if cfg.insecure_plaintext_for_benchmark:
            send_cipher, recv_cipher = NullCipher(), NullCipher()
        max_body = limits.max_frame_bytes + send_cipher.overhead
        self._writer = FrameWriter(send_cipher, max_body)
        self._reader = FrameReader(recv_cipher, limits.max_frame_bytes + recv_cipher.overhead)
        if result.leftover:
            self._reader.feed(result.leftover)
        self._send_lock = trio.Lock()
        self.send_timeout = SEND_TIMEOUT  # one frame's write; see SEND_TIMEOUT
        self._unsent = b""  # the tail of a sealed frame whose sender was cancelled mid-write
        self._rids = itertools.count(1)
        self._streams_out = itertools.count(1)
        self._requests: dict[int, Pending] = {}
        self._streams = IncomingStreams(limits, self.stats, self.short, cfg.tensor_budget,
                                        cfg.receive_pool)  # by stream id
        self.incoming = Inbox(limits)  # messages for the application, bounded by count and bytes
        self.closed = trio.Event()
        self.close_reason: str = ""

    # ---- identity ---------------------------------------------------------------------------------
    @property
    def short(self) -> str:
        return short_id(self.peer_id)

    def __repr__(self) -> str:
        return f"<Session {self.short} {self.remote_addr[0]}:{self.remote_addr[1]} {'out' if self.initiator else 'in'}>"

    # ---- sending ----------------------------------------------------------------------------------
    async def _send_frame(self, kind: int, stream: int, payload) -> None:
        if self.closed.is_set():
            raise SessionClosed(self.close_reason or "session closed")
        async with self._send_lock:
            if self.closed.is_set():  # closed while we waited for the lock (say, a stuck frame's deadline)
                raise SessionClosed(self.close_reason or "session closed")
            try:
                with trio.move_on_after(self.send_timeout) as deadline:
                    if self._unsent:
                        tail, self._unsent = self._unsent, b""
                        await self._write(memoryview(tail))
                    view = self._writer.seal(kind, stream, payload)
                    await self._write(view)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._mark_closed(f"send failed: {exc}")
                raise SessionClosed(self.close_reason) from exc
            if deadline.cancelled_caught:
                reason = f"peer stopped reading: a frame was not taken within {self.send_timeout:.1f}s"
                log.warning("closing session with %s: %s", self.short, reason)
                await self.aclose(reason)
                raise SessionClosed(reason)

    async def _write(self, view: memoryview) -> None:
        """Write a sealed frame whole, even if our caller is cancelled part-way.

        Why: a frame's nonce is spent when it is sealed, and the remote reads frames back to back, so a
        frame cut short (or sealed and never sent) would make every later frame fail authentication and
        kill the session. Cancellation still takes effect at once; the unsent tail is kept (copied: the
        sealing buffer is reused) and written before the next frame.
        """
        view = view.cast("B")
        try:
            while view:
                n = await self.sock.send(view)
                self.stats.bytes_out += n
                view = view[n:]
        except trio.Cancelled:
            self._unsent = bytes(view)
            raise

    async def send_message(self, message: Any, *, rid: int = 0, reply_to: int = 0, sent: trio.Event | None = None) -> int:
        """Send one message and return its encoded bytes (what a budget of the receiver's counts: `Envelope.size`);
        `sent` is set once it is written (a group's tensors wait for the message that announces them: the
        receiver allocates only for streams it was told of)."""
        data = self.cfg.registry.encode(message, rid=rid, reply_to=reply_to)
        await self._send_frame(KIND_MESSAGE, 0, data)
        self.stats.messages_out += 1
        if sent is not None:
            sent.set()
        return len(data)

    def new_request_id(self) -> int:
        """A request id for `request(rid=...)`, for a caller that must name the request later (say, to
        call it off) even if it gives up before the reply."""
        return next(self._rids)

    async def request(self, message: Any, *, timeout: float, rid: int | None = None,
                      sent: trio.Event | None = None) -> Envelope:
        """Send `message` and wait for the reply that names its request id (TooSlowError on timeout);
        `sent` as in `send_message`."""
        rid = next(self._rids) if rid is None else rid
        pending = self._requests[rid] = Pending()
        try:
            with trio.fail_after(timeout):
                await self.send_message(message, rid=rid, sent=sent)
                return await pending.wait()
        finally:
            self._requests.pop(rid, None)

    async def reply(self, to: Envelope, message: Any) -> None:
        await self.send_message(message, reply_to=to.rid)

    def new_stream_id(self) -> int:
        return next(self._streams_out)

    async def send_tensor(self, name: str, tensor: Any, *, codec: str = "raw", stream: int | None = None) -> int:
        """Stream one tensor (numpy or torch, CPU or CUDA) as a header message plus chunk frames.

        If this is cancelled (say, an exchange's deadline passes) after the header went out, the receiver
        is told (`TensorCancel`), so it does not keep half a tensor or wait out its own deadline for the rest.
        """
        stream = self.new_stream_id() if stream is None else stream
        if isinstance(tensor, EncodedTensor):  # encoded once by the caller, in its own codec: sent as it is
            if tensor.name != name:
                raise ValueError(f"an encoded tensor named {tensor.name!r} sent as {name!r}")
            source: EncodedTensor | TensorEncoder = tensor
            chunks = tensor.chunks(self.cfg.chunk_bytes)
        else:
            source = TensorEncoder(name, tensor, codec=codec, chunk_size=self.cfg.chunk_bytes)
            chunks = source.chunks()
        try:
            await self.send_message(source.header(stream))
            for chunk in chunks:
                await self._send_frame(KIND_CHUNK, stream, chunk)
        except BaseException as exc:  # cut short (even inside the header): tell the receiver
            await self.call_off([stream], type(exc).__name__)
            raise
        self.stats.tensors_out += 1
        return stream

    async def call_off(self, streams: list[int], reason: str) -> None:
        """Tell the remote that tensors it expects on `streams` will not come (or not whole): `TensorCancel`.

        Best effort (`send_best_effort`). Safe for a stream whose header never went out: the remote only
        fails whoever waits for it.
        """
        await self.send_best_effort(*(TensorCancel(stream=stream, reason=reason) for stream in streams))

    async def send_best_effort(self, *messages: Any, timeout: float = 2.0) -> None:
        """Send `messages` in order, even while our caller is being cancelled (shielded, `timeout` at most);
        a closed session just ends it. For the messages that call something off on the way out."""
        with trio.move_on_after(timeout) as scope:
            scope.shield = True
            for message in messages:
                if self.closed.is_set():
                    return
                try:
                    await self.send_message(message)
                except SessionClosed:
                    return

    async def receive_tensor(self, stream: int, *, timeout: float) -> DecodedTensor:
        """Wait for the tensor the remote sends on `stream` (it may already have arrived).

        On timeout or cancellation the stream is discarded: chunks still on their way are absorbed and
        dropped, so a late sender never breaks the session.
        """
        return await self._streams.receive(stream, timeout=timeout)

    def expect(self, stream: int, spec: Any = None) -> None:
        """We will read `stream`, a tensor matching `spec` (a TensorSpec) if given: only then may its header
        allocate memory (peer.session.streams). `receive_tensor` expects its stream too."""
        self._streams.expect(stream, spec)

    def discard(self, streams) -> None:
        """Nobody will read these streams (a refused or failed exchange): drop them as they complete."""
        self._streams.discard(streams)

    # ---- receiving --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Read frames until EOF or error, then close. Never raises for anything the remote did."""
        reason = "remote closed the connection"
        try:
            await self._read_loop()
        except ProtocolError as exc:
            reason = f"protocol error: {exc}"
            log.warning("closing session with %s: %s", self.short, reason)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            reason = f"connection lost: {exc}"
        except SessionClosed as exc:
            reason = str(exc) or self.close_reason
        finally:
            self._mark_closed(self.close_reason or reason)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _read_loop(self) -> None:
        reader, sock, stats = self._reader, self.sock, self.stats
        while not self.closed.is_set():
            # Drain first: bytes that arrived with the last handshake message may already hold frames.
            while (frame := reader.next_frame()) is not None:
                if frame.kind == KIND_MESSAGE:
                    await self._on_message(frame.open())
                elif frame.kind == KIND_CHUNK:
                    stats.last_useful = trio.current_time()
                    await self._streams.on_chunk(frame)
                else:  # the reader already rejects unknown kinds; keep the invariant explicit
                    raise ProtocolError(f"unexpected frame kind {frame.kind}")
            view = reader.want()
            n = -1
            with trio.move_on_at(self._streams.next_deadline()):  # a header nobody asks for has a lifetime
                n = await sock.recv_into(view)
            if n < 0:
                self._streams.expire()
                continue
            reader.got(n)
            if n == 0:
                return
            stats.bytes_in += n

    async def _on_message(self, data) -> None:
        env = self.cfg.registry.decode(data, self.cfg.limits)
        self.stats.messages_in += 1
        msg = env.message
        if not isinstance(msg, HEARTBEATS):
            self.stats.last_useful = trio.current_time()
        if isinstance(msg, TensorHeader):
            self._streams.on_header(msg)
            return
        if isinstance(msg, TensorCancel):
            self._streams.on_cancel(msg)
            return
        if env.reply_to:
            pending = self._requests.get(env.reply_to)
            if pending is not None:
                self.stats.last_answered = trio.current_time()
                pending.set(env)
            else:
                log.debug("late reply %d from %s ignored", env.reply_to, self.short)
            return
        await self.incoming.put(env)  # when full, reading stops until the consumer catches up (backpressure)

    # ---- closing ----------------------------------------------------------------------------------
    def _mark_closed(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        err = SessionClosed(reason)
        for p in self._requests.values():
            p.fail(err)
        self._streams.fail_all(err)
        self.incoming.close()

    async def aclose(self, reason: str = "closed locally") -> None:
        """Close now; the reader task ends and every waiter sees SessionClosed(reason)."""
        self._mark_closed(reason)
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

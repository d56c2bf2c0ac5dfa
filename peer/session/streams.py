"""The receiving side of a session's tensor streams: one slot per stream id, bounded by the wire limits.

A tensor arrives as a header message and then chunk frames on its stream; the reader task hands them
here (`on_header`, `on_chunk`, `on_cancel`) and whoever wants the tensor waits on its slot (`receive`).
Either may come first. What a peer can make us hold here is bounded (docs/design.md, "Invariants", 6): the number
of open streams by `max_queued_messages`, their decoded bytes by `max_inflight_tensor_bytes`, reserved
from the header before anything is allocated. A waiter that gives up leaves its slot marked `discard`,
so chunks still on their way are absorbed and dropped and a late sender never breaks the session.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import trio

from peer.session.buffers import ReceiveBufferPool
from protocol.errors import LimitExceeded, ProtocolError
from protocol.limits import WireLimits
from protocol.schema import TensorCancel, TensorHeader
from protocol.tensor_codec import DTYPES as TENSOR_DTYPES
from protocol.tensor_codec import DecodedTensor, TensorDecoder

log = logging.getLogger("peertrain.transport")


class Pending:
    """A one-shot result someone waits for: a request's reply, or a tensor stream's tensor."""

    __slots__ = ("event", "value", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def set(self, value: Any) -> None:
        self.value = value
        self.event.set()

    def fail(self, error: BaseException) -> None:
        if not self.event.is_set():
            self.error = error
            self.event.set()

    async def wait(self) -> Any:
        await self.event.wait()
        if self.error is not None:
            raise self.error
        return self.value


class StreamSlot:
    """A tensor being received: the decoder, whoever waits for it, and whether nobody wants it anymore."""

    __slots__ = ("decoder", "pending", "nbytes", "discard", "waiting")

    def __init__(self) -> None:
        self.decoder: TensorDecoder | None = None
        self.pending = Pending()
        self.nbytes = 0
        self.discard = False  # the waiter gave up: absorb the remaining chunks, then forget the stream
        self.waiting = False  # someone is in receive() for it


class IncomingStreams(Mapping[int, StreamSlot]):
    """The tensor streams one session is receiving, or holds until someone claims them.

    Read as a mapping it is stream id -> slot (what is open right now); `inflight_bytes` is what those
    slots hold against the in-flight budget.
    """

    def __init__(self, limits: WireLimits, stats: Any, peer: str):
        self.limits = limits
        self.inflight_bytes = 0
        self._stats = stats  # the session's SessionStats (tensors_in)
        self._peer = peer  # for log lines
        self._slots: dict[int, StreamSlot] = {}
        self._evicted: collections.deque[int] = collections.deque(maxlen=1024)  # stream ids dropped unclaimed
        self._pool = ReceiveBufferPool()

    def __getitem__(self, stream: int) -> StreamSlot:
        return self._slots[stream]

    def __iter__(self) -> Iterator[int]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    # ---- the waiting side ---------------------------------------------------------------------------
    async def receive(self, stream: int, *, timeout: float) -> DecodedTensor:
        """Wait for the tensor on `stream` (it may already have arrived); on timeout or cancellation the
        stream is discarded."""
        slot = self._slots.get(stream)
        if slot is None:
            if stream in self._evicted:
                raise ProtocolError(f"tensor stream {stream} was dropped to make room (in-flight budget full)")
            slot = self._slots[stream] = StreamSlot()
        done = False
        slot.waiting = True
        try:
            with trio.fail_after(timeout):
                value = await slot.pending.wait()
            done = True
            return value
        finally:
            slot.waiting = False
            if done or slot.pending.event.is_set():
                self._release(stream)
            else:
                slot.discard = True

    def discard(self, streams: Iterable[int]) -> None:
        """Nobody will read these streams: drop them as they complete.

        A stream whose header has not come yet gets a mark, within the same bound on open streams as a
        header (the ids may come from a peer: a refused offer can name 100,000). When the table is full, a
        stream is left unmarked: its tensor, if it ever comes, is an unclaimed one, dropped first for room.
        """
        full = False
        for stream in streams:
            slot = self._slots.get(stream)
            if slot is None:
                if full or stream in self._evicted:
                    continue
                if not self._room_for_a_stream():
                    full = True  # (nothing frees a slot before this loop ends)
                    continue
                slot = self._slots[stream] = StreamSlot()
            if slot.pending.event.is_set():
                self._release(stream)
            else:
                slot.discard = True

    def fail_all(self, error: BaseException) -> None:
        """The session ended: every waiter sees `error`."""
        for slot in self._slots.values():
            slot.pending.fail(error)

    def _release(self, stream: int) -> None:
        slot = self._slots.pop(stream, None)
        if slot is not None:
            self.inflight_bytes -= slot.nbytes

    # ---- the reader's side --------------------------------------------------------------------------
    def on_header(self, header: TensorHeader) -> None:
        slot = self._slots.get(header.stream)
        if slot is None:
            if not self._room_for_a_stream():
                raise LimitExceeded(f"too many tensor streams open ({len(self._slots)})")
            slot = self._slots[header.stream] = StreamSlot()
        if slot.decoder is not None or slot.pending.event.is_set():
            raise ProtocolError(f"tensor stream {header.stream} reused")
        estimate = self._decoded_bytes(header)
        if estimate <= self.limits.max_tensor_bytes:  # (a bigger one the decoder refuses with its own reason)
            self._reserve(header.name, estimate)  # before anything is allocated
        out = self._pooled(header, estimate)
        decoder = TensorDecoder(header, self.limits, out=out)  # validates before allocating
        # decoded size (a float16 body of a float64 tensor needs 4x its wire size), pooled or not
        need = decoder.memory_bytes + (out.nbytes if out is not None else 0)
        self._reserve(header.name, need)
        slot.decoder = decoder
        slot.nbytes = need
        self.inflight_bytes += need
        if decoder.done:  # zero-size tensor
            self._complete(header.stream, slot)

    def on_cancel(self, msg: TensorCancel) -> None:
        slot = self._slots.get(msg.stream)
        if slot is None or slot.pending.event.is_set():
            log.debug("cancel of tensor stream %d from %s ignored (nobody waits for it)", msg.stream, self._peer)
            return
        what = f"tensor {slot.decoder.name!r}" if slot.decoder is not None else f"the tensor on stream {msg.stream}"
        slot.decoder = None  # a chunk for it now is a protocol error
        self.inflight_bytes -= slot.nbytes
        slot.nbytes = 0
        if slot.discard:
            self._slots.pop(msg.stream, None)
            return
        slot.pending.fail(ProtocolError(f"{what} was abandoned by its sender ({msg.reason[:80] or 'no reason'})"))

    def on_chunk(self, frame) -> None:
        slot = self._slots.get(frame.stream)
        if slot is None or slot.decoder is None:
            raise ProtocolError(f"chunk for unknown tensor stream {frame.stream}")
        n = frame.open_into(slot.decoder.slot(frame.size))
        slot.decoder.advance(n)
        if slot.decoder.done:
            self._complete(frame.stream, slot)

    def _complete(self, stream: int, slot: StreamSlot) -> None:
        if slot.discard:
            self._release(stream)
            return
        try:
            slot.pending.set(slot.decoder.finish())
            self._stats.tensors_in += 1
        except ProtocolError as exc:
            # A bad tensor (NaN/Inf, ...) is the sender's fault for this one tensor; the frame stream is
            # intact, so fail the waiter and keep the session.
            log.warning("rejected tensor from %s: %s", self._peer, exc)
            slot.pending.fail(exc)

    # ---- the budget ---------------------------------------------------------------------------------
    def _room_for_a_stream(self) -> bool:
        """Is there room for one more open stream (after dropping what nobody will claim)?"""
        excess = len(self._slots) + 1 - self.limits.max_queued_messages
        if excess > 0:
            self._evict_unclaimed(streams=excess)
        return len(self._slots) < self.limits.max_queued_messages

    def _evict_unclaimed(self, *, streams: int = 0, nbytes: int = 0) -> None:
        """Make room by forgetting finished tensors nobody has asked for, oldest first, and (for room in
        the stream count) discard marks of tensors that have not begun.

        Why: a tensor can arrive for a receiver that gave up before it learnt the stream's id (a reply
        that came after its deadline); nobody will ever claim it. Such tensors are the first to go when
        the stream count or the in-flight budget is full, instead of the session being closed. A mark may
        wait for a tensor that never comes (its call-off arrived before the mark); dropping it costs at
        most holding that tensor as an unclaimed one if it does come.
        """
        for sid, slot in list(self._slots.items()):
            if streams <= 0 and nbytes <= 0:
                return
            if slot.waiting:
                continue
            if slot.pending.event.is_set():
                log.info("dropping unclaimed tensor stream %d from %s (%d bytes) to make room", sid, self._peer, slot.nbytes)
                nbytes -= slot.nbytes
                streams -= 1
                self._release(sid)
                self._evicted.append(sid)  # so a late receive fails at once instead of waiting
            elif streams > 0 and slot.discard and slot.decoder is None:
                streams -= 1
                self._release(sid)

    def _reserve(self, name: str, need: int) -> None:
        """Make sure `need` more bytes fit the in-flight budget (dropping unclaimed tensors), or raise."""
        budget = self.limits.max_inflight_tensor_bytes
        if self.inflight_bytes + need > budget:
            self._evict_unclaimed(nbytes=self.inflight_bytes + need - budget)
        if self.inflight_bytes + need > budget:
            raise LimitExceeded(f"tensor '{str(name)[:64]}' would put {self.inflight_bytes + need} bytes in flight "
                                f"(limit {budget})")

    def _decoded_bytes(self, header: TensorHeader) -> int:
        """The size of the array a header asks for (0 if it is malformed: the decoder rejects it then)."""
        wire = TENSOR_DTYPES.get(header.dtype)
        if wire is None or not all(isinstance(d, int) and d >= 0 for d in header.shape) or len(header.shape) > 8:
            return 0
        return math.prod(header.shape) * wire.itemsize

    def _pooled(self, header: TensorHeader, nbytes: int) -> Any:
        """A recycled output array of `nbytes` (`_decoded_bytes`) for this tensor, or None (the decoder then allocates)."""
        if nbytes == 0 or nbytes > self.limits.max_tensor_bytes:
            return None  # let the decoder reject the header with its own precise error
        return self._pool.array(TENSOR_DTYPES[header.dtype], tuple(header.shape))

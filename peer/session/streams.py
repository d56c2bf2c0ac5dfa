"""The receiving side of a session's tensor streams: one slot per stream id, bounded by the wire limits.

A tensor arrives as a header message and then chunk frames on its stream; the reader task hands them
here (`on_header`, `on_chunk`, `on_cancel`). What a peer can make us hold here is bounded (docs/design.md,
"Invariants", 6):

* **Nothing is allocated for a stream the receiver did not ask for.** The receiver registers what it
  expects (`expect`, from the offer/accept/params reply it accepted, or `receive`); a header is checked
  against that expectation (name, dtype, shape) and the limits before any allocation, and its decoded
  bytes are reserved from this session's in-flight budget and from the daemon's (`TensorBudget`, shared
  by every session of a daemon) first. The array is `np.empty` (or a recycled buffer): pages are
  committed as chunks are written into them, never zero-filled up front on the event loop.
* **Headers that come before their expectation are parked, allocating nothing** (why: the message that
  announces a group's streams, say an offer, is handled by the session's dispatch task while the reader
  goes on reading, so the first header can be read a moment before the expectation is registered;
  senders write the announcing message before the first tensor frame, `OutgoingGroup.send(after=...)`).
  At most `MAX_PARKED_HEADERS` wait at once, each at most `PARKED_HEADER_SECONDS`; a chunk for a parked
  stream makes the reader wait (backpressure, nothing buffered) until the stream is claimed. Past either
  bound the session is closed with the reason.
* **An expected stream lives as long as its waiter.** A receiver that gives up (deadline, cancellation,
  a group discarded) frees a half-received tensor at once, budget included; the chunks still on their way
  are absorbed without being stored, and the slot goes with the last one. Discard marks for streams whose
  header has not come yet count against the open-stream bound (`max_queued_messages`).
"""

from __future__ import annotations

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
from protocol.tensor_decoder import DecodedTensor, TensorDecoder

log = logging.getLogger("peertrain.transport")

MAX_PARKED_HEADERS = 16
"""Tensor headers one session may have waiting for their expectation at once. An honest sender has one
tensor of a group in flight at a time and announces the group before its first tensor, so a header waits
only for the announcing message's dispatch: a handful of groups at once is plenty."""

PARKED_HEADER_SECONDS = 10.0
"""How long a header may wait for the receiver to ask for its stream. An honest one waits one dispatch of
the session's announcing message (well under a second even on a loaded machine); 10 s covers a dispatch
task busy with another handler. A header nobody claims by then was unsolicited: the session is closed."""


class SpecMismatch(ProtocolError):
    """A tensor's header is not the tensor the receiver expected on its stream."""


def spec_mismatch(spec: Any, name: Any, dtype: Any, shape: Any) -> str:
    """Why a tensor `name` `dtype``shape` is not the one `spec` (a TensorSpec, or None: anything) expects, or ''."""
    shape = list(shape)
    if spec is None or (name == spec.name and dtype == spec.dtype and shape == list(spec.shape)):
        return ""
    return f"tensor {str(name)[:64]!r} {dtype}{shape[:8]} does not match {spec.name!r} {spec.dtype}{list(spec.shape)}"


class TensorBudget:
    """Decoded tensor bytes in flight across every session of one daemon (`WireLimits.max_daemon_inflight_tensor_bytes`).

    Shared by the sessions of a daemon through their `TransportConfig`; a reservation that would pass
    the limit is refused (LimitExceeded closes the session that asked for it)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    @classmethod
    def for_limits(cls, limits: WireLimits) -> TensorBudget:
        """A daemon's budget: its limit, or one session's budget if that was configured larger."""
        return cls(max(limits.max_daemon_inflight_tensor_bytes, limits.max_inflight_tensor_bytes))

    def reserve(self, name: str, need: int) -> None:
        if self.used + need > self.limit:
            raise LimitExceeded(f"tensor '{str(name)[:64]}' would put {self.used + need} bytes in flight across all "
                                f"sessions (daemon limit {self.limit})")
        self.used += need

    def give_back(self, n: int) -> None:
        self.used -= n


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
    """One stream: what the receiver expects, the parked header or the decoder, and whoever waits for it."""

    __slots__ = ("decoder", "pending", "nbytes", "discard", "waiting", "spec", "expected", "parked",
                 "parked_until", "claimed", "absorb")

    def __init__(self, *, expected: bool) -> None:
        self.decoder: TensorDecoder | None = None
        self.pending = Pending()
        self.nbytes = 0  # reserved from the budgets
        self.discard = False  # the waiter gave up: absorb the remaining chunks, then forget the stream
        self.waiting = False  # someone is in receive() for it
        self.spec: Any = None  # the TensorSpec the receiver expects, if it said
        self.expected = expected  # the receiver asked for this stream (or discarded it)
        self.parked: TensorHeader | None = None  # a header that came before its expectation
        self.parked_until = math.inf
        self.claimed: trio.Event | None = None  # set when a parked stream is claimed (or the session ends)
        self.absorb = -1  # body bytes still to drop unread (a discarded stream whose header came), -1: none


class IncomingStreams(Mapping[int, StreamSlot]):
    """The tensor streams one session is receiving or expects.

    Read as a mapping it is stream id -> slot (what is open right now); `inflight_bytes` is what those
    slots hold against this session's in-flight budget (and the daemon's `budget`).
    """

    def __init__(self, limits: WireLimits, stats: Any, peer: str, budget: TensorBudget | None = None,
                 pool: ReceiveBufferPool | None = None):
        self.limits = limits
        self.inflight_bytes = 0
        self.budget = budget if budget is not None else TensorBudget.for_limits(limits)
        self._stats = stats  # the session's SessionStats (tensors_in)
        self._peer = peer  # for log lines
        self._slots: dict[int, StreamSlot] = {}
        self._parked = 0
        self._pool = pool if pool is not None else ReceiveBufferPool()  # the daemon's (buffers.py says why)

    def __getitem__(self, stream: int) -> StreamSlot:
        return self._slots[stream]

    def __iter__(self) -> Iterator[int]:
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    # ---- the receiver's side ------------------------------------------------------------------------
    def expect(self, stream: int, spec: Any = None) -> None:
        """The receiver will read `stream`, a tensor matching `spec` (a TensorSpec) if given.

        Raises LimitExceeded if the open-stream table is full (the stream ids come from a peer)."""
        slot = self._slots.get(stream)
        if slot is None:
            if not self._room_for_a_stream():
                raise LimitExceeded(f"too many tensor streams open ({len(self._slots)})")
            slot = self._slots[stream] = StreamSlot(expected=True)
        slot.spec = spec if spec is not None else slot.spec
        if not slot.expected:
            slot.expected = True
            self._claim(stream, slot)

    async def receive(self, stream: int, *, timeout: float) -> DecodedTensor:
        """Wait for the tensor on `stream` (it may already have arrived); on timeout or cancellation the
        stream is discarded and whatever it held is freed."""
        if stream not in self._slots or not self._slots[stream].expected:
            self.expect(stream)
        slot = self._slots[stream]
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
                self._drop(stream, slot)

    def discard(self, streams: Iterable[int]) -> None:
        """Nobody will read these streams: free what they hold and drop their chunks as they arrive.

        A stream whose header has not come yet gets a mark, within the same bound on open streams as a
        header (the ids may come from a peer: a refused offer can name 100,000). When the table is full, a
        stream is left unmarked: its header, if it ever comes, is one nobody asked for.
        """
        full = False
        for stream in streams:
            slot = self._slots.get(stream)
            if slot is None:
                if full or not self._room_for_a_stream():
                    full = True  # (nothing frees a slot before this loop ends)
                    continue
                slot = self._slots[stream] = StreamSlot(expected=True)
            if slot.pending.event.is_set():
                self._release(stream)
            else:
                self._drop(stream, slot)

    def fail_all(self, error: BaseException) -> None:
        """The session ended: every waiter sees `error`, every budgeted byte is given back."""
        for slot in self._slots.values():
            slot.pending.fail(error)
            if slot.claimed is not None:
                slot.claimed.set()
            self._unreserve(slot)

    def next_deadline(self) -> float:
        """When the oldest parked header runs out of time (inf if none is parked)."""
        if not self._parked:
            return math.inf
        return min(s.parked_until for s in self._slots.values() if s.parked is not None)

    def expire(self) -> None:
        """Close the session (ProtocolError) if a header waited past its time for somebody to ask for it."""
        now = trio.current_time()
        for sid, slot in self._slots.items():
            if slot.parked is not None and slot.parked_until <= now:
                raise ProtocolError(f"tensor stream {sid} ({str(slot.parked.name)[:64]!r}, {slot.parked.nbytes} bytes) "
                                    f"was sent unasked: nobody expected it within {PARKED_HEADER_SECONDS:g}s")

    def _drop(self, stream: int, slot: StreamSlot) -> None:
        """The receiver gave up on `stream`: free what it holds now; absorb the chunks still to come."""
        slot.discard = slot.expected = True
        if slot.parked is not None:
            self._claim(stream, slot)
        elif slot.decoder is not None:
            slot.absorb = slot.decoder.remaining
            slot.decoder = None
            self._unreserve(slot)
            if slot.absorb == 0:
                self._slots.pop(stream, None)

    def _release(self, stream: int) -> None:
        slot = self._slots.get(stream)
        if slot is None:
            return
        self._unreserve(slot)
        if slot.absorb > 0:  # a refused tensor's body is still coming: drop it, then forget the stream
            slot.discard = True
            return
        self._forget(stream)

    def _forget(self, stream: int) -> None:
        slot = self._slots.pop(stream, None)
        if slot is not None:
            self._unreserve(slot)
            if slot.parked is not None:
                self._parked -= 1

    def _unreserve(self, slot: StreamSlot) -> None:
        self.inflight_bytes -= slot.nbytes
        self.budget.give_back(slot.nbytes)
        slot.nbytes = 0

    # ---- the reader's side --------------------------------------------------------------------------
    def on_header(self, header: TensorHeader) -> None:
        slot = self._slots.get(header.stream)
        if slot is None:
            self._park(header)
            return
        if slot.decoder is not None or slot.parked is not None or slot.absorb >= 0 or slot.pending.event.is_set():
            raise ProtocolError(f"tensor stream {header.stream} reused")
        self._start(header, slot)

    def _park(self, header: TensorHeader) -> None:
        if self._parked >= MAX_PARKED_HEADERS:
            raise LimitExceeded(f"more than {MAX_PARKED_HEADERS} tensor headers nobody asked for "
                                f"(stream {header.stream}, {str(header.name)[:64]!r})")
        if not self._room_for_a_stream():
            raise LimitExceeded(f"too many tensor streams open ({len(self._slots)})")
        slot = self._slots[header.stream] = StreamSlot(expected=False)
        slot.parked = header
        slot.parked_until = trio.current_time() + PARKED_HEADER_SECONDS
        slot.claimed = trio.Event()
        self._parked += 1

    def _claim(self, stream: int, slot: StreamSlot) -> None:
        """The receiver asked for (or discarded) a stream whose header is parked: start it now."""
        header, slot.parked = slot.parked, None
        if header is None:
            return
        self._parked -= 1
        slot.claimed.set()
        try:
            self._start(header, slot)
        except ProtocolError as exc:  # (raised in the receiver's task: the reader sees it at the next chunk)
            slot.pending.fail(exc)
            slot.absorb = -2  # poisoned: a chunk for it closes the session with this reason
            slot.spec = str(exc)

    def _start(self, header: TensorHeader, slot: StreamSlot) -> None:
        """Check a header against its expectation and the limits, reserve its bytes, then allocate."""
        if slot.discard:
            if type(header.nbytes) is not int or not 0 <= header.nbytes <= self.limits.max_tensor_bytes:
                raise ProtocolError(f"tensor stream {header.stream}: bad body size {header.nbytes!r}")
            slot.absorb = header.nbytes
            if slot.absorb == 0:
                self._slots.pop(header.stream, None)
            return
        TensorDecoder.check_header(header, self.limits)  # every field and limit, before any allocation
        mismatch = spec_mismatch(slot.spec, header.name, header.dtype, header.shape)
        if mismatch:  # the sender's fault for this one tensor: fail its waiter, drop its body unread
            log.warning("refused tensor from %s on stream %d: %s", self._peer, header.stream, mismatch)
            slot.pending.fail(SpecMismatch(mismatch))  # (the slot stays until its waiter has seen this)
            slot.absorb = header.nbytes if header.nbytes else -1
            return
        need = self._decoded_bytes(header)
        self._reserve(header.name, need)
        slot.nbytes = need
        try:
            out = self._pool.array(TENSOR_DTYPES[header.dtype], tuple(header.shape)) if need else None
            slot.decoder = TensorDecoder(header, self.limits, out=out)
        except BaseException:
            self._unreserve(slot)
            raise
        extra = slot.decoder.memory_bytes - (need if out is None else 0)  # q8 scales
        if extra > 0:
            self._reserve(header.name, extra)
            slot.nbytes += extra
        if slot.decoder.done:  # zero-size tensor
            self._complete(header.stream, slot)

    def on_cancel(self, msg: TensorCancel) -> None:
        slot = self._slots.get(msg.stream)
        if slot is None or slot.pending.event.is_set():
            log.debug("cancel of tensor stream %d from %s ignored (nobody waits for it)", msg.stream, self._peer)
            return
        if slot.discard or not slot.expected:  # given up on, or never asked for: forget it
            self._forget(msg.stream)
            return
        what = f"tensor {slot.decoder.name!r}" if slot.decoder is not None else f"the tensor on stream {msg.stream}"
        slot.decoder = None  # a chunk for it now is a protocol error
        self._unreserve(slot)
        slot.pending.fail(ProtocolError(f"{what} was abandoned by its sender ({msg.reason[:80] or 'no reason'})"))

    async def on_chunk(self, frame) -> None:
        """Write a chunk where it belongs; for a parked stream, first wait (bounded) until it is claimed."""
        slot = self._slots.get(frame.stream)
        if slot is not None and slot.parked is not None:
            with trio.move_on_at(slot.parked_until):
                await slot.claimed.wait()
            if slot.parked is not None:
                if slot.pending.error is not None:  # the session ended while we waited
                    raise trio.ClosedResourceError(str(slot.pending.error))
                self.expire()
                raise ProtocolError(f"tensor stream {frame.stream} was sent unasked")
            slot = self._slots.get(frame.stream)
        if slot is not None and slot.absorb == -2:
            raise ProtocolError(str(slot.spec))
        if slot is not None and slot.absorb >= 0:
            if frame.size > slot.absorb:
                raise ProtocolError(f"tensor stream {frame.stream}: body longer than declared")
            frame.open()  # authenticated, then dropped
            slot.absorb -= frame.size
            if slot.absorb == 0:
                slot.absorb = -1
                if slot.discard:  # (else a refused tensor's waiter has yet to see why)
                    self._slots.pop(frame.stream, None)
            return
        if slot is None or slot.decoder is None:
            raise ProtocolError(f"chunk for unknown tensor stream {frame.stream}")
        n = frame.open_into(slot.decoder.slot(frame.size))
        slot.decoder.advance(n)
        if slot.decoder.done:
            self._complete(frame.stream, slot)

    def _complete(self, stream: int, slot: StreamSlot) -> None:
        try:
            slot.pending.set(slot.decoder.finish())
            self._stats.tensors_in += 1
        except ProtocolError as exc:
            # A bad tensor (NaN/Inf, ...) is the sender's fault for this one tensor; the frame stream is
            # intact, so fail the waiter and keep the session.
            log.warning("rejected tensor from %s: %s", self._peer, exc)
            slot.pending.fail(exc)
        slot.decoder = None

    # ---- the budget ---------------------------------------------------------------------------------
    def _room_for_a_stream(self) -> bool:
        """Is there room for one more open stream (after dropping discard marks of tensors not begun)?"""
        if len(self._slots) >= self.limits.max_queued_messages:
            for sid, slot in list(self._slots.items()):
                if slot.discard and slot.decoder is None and slot.absorb < 0 and not slot.waiting:
                    del self._slots[sid]  # a mark for a tensor that may never come (its call-off came first)
                    break
        return len(self._slots) < self.limits.max_queued_messages

    def _reserve(self, name: str, need: int) -> None:
        """Count `need` more bytes against this session's in-flight budget and the daemon's, or raise."""
        budget = self.limits.max_inflight_tensor_bytes
        if self.inflight_bytes + need > budget:
            raise LimitExceeded(f"tensor '{str(name)[:64]}' would put {self.inflight_bytes + need} bytes in flight "
                                f"(limit {budget})")
        self.budget.reserve(name, need)
        self.inflight_bytes += need

    def _decoded_bytes(self, header: TensorHeader) -> int:
        """The size of the array a (checked) header asks for."""
        return math.prod(header.shape) * TENSOR_DTYPES[header.dtype].itemsize

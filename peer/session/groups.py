"""Groups of tensors that travel together between two peers, one tensor stream each.

An averaging exchange or a parameter download moves all of a group's tensors, and the stream ids are
named in a message (an offer, an accept, a params reply) before the tensors follow. What both ends must
get right about such a group lives here, once:

* The sender allocates the group's stream ids up front (`OutgoingGroup`), so a message can name them. If
  sending is cut short (a deadline, a closed session, the exchange failing elsewhere), it calls off the
  tensors it had not begun as well (the one cut short calls itself off: `Session.send_tensor`), so the
  receiver does not hold a slot for each and wait out its deadline.
* The sender writes the message that names the streams before the first tensor frame (`send(after=...)`,
  set by `Session.request(sent=...)` / `send_message(sent=...)`): the receiver allocates memory only for
  streams it was told of, so tensors racing ahead of their announcement would wait at the receiver.
* The receiver (`IncomingGroup`) registers the streams it expects, with their specs, as soon as it learns
  them (`Session.expect`): only then may a header allocate, and a header that contradicts its spec is
  refused before any allocation. It also checks every tensor against the spec it expects (name, dtype, shape):
  the peer chose the headers, and a tensor of another shape must not reach a model. A group it will not
  read (refused, aborted, failed part-way) it discards: the streams it has not read are dropped as their
  chunks arrive, and the ones it did read are already released, so nothing is left behind either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from peer.session.streams import SpecMismatch, spec_mismatch
from protocol.errors import ProtocolError
from protocol.schema.gossip import TensorSpec


class OutgoingGroup:
    """Tensors we send to one peer as a group: `streams[i]` carries the tensor named `specs[i].name`."""

    def __init__(self, session, specs: Sequence[TensorSpec]):
        self.session = session
        self.specs = list(specs)
        self.streams = [session.new_stream_id() for _ in self.specs]

    async def send(self, arrays: Sequence[Any], *, codec: str | Sequence[str] = "raw",
                   after: trio.Event | None = None) -> None:
        """Stream `arrays` (one per spec, in order), once `after` is set (the message naming the streams
        is written, when it is sent concurrently). `codec`: one for all, or one per tensor. Cut short, the
        tensors not begun are called off too."""
        if len(arrays) != len(self.specs):
            raise ValueError(f"{len(arrays)} tensors for a group of {len(self.specs)}")
        codecs = [codec] * len(arrays) if isinstance(codec, str) else list(codec)
        if len(codecs) != len(arrays):
            raise ValueError(f"{len(codecs)} codecs for a group of {len(arrays)}")
        if after is not None:
            await after.wait()
        for i, (spec, array, stream, c) in enumerate(zip(self.specs, arrays, self.streams, codecs)):
            try:
                await self.session.send_tensor(spec.name, array, codec=c, stream=stream)
            except BaseException as exc:
                await self.session.call_off(self.streams[i + 1:], type(exc).__name__)
                raise


class IncomingGroup:
    """Tensors a peer announced it sends us as a group: `streams[i]` must carry a tensor matching `specs[i]`.

    The stream ids come from the peer; the specs are ours. Created as soon as the announcing message is
    read, it registers what it expects (nothing if the peer named another number of streams than we
    expect tensors: `receive` refuses that). Either `receive` it or `discard` it (or both: after a failed
    `receive`, `discard` drops the streams it did not get to).
    """

    def __init__(self, session, streams: Sequence[int], specs: Sequence[TensorSpec], *, as_torch: bool = False):
        self.session = session
        self.streams = list(streams)
        self.specs = list(specs)
        self.as_torch = as_torch
        self._taken = 0  # streams[:_taken] the session already released or marked (receive_tensor does either)
        if len(self.streams) == len(self.specs):
            try:
                for stream, spec in zip(self.streams, self.specs):
                    session.expect(stream, spec)
            except ProtocolError:
                pass  # the open-stream table is full: `receive` fails at that stream (expecting it again)

    async def receive(self, *, timeout: float) -> list[Any]:
        """Every tensor of the group, in order, as numpy arrays (torch tensors with `as_torch`).

        Waits at most `timeout` for each tensor (the caller's own deadline bounds the whole). Raises
        ProtocolError if the peer announced another number of streams than we expect tensors, or a tensor
        does not match its spec; trio.TooSlowError on timeout; SessionClosed if the session ends.
        """
        if self._taken:
            raise RuntimeError("this group was already received or discarded")
        n = len(self.specs)
        if len(self.streams) != n:
            raise ProtocolError(f"{len(self.streams)} tensor streams announced for a group of {n} tensors")
        out = []
        for i, (spec, stream) in enumerate(zip(self.specs, self.streams)):
            self._taken = i + 1  # from here on receive_tensor releases the stream, or marks it discarded
            where = f"tensor {i + 1} of {n} on stream {stream}"
            try:
                tensor = await self.session.receive_tensor(stream, timeout=timeout)
            except SpecMismatch as exc:  # refused from its header, before any allocation
                raise ProtocolError(f"{where}: {exc}") from None
            check_spec(spec, tensor, where=where)
            out.append(tensor.to_torch() if self.as_torch else tensor.array)
        return out

    def discard(self) -> None:
        """This group will not be read (any further): drop the streams not yet received as they arrive."""
        self.session.discard(self.streams[self._taken:])
        self._taken = len(self.streams)


def check_spec(spec: TensorSpec, tensor, *, where: str) -> None:
    """Raise ProtocolError unless a received tensor has the expected name, dtype and shape."""
    mismatch = spec_mismatch(spec, tensor.name, tensor.dtype, tensor.array.shape)
    if mismatch:
        raise ProtocolError(f"{where}: {mismatch}")

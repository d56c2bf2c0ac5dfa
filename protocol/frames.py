"""The transport wire format and its sans-I/O reader and writer.

A frame on the wire is a 9-byte header followed by the sealed body::

    u32 body_len (big-endian) | u8 kind | u32 stream | body_len bytes of ciphertext + tag

The header travels in the clear but is the AEAD's associated data, so changing a
length, kind or stream fails authentication just like changing the body does.

Why the kind and stream are in the clear: the receiver learns *where a chunk
goes* before decrypting it, so it can decrypt a tensor chunk straight into the
destination tensor's memory (`Frame.open_into(tensor_slice)`) instead of
decrypting into a scratch buffer and copying. For multi-gigabyte gradient
exchanges that saved copy is most of the remaining CPU cost after the AEAD itself.
What leaks is only which stream a chunk belongs to, which traffic analysis would
reveal anyway.

The reader is pull-style for `sock.recv_into`: the I/O layer asks `want()` where
to put the next bytes and reports with `got(n)`. Buffers are allocated once and
reused (fresh megabyte-sized allocations per read halve loopback throughput).
Small frames are read into a shared buffer so that one `recv` can deliver many of
them; for a large body `want()` points at exactly the bytes still missing, so the
kernel copies them straight into the body buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Final, Protocol

from .cipher import byte_view
from .errors import LimitExceeded, ProtocolError

__all__ = [
    "HEADER_SIZE",
    "KIND_CHUNK",
    "KIND_MESSAGE",
    "KINDS",
    "Frame",
    "FrameCipher",
    "FrameReader",
    "FrameWriter",
    "LengthPrefixedReader",
    "encode_length_prefixed",
]

HEADER: Final = struct.Struct(">IBI")
HEADER_SIZE: Final = HEADER.size  # 9
KIND_MESSAGE: Final = 1
"""Body is one msgpack-encoded control message; stream is always 0."""
KIND_CHUNK: Final = 2
"""Body is raw tensor bytes belonging to `stream`."""
KINDS: Final = frozenset({KIND_MESSAGE, KIND_CHUNK})

_U32: Final = struct.Struct(">I")
_MAX_U32: Final = 2**32 - 1
_DEFAULT_READ_BUFFER: Final = 64 * 1024


class FrameCipher(Protocol):
    """What the reader and writer need from a cipher (`CipherState` or `NullCipher`)."""

    overhead: int

    def seal_into(self, plaintext: object, aad: bytes | memoryview, out: object) -> int: ...

    def open_into(self, ciphertext: object, aad: bytes | memoryview, out: object) -> int: ...


def _check_kind_stream(kind: int, stream: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown frame kind {kind}")
    if not 0 <= stream <= _MAX_U32:
        raise ValueError(f"stream id {stream} does not fit in 32 bits")
    if kind == KIND_MESSAGE and stream != 0:
        raise ValueError("message frames always use stream 0")


class FrameWriter:
    """Seals frames into one reusable buffer, ready for a single `sendall`."""

    def __init__(self, cipher: FrameCipher, max_body: int) -> None:
        if max_body < cipher.overhead:
            raise ValueError(f"max_body={max_body} cannot even hold the {cipher.overhead}-byte tag")
        if max_body > _MAX_U32:
            raise ValueError(f"max_body={max_body} does not fit the 32-bit length field")
        self._cipher = cipher
        self.max_body: Final = max_body
        self.max_plaintext: Final = max_body - cipher.overhead
        self._buf = bytearray(min(HEADER_SIZE + max_body, _DEFAULT_READ_BUFFER))
        self._view = memoryview(self._buf)

    def seal(self, kind: int, stream: int, plaintext: object) -> memoryview:
        """Header + sealed body, in an internal buffer valid until the next call."""
        _check_kind_stream(kind, stream)
        data = byte_view(plaintext)
        size = data.nbytes
        if size > self.max_plaintext:
            raise LimitExceeded(
                f"frame plaintext of {size} bytes exceeds the limit of {self.max_plaintext} bytes"
            )
        body_len = size + self._cipher.overhead
        total = HEADER_SIZE + body_len
        if len(self._buf) < total:
            # Replace rather than resize: a view handed out by the previous call may
            # still be alive, and a bytearray with live views cannot be resized.
            grown = min(max(total, 2 * len(self._buf)), HEADER_SIZE + self.max_body)
            self._buf = bytearray(grown)
            self._view = memoryview(self._buf)
        view = self._view
        HEADER.pack_into(self._buf, 0, body_len, kind, stream)
        self._cipher.seal_into(data, view[:HEADER_SIZE], view[HEADER_SIZE:total])
        return view[:total]


@dataclass(slots=True, eq=False)
class Frame:
    """One received, not yet decrypted frame.

    Open it exactly once, with `open_into` (decrypt into your memory, e.g. a tensor
    slice) or `open` (decrypt into the reader's scratch buffer), before asking the
    reader for anything else: the counter nonce means frames can only be opened in
    the order they arrived.
    """

    kind: int
    stream: int
    size: int
    """Plaintext length in bytes."""
    _reader: FrameReader = field(repr=False)
    _body: memoryview = field(repr=False)
    _aad: object = field(repr=False)

    def open_into(self, dest: object) -> int:
        """Decrypt and authenticate into the first `size` bytes of `dest`; returns `size`."""
        return self._reader._open_into(self, dest)

    def open(self) -> memoryview:
        """Decrypt into a reusable buffer; the view is valid until the next `want()`/`next_frame()`."""
        return self._reader._open(self)


class FrameReader:
    """Turns received bytes into `Frame`s without owning a socket.

    Typical loop::

        while True:
            n = sock.recv_into(reader.want())
            reader.got(n)
            if reader.eof: break
            while (frame := reader.next_frame()) is not None:
                handle(frame)          # must call frame.open() or frame.open_into(...)
    """

    def __init__(self, cipher: FrameCipher, max_body: int, *, buffer_size: int = _DEFAULT_READ_BUFFER) -> None:
        if max_body < cipher.overhead:
            raise ValueError(f"max_body={max_body} cannot even hold the {cipher.overhead}-byte tag")
        if buffer_size < 64:
            raise ValueError(f"buffer_size={buffer_size} is too small (minimum 64 bytes)")
        self._cipher = cipher
        self._overhead = cipher.overhead
        self.max_body: Final = max_body
        self.eof = False
        """True once the I/O layer reported a clean end of stream (between frames)."""

        # Shared buffer for headers and small frames: live bytes are [_start, _end).
        self._small = bytearray(buffer_size)
        self._sview = memoryview(self._small)
        self._start = 0
        self._end = 0
        self._min_read = max(HEADER_SIZE, min(4096, buffer_size // 4))

        # A body too large for the shared buffer is read into its own reusable buffer.
        self._big = bytearray(0)
        self._bview = memoryview(self._big)
        self._big_len = 0  # body length of the large frame being received; 0 = none
        self._big_filled = 0
        self._big_kind = 0
        self._big_stream = 0
        self._big_hdr = bytearray(HEADER_SIZE)

        self._plain = bytearray(0)  # scratch for Frame.open()
        self._pview = memoryview(self._plain)

        self._pending: Frame | None = None
        self._want_len = 0

        self._backlog = bytearray()  # feed() convenience only
        self._backlog_pos = 0
        self._backlog_eof = False

    # -- the I/O side ---------------------------------------------------------

    def want(self) -> memoryview:
        """Where the next received bytes should go (`sock.recv_into(reader.want())`)."""
        self._require_idle()
        if self.eof:
            raise RuntimeError("want() called after EOF was reported")
        if self._backlog_pos < len(self._backlog):
            raise RuntimeError("fed bytes are still queued: call next_frame() until it returns None first")
        room = self._room()
        if room is None:
            raise RuntimeError(
                "read buffer is full: call next_frame() until it returns None before reading more"
            )
        return room

    def got(self, n: int) -> None:
        """Report that `n` bytes were written into the last `want()` view; 0 means EOF."""
        if n < 0 or n > self._want_len:
            raise ValueError(f"got({n}) but the last want() view held {self._want_len} bytes")
        self._want_len = 0
        if n == 0:
            self._on_eof()
        elif self._big_len:
            self._big_filled += n
        else:
            self._end += n

    def feed(self, data: bytes) -> None:
        """Hand over received bytes by copying them (tests, fuzzing); b"" means EOF.

        Bytes that do not fit yet wait in a backlog that `next_frame()` drains, so
        any amount can be fed at once. Priming a reader with `feed()` (say, the
        bytes that arrived behind the last handshake message) and then switching
        to `want()`/`got()` is fine, but call `next_frame()` until it returns None
        first: the fed bytes may already hold whole frames that no further read
        would ever deliver, and `want()` refuses while fed bytes are queued.
        """
        if self._backlog_eof:
            raise RuntimeError("feed() called after EOF")
        if data:
            self._backlog += data
        else:
            self._backlog_eof = True
        if self._pending is None:
            self._pump()

    # -- the protocol side ----------------------------------------------------

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more bytes are needed."""
        self._require_idle()
        frame = self._parse()
        while frame is None and self._backlog_waiting():
            if not self._pump():
                break
            frame = self._parse()
        self._pending = frame
        return frame

    # -- internals ------------------------------------------------------------

    def _require_idle(self) -> None:
        if self._pending is not None:
            raise RuntimeError(
                "the previous frame was not opened: each frame must be opened exactly once, "
                "in order, before the next want()/next_frame() (its nonce depends on it)"
            )

    def _room(self) -> memoryview | None:
        if self._big_len:
            if self._big_filled == self._big_len:
                return None  # a complete large frame awaits next_frame()
            view = self._bview[self._big_filled : self._big_len]
        else:
            self._make_room()
            if self._end == len(self._small):
                return None
            view = self._sview[self._end :]
        self._want_len = len(view)
        return view

    def _make_room(self) -> None:
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = 0
            return
        if start == 0:
            return
        cap = len(self._small)
        compact = cap - end < self._min_read
        if not compact and end - start >= HEADER_SIZE:
            total = HEADER_SIZE + _U32.unpack_from(self._small, start)[0]
            compact = total <= cap and start + total > cap  # a small frame must end up contiguous
        if compact:
            live = end - start
            self._small[0:live] = self._small[start:end]
            self._start, self._end = 0, live

    def _check_header(self, body_len: int, kind: int, stream: int) -> None:
        if body_len > self.max_body:
            raise LimitExceeded(
                f"frame body of {body_len} bytes exceeds the limit of {self.max_body} bytes"
            )
        if body_len < self._overhead:
            raise ProtocolError(
                f"frame body of {body_len} bytes is shorter than the {self._overhead}-byte tag"
            )
        if kind not in KINDS:
            raise ProtocolError(f"unknown frame kind {kind}")
        if kind == KIND_MESSAGE and stream != 0:
            raise ProtocolError(f"message frame on stream {stream} (messages use stream 0)")

    def _parse(self) -> Frame | None:
        if self._big_len:
            if self._big_filled < self._big_len:
                return None
            body_len, self._big_len = self._big_len, 0
            return Frame(
                self._big_kind, self._big_stream, body_len - self._overhead,
                self, self._bview[:body_len], self._big_hdr,
            )
        start, end = self._start, self._end
        avail = end - start
        if avail < HEADER_SIZE:
            return None
        body_len, kind, stream = HEADER.unpack_from(self._small, start)
        self._check_header(body_len, kind, stream)  # before any allocation: 4 GB prefixes cost nothing
        total = HEADER_SIZE + body_len
        sview = self._sview
        if total <= len(self._small):
            if avail < total:
                return None
            frame = Frame(
                kind, stream, body_len - self._overhead,
                self, sview[start + HEADER_SIZE : start + total], sview[start : start + HEADER_SIZE],
            )
            start += total
            if start == end:
                start = end = 0
            self._start, self._end = start, end
            return frame
        # Large body: move what already arrived into the body buffer (at most one read's
        # worth) and let want() point at exactly the missing remainder from now on.
        if len(self._big) < body_len:
            self._big = bytearray(min(max(body_len, 2 * len(self._big)), self.max_body))
            self._bview = memoryview(self._big)
        have = avail - HEADER_SIZE
        self._bview[:have] = sview[start + HEADER_SIZE : end]
        self._big_hdr[:] = sview[start : start + HEADER_SIZE]
        self._big_len, self._big_filled = body_len, have
        self._big_kind, self._big_stream = kind, stream
        self._start = self._end = 0
        return None

    def _open_into(self, frame: Frame, dest: object) -> int:
        if self._pending is not frame:
            raise RuntimeError("this frame was already opened (each frame opens exactly once, in order)")
        room = byte_view(dest).nbytes
        if room < frame.size:
            raise ValueError(f"destination holds {room} bytes, the frame needs {frame.size}")
        self._pending = None
        return self._cipher.open_into(frame._body, frame._aad, dest)  # type: ignore[arg-type]

    def _open(self, frame: Frame) -> memoryview:
        size = frame.size
        if len(self._plain) < size:
            self._plain = bytearray(min(max(size, 2 * len(self._plain)), self.max_body))
            self._pview = memoryview(self._plain)
        out = self._pview[:size]
        self._open_into(frame, out)
        return out

    def _partial_frame_buffered(self) -> bool:
        if self._big_len:
            return self._big_filled < self._big_len
        pos, end = self._start, self._end
        while end - pos >= HEADER_SIZE:
            total = HEADER_SIZE + _U32.unpack_from(self._small, pos)[0]
            if end - pos < total:
                break
            pos += total
        return pos != end

    def _on_eof(self) -> None:
        if self._partial_frame_buffered():
            raise ProtocolError("connection closed mid-frame (truncated)")
        self.eof = True

    def _backlog_waiting(self) -> bool:
        return self._backlog_pos < len(self._backlog) or (self._backlog_eof and not self.eof)

    def _pump(self) -> bool:
        """Move fed bytes from the backlog through want()/got(); True if anything moved."""
        moved = False
        backlog = self._backlog
        while self._backlog_pos < len(backlog) and self._pending is None:
            room = self._room()
            if room is None:
                break
            pos = self._backlog_pos
            n = min(len(room), len(backlog) - pos)
            room[:n] = backlog[pos : pos + n]
            self._backlog_pos = pos + n
            self.got(n)
            moved = True
        if self._backlog_pos == len(backlog):
            backlog.clear()
            self._backlog_pos = 0
            if self._backlog_eof and not self.eof and self._pending is None:
                self._want_len = 0
                self._on_eof()
                moved = True
        return moved


def encode_length_prefixed(data: bytes) -> bytes:
    """u32 big-endian length + data: the framing of handshake messages (no cipher yet) and of the local
    control socket (peer/control.py) and attach sessions (peer/attach/)."""
    if len(data) > _MAX_U32:
        raise ValueError("message too long for a 32-bit length prefix")
    return _U32.pack(len(data)) + bytes(data)


class LengthPrefixedReader:
    """Splits a byte stream into u32-length-prefixed messages, refusing oversized ones.

    It holds only bytes not yet returned: after draining `next_message()`, at most one incomplete
    message (under 4 + max_len bytes) plus whatever the last `feed()` brought beyond it. The limit is
    checked on the length prefix alone, before a byte of the body is waited for or held.

    The I/O layer feeds it what it receives; one that must not read past a message (its socket's later
    bytes belong to someone else, or carry descriptors) reads exactly `needed()` bytes at a time.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len: Final = max_len
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def next_message(self) -> bytes | None:
        """The next whole message, or None if more bytes are needed.

        Raises LimitExceeded as soon as a too-large length prefix is seen.
        """
        buf = self._buf
        size = self._size()
        if size is None:
            return None
        end = 4 + size
        if len(buf) < end:
            return None
        message = bytes(buf[4:end])
        # Drop it at once (bytearray deletes from the front cheaply): a consumed prefix kept until the
        # buffer happened to end on a message boundary grew with every message of a stream.
        del buf[:end]
        return message

    def needed(self) -> int:
        """How many more bytes complete the next message (call it once `next_message()` returned None):
        the rest of the length prefix, else the rest of the body. Raises LimitExceeded like `next_message()`."""
        size = self._size()
        if size is None:
            return 4 - len(self._buf)
        return max(1, 4 + size - len(self._buf))

    def _size(self) -> int | None:
        """The body length of the next message, once its prefix is here; LimitExceeded if over `max_len`."""
        if len(self._buf) < 4:
            return None
        size = _U32.unpack_from(self._buf, 0)[0]
        if size > self.max_len:
            raise LimitExceeded(f"message of {size} bytes exceeds the limit of {self.max_len} bytes")
        return size

    def buffered(self) -> int:
        """How many received bytes are not yet returned as messages."""
        return len(self._buf)

    def take_buffered(self) -> bytes:
        """Remove and return everything not yet returned as a message (e.g. the bytes
        that follow the last handshake message)."""
        rest = bytes(self._buf)
        self._buf.clear()
        return rest

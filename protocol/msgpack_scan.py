"""A one-pass check that a msgpack message's containers fit in its bytes, run before msgpack sees it.

Its own module because it knows msgpack's byte format and no schema: `Registry.decode` runs it on every
message so that what msgpack then allocates stays proportional to the message's size.
"""

from __future__ import annotations

from protocol.errors import ProtocolError

__all__ = ["MAX_NESTING", "check_structure"]

MAX_NESTING = 32
"""Containers open at once in one message. The deepest schema nests 5 (envelope, body, a list of records,
a record, its links list, a link: `topo_records`); 32 leaves room for new schemas while bounding the work
and the preallocated containers of a message that is nothing but nested headers."""

# How the scan below reads each msgpack type byte: (kind, n). "skip": n more bytes follow; "str" (str or
# bin): a (-n)-byte big-endian length, then that many bytes; "array"/"map": n elements (n >= 0) or, for
# n < 0, a (-n)-byte big-endian count; "ext": like "str" plus a type byte (msgpack then refuses it:
# max_ext_len=0); "bad": 0xc1, which msgpack never uses.
_SCAN: list[tuple[str, int]] = [("bad", 0)] * 256
for _b in range(0x00, 0x80):
    _SCAN[_b] = ("skip", 0)  # positive fixint
for _b in range(0xE0, 0x100):
    _SCAN[_b] = ("skip", 0)  # negative fixint
for _b in range(0x80, 0x90):
    _SCAN[_b] = ("map", _b & 0x0F)
for _b in range(0x90, 0xA0):
    _SCAN[_b] = ("array", _b & 0x0F)
for _b in range(0xA0, 0xC0):
    _SCAN[_b] = ("skip", _b & 0x1F)  # fixstr
for _b, _spec in {
    0xC0: ("skip", 0), 0xC2: ("skip", 0), 0xC3: ("skip", 0),  # nil, false, true
    0xC4: ("str", -1), 0xC5: ("str", -2), 0xC6: ("str", -4),  # bin
    0xCA: ("skip", 4), 0xCB: ("skip", 8),  # float
    0xCC: ("skip", 1), 0xCD: ("skip", 2), 0xCE: ("skip", 4), 0xCF: ("skip", 8),  # uint
    0xD0: ("skip", 1), 0xD1: ("skip", 2), 0xD2: ("skip", 4), 0xD3: ("skip", 8),  # int
    0xD9: ("str", -1), 0xDA: ("str", -2), 0xDB: ("str", -4),  # str
    0xC7: ("ext", -1), 0xC8: ("ext", -2), 0xC9: ("ext", -4),  # ext: length, type byte, data
    0xD4: ("skip", 2), 0xD5: ("skip", 3), 0xD6: ("skip", 5), 0xD7: ("skip", 9), 0xD8: ("skip", 17),  # fixext
    0xDC: ("array", -2), 0xDD: ("array", -4), 0xDE: ("map", -2), 0xDF: ("map", -4),
}.items():
    _SCAN[_b] = _spec
del _b, _spec


def check_structure(data: bytes | bytearray | memoryview) -> None:
    """Refuse a message whose containers claim more elements than its bytes could hold, before msgpack
    sees it. Why: msgpack's unpacker reserves a list for an array's declared length up front, so ~5 KB of
    nested array headers declaring 100,000 elements each made it allocate 80 MB before finding the message
    truncated. Every element takes at least one byte, so a count above the bytes left is a lie; with this
    check what decoding allocates stays proportional to the message's size. One pass, no allocation."""
    try:
        buf = data if isinstance(data, bytes) else memoryview(data).cast("B")
    except TypeError:  # a non-contiguous view
        raise ProtocolError("message must be contiguous bytes") from None
    size = len(buf)
    pos = 0
    pending = [1]  # elements still to read in each open container (the message itself first)
    scan = _SCAN
    while pending:
        if not pending[-1]:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= size:
            raise ProtocolError("malformed message: truncated")
        kind, n = scan[buf[pos]]
        pos += 1
        if kind == "skip":
            pos += n
            continue
        if kind == "bad":
            raise ProtocolError(f"malformed message: msgpack type byte {buf[pos - 1]:#04x} is unused")
        if n < 0:  # the count or length follows in -n bytes
            n, pos = int.from_bytes(buf[pos : pos - n], "big"), pos - n
        if kind == "str":
            pos += n
            continue
        if kind == "ext":
            pos += n + 1
            continue
        if kind == "map":
            n *= 2
        if n > size - pos:
            raise ProtocolError(f"malformed message: {kind} of {n} elements in {size - pos} remaining bytes")
        if n:
            if len(pending) > MAX_NESTING:
                raise ProtocolError(f"malformed message: containers nested deeper than {MAX_NESTING}")
            pending.append(n)
    if pos > size:
        raise ProtocolError("malformed message: truncated")

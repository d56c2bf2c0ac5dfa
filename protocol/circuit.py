"""The first bytes of a relay circuit connection, sans-I/O.

A peer opening a circuit through a relay sends `hello(token)` instead of a handshake on a fresh TCP
connection; the relay answers `READY` once the other end has arrived and from then on forwards bytes
both ways without reading them. The two ends then run the ordinary handshake through it.

Why a listener can tell the two apart from the first 4 bytes: a handshake starts with a big-endian u32
length of at most 4096 (`protocol.handshake.MAX_HANDSHAKE_MESSAGE`), so its first byte is 0, while
`MAGIC` starts with "P".
"""

from __future__ import annotations

from typing import Final

from protocol.schema.nat import TOKEN_BYTES

__all__ = ["MAGIC", "HELLO_BYTES", "READY", "hello", "is_circuit", "parse_hello", "PEEK_BYTES"]

MAGIC: Final = b"PTRC"
PEEK_BYTES: Final = len(MAGIC)  # bytes a listener reads to tell a circuit from a handshake
HELLO_BYTES: Final = len(MAGIC) + TOKEN_BYTES
READY: Final = b"R"  # the relay's one byte: both ends are here, forwarding starts


def hello(token: bytes) -> bytes:
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a circuit token has {TOKEN_BYTES} bytes, got {len(token)}")
    return MAGIC + token


def is_circuit(prefix: bytes) -> bool:
    """Whether the first PEEK_BYTES bytes of a connection open a circuit (else: a handshake)."""
    return prefix[:PEEK_BYTES] == MAGIC


def parse_hello(data: bytes) -> bytes:
    """The token of a complete hello (exactly HELLO_BYTES bytes); ValueError if it is not one."""
    if len(data) != HELLO_BYTES or not is_circuit(data):
        raise ValueError("not a circuit hello")
    return bytes(data[len(MAGIC):])

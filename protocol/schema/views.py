"""The partial-view plane: one carrier message for the view messages (peer/membership/view_messages.py).

Why one carrier and not a message class each: the thirteen view messages and their bounds live with the
rules that use them (`view_messages.check`, which every message passes before a rule reads it); the wire
needs only to bound what arrives before it is decoded. So a `ViewPacket` names the message (`kind`) and
carries its msgpack body, both bounded here; membership decodes and checks the body, and a body that breaks
a bound closes the session like any malformed message.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Message

MAX_KIND_CHARS = 32  # the longest view message name ("view_neighbour_reply") with room
MAX_VIEW_BODY_BYTES = 48 * 1024
"""A view message's msgpack body: at most 35 entries (a shuffle's 32 plus its origin; a Status's 32
neighbours) of a peer ID (256 characters at most) and 4 addresses (262 each): ~46 KB at the very worst, so
48 KiB; an honest body is a few hundred bytes (IDs of 20 characters, one or two short addresses)."""

__all__ = ["ViewPacket", "MAX_KIND_CHARS", "MAX_VIEW_BODY_BYTES"]


@dataclass(frozen=True, slots=True)
class ViewPacket(Message):
    """One partial-view message: its type name and msgpack body (`view_messages.encode`)."""

    TYPE = "view"
    kind: str
    body: bytes

    def __post_init__(self) -> None:
        if not 0 < len(self.kind) <= MAX_KIND_CHARS:
            raise ValueError(f"kind must have 1..{MAX_KIND_CHARS} characters, got {len(self.kind)}")
        if len(self.body) > MAX_VIEW_BODY_BYTES:
            raise ValueError(f"body of {len(self.body)} bytes (at most {MAX_VIEW_BODY_BYTES})")

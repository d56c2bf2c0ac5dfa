"""Who may send a view message, and what each costs on the wire.

The messages themselves, and the bounds on every field, are the schema's (protocol/schema/views.py): the
registry decodes and bounds them like any message. What the schema cannot know is who sent one: `check`
refuses a message whose entry names someone other than its authenticated sender (a peer asking for an edge
on another's behalf). `wire_size` prices a message as the daemon frames it (the registry's envelope, a
sealed frame's header and tag), so the simulator's control bytes are the bytes a daemon sends.
"""

from __future__ import annotations

from protocol.cipher import TAG_SIZE
from protocol.frames import HEADER_SIZE
from protocol.messages import Message
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.views import VIEW_MESSAGES

REQUEST_ID = 1 << 31  # what an envelope's request id costs: a u32 (counters run that high)


class BadMessage(ValueError):
    """A view message its sender may not send: the session it came on is closed, with this as the reason."""


def check(msg: object, sender: str) -> None:
    """Raise BadMessage unless `msg` is a view message that `sender` (authenticated by its session) may send:
    one whose `entry` (the peer asking) is the sender. Its fields' bounds held when it was built or decoded."""
    if type(msg) not in VIEW_MESSAGES:
        raise BadMessage(f"not a view message: {type(msg).__name__}")
    entry = getattr(msg, "entry", None)
    if entry is not None and entry.peer_id != sender:
        raise BadMessage(f"{type(msg).TYPE}: entry names {entry.peer_id!r}, not the sender")  # type: ignore[attr-defined]


def framed_size(message_bytes: int) -> int:
    """Bytes on the session of one message of `message_bytes` encoded: in one sealed frame."""
    return message_bytes + HEADER_SIZE + TAG_SIZE


def wire_size(msg: Message) -> int:
    """Bytes `msg` takes on a session: the envelope `Registry.encode` makes, in one sealed frame."""
    return framed_size(len(DEFAULT_REGISTRY.encode(msg, rid=REQUEST_ID)))

"""What peers send each other to keep partial views (peer/membership/views.py), and what each costs on the wire.

Plain frozen dataclasses. On a session each travels in a `protocol.schema.views.ViewPacket` (its `TYPE`
and its msgpack body, `encode`), which the wire bounds before anything is decoded; `decode` rebuilds the
message from a packet and `check`s it. `wire_size` prices a message as the daemon frames it (the
msgpack envelope {"t", "v", "r", "q", "b"} around the packet), plus a sealed frame's header and tag, so the
simulator's control bytes are the bytes a daemon sends.

Every field a peer sends is bounded here (`check`): how many entries, how long a walk, how long an id or
address. A message that breaks a bound is `BadMessage`: the daemon closes that session with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Union

import msgpack

from protocol.addresses import MAX_ENTRY_ADDRESSES
from protocol.cipher import TAG_SIZE
from protocol.frames import HEADER_SIZE
from protocol.schema.session import MAX_ADDRESS_CHARS, MAX_NAME_CHARS

MAX_ENTRIES = 32  # entries one message may carry (shuffles, join samples, a neighbour list)
MAX_WALK = 16  # the longest random walk a peer forwards: a walk's TTL is at most this
MAX_DEGREE_FIELD = 1 << 16  # a degree a peer may claim (any larger is a lie, and refused)
REQUEST_ID = 1 << 31  # what an envelope's request id costs: a u32 (counters run that high)


class BadMessage(ValueError):
    """A view message breaks a bound: the session it came on is closed, with this as the reason."""


@dataclass(frozen=True, slots=True)
class Entry:
    """How to reach one peer: its ID and a few addresses (dial hints: the handshake checks the ID)."""

    peer_id: str
    addresses: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Join:
    """A newcomer asks a contact to bring it into the swarm."""

    TYPE = "view_join"
    entry: Entry


@dataclass(frozen=True, slots=True)
class JoinReply:
    """The contact's answer: a sample of its views, for the newcomer's passive view."""

    TYPE = "view_join_reply"
    entries: tuple[Entry, ...]


@dataclass(frozen=True, slots=True)
class JoinWalk:
    """A random walk on behalf of a newcomer; where it ends, that peer introduces itself (`WalkEnd`)."""

    TYPE = "view_join_walk"
    joiner: Entry
    ttl: int


@dataclass(frozen=True, slots=True)
class WalkEnd:
    """'A walk for you ended at me': a random peer of the swarm, for a newcomer to ask for edges."""

    TYPE = "view_walk_end"
    entry: Entry


@dataclass(frozen=True, slots=True)
class Seek:
    """A random walk for `origin`, one edge short: the first peer it meets that is short too asks
    `origin` for an edge; the first with an edge to spare hands one of its neighbours over to it."""

    TYPE = "view_seek"
    origin: Entry
    ttl: int


@dataclass(frozen=True, slots=True)
class NeighbourRequest:
    """Be my neighbour (one edge). `urgent`: I am below min_degree, take me even above your target. `lost`:
    a neighbour of us both that I saw fail (you may not have yet): we are its neighbours paired up."""

    TYPE = "view_neighbour"
    entry: Entry
    degree: int
    urgent: bool
    lost: str | None = None


@dataclass(frozen=True, slots=True)
class NeighbourReply:
    TYPE = "view_neighbour_reply"
    accepted: bool
    degree: int


@dataclass(frozen=True, slots=True)
class SwapRequest:
    """Give me one of your edges. With `drop`, a degree-preserving swap: you link to me and hand one of
    your neighbours to `drop`, whom I leave. Without, a split: your neighbour is handed to me (I gain two)."""

    TYPE = "view_swap"
    entry: Entry
    degree: int
    drop: Entry | None


@dataclass(frozen=True, slots=True)
class SwapReply:
    """`partner`: the neighbour handed off (None: I had room, and simply took you as a neighbour)."""

    TYPE = "view_swap_reply"
    accepted: bool
    degree: int
    partner: Entry | None


@dataclass(frozen=True, slots=True)
class Disconnect:
    """Our edge is gone. `handoff`: a peer that lost an edge for this too, and will link to you."""

    TYPE = "view_disconnect"
    handoff: Entry | None


@dataclass(frozen=True, slots=True)
class Shuffle:
    """A sample of `origin`'s views, sent to a passive peer (or walking the graph from a neighbour); the
    peer it ends at answers with its own. `degree`: the origin's, so two peers short of edges that meet
    in a shuffle link up."""

    TYPE = "view_shuffle"
    origin: Entry
    ttl: int
    entries: tuple[Entry, ...]
    degree: int


@dataclass(frozen=True, slots=True)
class ShuffleReply:
    TYPE = "view_shuffle_reply"
    entries: tuple[Entry, ...]
    degree: int


@dataclass(frozen=True, slots=True)
class Status:
    """To my neighbours when my edges change: my degree (their mixing weight), my neighbours (whom to
    link with if I fail) and my fastest link (whether my slow links are mine or theirs)."""

    TYPE = "view_status"
    degree: int
    neighbours: tuple[Entry, ...]
    fastest_bps: float | None


ViewMessage = Union[Join, JoinReply, JoinWalk, WalkEnd, Seek, NeighbourRequest, NeighbourReply, SwapRequest, SwapReply,
                    Disconnect, Shuffle, ShuffleReply, Status]


_MESSAGES = (Join, JoinReply, JoinWalk, WalkEnd, Seek, NeighbourRequest, NeighbourReply, SwapRequest, SwapReply, Disconnect,
             Shuffle, ShuffleReply, Status)
_FIELDS: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _MESSAGES}


def _check_entry(e: object, what: str) -> None:
    if type(e) is not Entry:
        raise BadMessage(f"{what} is not an entry")
    pid, addresses = e.peer_id, e.addresses
    if type(pid) is not str or not 0 < len(pid) <= MAX_NAME_CHARS:
        raise BadMessage(f"{what}: peer ID missing or over {MAX_NAME_CHARS} characters")
    if type(addresses) is not tuple or len(addresses) > MAX_ENTRY_ADDRESSES:
        raise BadMessage(f"{what}: more than {MAX_ENTRY_ADDRESSES} addresses")
    for a in addresses:
        if type(a) is not str or len(a) > MAX_ADDRESS_CHARS:
            raise BadMessage(f"{what}: an address over {MAX_ADDRESS_CHARS} characters")


def _check_entries(es: object, what: str) -> None:
    if type(es) is not tuple or len(es) > MAX_ENTRIES:
        raise BadMessage(f"{what}: more than {MAX_ENTRIES} entries")
    for e in es:
        _check_entry(e, what)


def _check_int(v: object, name: str, hi: int) -> None:
    if type(v) is not int or not 0 <= v <= hi:
        raise BadMessage(f"{name} {v!r} outside 0..{hi}")


def check(msg: ViewMessage, sender: str) -> None:
    """Raise BadMessage unless every field of `msg` (from the authenticated `sender`) is in range. Checked
    once, before any rule reads it: the rules trust these bounds and nothing else about a peer."""
    names = _FIELDS.get(type(msg))
    if names is None:
        raise BadMessage(f"not a view message: {type(msg).__name__}")
    for name in names:
        v = getattr(msg, name)
        if name == "entry":
            _check_entry(v, name)
            if v.peer_id != sender:  # type: ignore[attr-defined]
                raise BadMessage(f"{type(msg).TYPE}: entry names {v.peer_id!r}, not the sender")  # type: ignore[attr-defined]
        elif name in ("joiner", "origin"):
            _check_entry(v, name)
        elif name in ("drop", "partner", "handoff"):
            if v is not None:
                _check_entry(v, name)
        elif name in ("entries", "neighbours"):
            _check_entries(v, name)
        elif name == "ttl":
            _check_int(v, name, MAX_WALK)
        elif name == "degree":
            _check_int(v, name, MAX_DEGREE_FIELD)
        elif name == "lost":
            if v is not None and (type(v) is not str or not 0 < len(v) <= MAX_NAME_CHARS):
                raise BadMessage(f"lost: peer ID missing or over {MAX_NAME_CHARS} characters")
        elif name in ("accepted", "urgent"):
            if type(v) is not bool:
                raise BadMessage(f"{name} is not a bool")
        elif name == "fastest_bps":
            if v is not None and (type(v) is not float or not math.isfinite(v) or v <= 0):
                raise BadMessage(f"fastest_bps {v!r} is not a positive number")


def _wire(obj: object) -> object:
    """The msgpack form of a field: an entry as [peer ID, [addresses]], a message (or any dataclass of
    plain fields) as its field map."""
    if type(obj) is Entry:
        return (obj.peer_id, obj.addresses)
    names = _FIELDS.get(type(obj))
    if names is None and dataclasses.is_dataclass(obj):
        names = tuple(f.name for f in dataclasses.fields(obj))
    if names is not None:
        return {name: getattr(obj, name) for name in names}
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode(obj: object) -> bytes:
    """msgpack bytes of a message's body, an entry, or any state made of them (dicts, lists, numbers)."""
    return msgpack.packb(obj, default=_wire, use_bin_type=True)


_BY_TYPE: dict[str, type] = {cls.TYPE: cls for cls in _MESSAGES}
_ENTRY_FIELDS = frozenset({"entry", "joiner", "origin", "drop", "partner", "handoff"})
_ENTRIES_FIELDS = frozenset({"entries", "neighbours"})


def _entry_from_wire(v: object, what: str) -> Entry | None:
    if v is None:
        return None
    if type(v) is not tuple or len(v) != 2 or type(v[1]) is not tuple:
        raise BadMessage(f"{what} is not an entry")
    return Entry(v[0], v[1])  # its fields' types and sizes: `check`


def decode(kind: str, body: bytes, sender: str) -> ViewMessage:
    """The view message a `ViewPacket` from the authenticated `sender` carries, checked (`check`); BadMessage
    if it is not one, or breaks a bound. The packet's size was bounded when it was decoded."""
    cls = _BY_TYPE.get(kind)
    if cls is None:
        raise BadMessage(f"unknown view message {kind[:32]!r}")
    try:
        # arrays as tuples (the checks want tuples); no container can hold more than the body has bytes
        obj = msgpack.unpackb(body, raw=False, use_list=False, strict_map_key=True, max_ext_len=0)
    except Exception as e:  # msgpack raises a zoo of ValueError subclasses
        raise BadMessage(f"{kind}: malformed body: {type(e).__name__}") from None
    if type(obj) is not dict:
        raise BadMessage(f"{kind}: body is not a map")
    fields = {}
    for name in _FIELDS[cls]:
        if name not in obj:
            raise BadMessage(f"{kind}: field {name!r} missing")
        v = obj[name]
        if name in _ENTRY_FIELDS:
            v = _entry_from_wire(v, name)
        elif name in _ENTRIES_FIELDS:
            if type(v) is not tuple or len(v) > MAX_ENTRIES:
                raise BadMessage(f"{kind}: {name}: more than {MAX_ENTRIES} entries")
            v = tuple(_entry_from_wire(e, name) for e in v)
            if None in v:
                raise BadMessage(f"{kind}: {name}: an entry is missing")
        fields[name] = v
    msg = cls(**fields)
    check(msg, sender)
    return msg


def wire_size(msg: object) -> int:
    """Bytes `msg` takes on a session: its `ViewPacket` in the envelope `Registry.encode` makes, in one
    sealed frame."""
    return packet_size(type(msg).TYPE, encode(msg))  # type: ignore[attr-defined]


def packet_size(kind: str, body: bytes) -> int:
    """`wire_size` of a message already encoded (its kind and body, as a `ViewPacket` carries them)."""
    envelope = {"t": "view", "v": 1, "r": REQUEST_ID, "q": 0, "b": {"kind": kind, "body": body}}
    return len(encode(envelope)) + HEADER_SIZE + TAG_SIZE

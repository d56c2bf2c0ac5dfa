"""The partial-view plane: what peers send each other to keep partial views (peer/membership/views.py) and
to estimate the spectral gap with their neighbours (peer/topology/local_gap.py).

Each is a message of its own on the session, decoded and bounded by the registry like any other: how
many entries, how long a walk, how long an ID or address, how large a degree. A message that breaks a
bound closes its session with the reason; the rules that read them trust these bounds and nothing else
about a peer (who may send what, the authenticated sender, is the rules' own check:
`peer.membership.view_messages.check`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Union

import msgpack

from protocol.addresses import MAX_ENTRY_ADDRESSES
from protocol.bounds import MAX_ADDRESS_CHARS, MAX_DEGREE, check_peer_id
from protocol.messages import Message

__all__ = ["Disconnect", "Entry", "GapRound", "Join", "JoinReply", "JoinWalk", "NeighbourReply", "NeighbourRequest",
           "Seek", "Shuffle", "ShuffleReply", "Status", "SwapReply", "SwapRequest", "WalkEnd", "ViewMessage",
           "VIEW_MESSAGES", "MAX_ENTRIES", "MAX_WALK", "MAX_GAP_ROUNDS", "MAX_GAP_VECTORS", "MIN_GAP_SLOPE",
           "encoded_size"]

MAX_ENTRIES = 32  # entries one message may carry (shuffles, join samples, a neighbour list)
MAX_WALK = 16  # the longest random walk a peer forwards: a walk's TTL is at most this
MAX_GAP_EPOCH = 1 << 62  # epochs are wall-clock seconds / epoch_interval: far below this for any clock
MAX_GAP_ROUNDS = 10_000  # rounds per epoch (`GapConfig.rounds`' range): a round number is below this
MAX_GAP_VECTORS = 8  # values one round message may carry (`GapConfig.vectors`' range)
MIN_GAP_SLOPE = -50.0
"""The steepest slope an estimator reports (it clamps its fit to [MIN_GAP_SLOPE, 0]): exp(-50) is a
contraction no graph of peers reaches in a round; a slope above 0 would be growth, which mixing never is."""


def _check_int(what: str, value: int, hi: int) -> None:
    if not 0 <= value <= hi:
        raise ValueError(f"{what} {value} outside 0..{hi}")


def _check_entries(what: str, entries: tuple[Entry, ...]) -> None:
    if len(entries) > MAX_ENTRIES:
        raise ValueError(f"{what}: {len(entries)} entries, more than {MAX_ENTRIES}")


@dataclass(frozen=True, slots=True)
class Entry:
    """How to reach one peer: its ID and a few addresses (dial hints: the handshake checks the ID)."""

    peer_id: str
    addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_peer_id("entry", self.peer_id)
        if len(self.addresses) > MAX_ENTRY_ADDRESSES:
            raise ValueError(f"entry: {len(self.addresses)} addresses, more than {MAX_ENTRY_ADDRESSES}")
        for a in self.addresses:
            if len(a) > MAX_ADDRESS_CHARS:
                raise ValueError(f"entry: an address over {MAX_ADDRESS_CHARS} characters")


@dataclass(frozen=True, slots=True)
class Join(Message):
    """A newcomer asks a contact to bring it into the swarm."""

    TYPE = "view_join"
    entry: Entry


@dataclass(frozen=True, slots=True)
class JoinReply(Message):
    """The contact's answer: a sample of its views, for the newcomer's passive view."""

    TYPE = "view_join_reply"
    entries: tuple[Entry, ...]

    def __post_init__(self) -> None:
        _check_entries("entries", self.entries)


@dataclass(frozen=True, slots=True)
class JoinWalk(Message):
    """A random walk on behalf of a newcomer; where it ends, that peer introduces itself (`WalkEnd`)."""

    TYPE = "view_join_walk"
    joiner: Entry
    ttl: int

    def __post_init__(self) -> None:
        _check_int("ttl", self.ttl, MAX_WALK)


@dataclass(frozen=True, slots=True)
class WalkEnd(Message):
    """'A walk for you ended at me': a random peer of the swarm, for a newcomer to ask for edges."""

    TYPE = "view_walk_end"
    entry: Entry


@dataclass(frozen=True, slots=True)
class Seek(Message):
    """A random walk for `origin`, one edge short: the first peer it meets that is short too asks
    `origin` for an edge; the first with an edge to spare hands one of its neighbours over to it."""

    TYPE = "view_seek"
    origin: Entry
    ttl: int

    def __post_init__(self) -> None:
        _check_int("ttl", self.ttl, MAX_WALK)


@dataclass(frozen=True, slots=True)
class NeighbourRequest(Message):
    """Be my neighbour (one edge). `urgent`: I am below min_degree, take me even above your target. `lost`:
    a neighbour of us both that I saw fail (you may not have yet): we are its neighbours paired up."""

    TYPE = "view_neighbour"
    entry: Entry
    degree: int
    urgent: bool
    lost: str | None = None

    def __post_init__(self) -> None:
        _check_int("degree", self.degree, MAX_DEGREE)
        if self.lost is not None:
            check_peer_id("lost", self.lost)


@dataclass(frozen=True, slots=True)
class NeighbourReply(Message):
    TYPE = "view_neighbour_reply"
    accepted: bool
    degree: int

    def __post_init__(self) -> None:
        _check_int("degree", self.degree, MAX_DEGREE)


@dataclass(frozen=True, slots=True)
class SwapRequest(Message):
    """Give me one of your edges. With `drop`, a degree-preserving swap: you link to me and hand one of
    your neighbours to `drop`, whom I leave. Without, a split: your neighbour is handed to me (I gain two)."""

    TYPE = "view_swap"
    entry: Entry
    degree: int
    drop: Entry | None

    def __post_init__(self) -> None:
        _check_int("degree", self.degree, MAX_DEGREE)


@dataclass(frozen=True, slots=True)
class SwapReply(Message):
    """`partner`: the neighbour handed off (None: I had room, and simply took you as a neighbour)."""

    TYPE = "view_swap_reply"
    accepted: bool
    degree: int
    partner: Entry | None

    def __post_init__(self) -> None:
        _check_int("degree", self.degree, MAX_DEGREE)


@dataclass(frozen=True, slots=True)
class Disconnect(Message):
    """Our edge is gone. `handoff`: a peer that lost an edge for this too, and will link to you."""

    TYPE = "view_disconnect"
    handoff: Entry | None


@dataclass(frozen=True, slots=True)
class Shuffle(Message):
    """A sample of `origin`'s views, sent to a passive peer (or walking the graph from a neighbour); the
    peer it ends at answers with its own. `degree`: the origin's, so two peers short of edges that meet
    in a shuffle link up."""

    TYPE = "view_shuffle"
    origin: Entry
    ttl: int
    entries: tuple[Entry, ...]
    degree: int

    def __post_init__(self) -> None:
        _check_int("ttl", self.ttl, MAX_WALK)
        _check_entries("entries", self.entries)
        _check_int("degree", self.degree, MAX_DEGREE)


@dataclass(frozen=True, slots=True)
class ShuffleReply(Message):
    TYPE = "view_shuffle_reply"
    entries: tuple[Entry, ...]
    degree: int

    def __post_init__(self) -> None:
        _check_entries("entries", self.entries)
        _check_int("degree", self.degree, MAX_DEGREE)


@dataclass(frozen=True, slots=True)
class Status(Message):
    """To my neighbours when my edges change: my degree (their mixing weight), my neighbours (whom to
    link with if I fail) and my fastest link (whether my slow links are mine or theirs)."""

    TYPE = "view_status"
    degree: int
    neighbours: tuple[Entry, ...]
    fastest_bps: float | None

    def __post_init__(self) -> None:
        _check_int("degree", self.degree, MAX_DEGREE)
        _check_entries("neighbours", self.neighbours)
        if self.fastest_bps is not None and not (math.isfinite(self.fastest_bps) and self.fastest_bps > 0):
            raise ValueError(f"fastest_bps {self.fastest_bps!r} is not a positive number")


ViewMessage = Union[Join, JoinReply, JoinWalk, WalkEnd, Seek, NeighbourRequest, NeighbourReply, SwapRequest, SwapReply,
                    Disconnect, Shuffle, ShuffleReply, Status]
VIEW_MESSAGES: tuple[type[Message], ...] = (Join, JoinReply, JoinWalk, WalkEnd, Seek, NeighbourRequest, NeighbourReply,
                                            SwapRequest, SwapReply, Disconnect, Shuffle, ShuffleReply, Status)


@dataclass(frozen=True, slots=True)
class GapRound(Message):
    """One round's values of the gap estimate to a neighbour, with the sender's degree (the weight) and its
    current slope (its estimate so far: neighbours average it in the last round). Whether the round and the
    number of values fit our estimator's config is `peer.topology.local_gap.check_round`'s to say."""

    TYPE = "gap_round"
    epoch: int
    round: int
    degree: int
    values: tuple[float, ...]
    slope: float | None

    def __post_init__(self) -> None:
        if not (0 <= self.epoch < MAX_GAP_EPOCH and 0 <= self.round < MAX_GAP_ROUNDS):
            raise ValueError(f"gap round {self.round} / epoch {self.epoch} out of range")
        _check_int("degree", self.degree, MAX_DEGREE)
        if not 0 < len(self.values) <= MAX_GAP_VECTORS or not all(math.isfinite(v) for v in self.values):
            raise ValueError(f"gap round needs 1..{MAX_GAP_VECTORS} finite values, got {len(self.values)}")
        if self.slope is not None and not (math.isfinite(self.slope) and MIN_GAP_SLOPE <= self.slope <= 0.0):
            raise ValueError(f"gap slope {self.slope!r} out of range")


def _fields(obj: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encoded_size(state: Any) -> int:
    """Bytes of `state` (entries, messages, lists, dicts and numbers) in the wire's encoding: records as maps of
    their fields. What a peer's views and gap estimator report as the state they hold (`Views.state_bytes`)."""
    return len(msgpack.packb(state, default=_fields, use_bin_type=True))

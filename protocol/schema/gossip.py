"""Gossip-averaging messages: the symmetric pairwise exchange and parameter download.

An exchange between i (initiator) and j:
  i → j  AverageOffer (request; i's tensors follow on `streams`)
  j → i  AverageAccept (reply; the weight both will use, at most the offer's `max_weight`; j's tensors
         follow, in the offer's `codec`) | AverageReject (a refusal: code and reason, protocol/refusal.py)
  i → j  AverageCommit (i received everything and applied; j applies on receipt)
       | AverageAbort (i gave up after its offer went out; j applies nothing, stops waiting)
Both apply x += w * s * (x_other_snapshot - x_own_snapshot) with the same w and the same clip s <= 1, so
the swarm sum is unchanged; s comes from the smaller of the two `radius` values (the offer's and the
accept's) and the snapshots' distance (peer/averaging/bounds.py).

The weight is the smaller of what each side allows under the offer's `rule` ("pairwise": a fixed
share, 1/3 in peer/averaging/weights.py; "metropolis": 1/(1+degree), so the two sides' minimum is the
Metropolis-Hastings weight) and of the room left in each side's budget of weight in flight.

A round's update pushed to every partner (local steps with the sparse outer exchange, issue 41):
  i → j  UpdatePush (request; i's sparse update follows on `streams`, one tensor per spec of the group)
  j → i  UpdateTaken (reply: j added it, scaled by `scale` <= 1 where it was past j's bound) | ErrorReply
j adds outer_lr/n x the update to its own copy of the group; nothing is sent back, and no sum is kept
between the two: every peer applies every peer's update (peer/averaging/pushes.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from protocol.messages import Message
from protocol.refusal import MAX_CODE_CHARS, MAX_REASON_CHARS, Code, Refusal

NO_RADIUS = -1.0  # what a peer on version 2 (which announces none) reads as: refused, never guessed
NO_BOUND = sys.float_info.max  # a radius that bounds nothing ("none from my side"): the wire carries no inf

__all__ = ["TensorSpec", "AverageOffer", "AverageAccept", "AverageReject", "AverageCommit",
           "AverageAbort", "ParamsRequest", "ParamsReply", "UpdatePush", "UpdateTaken"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True, slots=True)
class AverageOffer(Message):
    TYPE = "avg_offer"
    VERSION = 3  # 3: radius (2: max_weight and rule replace degree); an older peer's offer is refused, not misread
    group: str
    tensors: list[TensorSpec]
    streams: list[int]
    max_weight: float  # the most the initiator will apply (already set aside in its budget), 0 < w <= 1/2
    rule: str = "pairwise"  # "pairwise" | "metropolis": how the server caps the weight from its side
    codec: str = "raw"  # the exchange's: the initiator's tensors come in it, and the server replies in it
    step: int = 0
    radius: float = NO_RADIUS  # the initiator's clip radius for this exchange, >= 0 (NO_BOUND: none from its side)


@dataclass(frozen=True, slots=True)
class AverageAccept(Message):
    TYPE = "avg_accept"
    VERSION = 3  # 3: radius (2: no degree, the weight is all the initiator checks)
    weight: float
    streams: list[int]
    step: int = 0
    radius: float = NO_RADIUS  # the server's clip radius for this exchange, >= 0 (NO_BOUND: none from its side)


@dataclass(frozen=True, slots=True)
class AverageReject(Message):
    """The server refuses the offer: `code` for the initiator to act on, `reason` for people.

    `code` came after version 1 and has a default, so no VERSION bump: an older peer ignores it, and its
    rejects, which lack it, read as Code.UNKNOWN (the compatibility rules, protocol/messages.py)."""

    TYPE = "avg_reject"
    reason: str
    code: str = Code.UNKNOWN.value

    def __post_init__(self) -> None:
        if len(self.code) > MAX_CODE_CHARS:
            raise ValueError(f"a refusal code of at most {MAX_CODE_CHARS} characters, got {len(self.code)}")
        if len(self.reason) > MAX_REASON_CHARS:
            raise ValueError(f"a reason of at most {MAX_REASON_CHARS} characters, got {len(self.reason)}")

    @classmethod
    def of(cls, refusal: Refusal) -> "AverageReject":
        """The wire form of a refused offer."""
        return cls(reason=refusal.reason, code=refusal.code.value)

    def refusal(self) -> Refusal:
        """This reject read back as a refusal (an unknown code reads as Code.UNKNOWN)."""
        return Refusal.from_wire(self.code, self.reason)


@dataclass(frozen=True, slots=True)
class AverageCommit(Message):
    TYPE = "avg_commit"
    exchange: int


@dataclass(frozen=True, slots=True)
class AverageAbort(Message):
    """The initiator will not commit `exchange` (the offer's request id): the server stops waiting for it.

    Without it a server whose initiator gave up once the offer was out (an inconsistent reply, its deadline,
    even before the reply came, cancellation) would hold the exchange's weight until its own deadline. A
    server that already accepted still finishes sending its tensors; one that had not accepted yet sends
    nothing."""

    TYPE = "avg_abort"
    exchange: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ParamsRequest(Message):
    """A joining peer asks a neighbour for its current parameters of `group`, if it has trained to `min_step`
    (a neighbour behind it refuses rather than send a model the joiner would drop; 0: any step)."""

    TYPE = "params_request"
    group: str
    min_step: int = 0


@dataclass(frozen=True, slots=True)
class ParamsReply(Message):
    TYPE = "params_reply"
    tensors: list[TensorSpec]
    streams: list[int]
    step: int = 0
    available: bool = True


@dataclass(frozen=True, slots=True)
class UpdatePush(Message):
    """A round's sparse update of `group`, for the receiver to add to its own copy (peer/averaging/pushes.py).
    The tensors follow on `streams`, one per tensor of the group in the receiver's order, codec "sparse"."""

    TYPE = "update_push"
    group: str
    streams: list[int]
    round: int = 0  # the sender's outer round (status and logs only: nothing is ordered by it)


@dataclass(frozen=True, slots=True)
class UpdateTaken(Message):
    """The receiver added the push, scaled by `scale` (1, or less where its norm was past the bound)."""

    TYPE = "update_taken"
    scale: float = 1.0

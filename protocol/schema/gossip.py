"""Gossip-averaging messages: the symmetric pairwise exchange and parameter download.

An exchange between i (initiator) and j:
  i → j  AverageOffer (request; i's tensors follow on `streams`)
  j → i  AverageAccept (reply; the weight both will use, at most the offer's `max_weight`; j's tensors
         follow) | AverageReject
  i → j  AverageCommit (i received everything and applied; j applies on receipt)
       | AverageAbort (i gave up after its offer went out; j applies nothing, stops waiting)
Both apply x += w * (x_other_snapshot - x_own_snapshot) with the same w, so the swarm sum is unchanged.

The weight is the smaller of what each side allows under the offer's `rule` ("pairwise": a fixed
share, 1/3 in peer/averaging/weights.py; "metropolis": 1/(1+degree), so the two sides' minimum is the
Metropolis-Hastings weight) and of the room left in each side's budget of weight in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Message

__all__ = ["TensorSpec", "AverageOffer", "AverageAccept", "AverageReject", "AverageCommit",
           "AverageAbort", "ParamsRequest", "ParamsReply"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str
    shape: list[int]


@dataclass(frozen=True, slots=True)
class AverageOffer(Message):
    TYPE = "avg_offer"
    VERSION = 2  # 2: max_weight and rule replace degree (a peer on version 1 is refused, not misread)
    group: str
    tensors: list[TensorSpec]
    streams: list[int]
    max_weight: float  # the most the initiator will apply (already set aside in its budget), 0 < w <= 1/2
    rule: str = "pairwise"  # "pairwise" | "metropolis": how the server caps the weight from its side
    codec: str = "raw"
    step: int = 0


@dataclass(frozen=True, slots=True)
class AverageAccept(Message):
    TYPE = "avg_accept"
    VERSION = 2  # 2: no degree (the weight is all the initiator checks)
    weight: float
    streams: list[int]
    step: int = 0


@dataclass(frozen=True, slots=True)
class AverageReject(Message):
    TYPE = "avg_reject"
    reason: str


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
    """A joining peer asks a neighbour for its current parameters of `group`."""

    TYPE = "params_request"
    group: str


@dataclass(frozen=True, slots=True)
class ParamsReply(Message):
    TYPE = "params_reply"
    tensors: list[TensorSpec]
    streams: list[int]
    step: int = 0
    available: bool = True

"""One averaging exchange, as an explicit state machine (sans-I/O, in the manner of h11's `_state.py`).

An exchange between initiator i and neighbour j (messages in protocol/schema/gossip.py):

    i: snapshot a = x_i, set aside m      j: (on offer) w = min(m, j's cap, j's room), snapshot b = x_j
    i → j  offer(m) + a                   j → i  accept(w) + b
    i: got b → commit, x_i += w (b - a)      j: got a and commit → x_j += w (a - b)
    (i gives up after its offer → abort)     j: abort → finish the transfers (or, not yet accepted, send nothing), apply nothing

Both sides add `w * (other snapshot - own snapshot)` (times the same clip s <= 1, peer/averaging/bounds.py),
so the swarm-wide sum is unchanged by averaging however the trainers' own updates interleave (docs/design.md, "Invariants", 1). A side that does not reach the
commit applies nothing. Every exchange has a deadline; a slow or dead neighbour is skipped.

The engine (peer/averaging/engine.py, serving.py) does the I/O and tells an `Exchange` what happened
(`handle`); the tables below say which step may follow which, and what an exchange that ends by a step
still owes (`Cleanup`: an abort to the peer, dropping the peer's tensors). The engine's cleanup reads
that, so what an ending owes is decided once, here, for every way an exchange can end. An illegal step is a bug
in the engine (a peer's message is checked before it becomes a step), so it raises `ExchangeStateError`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    INITIATOR = "initiator"
    SERVER = "server"


class State(enum.Enum):
    RESERVED = "reserved"  # i: weight set aside, snapshot being taken; nothing sent yet
    OFFERED = "offered"  # i: offer and tensors on their way. j: offer taken, snapshot being taken; nothing sent yet
    TRANSFER = "transfer"  # accepted: tensors move both ways
    DECIDING = "deciding"  # all of the other side's tensors are in: i commits, j waits for i's verdict
    COMMITTED = "committed"  # both apply w * (other - own)
    REFUSED = "refused"  # j said no; nothing applied
    ABORTED = "aborted"  # j: i called it off; nothing applied
    FAILED = "failed"  # deadline, closed session, bad message or cancellation; nothing applied


class Event(enum.Enum):
    OFFER = "offer"  # i: the offer goes out
    REFUSE = "refuse"  # j refuses the offer / i reads the refusal
    ACCEPT = "accept"  # j accepts / i reads an accept (its tensors are coming, even if it is inconsistent)
    RECEIVED = "received"  # every tensor of the other side arrived whole and as specified
    COMMIT = "commit"  # i's commit went out / j reads it
    ABORT = "abort"  # j reads i's abort
    FAIL = "fail"  # anything else that ends it


@dataclass(frozen=True)
class Cleanup:
    """What an exchange that ended still owes, beyond giving back its weight and snapshot (always done)."""

    send_abort: bool = False  # i: the offer is out and no verdict was sent; j may be serving it
    discard_incoming: bool = False  # the peer's tensors (or the rest of them) will not be read: drop them


NOTHING = Cleanup()
ABORT = Cleanup(send_abort=True)
DISCARD = Cleanup(discard_incoming=True)
ABORT_AND_DISCARD = Cleanup(send_abort=True, discard_incoming=True)
GO_ON = None  # not an ending: nothing owed yet

S, E = State, Event
_INITIATOR = (
    # from        step        to            an ending here owes
    (S.RESERVED,  E.OFFER,    S.OFFERED,   GO_ON),
    (S.RESERVED,  E.FAIL,     S.FAILED,    NOTHING),  # nothing went out (also: their offer won a collision)
    (S.OFFERED,   E.REFUSE,   S.REFUSED,   NOTHING),  # they drop our tensors
    (S.OFFERED,   E.ACCEPT,   S.TRANSFER,  GO_ON),
    (S.OFFERED,   E.FAIL,     S.FAILED,    ABORT),  # they may have accepted and wait for our tensors or verdict
    (S.TRANSFER,  E.RECEIVED, S.DECIDING,  GO_ON),
    (S.TRANSFER,  E.FAIL,     S.FAILED,    ABORT_AND_DISCARD),  # their tensors keep coming
    (S.DECIDING,  E.COMMIT,   S.COMMITTED, NOTHING),
    (S.DECIDING,  E.FAIL,     S.FAILED,    ABORT),  # the commit did not go out
)
_SERVER = (
    (S.OFFERED,   E.REFUSE,   S.REFUSED,   DISCARD),  # their tensors come with the offer
    (S.OFFERED,   E.ABORT,    S.ABORTED,   DISCARD),  # they gave up before we accepted: we send nothing
    (S.OFFERED,   E.ACCEPT,   S.TRANSFER,  GO_ON),
    (S.OFFERED,   E.FAIL,     S.FAILED,    DISCARD),
    (S.TRANSFER,  E.RECEIVED, S.DECIDING,  GO_ON),  # (an abort that comes meanwhile waits: both transfers end whole)
    (S.TRANSFER,  E.FAIL,     S.FAILED,    DISCARD),
    (S.DECIDING,  E.COMMIT,   S.COMMITTED, NOTHING),
    (S.DECIDING,  E.ABORT,    S.ABORTED,   NOTHING),
    (S.DECIDING,  E.FAIL,     S.FAILED,    NOTHING),  # no verdict before the deadline; all of theirs is in
)
del S, E


def _table(rows) -> dict[State, dict[Event, tuple[State, Cleanup | None]]]:
    out: dict[State, dict[Event, tuple[State, Cleanup | None]]] = {}
    for start, event, end, cleanup in rows:
        out.setdefault(start, {})[event] = (end, cleanup)
    return out


TRANSITIONS = {Role.INITIATOR: _table(_INITIATOR), Role.SERVER: _table(_SERVER)}
START = {Role.INITIATOR: State.RESERVED, Role.SERVER: State.OFFERED}


class ExchangeStateError(RuntimeError):
    """A step the protocol does not allow in the exchange's state: a bug in the engine, not the peer."""


class Exchange:
    """Where one exchange stands, for one side. `cleanup` is set once it has ended."""

    __slots__ = ("role", "state", "reason", "cleanup")

    def __init__(self, role: Role):
        self.role = role
        self.state = START[role]
        self.reason = ""  # why it ended, when it ended otherwise than committed
        self.cleanup: Cleanup | None = None

    @property
    def ended(self) -> bool:
        return self.cleanup is not None

    @property
    def committed(self) -> bool:
        return self.state is State.COMMITTED

    def handle(self, event: Event, reason: str = "") -> State:
        """Take one step; raises ExchangeStateError if the protocol does not allow it here."""
        step = TRANSITIONS[self.role].get(self.state, {}).get(event)
        if step is None:
            raise ExchangeStateError(f"{self.role.value} exchange in state {self.state.value!r} "
                                     f"cannot take {event.value!r}")
        self.state, cleanup = step
        if cleanup is not None:
            self.cleanup, self.reason = cleanup, reason
        return self.state

    def end(self, reason: str) -> Cleanup:
        """The exchange is over, whatever happened: still open, it fails with `reason`. What it owes."""
        if self.cleanup is None:
            self.handle(Event.FAIL, reason)
        assert self.cleanup is not None
        return self.cleanup

    def __repr__(self) -> str:
        return f"<Exchange {self.role.value} {self.state.value}>"

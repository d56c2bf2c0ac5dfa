"""One refusal: a code from one enum for programs, and a reason for people.

Every "no" a peer can say to a request (an averaging offer, a download, a stage call, a state fetch, a
dial-back, a punch, a relay) and every "no" an in-process call gets from the same rules is a `Refusal`:
the server builds it where it checks, sends it on the wire as an `ErrorReply` (or inside the reply message
that has a refusal field), and the asker reads it back with `Refusal.from_wire`. In-process calls raise
`Refused`. Callers branch on `code` (is it worth asking another peer? later?), never on the text.

A code we do not know (a newer peer) reads as `Code.UNKNOWN`, not as an error: the reason still says why.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MAX_REASON_CHARS = 512  # a reason is one line a log or a table can show; longer ones are cut, not refused
MAX_CODE_CHARS = 32
"""Characters of a refusal code in a reply: an identifier (`Code`'s values have at most 14), with room."""


class Code(enum.StrEnum):
    """Why a request was refused. The values are the wire's; add new ones at the end of a group."""

    # -- the peer is fine, only full or not ready now: ask again later or elsewhere (uses up no retry)
    BUSY = "busy"
    TOO_SOON = "too_soon"
    # -- the peer will not serve *us* this (role checks)
    NOT_NEIGHBOUR = "not_neighbour"
    BANNED = "banned"
    NOT_A_MEMBER = "not_a_member"
    WRONG_PATH = "wrong_path"  # asked over a relayed session what needs a direct one, or the reverse
    DISABLED = "disabled"  # the feature is off on that peer
    # -- what we asked for is not there
    NO_GROUP = "no_group"
    NOT_AVERAGED = "not_averaged"
    NO_STATE = "no_state"
    NO_RESERVATION = "no_reservation"
    # -- the request does not match what the server holds (our view was stale: another peer may do)
    NOT_SERVING = "not_serving"
    WRONG_PIPELINE = "wrong_pipeline"
    WRONG_CUT = "wrong_cut"
    WRONG_STAGE = "wrong_stage"
    MOVED = "moved"
    # -- the request itself is wrong: any peer would refuse it, do not retry
    WRONG_SPECS = "wrong_specs"
    WRONG_KIND = "wrong_kind"
    TOO_BIG = "too_big"
    BAD_CODEC = "bad_codec"
    BAD_INPUT = "bad_input"
    BAD_RULE = "bad_rule"
    BAD_WEIGHT = "bad_weight"
    CANNOT_WORK = "cannot_work"  # e.g. a punch through a NAT that picks random ports
    BAD_RADIUS = "bad_radius"  # an averaging offer without a radius (an older peer) or with an impossible one
    # -- a code this version does not know
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, text: str) -> "Code":
        """The code a peer sent, or UNKNOWN (never raises: a newer peer's code is not a protocol error)."""
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN


TRY_LATER = frozenset({Code.BUSY, Code.TOO_SOON})  # full, not broken: asking again is fine
STALE_VIEW = frozenset({Code.NOT_SERVING, Code.WRONG_PIPELINE, Code.WRONG_CUT, Code.WRONG_STAGE, Code.MOVED})
ASKERS_FAULT = frozenset({Code.WRONG_SPECS, Code.WRONG_KIND, Code.TOO_BIG, Code.BAD_CODEC, Code.BAD_INPUT,
                          Code.BAD_RULE, Code.BAD_WEIGHT, Code.BAD_RADIUS})  # any peer would refuse it: do not retry elsewhere


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refused request: `code` to act on, `reason` to show."""

    code: Code
    reason: str

    def __post_init__(self) -> None:
        if len(self.reason) > MAX_REASON_CHARS:
            object.__setattr__(self, "reason", self.reason[: MAX_REASON_CHARS - 1] + "…")

    @classmethod
    def from_wire(cls, code: str, reason: str) -> "Refusal":
        """A refusal as a peer sent it (an ErrorReply's code and message): unknown codes read as UNKNOWN."""
        return cls(Code.parse(code), reason)

    def __str__(self) -> str:
        return f"refused ({self.code.value}): {self.reason}"


class Refused(Exception):
    """An in-process call refused by the same rules a peer's request would be; `.refusal` says why."""

    def __init__(self, refusal: Refusal):
        super().__init__(str(refusal))
        self.refusal = refusal

    @property
    def code(self) -> Code:
        return self.refusal.code

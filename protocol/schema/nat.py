"""Reaching peers behind NAT: dial-back, relay reservations and circuits, hole-punch coordination.

Dial-back (is my advertised address reachable from outside?)
  A → B  DialBackRequest(addresses)        B dials each address, but only at A's own IP (see peer/nat)
  B → A  DialBackReply(results)            each result: reached or not, or not tried (a refusal code)

Relay (A behind NAT holds a reservation with public R; B reaches A through R)
  A → R  RelayReserve                        R → A  RelayReservation(ok, code, reason, limits)
  B → R  RelayConnect(target=A)              R → A  RelayIncoming(source=B, token_a)   A → R  RelayAck(ok, code)
                                             R → B  RelayConnectReply(ok, code, reason, token_b)
  then A and B each open a new TCP connection to R and send a circuit hello (`protocol.circuit`) with
  their token; R joins the two connections byte for byte, and A and B run their own handshake through it.

Hole punch (A and B share a relayed session; B started it)
  B → A  PunchOffer(address)  (request)      A → B  PunchOffer(address)  (reply) | ErrorReply (declined)
  B → A  PunchSync            B waits half the measured round trip, then both dial each other at once.

A refusal is a code from protocol/refusal.py's `Code` (what a program acts on) and a reason (what a person
reads): in an ErrorReply, or in the reply's own `code` and `reason` where it has an `ok` (`refused` builds
one, `refusal()` reads it back; a peer older than these codes sends none: it reads as Code.UNKNOWN).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Message
from protocol.bounds import MAX_ADDRESS_CHARS, check_peer_id
from protocol.refusal import MAX_CODE_CHARS, MAX_REASON_CHARS, Code, Refusal

__all__ = ["DialBackRequest", "DialBackResult", "DialBackReply", "RelayReserve", "RelayReservation",
           "RelayConnect", "RelayConnectReply", "RelayIncoming", "RelayAck", "PunchOffer", "PunchSync",
           "MAX_DIALBACK_ADDRESSES", "NOT_TRIED", "TOKEN_BYTES"]

MAX_DIALBACK_ADDRESSES = 4
"""Addresses one dial-back request may name: a daemon advertises a few; each costs the asked peer a dial."""
NOT_TRIED = "not tried: "
"""How a dial-back result that was not tried starts its reason: for people, and for peers older than codes,
which read it by this alone."""
TOKEN_BYTES = 16
"""A circuit token: 128 random bits, unguessable, used once, valid for seconds."""


def _check_address(address: str) -> None:
    if not 0 < len(address) <= MAX_ADDRESS_CHARS:
        raise ValueError(f"an address of 1..{MAX_ADDRESS_CHARS} characters, got {len(address)}")


def _check_reason(reason: str) -> None:
    if len(reason) > MAX_REASON_CHARS:
        raise ValueError(f"a reason of at most {MAX_REASON_CHARS} characters, got {len(reason)}")


def _check_refusal(ok: bool, code: str, reason: str) -> None:
    _check_reason(reason)
    if len(code) > MAX_CODE_CHARS:
        raise ValueError(f"a refusal code of at most {MAX_CODE_CHARS} characters, got {len(code)}")
    if ok and code:
        raise ValueError("an accepted request carries no refusal code")


def _read_refusal(ok: bool, code: str, reason: str) -> Refusal | None:
    return None if ok else Refusal.from_wire(code, reason)


def _check_token(token: bytes) -> None:
    if len(token) != TOKEN_BYTES:
        raise ValueError(f"a token of {TOKEN_BYTES} bytes, got {len(token)}")


@dataclass(frozen=True, slots=True)
class DialBackRequest(Message):
    """Please dial me at these addresses and tell me whether it worked."""

    TYPE = "dialback"
    addresses: list[str]

    def __post_init__(self) -> None:
        if not 0 < len(self.addresses) <= MAX_DIALBACK_ADDRESSES:
            raise ValueError(f"1..{MAX_DIALBACK_ADDRESSES} addresses, got {len(self.addresses)}")
        for a in self.addresses:
            _check_address(a)


@dataclass(frozen=True, slots=True)
class DialBackResult:
    address: str
    ok: bool
    reason: str  # why it failed ("" when it worked), or why it was not tried
    code: str = ""  # "" when it was tried (`ok` says how it went), else why not: a refusal code

    def __post_init__(self) -> None:
        _check_address(self.address)
        _check_refusal(self.ok, self.code, self.reason)

    @classmethod
    def not_tried(cls, address: str, refusal: Refusal) -> "DialBackResult":
        return cls(address, False, (NOT_TRIED + refusal.reason)[:MAX_REASON_CHARS], code=refusal.code.value)

    def refusal(self) -> Refusal | None:
        """Why the asked peer did not dial this address (the result is no evidence either way), or None if it
        did. A peer older than codes marked a result not tried only by NOT_TRIED: read as Code.UNKNOWN."""
        if self.code:
            return Refusal.from_wire(self.code, self.reason)
        if not self.ok and self.reason.startswith(NOT_TRIED):
            return Refusal(Code.UNKNOWN, self.reason)
        return None


@dataclass(frozen=True, slots=True)
class DialBackReply(Message):
    TYPE = "dialback_reply"
    results: list[DialBackResult]

    def __post_init__(self) -> None:
        if len(self.results) > MAX_DIALBACK_ADDRESSES:
            raise ValueError(f"at most {MAX_DIALBACK_ADDRESSES} results, got {len(self.results)}")


@dataclass(frozen=True, slots=True)
class RelayReserve(Message):
    """Please relay connections to me for as long as this session lasts."""

    TYPE = "relay_reserve"


@dataclass(frozen=True, slots=True)
class RelayReservation(Message):
    """The answer to RelayReserve, with the limits every circuit to us will have."""

    TYPE = "relay_reservation"
    ok: bool
    reason: str = ""
    max_circuit_bytes: int = 0
    max_circuit_seconds: float = 0.0
    code: str = ""  # a refusal's code ("" when ok)

    def __post_init__(self) -> None:
        _check_refusal(self.ok, self.code, self.reason)
        if not 0 <= self.max_circuit_bytes < 1 << 62 or not 0 <= self.max_circuit_seconds <= 366 * 86400:
            raise ValueError("circuit limits out of range")

    @classmethod
    def refused(cls, refusal: Refusal) -> "RelayReservation":
        return cls(ok=False, code=refusal.code.value, reason=refusal.reason)

    def refusal(self) -> Refusal | None:
        return _read_refusal(self.ok, self.code, self.reason)


@dataclass(frozen=True, slots=True)
class RelayConnect(Message):
    """Please connect me to `target`, who holds a reservation with you."""

    TYPE = "relay_connect"
    target: str

    def __post_init__(self) -> None:
        check_peer_id("target", self.target)


@dataclass(frozen=True, slots=True)
class RelayConnectReply(Message):
    TYPE = "relay_connect_reply"
    ok: bool
    reason: str = ""
    token: bytes = b""  # present when ok
    code: str = ""  # a refusal's code ("" when ok)

    def __post_init__(self) -> None:
        _check_refusal(self.ok, self.code, self.reason)
        if self.ok:
            _check_token(self.token)
        elif self.token:
            raise ValueError("a refusal carries no token")

    @classmethod
    def refused(cls, refusal: Refusal) -> "RelayConnectReply":
        return cls(ok=False, code=refusal.code.value, reason=refusal.reason)

    def refusal(self) -> Refusal | None:
        return _read_refusal(self.ok, self.code, self.reason)


@dataclass(frozen=True, slots=True)
class RelayIncoming(Message):
    """(relay → reserved peer) `source` wants a circuit to you: connect to me with this token."""

    TYPE = "relay_incoming"
    source: str
    token: bytes

    def __post_init__(self) -> None:
        check_peer_id("source", self.source)
        _check_token(self.token)


@dataclass(frozen=True, slots=True)
class RelayAck(Message):
    """The reserved peer's answer to RelayIncoming: will it connect?"""

    TYPE = "relay_ack"
    ok: bool
    reason: str = ""
    code: str = ""  # a refusal's code ("" when ok)

    def __post_init__(self) -> None:
        _check_refusal(self.ok, self.code, self.reason)

    @classmethod
    def refused(cls, refusal: Refusal) -> "RelayAck":
        return cls(ok=False, code=refusal.code.value, reason=refusal.reason)

    def refusal(self) -> Refusal | None:
        return _read_refusal(self.ok, self.code, self.reason)


@dataclass(frozen=True, slots=True)
class PunchOffer(Message):
    """The address (IP as seen from outside, and the port of a socket kept for this punch) to dial."""

    TYPE = "punch_offer"
    address: str

    def __post_init__(self) -> None:
        _check_address(self.address)


@dataclass(frozen=True, slots=True)
class PunchSync(Message):
    """Dial now (the sender dials after half the round trip it measured, so both SYNs cross)."""

    TYPE = "punch_sync"

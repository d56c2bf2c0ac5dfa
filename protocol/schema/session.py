"""Membership and session-plane messages: liveness, identity records, goodbyes.

These are the messages every session speaks regardless of what is trained:
heartbeats measure round-trip time, peer records say who a peer is and where
it can be reached, and peer exchange spreads those records through the swarm.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from protocol.bounds import MAX_ADDRESS_CHARS, check_peer_id
from protocol.identity import KEY_SIZE, SIGNATURE_SIZE
from protocol.messages import Message
from protocol.refusal import Refusal

MAX_RECORD_ADDRESSES = 16
"""Addresses in one peer record: a host has a few interfaces, each maybe with IPv4 and IPv6; a daemon
advertises at most 8 (`peer.membership.peers.MAX_ADDRESSES`), so 16 leaves room and refuses the
90,000-address records that once froze address merging."""
MAX_PEERS_PER_EXCHANGE = 256
"""Records in one PeerExchange message (a sender forwards at most 256)."""
MAX_SWARM_CHARS = 256
"""Characters of a swarm name in a peer record (a config's `swarm`, any name its operator picked)."""

__all__ = [
    "ErrorReply",
    "Goodbye",
    "PeerExchange",
    "PeerRecord",
    "Ping",
    "Pong",
    "peer_record_signing_bytes",
]


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Heartbeat; `sent` is the sender's clock, echoed back to measure RTT."""

    TYPE = "ping"
    sent: float


@dataclass(frozen=True, slots=True)
class Pong(Message):
    """Answer to a Ping (reply_to = its rid); `echo` is the Ping's `sent`."""

    TYPE = "pong"
    echo: float


@dataclass(frozen=True, slots=True)
class PeerRecord(Message):
    """A self-signed statement "peer `peer_id` with this key is at these addresses".

    Signed by the peer's own key so it can be relayed by others (peer exchange)
    without trusting the relay. `addresses` are "host:port" strings; `issued`
    and `expires` are wall-clock seconds, checked by the receiver's policy code,
    not here (this package reads no clocks).
    """

    TYPE = "peer_record"
    peer_id: str
    public_key: bytes
    swarm: str
    addresses: list[str]
    issued: float
    expires: float
    signature: bytes

    def __post_init__(self) -> None:
        check_peer_id("peer_id", self.peer_id)
        if len(self.swarm) > MAX_SWARM_CHARS:
            raise ValueError(f"swarm must have at most {MAX_SWARM_CHARS} characters, got {len(self.swarm)}")
        if len(self.public_key) != KEY_SIZE:
            raise ValueError(f"public_key must have {KEY_SIZE} bytes, got {len(self.public_key)}")
        # empty while a record is being built, before it is signed
        if len(self.signature) > SIGNATURE_SIZE:
            raise ValueError(f"signature must have at most {SIGNATURE_SIZE} bytes, got {len(self.signature)}")
        if len(self.addresses) > MAX_RECORD_ADDRESSES:
            raise ValueError(f"{len(self.addresses)} addresses (at most {MAX_RECORD_ADDRESSES})")
        if any(isinstance(a, str) and len(a) > MAX_ADDRESS_CHARS for a in self.addresses):
            raise ValueError(f"an address longer than {MAX_ADDRESS_CHARS} characters")


_PEER_RECORD_DOMAIN = "peertrain/peer_record/v1"


def peer_record_signing_bytes(record: PeerRecord) -> bytes:
    """The exact bytes a PeerRecord's signature covers: every field but `signature`.

    A msgpack array in a fixed field order with floats always as float64, so
    anyone holding the public key reproduces the same bytes. The leading domain
    tag keeps a signature over a peer record from being valid for any other
    kind of signed message.
    """
    return msgpack.packb(
        [
            _PEER_RECORD_DOMAIN,
            record.peer_id,
            bytes(record.public_key),
            record.swarm,
            list(record.addresses),
            float(record.issued),
            float(record.expires),
        ],
        use_bin_type=True,
        use_single_float=False,
    )


@dataclass(frozen=True, slots=True)
class PeerExchange(Message):
    """Some peer records the sender knows, to spread membership (gossip-style)."""

    TYPE = "pex"
    peers: list[PeerRecord]

    def __post_init__(self) -> None:
        if len(self.peers) > MAX_PEERS_PER_EXCHANGE:
            raise ValueError(f"{len(self.peers)} peer records (at most {MAX_PEERS_PER_EXCHANGE})")


@dataclass(frozen=True, slots=True)
class Goodbye(Message):
    """Sent before a deliberate close, so the other side can tell leaving from crashing."""

    TYPE = "bye"
    reason: str


@dataclass(frozen=True, slots=True)
class ErrorReply(Message):
    """A request could not be served; `code` is machine-readable, `message` for humans."""

    TYPE = "error"
    code: str
    message: str

    @classmethod
    def of(cls, refusal: Refusal) -> "ErrorReply":
        """The wire form of a refusal (protocol/refusal.py)."""
        return cls(code=refusal.code.value, message=refusal.reason)

    def refusal(self) -> Refusal:
        """This reply read back as a refusal (an unknown code reads as Code.UNKNOWN)."""
        return Refusal.from_wire(self.code, self.message)

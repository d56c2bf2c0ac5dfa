"""Membership and session-plane messages: liveness, identity records, goodbyes.

These are the messages every session speaks regardless of what is trained:
heartbeats measure round-trip time, peer records say who a peer is and where
it can be reached, and peer exchange spreads those records through the swarm.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from protocol.messages import Message

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

"""Bounds on the fields messages carry: one per kind of field, defined once for every schema.

Why one place: a peer ID, an address or a degree is the same thing in a view entry, a signed record and a
relay request, and a hostile peer looks for the loosest bound among them (an ID that one message refuses
but another copies into every view). Bounds of one plane alone (a record's neighbour count, a pipeline's
stage count) stay with that plane's schema. Constants and the one check of a peer ID; no imports, so any
protocol module may use them.
"""

from __future__ import annotations

__all__ = ["MAX_ADDRESS_CHARS", "MAX_DEGREE", "MAX_PEER_ID_CHARS", "check_peer_id"]

MAX_PEER_ID_CHARS = 64
"""Characters of a peer ID anywhere on the wire. A real ID is `protocol.identity.PEER_ID_LENGTH` (20) base32
characters of a key's hash; the wire bounds its length, not its form (the handshake and signatures prove
who is who), so tests and simulators may name peers freely, with room for a longer digest in a later
version. 64, not the 256 peer records once allowed: an ID is copied into many views and records, and a
256-character one made a hostile entry cost thirteen times an honest one everywhere it went."""
MAX_ADDRESS_CHARS = 262
"""Characters of one "host:port" address: a DNS name's 255, a colon and a port."""
MAX_DEGREE = 1 << 16
"""A peer's degree (gossip neighbours) as it claims it in a message: any larger is a lie, and refused;
real degrees are `[topology] max_degree` (8 by default, 32 at most in partial views)."""


def check_peer_id(what: str, value: str) -> None:
    """A peer ID field of any message: 1..MAX_PEER_ID_CHARS characters (ValueError naming `what` otherwise)."""
    if not 0 < len(value) <= MAX_PEER_ID_CHARS:
        raise ValueError(f"{what}: a peer ID of 1..{MAX_PEER_ID_CHARS} characters, got {len(value)}")

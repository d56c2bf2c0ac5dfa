"""Addresses as peers write them in signed records: direct "host:port", or relayed "host:port/relay/<relay peer ID>".

A relayed address names the relay's own direct address and its peer ID: a peer holding a reservation
with that relay can be reached by asking the relay for a circuit (peer/nat/relay.py). The form keeps
`host:port` in front, so software that only knows direct addresses finds no valid port and skips it.

Here, not in peer/nat/, because the wire bounds them too: a stage announcement carries its server's
addresses (protocol/schema/pipeline.py), and the schema refuses one it cannot parse. Pure text: no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.bounds import MAX_PEER_ID_CHARS

RELAY_MARK = "/relay/"
MAX_ENTRY_ADDRESSES = 4
"""Addresses one view entry or stage announcement carries: a peer's direct addresses, as few as dialing needs
(a peer record may carry 16; an entry is copied into up to a hundred views, so it carries the first few)."""


@dataclass(frozen=True)
class RelayedAddress:
    relay_id: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{format_hostport(self.host, self.port)}{RELAY_MARK}{self.relay_id}"


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str) -> tuple[str, int] | None:
    """A direct "host:port" (IPv6 in brackets), or None for anything else (a relayed address included)."""
    if not isinstance(text, str) or "/" in text or "@" in text:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def parse_relayed(text: str) -> RelayedAddress | None:
    if not isinstance(text, str):
        return None
    direct, sep, relay_id = text.partition(RELAY_MARK)
    if not sep or not relay_id or "/" in relay_id or len(relay_id) > MAX_PEER_ID_CHARS:
        return None
    hp = parse_address(direct)
    return RelayedAddress(relay_id, hp[0], hp[1]) if hp else None

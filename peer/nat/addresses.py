"""Addresses in signed peer records: direct "host:port", or relayed "host:port/relay/<relay peer ID>".

Their text forms and parsers live in protocol/addresses.py (the wire bounds them too) and are re-exported
here, where the daemon's address helpers are.
"""

from __future__ import annotations

import ipaddress

# the text forms are the wire's (a stage announcement's addresses are checked when it is decoded)
from protocol.addresses import RELAY_MARK, RelayedAddress, format_hostport, parse_address, parse_relayed  # noqa: F401


def ip_literal(host: str) -> str | None:
    """The canonical form of an IP literal, or None for a host name or garbage."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None

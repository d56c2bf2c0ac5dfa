"""Who may hold an inbound handshake slot: the fairness rule of the listener, pure so that it can be tested
alone (docs/design.md, "Handshake slots"); `serve` in `peer/session/connect.py` drives it.

Before a connection has finished a handshake nothing is known about it but its source address, and
anyone can open thousands a second from one address. A single oldest-first queue let such a flood keep
pushing out an honest peer's handshake before it could finish. Here slots are shared by source: a
newcomer always gets a slot, and when the slots its source may hold are all taken, the one that goes is
the oldest of the source that holds the most:

1. its IP holds `per_ip` already: the oldest of its own IP goes;
2. else its prefix (IPv4 /24, IPv6 /64: what one subscriber or one rented block has) holds `per_prefix`:
   the oldest of the IP holding the most in that prefix goes;
3. else all `total` are held: the oldest of the IP holding the most, in the prefix holding the most, goes
   (between equals, the one whose oldest handshake is the oldest).

So a flood from one IP or one prefix only ever pushes out its own connections (it can hold `per_ip` or
`per_prefix` slots, fewer than `total`), and a handshake from another prefix, once admitted, is pushed
out only when its prefix holds as many slots as the largest one: with fewer than `total - 1` flooding
prefixes, never. A flood from more prefixes than that (a botnet) is as bad as before, oldest first.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

H = TypeVar("H", bound=Hashable)

MAX_HANDSHAKES = 64
"""Inbound handshakes in progress at once. Each holds a descriptor, a task and a few KiB of handshake state
until its deadline (`[membership] handshake_timeout`), so 64 is cheap next to the 64 sessions the daemon
keeps by default, and four prefixes' worth of slots: a one-prefix flood leaves half of them to the rest."""

MAX_HANDSHAKES_PER_PREFIX = 32
"""Handshakes in progress from one IPv4 /24 or IPv6 /48. Half of MAX_HANDSHAKES, so a flood from one
prefix can never fill the slots; two hosts' worth of MAX_HANDSHAKES_PER_IP, for a LAN's peers joining at once."""

MAX_HANDSHAKES_PER_IP = 16
"""Handshakes in progress from one IP: the listener's old global cap, which every local swarm (many daemons
on 127.0.0.1 joining one bootstrap at once) fits; below MAX_HANDSHAKES_PER_PREFIX, so a flood from one IP
never pushes out a peer at another IP of the same prefix either."""

IPV4_PREFIX_BITS = 24  # one subscriber's or one small rented block's addresses
IPV6_PREFIX_BITS = 48  # what a provider gives one site (a /56 or /64 inside it, often): one attacker holds all of it at no cost


def source_of(ip: str) -> tuple[str, str]:
    """(ip, prefix) of a remote address: the prefix is its /24 (IPv4, IPv4-mapped IPv6 included) or /48;
    an address that does not parse (never, from a socket) is its own prefix."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip, ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    bits = IPV4_PREFIX_BITS if addr.version == 4 else IPV6_PREFIX_BITS
    return str(addr), str(ipaddress.ip_network((addr, bits), strict=False))


class HandshakeSlots(Generic[H]):
    """The slots, each held by a `holder` (any hashable: the listener uses the handshake's cancel scope).
    `admit` always makes room for a newcomer and says whom it pushed out; `release` frees a slot."""

    def __init__(self, total: int = MAX_HANDSHAKES, per_prefix: int = MAX_HANDSHAKES_PER_PREFIX,
                 per_ip: int = MAX_HANDSHAKES_PER_IP):
        if not 1 <= per_ip <= per_prefix <= total:
            raise ValueError(f"need 1 <= per_ip ({per_ip}) <= per_prefix ({per_prefix}) <= total ({total})")
        self.total, self.per_prefix, self.per_ip = total, per_prefix, per_ip
        self._where: dict[H, tuple[str, str]] = {}  # holder -> (ip, prefix)
        self._by_ip: dict[str, OrderedDict[H, int]] = {}  # ip -> its holders, oldest first, with their arrival
        self._by_prefix: dict[str, dict[str, None]] = {}  # prefix -> its IPs holding slots
        self._prefix_count: dict[str, int] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, holder: object) -> bool:
        return holder in self._where

    def held_by_ip(self, ip: str) -> int:
        holders = self._by_ip.get(source_of(ip)[0])
        return len(holders) if holders else 0

    def held_by_prefix(self, ip: str) -> int:
        return self._prefix_count.get(source_of(ip)[1], 0)

    def admit(self, ip: str, holder: H) -> H | None:
        """Give `holder` (from `ip`) a slot; the holder pushed out to make room (its slot is free already:
        the caller ends its handshake), or None."""
        if holder in self._where:
            raise ValueError("this holder has a slot already")
        address, prefix = source_of(ip)
        victim = self._victim(address, prefix)
        if victim is not None:
            self.release(victim)
        self._where[holder] = (address, prefix)
        self._by_ip.setdefault(address, OrderedDict())[holder] = next(self._arrivals)
        self._by_prefix.setdefault(prefix, {})[address] = None
        self._prefix_count[prefix] = self._prefix_count.get(prefix, 0) + 1
        return victim

    def release(self, holder: H) -> bool:
        """Free `holder`'s slot; False if it held none (released already, or pushed out)."""
        where = self._where.pop(holder, None)
        if where is None:
            return False
        address, prefix = where
        holders = self._by_ip[address]
        del holders[holder]
        if not holders:
            del self._by_ip[address]
            del self._by_prefix[prefix][address]
        self._prefix_count[prefix] -= 1
        if not self._prefix_count[prefix]:
            del self._prefix_count[prefix]
            del self._by_prefix[prefix]
        return True

    def _victim(self, address: str, prefix: str) -> H | None:
        if len(self._by_ip.get(address, ())) >= self.per_ip:
            return self._oldest(address)
        if self._prefix_count.get(prefix, 0) >= self.per_prefix:
            return self._oldest(self._largest_ip(prefix))
        if len(self._where) >= self.total:
            largest = max(self._prefix_count, key=lambda p: (self._prefix_count[p], -self._oldest_arrival_in(p)))
            return self._oldest(self._largest_ip(largest))
        return None

    def _oldest(self, address: str) -> H:
        return next(iter(self._by_ip[address]))

    def _oldest_arrival(self, address: str) -> int:
        return next(iter(self._by_ip[address].values()))

    def _oldest_arrival_in(self, prefix: str) -> int:
        return min(self._oldest_arrival(a) for a in self._by_prefix[prefix])

    def _largest_ip(self, prefix: str) -> str:
        return max(self._by_prefix[prefix], key=lambda a: (len(self._by_ip[a]), -self._oldest_arrival(a)))

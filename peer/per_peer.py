"""Tables keyed by peer ID that keep only the peers most recently touched.

Counters a service keeps per peer (exchanges, clips, strikes) must not grow with every identity ever seen:
keys are free, and a peer that made a new one for each exchange would grow them without end. The bound drops
the peer least recently touched, one we have not dealt with for the longest: these are figures for `peer
status`, never evidence (the ban list keeps its own records: peer/averaging/bans.py). The tables are plain
dicts (insertion order is the recency order), so they compare and serialise as before.
"""

from __future__ import annotations

from typing import Callable, TypeVar

V = TypeVar("V")

MAX_PEERS_SHOWN = 256
"""Peers a per-peer table keeps: many times the partners one daemon has at once (max_degree 8, churn over
hours), and a `peer status` that lists them all stays tens of KB."""


def touch(table: dict[str, V], peer_id: str, make: Callable[[], V], limit: int = MAX_PEERS_SHOWN) -> V:
    """`table[peer_id]`, made by `make` if new, now the most recent; the least recent go past `limit`."""
    row = table.pop(peer_id, None)
    table[peer_id] = make() if row is None else row
    _trim(table, limit)
    return table[peer_id]


def count(table: dict[str, int], peer_id: str, n: int = 1, limit: int = MAX_PEERS_SHOWN) -> None:
    """Add `n` to `peer_id`'s count, now the most recent; the least recent go past `limit`."""
    table[peer_id] = table.pop(peer_id, 0) + n
    _trim(table, limit)


def _trim(table: dict, limit: int) -> None:
    while len(table) > limit:
        del table[next(iter(table))]

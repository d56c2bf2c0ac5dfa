"""The passive view: peers this one knows and could link to, bounded, and which of them makes room.

HyParView's passive view (peer/membership/views.py keeps the active one beside it): a bounded set of entries
learnt from joins, shuffles and mDNS, refreshed by shuffles. What it holds is what a newcomer's edges and a
swap's partners are drawn from, so what it evicts when full decides how far a flood of keys can crowd it:
keys are free and one /24 holds 254 addresses, so a full view makes room in the prefix holding the most
entries (`victim`). A flood then only pushes out its own prefix's entries, while a LAN swarm, all in one
prefix, evicts at random as before (issue 40).
"""

from __future__ import annotations

import random

from peer.session.handshake_slots import source_of
from protocol.addresses import RELAY_MARK, parse_address
from protocol.schema.views import Entry


def entry_prefix(entry: Entry) -> str:
    """The network prefix an entry's first address lies in (IPv4 /24, IPv6 /48: `source_of`); a relayed address
    counts by its relay's address, and an entry without a parseable address is a prefix of its own ID."""
    for text in entry.addresses[:1]:
        parsed = parse_address(text.split(RELAY_MARK, 1)[0])
        if parsed is not None:
            return source_of(parsed[0])[1]
    return "id:" + entry.peer_id


class PassiveView(dict[str, Entry]):
    """Peer ID -> entry, at most `size` of them; `add` and `integrate` make room when full. The caller keeps
    out what is not a candidate (ourselves, our neighbours)."""

    def __init__(self, size: int, rng: random.Random):
        super().__init__()
        self.size, self.rng = size, rng

    def add(self, entry: Entry) -> None:
        """Hold `entry` (a fresher one replaces what we had of that peer), evicting `victim` when full."""
        if entry.peer_id not in self and len(self) >= self.size:
            del self[self.victim(entry, [])]
        self[entry.peer_id] = entry

    def integrate(self, entries: list[Entry], *, sent: list[Entry]) -> None:
        """A shuffle's entries (new peers only); when full, those I just sent away go first (Cyclon), unless the
        newcomer's prefix holds the most already (`victim`)."""
        evict = [e.peer_id for e in sent]
        for e in entries:
            if e.peer_id in self:
                continue
            if len(self) >= self.size:
                while evict and evict[-1] not in self:
                    evict.pop()
                victim = self.victim(e, evict)
                if evict and victim == evict[-1]:
                    evict.pop()
                del self[victim]
            self[e.peer_id] = e

    def victim(self, newcomer: Entry, preferred: list[str]) -> str:
        """Which entry makes room for `newcomer` in a full view: one of its own prefix (`entry_prefix`) if that
        prefix holds the most entries already, else the last of `preferred` (a shuffle's: what I just sent
        away), else a random one of the prefix holding the most (module docstring)."""
        by_prefix: dict[str, list[str]] = {}
        for p, e in self.items():
            by_prefix.setdefault(entry_prefix(e), []).append(p)
        largest = max(len(ps) for ps in by_prefix.values())
        own = by_prefix.get(entry_prefix(newcomer), [])
        if own and len(own) >= largest:
            return self.rng.choice(own)
        if preferred:
            return preferred[-1]
        return self.rng.choice(self.rng.choice([ps for ps in by_prefix.values() if len(ps) == largest]))

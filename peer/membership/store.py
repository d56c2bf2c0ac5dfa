"""The peer store: peers we were connected to, kept in the home across restarts as dial hints.

Each entry keeps the peer's own signed `PeerRecord` when we have one (membership keeps the latest in
`PeerInfo.record`; a connected peer sends its own in its first peer exchange), the addresses we knew it
at, and when we last saw it. A restarted daemon dials these before (or without) any bootstrap or mDNS.

On load every record is checked again (peer ID against key, signature, swarm, issue time). A record past
its TTL is still used: the handshake authenticates whoever answers, so an address is only ever a hint;
but one older than MAX_STORE_AGE likely names an address the peer has left. The file is read bounded and
a corrupt one costs a warning, never the start.

File (`Home.peer_cache`, msgpack, 0600, written atomically):
    {"v": 2, "peers": [{"peer_id", "last_seen", "record": {PeerRecord fields} | None, "addresses": [str]}]}
Version 1 (a list of {"peer_id", "addresses"}) is still read; its entries are unverified.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable

import msgpack

from peer.home import atomic_write
from protocol import identity as ident
from protocol.bounds import MAX_ADDRESS_CHARS
from protocol.limits import MiB
from protocol.schema import PeerRecord, peer_record_signing_bytes
from protocol.schema.session import MAX_RECORD_ADDRESSES

log = logging.getLogger("peertrain.membership")

STORE_VERSION = 2
MAX_STORED_PEERS = 256
"""Entries kept and read: enough to find the swarm again after a restart; the file stays ~100 KiB."""
MAX_STORED_ADDRESSES = MAX_RECORD_ADDRESSES  # per entry, as many as a signed record may carry
MAX_STORE_BYTES = 1 * MiB
"""A larger file is refused unread: 256 full entries take well under this, so it is not ours."""
MAX_STORE_AGE = 7 * 86400.0
"""A record issued (or an entry last seen) longer ago is dropped: a week-old address is likely stale."""
MAX_CLOCK_SKEW = 300.0
"""A record issued further in the future is refused, as membership refuses it in peer exchange."""


@dataclass(frozen=True)
class StoredPeer:
    """A peer to dial at start. `verified`: its signed record checked out (its addresses come first; the
    rest are ones we learned first-hand). Addresses are strings, "host:port" or relayed
    "host:port/relay/<relay peer ID>", passed on as they are."""

    peer_id: str
    addresses: list[str]
    verified: bool
    last_seen: float


@dataclass(frozen=True)
class StoreEntry:
    """What `PeerStore.save` writes for one peer."""

    peer_id: str
    last_seen: float
    record: PeerRecord | None
    addresses: list[str]


def record_to_wire(rec: PeerRecord) -> dict[str, Any]:
    return {f.name: getattr(rec, f.name) for f in fields(rec)}


def record_from_wire(obj: Any) -> PeerRecord:
    """A PeerRecord from its stored form; ValueError if the types are wrong (the record checks its sizes)."""
    if not isinstance(obj, dict):
        raise ValueError("record is not a map")
    kinds = {"peer_id": str, "public_key": bytes, "swarm": str, "addresses": list, "issued": (int, float),
             "expires": (int, float), "signature": bytes}
    for name, kind in kinds.items():
        if not isinstance(obj.get(name), kind) or isinstance(obj.get(name), bool):
            raise ValueError(f"record field {name!r} missing or of the wrong type")
    if not all(isinstance(a, str) for a in obj["addresses"]):
        raise ValueError("record address is not a string")
    return PeerRecord(**{name: obj[name] for name in kinds})


def check_record(rec: PeerRecord, *, swarm: str, now: float) -> str | None:
    """None if the record may be used as a dial hint; else why not. Unlike peer exchange, its TTL is
    not checked (see the module docstring); its age is."""
    if ident.peer_id_from_public_bytes(rec.public_key) != rec.peer_id:
        return "peer ID does not match its public key"
    if not ident.verify(rec.public_key, rec.signature, peer_record_signing_bytes(rec)):
        return "bad signature (the record was changed after it was signed)"
    if rec.swarm != swarm:
        return f"other swarm {rec.swarm!r}"
    if not math.isfinite(rec.issued):
        return "no valid issue time"
    if rec.issued > now + MAX_CLOCK_SKEW:
        return f"issued {rec.issued - now:.0f} s in the future"
    if rec.issued < now - MAX_STORE_AGE:
        return f"issued {(now - rec.issued) / 86400:.1f} days ago"
    return None


def _addresses(values: Any) -> list[str]:
    if not isinstance(values, list):
        return []
    good = [a for a in values[:MAX_STORED_ADDRESSES] if isinstance(a, str) and 0 < len(a) <= MAX_ADDRESS_CHARS]
    return list(dict.fromkeys(good))


def entries_from_peers(peers: Iterable[Any]) -> list[StoreEntry]:
    """Store entries for membership's peers (`PeerInfo`) that we were connected to at some point, most
    recently seen first: the signed record when we got one, and the addresses we knew."""
    out = []
    for p in peers:
        if not p.last_seen:
            continue
        addrs = [f"[{h}]:{pt}" if ":" in h else f"{h}:{pt}" for h, pt in p.addresses]
        addrs += [str(r) for r in getattr(p, "relayed", ())]  # relayed addresses (peer/nat), where kept
        if p.record is not None or addrs:
            out.append(StoreEntry(p.peer_id, p.last_seen, p.record, addrs[:MAX_STORED_ADDRESSES]))
    out.sort(key=lambda e: e.last_seen, reverse=True)
    return out[:MAX_STORED_PEERS]


class PeerStore:
    """The peer store file of one home, for one swarm (records of other swarms are dropped on load)."""

    def __init__(self, path: Path, *, swarm: str):
        self.path = Path(path)
        self.swarm = swarm

    def save(self, entries: Iterable[StoreEntry]) -> None:
        peers = [{"peer_id": e.peer_id, "last_seen": float(e.last_seen),
                  "record": record_to_wire(e.record) if e.record is not None else None,
                  "addresses": list(e.addresses)[:MAX_STORED_ADDRESSES]}
                 for e in sorted(entries, key=lambda e: e.last_seen, reverse=True)[:MAX_STORED_PEERS]]
        data = msgpack.packb({"v": STORE_VERSION, "peers": peers}, use_bin_type=True)
        atomic_write(self.path, data, mode=0o600)

    def load(self, *, now: float | None = None) -> list[StoredPeer]:
        """The stored peers still worth dialing, most recently seen first; [] if there is no file or it
        cannot be used (with a warning saying why)."""
        now = time.time() if now is None else now
        try:
            st = os.stat(self.path)
            if st.st_size > MAX_STORE_BYTES:
                log.warning("ignoring peer store %s: %d bytes, more than the %d a store can hold", self.path,
                            st.st_size, MAX_STORE_BYTES)
                return []
            data = msgpack.unpackb(self.path.read_bytes(), raw=False)
            if isinstance(data, list):  # version 1: no records, no times; the file's age stands for both
                raw = [{"peer_id": e.get("peer_id"), "addresses": e.get("addresses"), "last_seen": st.st_mtime,
                        "record": None} for e in data[:MAX_STORED_PEERS] if isinstance(e, dict)]
            elif isinstance(data, dict) and data.get("v") == STORE_VERSION and isinstance(data.get("peers"), list):
                raw = [e for e in data["peers"][:MAX_STORED_PEERS] if isinstance(e, dict)]
            else:
                raise ValueError("not a peer store (unknown version or layout)")
        except FileNotFoundError:
            return []
        except Exception as exc:  # a corrupt store is only lost hints, never fatal
            log.warning("ignoring unreadable peer store %s: %s: %s", self.path, type(exc).__name__, exc)
            return []
        out = [p for p in (self._entry(e, now) for e in raw) if p is not None]
        out.sort(key=lambda p: p.last_seen, reverse=True)
        return out

    def _entry(self, e: dict, now: float) -> StoredPeer | None:
        peer_id, last_seen = e.get("peer_id"), e.get("last_seen")
        if not ident.is_peer_id(peer_id) or not isinstance(last_seen, (int, float)) or not math.isfinite(last_seen):
            return None
        short = ident.short_id(peer_id)
        if last_seen < now - MAX_STORE_AGE:
            log.info("peer store: dropping %s: last seen %.1f days ago", short, (now - last_seen) / 86400)
            return None
        addresses = _addresses(e.get("addresses"))
        if e.get("record") is None:
            return StoredPeer(peer_id, addresses, False, min(float(last_seen), now)) if addresses else None
        try:
            rec = record_from_wire(e["record"])
        except (ValueError, TypeError) as exc:
            log.warning("peer store: dropping %s: unreadable record (%s)", short, exc)
            return None
        why = "record of another peer" if rec.peer_id != peer_id else check_record(rec, swarm=self.swarm, now=now)
        if why is not None:
            level = logging.INFO if why.startswith(("issued", "other swarm")) else logging.WARNING
            log.log(level, "peer store: dropping %s: %s", short, why)
            return None
        merged = list(dict.fromkeys(_addresses(rec.addresses) + addresses))[:MAX_STORED_ADDRESSES]
        return StoredPeer(peer_id, merged, True, min(float(last_seen), now))

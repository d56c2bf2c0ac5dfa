"""The persistent peer store (peer/membership/store.py): signed records checked again on load, old files
read, bounded reads, atomic writes; and a restarted daemon finding its swarm again from it alone."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import msgpack
import pytest

from peer.bench.hosts import free_port
from peer.home import Home
from peer.membership.store import (MAX_STORE_AGE, MAX_STORED_PEERS, PeerStore, StoreEntry, entries_from_peers,
                                   record_to_wire)
from protocol import identity as ident
from protocol.schema import PeerRecord, peer_record_signing_bytes
from peer.testing.swarm import swarm_config, unique_swarm
from tests.daemons import QUICK_FAILURE_DETECTION

SWARM = "lab"


def signed(key=None, *, swarm: str = SWARM, addresses=("203.0.113.7:7100",), issued: float | None = None) -> PeerRecord:
    key = key or ident.generate_identity()
    pub = ident.public_key_bytes(key)
    issued = time.time() if issued is None else issued
    rec = PeerRecord(ident.peer_id_from_public_bytes(pub), pub, swarm, list(addresses), issued, issued + 600, b"")
    return replace(rec, signature=ident.sign(key, peer_record_signing_bytes(rec)))


def entry(rec: PeerRecord | None = None, *, peer_id: str | None = None, last_seen: float | None = None,
          addresses=("198.51.100.2:7100",)) -> StoreEntry:
    pid = peer_id or (rec.peer_id if rec else ident.peer_id_of(ident.generate_identity()))
    return StoreEntry(pid, time.time() if last_seen is None else last_seen, rec, list(addresses))


def test_round_trip_keeps_signed_records_first_and_most_recent_first(tmp_path):
    store = PeerStore(tmp_path / "peers.msgpack", swarm=SWARM)
    old, new = signed(), signed(addresses=["203.0.113.8:7100", "203.0.113.8:7100/relay/abcdefghijklmnopqrst"])
    bare = entry(last_seen=time.time() - 60)
    store.save([entry(old, last_seen=time.time() - 30), entry(new), bare])
    got = store.load()
    assert [p.peer_id for p in got] == [new.peer_id, old.peer_id, bare.peer_id]
    assert got[0].verified and got[0].addresses == ["203.0.113.8:7100", "203.0.113.8:7100/relay/abcdefghijklmnopqrst",
                                                    "198.51.100.2:7100"]
    assert not got[2].verified and got[2].addresses == ["198.51.100.2:7100"]
    assert os.stat(store.path).st_mode & 0o777 == 0o600


def test_entries_from_membership_peers_skip_the_never_connected(tmp_path):
    rec = signed()
    peers = [SimpleNamespace(peer_id=rec.peer_id, last_seen=time.time(), record=rec, addresses=[("::1", 7000)]),
             SimpleNamespace(peer_id="x" * 20, last_seen=0.0, record=None, addresses=[("10.0.0.1", 7000)]),
             SimpleNamespace(peer_id="y" * 20, last_seen=time.time(), record=None, addresses=[])]
    assert [(e.peer_id, e.addresses) for e in entries_from_peers(peers)] == [(rec.peer_id, ["[::1]:7000"])]


@pytest.mark.parametrize("case, reason", [
    ("tampered", "bad signature"),
    ("other_swarm", "other swarm 'elsewhere'"),
    ("future", "in the future"),
    ("too_old", "days ago"),
    ("wrong_key", "does not match its public key"),
])
def test_a_record_that_does_not_check_out_is_dropped_with_the_reason(tmp_path, caplog, case, reason):
    now = time.time()
    rec = {"tampered": lambda: replace(signed(), addresses=["192.0.2.66:7100"]),
           "other_swarm": lambda: signed(swarm="elsewhere"),
           "future": lambda: signed(issued=now + 3600),
           "too_old": lambda: signed(issued=now - MAX_STORE_AGE - 60),
           "wrong_key": lambda: replace(signed(), public_key=ident.public_key_bytes(ident.generate_identity())),
           }[case]()
    good = signed()
    store = PeerStore(tmp_path / "peers.msgpack", swarm=SWARM)
    store.save([entry(rec), entry(good)])
    with caplog.at_level(logging.INFO, logger="peertrain.membership"):
        got = store.load()
    assert [p.peer_id for p in got] == [good.peer_id]
    assert any(ident.short_id(rec.peer_id) in r.message and reason in r.message for r in caplog.records), caplog.text


def test_an_entry_not_seen_for_a_week_is_dropped(tmp_path):
    store = PeerStore(tmp_path / "peers.msgpack", swarm=SWARM)
    store.save([entry(last_seen=time.time() - MAX_STORE_AGE - 60), entry(signed())])
    assert len(store.load()) == 1


def test_an_old_v1_file_is_read_unverified(tmp_path):
    path = tmp_path / "peers.msgpack"
    a, b = (ident.peer_id_of(ident.generate_identity()) for _ in range(2))
    path.write_bytes(msgpack.packb([{"peer_id": a, "addresses": ["127.0.0.1:7001", "10.0.0.2:7001"]},
                                    {"peer_id": b, "addresses": ["not an address" * 50]},  # too long: dropped
                                    {"peer_id": 12, "addresses": ["127.0.0.1:7002"]}]))  # not a peer ID
    got = PeerStore(path, swarm=SWARM).load()
    assert [(p.peer_id, p.addresses, p.verified) for p in got] == [(a, ["127.0.0.1:7001", "10.0.0.2:7001"], False)]


def test_reads_are_bounded(tmp_path):
    path = tmp_path / "peers.msgpack"
    many = [{"peer_id": ident.peer_id_of(ident.generate_identity()), "last_seen": time.time(), "record": None,
             "addresses": [f"198.51.100.{i % 250}:{7000 + j}" for j in range(40)]} for i in range(300)]
    path.write_bytes(msgpack.packb({"v": 2, "peers": many}))
    got = PeerStore(path, swarm=SWARM).load()
    assert len(got) == MAX_STORED_PEERS and all(len(p.addresses) == 16 for p in got)


def test_a_huge_garbage_file_is_refused_quickly(tmp_path, caplog):
    path = tmp_path / "peers.msgpack"
    path.write_bytes(os.urandom(2 << 20))
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="peertrain.membership"):
        assert PeerStore(path, swarm=SWARM).load() == []
    assert time.perf_counter() - t0 < 0.1
    assert "ignoring peer store" in caplog.text and "bytes" in caplog.text


@pytest.mark.parametrize("data", [b"\xc1garbage", msgpack.packb({"v": 99, "peers": []}), msgpack.packb("text"),
                                  msgpack.packb({"v": 2, "peers": [{"peer_id": "a" * 20, "last_seen": 1e300,
                                                                    "record": {"peer_id": 5}, "addresses": [1]}]})])
def test_a_corrupt_file_is_a_warning_not_an_error(tmp_path, data):
    path = tmp_path / "peers.msgpack"
    path.write_bytes(data)
    assert PeerStore(path, swarm=SWARM).load() == []


def test_saving_is_atomic_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    store = PeerStore(tmp_path / "peers.msgpack", swarm=SWARM)
    store.save([entry(signed())])
    before = store.path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)  # the rename fails: the old file must stay whole
    with pytest.raises(OSError):
        store.save([entry(signed()) for _ in range(3)])
    monkeypatch.undo()
    assert store.path.read_bytes() == before
    store.save([entry(signed()) for _ in range(3)])
    assert len(store.load()) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peers.msgpack"]


def test_record_wire_form_is_plain_msgpack():
    rec = signed()
    assert msgpack.unpackb(msgpack.packb(record_to_wire(rec)), raw=False)["signature"] == rec.signature


@pytest.mark.slow
def test_a_restarted_daemon_rejoins_from_its_peer_store_alone(cluster, tmp_path):
    """C learned B through A; with A gone, no mDNS and C's only --join pointing at A's dead address, C
    finds B again at the address it stored, once B is back on its port."""
    swarm = unique_swarm()
    base = swarm_config(swarm=swarm, mdns=False, membership=QUICK_FAILURE_DETECTION)  # private_addresses on
    a = cluster.start("a", config=base)
    a_addr = a.wait_ready()["listen"]
    port_b = free_port()
    b = cluster.start("b", "--join", a_addr, config=base.replace(daemon={"listen": f"127.0.0.1:{port_b}"}))
    c = cluster.start("c", "--join", a_addr, config=base)
    b_id = b.wait_ready()["peer_id"]
    c.wait_ready()
    c.wait_until(lambda st: b_id in {p["peer_id"] for p in st["peers"] if p["state"] == "connected"},
                 timeout=30, what="c to reach b through a's peer exchange")
    time.sleep(1.0)  # b's own signed record arrives in its first peer exchange (pex_interval 0.5 s)
    assert cluster.stop() == [0, 0, 0]

    stored = {p.peer_id: p for p in PeerStore(Home(c.home).peer_cache, swarm=swarm).load()}
    assert stored[b_id].verified and f"127.0.0.1:{port_b}" in stored[b_id].addresses

    cluster.restart(b).wait_ready()
    cluster.restart(c).wait_ready()
    t0 = time.monotonic()
    st = c.wait_until(lambda st: any(p["peer_id"] == b_id and p["state"] == "connected" for p in st["peers"]) and st,
                      timeout=20, what="c to reconnect to b from its peer store")
    assert next(p for p in st["peers"] if p["peer_id"] == b_id)["source"] == "cache"
    assert time.monotonic() - t0 < 20

"""Hypothesis over signed records and mDNS TXT properties: mutations of valid records through the message
decoder, and random TXT dicts through the announcement parser. Only the documented errors escape, and the
work per record is bounded (allocation proportional to the message; a TXT parse allocates next to nothing)."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.membership.mdns import SERVICE_TYPE, Announcement, MdnsDiscovery, _Rejected
from protocol.identity import generate_identity, public_key_bytes
from protocol.limits import KiB
from protocol.schema import DEFAULT_REGISTRY, PeerExchange, PeerRecord, TopologyRecord, TopologyRecords
from protocol.schema.topology import LinkReport
from protocol.schema.training import TrainingFigures

from tests.test_fuzz_wire import decode_bounded, peak

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = public_key_bytes(generate_identity())
PEER = PeerRecord(peer_id="p" * 20, public_key=KEY, swarm="s", addresses=["10.0.0.1:7000"], issued=1.0,
                  expires=2.0, signature=b"s" * 64)
FIGURES = TrainingFigures(step=10, loss=0.5, accuracy=0.9, samples_per_s=100.0)
TOPO = TopologyRecord(peer_id="p" * 20, public_key=KEY, version=3, issued=1.0, neighbours=["n" * 20],
                      links=[LinkReport("n" * 20, 1e9, 0.01)], signature=b"s" * 64, training=FIGURES)

addresses = st.lists(st.text(max_size=300) | st.sampled_from(["127.0.0.1:1", "[::1]:7000", "host:99999"]), max_size=20)
peer_changes = st.fixed_dictionaries({}, optional={
    "public_key": st.binary(max_size=40), "signature": st.binary(max_size=80), "addresses": addresses,
    "expires": st.sampled_from([1e300, -1.0, 0.0, 2.0**63]), "issued": st.floats(-1e300, 1e300),
    "peer_id": st.text(max_size=300), "swarm": st.text(max_size=300)})
hostile_numbers = st.none() | st.floats() | st.integers(-2**64, 2**64) | st.booleans() | st.text(max_size=4)
training_changes = st.fixed_dictionaries({}, optional={
    "step": hostile_numbers, "loss": hostile_numbers, "accuracy": hostile_numbers, "samples_per_s": hostile_numbers})
topo_changes = st.fixed_dictionaries({}, optional={
    "public_key": st.binary(max_size=40), "signature": st.binary(max_size=80), "version": st.integers(-1, 2**63),
    "neighbours": st.lists(st.text(max_size=70), max_size=70), "peer_id": st.text(max_size=70),
    "issued": st.sampled_from([1e300, -1.0, 2.0**63]), "training": st.none() | st.builds(
        lambda c: bypassing_checks(FIGURES, c), training_changes)})


def bypassing_checks(record, changes: dict):
    """The record with `changes`, built without its own __post_init__ (a hostile peer's encoder has none)."""
    out = object.__new__(type(record))
    for name in record.__dataclass_fields__:
        object.__setattr__(out, name, changes.get(name, getattr(record, name)))
    return out


def wire(msg) -> bytes | None:
    struct = DEFAULT_REGISTRY._structs[type(msg)]
    try:
        return msgpack.packb({"t": msg.TYPE, "v": 1, "r": 0, "q": 0, "b": struct.to_wire(msg)}, use_bin_type=True)
    except Exception:
        return None  # not encodable at all (e.g. a lone surrogate): no peer can send it


@FUZZ
@given(changes=st.lists(peer_changes, min_size=1, max_size=3))
def test_mutated_peer_records_through_pex(changes) -> None:
    data = wire(bypassing_checks(PeerExchange(peers=[PEER]), {"peers": [bypassing_checks(PEER, c) for c in changes]}))
    if data is not None:
        decode_bounded(data)


@FUZZ
@given(changes=st.lists(topo_changes, min_size=1, max_size=3))
def test_mutated_topology_records(changes) -> None:
    data = wire(bypassing_checks(TopologyRecords(records=[TOPO]),
                                 {"records": [bypassing_checks(TOPO, c) for c in changes]}))
    if data is not None:
        decode_bounded(data)


# --- mDNS TXT ------------------------------------------------------------------------------------------


@dataclass
class FakeInfo:
    """What `_announcement_from` reads of a resolved zeroconf ServiceInfo."""

    properties: dict
    port: int | None
    addresses: list[str]

    def parsed_addresses(self) -> list[str]:
        return self.addresses


DISC = MdnsDiscovery(peer_id="me", swarm="s", port=7001, protocol_version=1, interfaces=["127.0.0.1"])
GOOD = {b"id": b"other", b"swarm": b"s", b"pv": b"1", b"port": b"7002"}
txt_values = st.none() | st.binary(max_size=300) | st.sampled_from([b"", b"1", b"7002", b"s", b"other", "str",
                                                                    b"\xff\xfe", b"99999999999", b"\xd9\xa3"])
txt_dicts = st.dictionaries(st.sampled_from(list(GOOD)) | st.binary(max_size=10), txt_values, max_size=8)


@FUZZ
@given(props=txt_dicts, merge=st.booleans(), port=st.none() | st.integers(-1, 70000),
       addresses=st.lists(st.sampled_from(["127.0.0.1", "0.0.0.0", "224.0.0.251", "fe80::1", "::1"]), max_size=4))
def test_txt_properties_parse_into_an_announcement_or_a_rejection(props, merge, port, addresses) -> None:
    props = {**GOOD, **props} if merge else props
    with peak() as used:
        try:
            ann = DISC._announcement_from(f"other.{SERVICE_TYPE}", FakeInfo(props, port, addresses))
        except _Rejected:
            ann = None
    assert used[0] < 16 * KiB
    if ann is not None:
        assert isinstance(ann, Announcement) and ann.swarm == "s" and ann.protocol_version == 1
        assert ann.addresses and all(0 < p < 65536 for _, p in ann.addresses)

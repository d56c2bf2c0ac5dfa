"""Decode-time checks of topology and peer records (issue 15): whatever a peer sends either decodes into a
record the view can hold without raising, or is refused with a ProtocolError that names the field."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.topology.graph import GraphView, LinkEstimate
from peer.topology.records import signed_record
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.schema import DEFAULT_REGISTRY, PeerExchange, TopologyRecords
from protocol.schema.session import MAX_RECORD_ADDRESSES
from protocol.identity import generate_identity, peer_id_from_public_bytes, public_key_bytes, verify
from protocol.schema.pipeline import MAX_SAMPLES_PER_S, MAX_STEP
from protocol.schema.topology import (
    MAX_BANDWIDTH_BPS, MAX_GROUP_CHARS, MAX_RECORD_GROUPS, MAX_RECORD_LINKS, MAX_RECORD_NEIGHBOURS, MAX_RTT_S,
    LinkReport, TopologyRecord, topology_record_signing_bytes)
from protocol.schema.training import MAX_FIGURE_LOSS, TrainingFigures

numbers = st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10, 10**14)
ids = st.text(min_size=0, max_size=80)


def wire(t: str, body: dict) -> bytes:
    return msgpack.packb({"t": t, "v": 1, "r": 0, "q": 0, "b": body}, use_bin_type=True)


def record_body(*, neighbours=(), links=(), public_key=b"k" * 32, signature=b"s" * 64, peer_id="p" * 20) -> dict:
    return {"peer_id": peer_id, "public_key": public_key, "version": 1, "issued": 1.0, "neighbours": list(neighbours),
            "links": [{"peer": p, "bandwidth_bps": b, "rtt_s": r} for p, b, r in links], "signature": signature}


@settings(max_examples=300)
@given(links=st.lists(st.tuples(ids, numbers, numbers), max_size=4), neighbours=st.lists(ids, max_size=4),
       public_key=st.binary(max_size=40), signature=st.binary(max_size=80), peer_id=ids)
def test_a_decoded_topology_record_is_always_one_the_view_can_hold(links, neighbours, public_key, signature, peer_id):
    data = wire("topo_records", {"records": [record_body(neighbours=neighbours, links=links, public_key=public_key,
                                                          signature=signature, peer_id=peer_id)]})
    try:
        env = DEFAULT_REGISTRY.decode(data, DEFAULT_LIMITS)
    except ProtocolError:
        return
    [rec] = env.message.records
    assert len(rec.public_key) == 32 and len(rec.signature) <= 64 and 0 < len(rec.peer_id) <= 64
    nodes = {rec.peer_id} | {lr.peer for lr in rec.links}
    reports = {rec.peer_id: {lr.peer: LinkEstimate(lr.bandwidth_bps, lr.rtt_s) for lr in rec.links if lr.peer != rec.peer_id}}
    for lr in rec.links:  # finite, in range: the view's own checks never fire on a decoded record
        assert lr.bandwidth_bps is None or 0 < lr.bandwidth_bps <= MAX_BANDWIDTH_BPS
        assert lr.rtt_s is None or 0 <= lr.rtt_s <= MAX_RTT_S
    GraphView.from_reports(nodes, set(), reports)


@pytest.mark.parametrize("links, neighbours, field", [
    ([["a" * 20, 0.0, 0.1]], [], "bandwidth_bps"),
    ([["a" * 20, -5.0, 0.1]], [], "bandwidth_bps"),
    ([["a" * 20, 1e300, 0.1]], [], "bandwidth_bps"),
    ([["a" * 20, 1e6, -0.1]], [], "rtt_s"),
    ([["a" * 20, 1e6, 1e9]], [], "rtt_s"),
    ([["a" * 20, float("nan"), 0.1]], [], "NaN"),
    ([["", 1e6, 0.1]], [], "link peer"),
    ([], ["n" * 20] * (MAX_RECORD_NEIGHBOURS + 1), "neighbours"),
    ([["a" * 20, 1e6, 0.1]] * (MAX_RECORD_LINKS + 1), [], "link reports"),
    ([], ["x" * 65], "neighbour"),
])
def test_out_of_range_topology_records_are_refused_with_the_field_named(links, neighbours, field):
    with pytest.raises(ProtocolError, match=field):
        DEFAULT_REGISTRY.decode(wire("topo_records", {"records": [record_body(neighbours=neighbours, links=links)]}),
                                DEFAULT_LIMITS)


def test_a_largest_record_is_small_enough_to_batch():
    """The schema's count bounds cap a record's wire size, so a broadcast can always be split."""
    rec = TopologyRecord(peer_id="p" * 20, public_key=b"k" * 32, version=2**63, issued=1e9,
                         neighbours=["n" * 64] * MAX_RECORD_NEIGHBOURS,
                         links=[LinkReport("l" * 64, MAX_BANDWIDTH_BPS, MAX_RTT_S)] * MAX_RECORD_LINKS,
                         signature=b"s" * 64)
    size = len(DEFAULT_REGISTRY.encode(TopologyRecords(records=[rec])))
    assert size < 24 * 1024 < DEFAULT_LIMITS.max_message_bytes


def peer_record_body(addresses) -> dict:
    return {"peer_id": "p" * 20, "public_key": b"k" * 32, "swarm": "s", "addresses": addresses,
            "issued": 1.0, "expires": 2.0, "signature": b"s" * 64}


@given(addresses=st.lists(st.text(max_size=300), max_size=2 * MAX_RECORD_ADDRESSES))
def test_peer_records_bound_their_addresses(addresses):
    data = wire("pex", {"peers": [peer_record_body(addresses)]})
    try:
        env = DEFAULT_REGISTRY.decode(data, DEFAULT_LIMITS)
    except ProtocolError:
        assert len(addresses) > MAX_RECORD_ADDRESSES or any(len(a) > 262 for a in addresses)
        return
    assert isinstance(env.message, PeerExchange)
    assert len(env.message.peers[0].addresses) <= MAX_RECORD_ADDRESSES


def test_a_peer_record_with_90000_addresses_is_refused_at_decode():
    addresses = [f"{i}:1" for i in range(90_000)]  # short enough to fit one 1 MiB message
    with pytest.raises(ProtocolError, match="90000 addresses"):
        DEFAULT_REGISTRY.decode(wire("pex", {"peers": [peer_record_body(addresses)]}), DEFAULT_LIMITS)


# --- the owner's training figures (issue 31) ---------------------------------------------------------


def figures_body(**training) -> dict:
    return dict(record_body(), training={"step": 10, "loss": 0.5, "accuracy": 0.9, "samples_per_s": 100.0, **training})


@pytest.mark.parametrize("change, field", [
    ({"loss": float("nan")}, "NaN"),  # the decoder refuses non-finite floats before the schema's checks
    ({"loss": float("inf")}, "loss|inf"),
    ({"loss": -0.1}, "training loss"),
    ({"loss": 1e7}, "training loss"),
    ({"accuracy": 1.5}, "training accuracy"),
    ({"accuracy": -0.5}, "training accuracy"),
    ({"samples_per_s": -1.0}, "training samples_per_s"),
    ({"samples_per_s": 1e12}, "training samples_per_s"),
    ({"step": -1}, "training step"),
    ({"step": 2**60}, "training step"),
    ({"step": True}, "step"),
    ({"step": 1.5}, "step"),
])
def test_out_of_range_training_figures_are_refused_with_a_reason(change, field):
    with pytest.raises(ProtocolError, match=field):
        DEFAULT_REGISTRY.decode(wire("topo_records", {"records": [figures_body(**change)]}), DEFAULT_LIMITS)


@pytest.mark.parametrize("change", [{}, {"loss": None, "samples_per_s": None}, {"accuracy": None}, {"step": 0},
                                    {"loss": 0.0, "accuracy": 1.0}, {"step": MAX_STEP, "loss": MAX_FIGURE_LOSS}])
def test_in_range_training_figures_decode(change):
    [rec] = DEFAULT_REGISTRY.decode(wire("topo_records", {"records": [figures_body(**change)]}),
                                    DEFAULT_LIMITS).message.records
    assert isinstance(rec.training, TrainingFigures) and rec.training.step == change.get("step", 10)


def test_a_record_without_training_figures_is_still_valid_and_signs_as_before():
    [rec] = DEFAULT_REGISTRY.decode(wire("topo_records", {"records": [record_body()]}), DEFAULT_LIMITS).message.records
    assert rec.training is None
    with_none = dataclasses.replace(rec, training=None)
    assert topology_record_signing_bytes(with_none) == topology_record_signing_bytes(rec)


def test_the_signature_covers_the_training_figures():
    me = generate_identity()
    pid = peer_id_from_public_bytes(public_key_bytes(me))
    rec = signed_record(me, pid, version=1, neighbours=[], links={}, stage=None, groups=[],
                        training=TrainingFigures(step=7, loss=0.25, accuracy=0.5, samples_per_s=10.0))
    assert verify(rec.public_key, rec.signature, topology_record_signing_bytes(rec))
    for forged in (TrainingFigures(step=8, loss=0.25, accuracy=0.5, samples_per_s=10.0),
                   TrainingFigures(step=7, loss=0.01, accuracy=0.5, samples_per_s=10.0),
                   TrainingFigures(step=7, loss=0.25, accuracy=0.99, samples_per_s=10.0),
                   TrainingFigures(step=7, loss=0.25, accuracy=0.5, samples_per_s=None), None):
        assert not verify(rec.public_key, rec.signature,
                          topology_record_signing_bytes(dataclasses.replace(rec, training=forged))), forged
    # and it survives the wire: the decoded record still verifies
    [back] = DEFAULT_REGISTRY.decode(DEFAULT_REGISTRY.encode(TopologyRecords(records=[rec])), DEFAULT_LIMITS).message.records
    assert back.training == rec.training and verify(back.public_key, back.signature, topology_record_signing_bytes(back))


@pytest.mark.parametrize("metrics, expected", [
    ({"step": 3, "loss": 0.5, "accuracy": 0.75, "samples_per_s": 12.0}, TrainingFigures(3, 0.5, 0.75, 12.0)),
    ({"step": 3, "loss": float("nan"), "accuracy": 0.75}, TrainingFigures(3, None, 0.75, None)),
    ({"step": 3, "loss": 2e6, "accuracy": 1.2}, None),  # nothing in range left to draw
    ({"step": 3, "loss": -1.0, "accuracy": 0.5, "samples_per_s": float("inf")}, TrainingFigures(3, None, 0.5, None)),
    ({"loss": 0.5}, None),  # no step
    ({"step": -2, "loss": 0.5}, None),
    ({"step": "7", "loss": 0.5}, None),
    ({"step": 1, "loss": "0.5"}, None),
    ({"state": "starting"}, None),
    ({"step": np.int64(4), "loss": np.float32(0.5), "accuracy": True}, TrainingFigures(4, 0.5, None, None)),  # numpy
])
def test_an_owner_signs_only_figures_in_range(metrics, expected):
    """A trainer may publish anything: what goes into our record always passes the receivers' checks."""
    assert TrainingFigures.from_metrics(metrics) == expected


def test_a_largest_record_with_training_figures_is_small_enough_to_batch():
    rec = TopologyRecord(peer_id="p" * 20, public_key=b"k" * 32, version=2**63, issued=1e9,
                         neighbours=["n" * 64] * MAX_RECORD_NEIGHBOURS,
                         links=[LinkReport("l" * 64, MAX_BANDWIDTH_BPS, MAX_RTT_S)] * MAX_RECORD_LINKS,
                         signature=b"s" * 64, groups=["g" * MAX_GROUP_CHARS] * MAX_RECORD_GROUPS,
                         training=TrainingFigures(MAX_STEP, MAX_FIGURE_LOSS, 1.0, MAX_SAMPLES_PER_S))
    size = len(DEFAULT_REGISTRY.encode(TopologyRecords(records=[rec])))
    assert size < 24 * 1024 < DEFAULT_LIMITS.max_message_bytes

"""The averaging messages' own rules: a rejected offer carries a refusal code, bounded, and readable from
peers that send none."""

from __future__ import annotations

import msgpack
import pytest

from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.refusal import MAX_REASON_CHARS, Code, Refusal
from protocol.schema import DEFAULT_REGISTRY
from protocol.refusal import MAX_CODE_CHARS
from protocol.schema.gossip import AverageReject


def wire(body: dict, v: int = 1) -> bytes:
    return msgpack.packb({"t": "avg_reject", "v": v, "r": 0, "q": 7, "b": body}, use_bin_type=True)


def test_a_reject_carries_a_refusal_both_ways():
    refusal = Refusal(Code.BANNED, "banned for 60s more: let an exchange we had accepted lapse")
    env = DEFAULT_REGISTRY.decode(DEFAULT_REGISTRY.encode(AverageReject.of(refusal), reply_to=7), DEFAULT_LIMITS)
    assert env.message.refusal() == refusal and env.message.code == "banned"


def test_a_reject_from_a_peer_that_sends_no_code_reads_as_unknown_and_a_newer_code_too():
    old = DEFAULT_REGISTRY.decode(wire({"reason": "busy"}), DEFAULT_LIMITS).message
    assert old.refusal() == Refusal(Code.UNKNOWN, "busy")
    newer = DEFAULT_REGISTRY.decode(wire({"reason": "x", "code": "overheated"}), DEFAULT_LIMITS).message
    assert newer.refusal().code is Code.UNKNOWN and newer.code == "overheated"


@pytest.mark.parametrize("body, expected", [
    ({"reason": "x", "code": "c" * (MAX_CODE_CHARS + 1)}, "refusal code of at most"),
    ({"reason": "r" * (MAX_REASON_CHARS + 1), "code": "busy"}, "reason of at most"),
])
def test_a_reject_with_an_overlong_code_or_reason_is_refused_at_decode(body, expected):
    with pytest.raises(ProtocolError, match=expected):
        DEFAULT_REGISTRY.decode(wire(body), DEFAULT_LIMITS)

"""The wire's limits (protocol/limits.py) refuse values that would make them meaningless: every bound a
positive int, and the bounds consistent with each other (a message fits in a frame, a tensor in the
in-flight budget)."""

from __future__ import annotations

import pytest

from protocol.limits import WireLimits


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_wire_limits_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="max_str_len"):
        WireLimits(max_str_len=bad)


def test_wire_limits_must_be_consistent():
    with pytest.raises(ValueError, match="fit in one frame"):
        WireLimits(max_message_bytes=2 << 20, max_frame_bytes=1 << 20)
    with pytest.raises(ValueError, match="in-flight"):
        WireLimits(max_tensor_bytes=2 << 30, max_inflight_tensor_bytes=1 << 30)
    assert WireLimits().max_frame_bytes == 4 * 1024 * 1024 + 64

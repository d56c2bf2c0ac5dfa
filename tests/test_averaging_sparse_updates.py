"""Every update to everyone (peer/averaging/sparse_updates.py): a round's sparse send is what the wire decodes,
error feedback loses nothing, and peers holding the same sends step to the same bits whatever their order."""

from __future__ import annotations

import math

import numpy as np
import pytest

from peer.averaging.edge_copies import SPARSE_BLOCK, SPARSE_TOPK, sparse_roundtrip
from peer.averaging.sparse_updates import UpdateFeedback, outer_step


def updates(rounds: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) * (1 + r) for r in range(rounds)]


def test_a_send_is_what_the_wire_decodes_and_keeps_topk_of_each_chunk():
    size = 3 * SPARSE_BLOCK + 100  # a short last chunk too
    (u,) = updates(1, size)
    q = UpdateFeedback(size).send(u)
    assert np.array_equal(q, sparse_roundtrip(u))  # the first round's error is the update itself
    chunks = [q[i:i + SPARSE_BLOCK] for i in range(0, size, SPARSE_BLOCK)]
    assert all(np.count_nonzero(c) <= SPARSE_TOPK for c in chunks)
    assert np.count_nonzero(q) >= 3 * SPARSE_TOPK  # every full chunk sends its share


def test_without_decay_what_was_sent_plus_what_is_kept_is_every_update():
    size = 2 * SPARSE_BLOCK
    fb = UpdateFeedback(size, decay=1.0)
    us = updates(20, size)
    sent = sum(fb.send(u).astype(np.float64) for u in us)
    total = sum(u.astype(np.float64) for u in us)
    assert np.allclose(sent + fb.error, total, rtol=0, atol=1e-3)
    # and the error feedback sends what earlier rounds left out: far more distinct entries than one round's
    assert np.count_nonzero(sent) > 4 * 2 * SPARSE_TOPK


def test_decay_forgets_a_share_of_what_was_left_out():
    size = SPARSE_BLOCK
    u = updates(1, size)[0]
    fb = UpdateFeedback(size, decay=0.5)
    q1 = fb.send(u)
    left = u - q1
    fb.send(np.zeros(size, dtype=np.float32))
    # the second round's error starts from half of what the first left out, less what it then sent
    q2 = sparse_roundtrip(0.5 * left)
    assert np.allclose(fb.error, 0.5 * left - q2, atol=1e-6)


def test_peers_holding_the_same_sends_step_to_the_same_bits_in_any_order():
    size = SPARSE_BLOCK
    ref = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    sends = {f"peer{k}": UpdateFeedback(size).send(u) for k, u in enumerate(updates(4, size, seed=2))}
    a = outer_step(ref, sends, outer_lr=3.0)
    b = outer_step(ref, dict(reversed(list(sends.items()))), outer_lr=3.0)
    assert a.tobytes() == b.tobytes()
    expected = ref.astype(np.float64) + 3.0 * np.mean([s.astype(np.float64) for s in sends.values()], axis=0)
    assert np.allclose(a, expected, atol=1e-5)


@pytest.mark.parametrize("kw, what", [
    (dict(size=0), "size"), (dict(size=10, decay=0.0), "decay"), (dict(size=10, decay=math.nan), "decay"),
    (dict(size=10, decay=1.5), "decay"), (dict(size=10, topk=0), "topk"), (dict(size=10, topk=SPARSE_BLOCK + 1), "topk"),
])
def test_bad_settings_are_refused_by_name(kw, what):
    with pytest.raises(ValueError, match=what):
        UpdateFeedback(**kw)


def test_bad_updates_and_steps_are_refused_and_change_nothing():
    fb = UpdateFeedback(8)
    with pytest.raises(ValueError, match="8"):
        fb.send(np.zeros(9, dtype=np.float32))
    with pytest.raises(ValueError, match="NaN or infinite"):
        fb.send(np.array([0, 1, 2, np.nan, 4, 5, 6, np.inf], dtype=np.float32))
    assert not fb.error.any()  # a refused update left the accumulator as it was
    ref = np.zeros(8, dtype=np.float32)
    for lr in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="outer_lr"):
            outer_step(ref, {"a": ref}, outer_lr=lr)
    with pytest.raises(ValueError, match="no sends"):
        outer_step(ref, {})
    with pytest.raises(ValueError, match="send from b"):
        outer_step(ref, {"a": ref, "b": np.zeros(7, dtype=np.float32)})

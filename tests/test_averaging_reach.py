"""Our own reach (peer/averaging/reach.py): what our steps moved us, the exchanges' updates taken out, on a
random probe of the coordinates; wired into SharedTensors' snapshots and updates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from peer.averaging.reach import PROBE_ELEMENTS, REACH_WINDOW_S, OwnReach
from peer.averaging.shared import SharedTensors

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_our_steps_are_measured_and_the_updates_are_taken_out():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_000).astype(np.float32)
    group = SharedTensors("g", {"w": x})
    group.reach._clock = clock = Clock()
    group.release(group.snapshot())
    assert group.reach.reach() is None  # one snapshot: no move yet
    steps = []
    for k in range(5):
        clock.t = float(k)
        step = 0.01 * rng.standard_normal(x.size).astype(np.float32)
        x += step  # our optimizer step
        steps.append(float(np.dot(step, step)))
        own = group.snapshot()
        other = own[0] + rng.standard_normal(x.size).astype(np.float32)  # a partner far away: a big update
        group.apply(1 / 3, [other], own, radii=(1e30, 1e30))
        group.release(own)
    group.release(group.snapshot())
    got, want = group.reach.reach(), math.sqrt(sum(steps))
    assert abs(got - want) / want < 0.1, (got, want)  # the updates (20x the steps) left out; probe's error only


def test_the_window_forgets_old_moves_and_a_load_is_no_move():
    clock = Clock()
    reach = OwnReach([100], clock=clock)
    reach.snapshot([np.zeros(100)])
    reach.snapshot([np.full(100, 1.0)])
    assert reach.reach() == pytest.approx(10.0)  # all 100 coordinates probed: exact
    clock.t = REACH_WINDOW_S
    assert reach.reach() is None
    reach.restart()
    reach.snapshot([np.full(100, 50.0)])
    assert reach.reach() is None  # the jump of a load is not ours


def test_the_probe_is_bounded_and_spans_every_tensor():
    reach = OwnReach([50_000, 3, 70_000], rng=np.random.default_rng(1))
    values = [np.arange(50_000.0), np.arange(3.0), np.arange(70_000.0)]
    assert reach.probe(values).shape == (PROBE_ELEMENTS,)
    torch = pytest.importorskip("torch")
    assert np.array_equal(reach.probe([torch.from_numpy(v) for v in values]), reach.probe(values))

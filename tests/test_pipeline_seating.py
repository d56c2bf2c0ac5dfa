"""The daemon's seating (peer/pipeline/seating.py): it reads the records and the job's figures, and orders the
job's moves: the start-up spread (without the start-up race), takeovers in order, rebalancing after a measured
window, the cool-down of a stage left, and orders that go stale. A fake clock and fake records: no daemon."""

from __future__ import annotations

import dataclasses
import math

import pytest
import trio

from peer.pipeline.seating import (CLAIM_SETTLE_S, MIN_STAY_EVALS, ORDER_TTL_S, TAKEOVER_GRACE_S, TAKEOVER_SETTLE_S,
                                   Seating)
from peertrain.pipeline import PipelineKey, SeatFigures, StateSource
from tests.test_pipeline_rebalance import smap_of

KEY = PipelineKey("p", (2, 4))


class Records:
    def __init__(self, me: str, smap):
        self.me, self.smap = me, smap
        self.sources: dict[int, list[StateSource]] = {}
        self.copies: dict[int, int] = {}
        self.announced = 0

    def stage_map(self, key):
        assert key == KEY
        return {s: [dataclasses.replace(p, me=p.peer_id == self.me) for p in peers] for s, peers in self.smap.items()}

    def state_sources(self, key, stage):
        return self.sources.get(stage, [])

    def own_copy_step(self, key, stage):
        return self.copies.get(stage)

    def announce_soon(self):
        self.announced += 1


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def figures(**kw) -> SeatFigures:
    base = dict(key=KEY, stage_seconds=(1.0, 1.0, 1.0), stage_bytes=(0, 0, 0), room_bytes=0, settling=False,
                rebalance_every=10.0, min_gain=0.05)
    return SeatFigures(**{**base, **kw})


def seating(me: str, smap, **kw):
    clock, records = Clock(), Records(me, smap)
    s = Seating(records, me, confirm_s=kw.pop("confirm_s", 1.0), clock=clock)
    s.set_figures(figures(**kw))
    return s, clock, records


def take(s: Seating):
    return trio.run(s.next_order, 0.01)


def test_a_settling_peer_moves_to_an_empty_stage_only_once_it_stayed_empty_a_record_interval():
    # d is the largest ID of crowded stage 0; stage 2 is empty: perhaps its peer is about to announce it
    smap = smap_of(3, ("a", 0, 0.0), ("d", 0, 0.0), ("b", 1, 0.0))
    s, clock, records = seating("d", smap, settling=True, confirm_s=2.0)
    s.tick()
    assert s.order is None  # just seen empty: not yet
    clock.t += 1.0
    records.smap = smap_of(3, ("a", 0, 0.0), ("d", 0, 0.0), ("b", 1, 0.0), ("c", 2, 0.0))  # its peer announced
    s.tick()
    clock.t += 5.0
    s.tick()
    assert s.order is None  # the race: before, d left stage 0 for a stage about to be served
    records.smap = smap  # c gone: stage 2 empty again, and it stays so
    s.tick()
    clock.t += 2.0
    s.tick()
    order = take(s)
    assert order is not None and order.to_stage == 2 and order.starting and "no peer" in order.reason


def test_a_settling_peer_that_is_not_the_largest_id_or_is_pinned_stays():
    smap = smap_of(3, ("a", 0, 0.0), ("d", 0, 0.0), ("b", 1, 0.0))
    for me, kw in (("a", {}), ("d", {"pinned": True})):
        s, clock, _ = seating(me, smap, settling=True, **kw)
        for _ in range(5):
            s.tick()
            clock.t += 1.0
        assert s.order is None, me


def test_takeover_goes_in_order_with_a_grace_period_per_rank():
    # stage 2 empty; e holds the freshest copy of it, so e goes first, b a grace period later
    smap = smap_of(3, ("b", 0, 30.0), ("c", 0, 20.0), ("d", 1, 20.0), ("e", 1, 20.0))
    first, _, recs = seating("e", smap)
    recs.copies[2] = 50
    first.tick()
    order = take(first)
    assert order is not None and (order.to_stage, order.settle_s) == (2, TAKEOVER_SETTLE_S)
    assert "freshest copy" in order.reason and not order.starting
    second, clock, recs = seating("b", smap)
    recs.sources[2] = [StateSource("e", 50, False)]  # e's copy, as the records say it
    second.tick()
    assert second.order is None
    clock.t += TAKEOVER_GRACE_S
    second.tick()
    order = take(second)
    assert order is not None and order.to_stage == 2 and "waited 6s for 1 better-placed peers" in order.reason


def test_no_takeover_or_rebalancing_when_the_job_turned_rebalancing_off():
    s, clock, _ = seating("e", smap_of(3, ("d", 1, 20.0), ("e", 1, 20.0), ("b", 0, 1.0)), rebalance_every=0.0)
    for _ in range(50):
        s.tick()
        clock.t += 1.0
    assert s.order is None


def test_rebalancing_waits_for_a_measured_window_then_orders_the_planned_move_and_a_stay():
    # stage 2 is the bottleneck (5/s); stage 1 has two fast peers: the smaller ID the plan names moves
    smap = smap_of(3, ("a", 0, 20.0), ("c", 1, 20.0), ("d", 1, 20.0), ("e", 2, 5.0))
    s, clock, records = seating("c", smap, rebalance_every=10.0)
    orders = []
    for _ in range(60):  # 30 s of ticks
        s.tick()
        if s.order is not None:
            orders.append((clock.t - 1000.0, take(s)))
            break
        clock.t += 0.5
    assert orders, "no move planned"
    at, order = orders[0]
    assert at >= 10.0  # rates measured first (the plan is drawn 1-2 intervals after the figures)
    assert (order.to_stage, order.settle_s) == (2, CLAIM_SETTLE_S) and "bottleneck" in order.reason
    s.moved(1, 2)  # the job made it
    assert s.cooling_from == 1 and records.announced == 1
    records.smap = smap_of(3, ("a", 0, 20.0), ("d", 1, 20.0), ("c", 2, 0.0, -1, 1), ("e", 2, 5.0))
    trio.run(s.next_order, 0.0)  # the job asks again: the move is over
    for _ in range(int(MIN_STAY_EVALS * 10.0 / 0.5) - 2):
        s.tick()
        assert s.order is None
        clock.t += 0.5
    assert s.cooling_from == -1 and records.announced == 2  # the cool-down (one interval) ended, announced


def test_an_order_the_job_does_not_take_goes_stale_and_nothing_is_decided_while_the_job_moves():
    smap = smap_of(3, ("b", 0, 30.0), ("c", 0, 20.0), ("d", 1, 20.0))
    s, clock, _ = seating("b", smap)
    s.tick()
    assert s.order is not None
    clock.t += ORDER_TTL_S + 0.1
    assert take(s) is None  # stale: dropped, decided afresh on the next tick
    s.tick()
    order = take(s)
    assert order is not None and s.busy
    s.tick()
    assert s.order is None  # the job is busy with the last one


def test_first_order_spreads_starting_peers_by_rank_and_sends_a_joiner_where_it_is_needed():
    s, _, records = seating("x", smap_of(3))
    order = s.first_order(figures(settling=True), 1)
    assert (order.to_stage, order.starting) == (1, True)
    records.smap = smap_of(3, ("a", 0, 9.0), ("b", 1, 9.0), ("c", 2, 2.0))
    records.smap = {k: [dataclasses.replace(p, step=5) for p in v] for k, v in records.smap.items()}
    order = s.first_order(figures(settling=True), 0)  # rank 0, but the pipeline trains: its bottleneck
    assert (order.to_stage, order.starting) == (2, False)
    with pytest.raises(ValueError, match="holds no stage"):
        s.first_order(figures(stage_bytes=(10, 10, 10), room_bytes=5), 0)


def test_may_switch_asks_the_records():
    s, _, records = seating("d", smap_of(3, ("a", 0, 1.0), ("d", 0, 1.0)))
    assert s.may_switch(0) is None
    records.smap = smap_of(3, ("d", 0, 1.0))
    assert "no peer left" in s.may_switch(0)


def test_a_peer_too_small_for_the_empty_stage_is_never_ordered_there():
    smap = smap_of(3, ("b", 0, 30.0), ("c", 0, 20.0), ("d", 1, 20.0))
    s, clock, _ = seating("b", smap, stage_bytes=(1, 1, 100), room_bytes=50)
    for _ in range(40):
        s.tick()
        clock.t += 1.0
    assert s.order is None


@pytest.mark.parametrize("bad", [dict(stage_seconds=(1.0, math.nan, 1.0)), dict(stage_seconds=(1.0, 0.0, 1.0)),
                                 dict(stage_seconds=(1.0, 1.0)), dict(stage_bytes=(0, -1, 0)),
                                 dict(room_bytes=-1), dict(rebalance_every=math.nan), dict(min_gain=-0.1)])
def test_seat_figures_refuse_what_no_stage_has(bad):
    with pytest.raises(ValueError, match="SeatFigures"):
        figures(**bad)


def test_status_says_the_order_out_and_the_cool_down():
    s, _, _ = seating("b", smap_of(3, ("b", 0, 30.0), ("c", 0, 20.0), ("d", 1, 20.0)))
    s.tick()
    st = s.status()
    assert st["order"]["to_stage"] == 2 and st["cooling_from"] is None and not st["settling"]
    take(s)
    s.moved(0, 2)
    assert s.status()["moving"] and s.status()["cooling_from"] == 0

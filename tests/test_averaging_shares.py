"""A partner's share of how far it moved us (peer/averaging/shares.py): the bound over time that the
dissensus liar, inside the radius but exchanging with its victim at every turn, runs into."""

from __future__ import annotations

import math

from peer.averaging.shares import SHARE_MARGIN, SHARE_WINDOW_S, MoveShares


def test_a_partner_moving_us_past_twice_the_others_median_is_held_until_its_window_drains() -> None:
    s = MoveShares()
    for t in range(10):
        s.record("model", "h1", 1.0, float(t))
        s.record("model", "h2", 1.5, float(t))
        s.record("model", "liar", 1.5 * SHARE_MARGIN, float(t))  # at the margin of the upper median (h2's)
    assert s.over("model", "liar", 10.0) is None and s.over("model", "h1", 10.0) is None
    for t in range(10):
        s.record("model", "liar", 1.0, 10.0 + t)  # now past it
    why = s.over("model", "liar", 20.0)
    assert why is not None and "'model'" in why and f"{SHARE_MARGIN:g}x" in why
    assert s.over("model", "h1", 20.0) is None and s.over("model", "h2", 20.0) is None  # the honest stay free
    assert s.over("model", "liar", 20.0 + SHARE_WINDOW_S) is None  # its window drained (and so did theirs)


def test_no_bound_without_another_partner_to_compare_and_groups_apart() -> None:
    s = MoveShares()
    s.record("model", "only", 100.0, 0.0)
    assert s.over("model", "only", 1.0) is None  # a pair: nothing to judge by
    s.record("other", "h", 1.0, 0.0)
    assert s.over("model", "only", 1.0) is None  # another group's partners are not ours here
    s.record("model", "h", 1.0, 0.0)
    assert s.over("model", "only", 1.0) is not None
    s.forget("model")
    assert s.share("model", "only", 1.0) == 0.0


def test_colluders_fewer_than_half_do_not_lift_each_others_share() -> None:
    s = MoveShares()
    for p, moved in (("h1", 1.0), ("h2", 1.0), ("h3", 1.0), ("x1", 10.0), ("x2", 10.0)):
        s.record("model", p, moved, 0.0)
    assert s.over("model", "x1", 1.0) is not None and s.over("model", "x2", 1.0) is not None  # median of the others: 1


def test_bad_moves_are_not_counted() -> None:
    s = MoveShares()
    for moved in (math.nan, math.inf, -1.0, 0.0):
        s.record("model", "p", moved, 0.0)
    assert s.share("model", "p", 0.0) == 0.0
    assert SHARE_MARGIN >= 1.0

"""A partner's share of how far it moved us (peer/averaging/shares.py): the bound over time that the
dissensus liar, inside the radius but exchanging with its victim at every turn, runs into."""

from __future__ import annotations

import math

from peer.averaging.shares import SHARE_BUCKET_S, SHARE_FLOOR_MOVES, SHARE_MARGIN, SHARE_WINDOW_S, MoveShares


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
    for t in range(4):
        s.record("model", "only", 100.0, t * SHARE_BUCKET_S)
    assert s.over("model", "only", 10.0) is None  # a pair: nothing to judge by
    s.record("other", "h", 1.0, 0.0)
    assert s.over("model", "only", 10.0) is None  # another group's partners are not ours here
    s.record("model", "h", 1.0, 0.0)
    assert s.over("model", "only", 10.0) is not None
    s.forget("model")
    assert s.share("model", "only", 1.0) == 0.0


def test_colluders_fewer_than_half_do_not_lift_each_others_share() -> None:
    s = MoveShares()
    for t in range(4):
        for p, moved in (("h1", 1.0), ("h2", 1.0), ("h3", 1.0), ("x1", 10.0), ("x2", 10.0)):
            s.record("model", p, moved, t * SHARE_BUCKET_S)
    assert s.over("model", "x1", 1.0) is not None and s.over("model", "x2", 1.0) is not None  # median of the others: 1


def test_bad_moves_are_not_counted() -> None:
    s = MoveShares()
    for moved in (math.nan, math.inf, -1.0, 0.0):
        s.record("model", "p", moved, 0.0)
    assert s.share("model", "p", 0.0) == 0.0
    assert SHARE_MARGIN >= 1.0


def test_a_laggard_closing_in_on_converged_partners_is_never_held_but_one_keeping_its_distance_is() -> None:
    """The ring of 4 that stalled (shares.py): our other partner has converged with us (its moves ~0), one is far.
    Each exchange with the laggard takes 2/3 of its distance (w = 1/3): a geometric series, at most 1.5x its first
    move, under the floor of SHARE_FLOOR_MOVES x its largest. A partner keeping its distance is held after a few."""
    s = MoveShares()
    s.record("model", "converged", 1e-9, 0.0)
    first = 0.3
    for k in range(30):
        now = 0.1 * k
        assert s.over("model", "laggard", now) is None, k  # every exchange is let through
        s.record("model", "laggard", first * (1 / 3) ** k, now)
    s = MoveShares()
    s.record("model", "converged", 1e-9, 0.0)
    taken = 0
    for k in range(30):
        now = 0.1 * k
        if s.over("model", "steady", now) is None:
            s.record("model", "steady", first, now)
            taken += 1
    assert taken == 2  # its first move, its second under the floor its first set, then held
    s = MoveShares()
    s.record("model", "converged", 1e-9, 0.0)
    taken = 0
    for k in range(30):  # large and small in turn, to look as if it closed in: at most 3 of its largest and a few
        now = 0.1 * k
        if s.over("model", "alternating", now) is None:
            s.record("model", "alternating", first if k % 2 == 0 else first * 0.1, now)
            taken += 1
    assert s.share("model", "alternating", 3.0) <= SHARE_MARGIN * SHARE_FLOOR_MOVES * first + first

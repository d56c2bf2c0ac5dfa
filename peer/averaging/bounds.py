"""What one exchange may cost a peer: how long it holds weight, and how far it may move the tensors.

Hold: an exchange holds its weight from the offer until the commit. An honest one needs a few round trips
plus its bytes at the slowest link we still serve, so both sides cut it at `hold_seconds(nbytes)` (capped
by the configured exchange_timeout); the server waits `COMMIT_SLACK_S` longer than the initiator may
take to commit, so a commit sent in time is always served (a server that gave up while the initiator
applied would change the swarm's sum).

Clip: both sides apply w * s * (other - own) with the same scale s, computed by `update_scale` from
quantities both sides hold identically (the squared norms of the two snapshots, swapped, and of their
difference, negated), so the pair's updates still cancel exactly: Δx_i + Δx_j = w s (b - a) + w s (a - b) = 0.
A rule on each side's own history of distances could not promise that: the two histories differ as soon
as one side restarts or misses one commit, and then every clipped exchange would change the sum.
The bound is `ratio` times the smaller of the two norms: a peer cannot raise it by sending larger values,
and honest models (independently initialised ones differ by about sqrt(2) times their norm) stay far
below the default ratio. Non-finite norms (values near float32's limit square to inf) give s = 0:
nothing is applied, on both sides.
"""

from __future__ import annotations

import math

HOLD_BASE_S = 10.0  # two snapshots and the offer/accept/commit round trips: seconds when a loaded machine makes threads wait for a core
HOLD_FLOOR_BPS = 256 * 1024  # 2 Mbit/s: the slowest link we still average over; both directions move at once
COMMIT_SLACK_S = 5.0  # the server's extra wait for a commit in flight (the initiator's deadline ends first)


def hold_seconds(nbytes: int, exchange_timeout: float) -> float:
    """The initiator's deadline for an exchange of `nbytes` per side, from before its offer to its commit."""
    return min(exchange_timeout, HOLD_BASE_S + nbytes / HOLD_FLOOR_BPS)


def update_scale(diff_sq: float, own_sq: float, other_sq: float, ratio: float) -> float:
    """The factor s in [0, 1] both sides apply to w * (other - own): symmetric in (own_sq, other_sq).

    `diff_sq` = ||other - own||^2, the norms' squares of the two snapshots; s < 1 when the difference is more
    than `ratio` times the smaller norm. Evaluated the same on both sides (the arguments are swapped there),
    so the pair's updates cancel."""
    if not all(math.isfinite(v) and v >= 0.0 for v in (diff_sq, own_sq, other_sq)):
        return 0.0  # an overflowed norm (or a value no sum of squares has): apply nothing
    bound, diff = ratio * math.sqrt(min(own_sq, other_sq)), math.sqrt(diff_sq)  # norms, not squares: no under/overflow
    return 1.0 if diff <= bound else bound / diff


def cannot_clip(own_sq: float, other_sq: float, ratio: float) -> bool:
    """Whether the rule gives s = 1 whatever the difference: ||other - own|| <= ||own|| + ||other||, so when
    that sum is within `ratio` times the smaller norm no difference can exceed the bound. Symmetric in the
    two norms, so both sides decide alike; it spares a pass over the tensors in the common case."""
    if not (math.isfinite(own_sq) and math.isfinite(other_sq) and own_sq >= 0.0 and other_sq >= 0.0):
        return False
    own, other = math.sqrt(own_sq), math.sqrt(other_sq)
    return own + other <= ratio * min(own, other)


def download_ok(diff_sq: float, own_sq: float, other_sq: float, ratio: float) -> bool:
    """Whether downloaded parameters may replace ours: the same rule as an exchange, unclipped."""
    return update_scale(diff_sq, own_sq, other_sq, ratio) == 1.0

"""What one exchange may cost a peer: how long it holds weight, and how far it may move the tensors.

Hold: an exchange holds its weight from the offer until the commit. An honest one needs a few round trips
plus its bytes at the slowest link we still serve, so both sides cut it at `hold_seconds(nbytes)` (capped
by the configured exchange_timeout); the server waits `COMMIT_SLACK_S` longer than the initiator may
take to commit, so a commit sent in time is always served (a server that gave up while the initiator
applied would change the swarm's sum).

Clip (docs/design.md, "Robust averaging"): each side announces a radius in the exchange (the initiator in
its offer, the server in its accept: peer/averaging/radius.py says how it is chosen), and both apply
w * s * (other - own) with s = min(1, min(r_i, r_j) / ||b - a||), computed by `clip_scale` from quantities
both sides hold bit for bit: the two announced radii and ||b - a||^2 (peer/averaging/norms.py, over the
wire values). So the pair's updates cancel exactly, clipped or not: Δx_i + Δx_j = w s (b - a) + w s (a - b)
= 0. A peer can only lower the pair's radius by what it announces (it stops averaging with us), never raise
it past ours. A non-finite distance (values whose square overflows) or radius gives s = 0: nothing is
applied, on both sides.
"""

from __future__ import annotations

import math

HOLD_BASE_S = 10.0  # two snapshots and the offer/accept/commit round trips: seconds when a loaded machine makes threads wait for a core
HOLD_FLOOR_BPS = 256 * 1024  # 2 Mbit/s: the slowest link we still average over; both directions move at once
OPPOSED_COSINE = 0.1  # k: cos(a, b) < -k is "pointing away"; honest models of one task are aligned (cos > 0.7 in the byzantine tests), independent inits at 0 +- 1/sqrt(n)
OPPOSED_MIN_ELEMENTS = 10_000  # below, two independent inits could look opposed by chance: at n = 10^4 it takes a 9-sigma draw (d^2 ~ 2, bound ~ -0.09 of ||a||^2 = 9 / sqrt(n))
COMMIT_SLACK_S = 5.0  # the server's extra wait for a commit in flight (the initiator's deadline ends first)


def hold_seconds(nbytes: int, exchange_timeout: float) -> float:
    """The initiator's deadline for an exchange of `nbytes` per side, from before its offer to its commit."""
    return min(exchange_timeout, HOLD_BASE_S + nbytes / HOLD_FLOOR_BPS)


def valid_radius(radius: float) -> bool:
    """Whether a peer's announced radius is one: a float >= 0 (the wire carries no inf or NaN; the largest
    float, NO_BOUND, says "no bound from my side"); negatives (an older peer, which announces none, reads as
    -1) are not."""
    return isinstance(radius, float) and radius >= 0.0


def opposed(diff_sq: float, dot: float, elements: int) -> bool:
    """Whether two models point away from each other: cos(a, b) < -OPPOSED_COSINE for sure, from quantities
    both sides hold bit for bit (norms.diff_sq_and_dot), in a group of at least OPPOSED_MIN_ELEMENTS values.

    With p = <a, b> < 0, ||a|| ||b|| <= (||a||^2 + ||b||^2) / 2 = (d^2 + 2p) / 2, so p < -k d^2 / (2 (1 + k))
    gives -p > k (d^2 + 2p) / 2 >= k ||a|| ||b||: cos < -k. Exact when the norms are equal (a sign flip);
    stricter otherwise, and still true of -c times our model for any c > 0 at k = 0.1 (c = 0.1: p = -0.1,
    d^2 = 1.21, bound -0.055)."""
    k = OPPOSED_COSINE
    return elements >= OPPOSED_MIN_ELEMENTS and math.isfinite(dot) and dot < -k * diff_sq / (2.0 * (1.0 + k))


def clip_scale(diff_sq: float, radius_a: float, radius_b: float, *, dot: float = 0.0, elements: int = 0) -> float:
    """The factor s in [0, 1] both sides apply to w * (other - own), symmetric in the two radii.

    `diff_sq` = ||other - own||^2 and `dot` = <other, own> (the same on both sides: norms.diff_sq_and_dot);
    s < 1 when the distance is past the smaller radius, 0 when the two point away from each other (`opposed`,
    over `elements` values). Both sides pass the same numbers (the radii swapped), so they get the same s."""
    if not (math.isfinite(diff_sq) and diff_sq >= 0.0 and radius_a >= 0.0 and radius_b >= 0.0):
        return 0.0  # an overflowed distance (or a value no sum of squares has), or a NaN radius: apply nothing
    if opposed(diff_sq, dot, elements):
        return 0.0  # values pointing away from ours: no honest model of the task does (radius.py strikes it)
    radius = min(radius_a, radius_b)
    distance = math.sqrt(diff_sq)  # the norm, not its square: no under/overflow against the radius
    return 1.0 if distance <= radius else radius / distance


def download_ok(diff_sq: float, own_sq: float, other_sq: float, ratio: float) -> bool:
    """Whether downloaded parameters may replace ours: within `ratio` times the smaller of the two norms.

    A model that is all zeros (a freshly initialised linear model) has nothing to protect and no norm to
    judge by: it takes any finite download, and its exchanges then judge it against the swarm (radius.py)."""
    values = (diff_sq, own_sq, other_sq)
    if not all(math.isfinite(v) and v >= 0.0 for v in values):
        return False
    if own_sq == 0.0:
        return True
    return within_ratio(diff_sq, own_sq, other_sq, ratio)


def within_ratio(diff_sq: float, a_sq: float, b_sq: float, ratio: float) -> bool:
    """||a - b|| <= ratio x the smaller of ||a||, ||b||, from their squares (finite ones; two zeros are within)."""
    values = (diff_sq, a_sq, b_sq)
    return (all(math.isfinite(v) and v >= 0.0 for v in values)
            and math.sqrt(diff_sq) <= ratio * math.sqrt(min(a_sq, b_sq)))

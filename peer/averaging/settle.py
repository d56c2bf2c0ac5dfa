"""What either side of an exchange does once it is decided: apply a committed update, settle the residual;
and the radius each side announces before (peer/averaging/radius.py).

The initiator (peer/averaging/engine.py) and the server (serving.py) end alike here, so the two halves of
the swarm-wide sum (peer/averaging/exchange.py) are applied by the same code.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import trio

from peer.averaging.ledger import Ledger
from peer.averaging.radius import Radii, Radius
from peer.averaging.shared import SharedTensors
from protocol.schema.gossip import NO_BOUND

log = logging.getLogger("peertrain.gossip")


async def our_radius(radii: Radii | None, group: SharedTensors, peer_id: str, sent: list[Any]) -> Radius | None:
    """The radius we announce for an exchange of `group` with `peer_id` (None: the defence is off, the bench's
    switch). Our norm comes from the last update; only when none is known is it taken from `sent` (our
    snapshot as sent), in a worker thread."""
    if radii is None:
        return None
    norm = group.norm if group.norm is not None else await trio.to_thread.run_sync(group.own_norm, sent)
    return radii.radius(group.name, peer_id, norm, trio.current_time())


def wire_radius(radius: Radius | None) -> float:
    """What goes on the wire for `radius`: NO_BOUND (the largest float: the wire carries no inf) says "no
    bound from my side"."""
    if radius is None or not math.isfinite(radius.announced):
        return NO_BOUND
    return radius.announced


async def apply_committed(group: SharedTensors, weight: float, others: list[Any], sent: list[Any], *,
                          peer_id: str, radius: Radius | None, theirs: float, radii: Radii | None,
                          ledger: Ledger) -> None:
    """Add a committed exchange's update to `group`, in a worker thread and shielded: the other side applies
    its half, so ours must land whatever happens (the sum). Both sides clip it alike, by the smaller of our
    `radius` and the one the peer announced (`theirs`); its distance is remembered for later radii and
    judged as evidence (radius.py), counted and, if it is evidence against the peer, struck. An update
    whose lock was held past its bound is owed, not lost (SharedTensors.apply), and logged."""
    pair = None if radius is None else (radius.announced, theirs)
    with trio.CancelScope(shield=True):
        scale, distance, pointing_away = await trio.to_thread.run_sync(
            lambda: group.apply(weight, others, sent, radii=pair))
    if group.owing:
        log.warning("group %s was locked past its bound while an exchange with %s applied: the rest of the "
                    "update is added when the lock is next had", group.name, peer_id[:8])
    if radius is not None and radii is not None:
        strike = radii.judge(group.name, peer_id, distance=distance, radius=radius, moved=weight * scale,
                             now=trio.current_time(), opposed=pointing_away)
        if scale < 1.0:
            log.log(logging.WARNING if strike else logging.INFO,
                    "update from %s clipped to %.3g of its size (distance %.3g; radii: ours %.3g, theirs %.3g)%s",
                    peer_id[:8], scale, distance, radius.announced, theirs, f": {strike}" if strike else "")
        elif strike:
            log.warning("update from %s: %s", peer_id[:8], strike)
        ledger.judged(peer_id, scale=scale, distance=distance, radius=radius.announced, strike=strike)
    group.release(others)  # the received copies become later snapshots' buffers


async def keep_residual(group: SharedTensors, own: list[Any], sent: list[Any] | None) -> None:
    """Settle an exchange's error-feedback reservation, in a worker thread (a pass over the whole group),
    shielded: a reservation left unsettled would keep every later exchange from carrying the residual."""
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(group.keep_residual, own, sent)

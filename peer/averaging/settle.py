"""What either side of an exchange does once it is decided: apply a committed update, settle the residual.

The initiator (peer/averaging/engine.py) and the server (serving.py) end alike here, so the two halves of
the swarm-wide sum (peer/averaging/exchange.py) are applied by the same code.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from peer.averaging.ledger import Ledger
from peer.averaging.shared import SharedTensors

log = logging.getLogger("peertrain.gossip")


async def apply_committed(group: SharedTensors, weight: float, others: list[Any], sent: list[Any], *,
                          peer_id: str, max_ratio: float, ledger: Ledger) -> None:
    """Add a committed exchange's update to `group`, in a worker thread and shielded: the other side applies
    its half, so ours must land whatever happens (the sum). An update that had to be clipped (both sides
    clip it alike) is logged, counted and struck; one whose lock was held past its bound is owed, not
    lost (SharedTensors.apply), and logged."""
    with trio.CancelScope(shield=True):
        scale = await trio.to_thread.run_sync(lambda: group.apply(weight, others, sent, max_ratio=max_ratio))
    if group.owing:
        log.warning("group %s was locked past its bound while an exchange with %s applied: the rest of the "
                    "update is added when the lock is next had", group.name, peer_id[:8])
    if scale < 1.0:
        log.warning("update from %s clipped to %.3g of its size (past max_update_ratio %g)",
                    peer_id[:8], scale, max_ratio)
        ledger.clipped(peer_id, "sent an update past max_update_ratio")
    group.release(others)  # the received copies become later snapshots' buffers


async def keep_residual(group: SharedTensors, own: list[Any], sent: list[Any] | None) -> None:
    """Settle an exchange's error-feedback reservation, in a worker thread (a pass over the whole group),
    shielded: a reservation left unsettled would keep every later exchange from carrying the residual."""
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(group.keep_residual, own, sent)

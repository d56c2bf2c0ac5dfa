"""The daemon's driver of the local spectral-gap estimate: one `GapEstimator` (peer/topology/local_gap.py)
run over the partial views' active neighbours with real sessions.

The estimator's rounds must line up across peers without anyone leading them, so they follow the wall
clock: epoch e starts at e x `epoch_interval` seconds since the Unix epoch, round r of it fills the slot
[start + r x R, start + (r + 1) x R) with R = `round_interval`. A peer sends its round message a quarter
into the slot and mixes what arrived at the slot's end, so clocks may disagree by up to R/4 (NTP keeps
hosts within milliseconds) before a round's values are missed; a missed value only leaves that neighbour
out of that round (an estimate, not an invariant). A daemon that starts mid-epoch waits for the next one.
At an epoch's end the reading goes to `Views.gap`, which the local rewiring rule reads
(peer/topology/local_rewire.py). See docs/design.md, "Partial views".

Round messages (`GapRound`, protocol/schema/views.py) go only to neighbours we already have a session with
(nothing is dialed for them), inside the same per-session byte budget as the views' messages. What a peer
sends is bounded before the estimator reads it (the schema, when the message is decoded, then
`local_gap.check_round` against our config); a message out of range closes the session with the reason.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import trio

from peer.session.transport import SessionClosed
from peer.topology.local_gap import GapConfig, GapEstimator
from protocol.schema.views import GapRound, encoded_size

if TYPE_CHECKING:
    import random

    from peer.membership.views import Views
    from peer.session.transport import Session

log = logging.getLogger("peertrain.membership")

SEND_TIMEOUT_FRACTION = 0.5
"""A round message not written within this fraction of a round is dropped: it would arrive after the
slot it belongs to, where the receiver ignores it."""


def estimator_state_bytes(estimator: GapEstimator) -> int:
    """Bytes of what an estimator holds, serialized as the views' state is (`Views.state_bytes`): the figure
    the daemon's status and the simulator (peer/bench/scale.py) add to a peer's state."""
    return encoded_size(estimator.state_for_size())


class GapDriver:
    """Runs the estimator for `views` (see the module docstring). `sessions()` gives the sessions we have,
    by peer; `send(session, message)` writes one `GapRound`."""

    def __init__(self, cfg: GapConfig, views: Views, rng: random.Random, *,
                 sessions: Callable[[], Mapping[str, Session]],
                 send: Callable[[Session, GapRound], Awaitable[None]],
                 wall_clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.views = views
        self.estimator = GapEstimator(cfg, rng)
        self._sessions = sessions
        self._send = send
        self._wall_clock = wall_clock
        self.epochs = 0  # epochs finished with a reading
        self.sent = self.received = 0  # round messages
        self.ignored = 0  # round messages from peers outside our active view

    def status(self) -> dict:
        r = self.views.gap
        return {"epochs": self.epochs, "running": self.estimator.running, "round": self.estimator.round,
                "reading": None if r is None else {"epoch": r.epoch, "gap": round(r.gap, 5),
                                                   "reference": round(r.reference, 5), "ratio": round(r.ratio, 4),
                                                   "degree": round(r.degree, 2)}}

    def receive(self, sender: str, msg: GapRound) -> None:
        """A round message, kept only from a peer of our active view: the estimator keeps at most
        `max_neighbours` senders a round, first come, and any session's rounds used to take those places
        before our neighbours' came (a round from a peer that just left the view is dropped, no fault)."""
        if sender not in self.views.active:
            self.ignored += 1
            return
        self.received += 1
        self.estimator.receive(sender, msg)

    async def run(self) -> None:
        """Epoch after epoch, until cancelled."""
        cfg = self.cfg
        async with trio.open_nursery() as nursery:
            while True:
                epoch = math.floor(self._wall_clock() / cfg.epoch_interval) + 1
                start = epoch * cfg.epoch_interval
                await self._sleep_until(start)
                self.estimator.begin(epoch)
                for r in range(cfg.rounds):
                    slot = start + r * cfg.round_interval
                    await self._sleep_until(slot + cfg.round_interval / 4)
                    msg = self.estimator.message(self.views.degree)
                    sessions = self._sessions()
                    for peer in list(self.views.active):
                        session = sessions.get(peer)
                        if msg is not None and session is not None:
                            nursery.start_soon(self._send_one, session, msg)
                    await self._sleep_until(slot + cfg.round_interval)
                    self.estimator.advance(set(self.views.active))
                self.views.set_gap(self.estimator.reading)
                if self.estimator.reading is not None:
                    self.epochs += 1
                    r = self.estimator.reading
                    log.info("gap estimate, epoch %d: %.4f (%.2fx a random %.1f-regular graph's)",
                             r.epoch, r.gap, r.ratio, r.degree)

    async def _send_one(self, session: Session, msg: GapRound) -> None:
        with trio.move_on_after(self.cfg.round_interval * SEND_TIMEOUT_FRACTION):
            try:
                await self._send(session, msg)
                self.sent += 1
            except SessionClosed:
                pass

    async def _sleep_until(self, wall: float) -> None:
        """Sleep until the wall clock reads `wall` (trio's clock is monotonic, not the wall's)."""
        await trio.sleep(max(0.0, wall - self._wall_clock()))


"""Gradients a stage server keeps aside until the driver acknowledges their microbatch: at most once per stage.

A "backward" or "loss" call computes the stage's parameter gradient for one microbatch, but the reply may be
lost or late, and the driver then re-sends the call to another peer of the stage; and a microbatch may fail at
an earlier stage after this one computed its part. So a call's gradient does not enter the stage when it is
computed: the server keeps it here under an id it names in its reply, and adds it to the stage only when the
driver that made the call acknowledges it (`StageAck`), which it does once the microbatch's backward has
completed through every stage. A microbatch that failed is acknowledged as "drop", and so is every call a
driver made only to check another peer's answer (peer/pipeline/verify.py); a gradient nobody acknowledges is
dropped after `hold_s`. Each gradient is taken at most once, so it enters the stage at most
once. An ack naming an id not kept for its sender (unknown, already taken, or kept for another driver) changes
nothing and is counted.

What a driver can make a server keep is bounded in count (per driver and in all) and in bytes; when a bound
is reached the oldest is dropped (counted), so a server never stalls for want of room, and a driver that keeps
too many only loses its own oldest. Pure bookkeeping: the clock is passed in, the gradients are opaque.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_KEPT = 64
"""Gradients one server keeps for all drivers together. One waits only for the rest of its microbatch's backward
(the calls to the earlier stages), so a server keeps about as many as there are microbatches in flight past its
stage: a few per driver (a trainer keeps 2 x stages in flight by default). 64 is four times the calls a server
holds by default ([pipeline] max_queue)."""
MAX_KEPT_PER_DRIVER = 32
"""Of which one driver: its microbatches in flight (2 x stages by default, 16 in the busiest test), plus replies
it lost, waiting for `hold_s`, with room. Past it that driver's own oldest is dropped, nobody else's."""
MAX_KEPT_BYTES = 4 << 30
"""Bytes of kept gradients, in all. Each is a full copy of the stage's parameter gradient, on the stage's device:
for a 100 MB stage that is 40 of them; a stage of more than 4 GiB keeps one (the newest)."""
HOLD_CALL_TIMEOUTS = 2.0
"""A gradient is kept at most this many times `[pipeline] max_call_timeout`: the rest of its microbatch's
backward is a few calls, each given up by the driver after at most that long."""
SWEEP_S = 5.0
"""How often the daemon drops the gradients past their hold when no call or ack comes (they hold memory)."""


class HeldGradient(Protocol):
    """One call's parameter gradient, as the stage handler computed it (trainers/pipeline/stage.py)."""

    samples: int
    nbytes: int
    deferred: bool  # computed when acknowledged, not when called (its ack is answered before the computation)

    def accumulate(self) -> bool:
        """Add it to the stage's accumulated gradient (in a worker thread): False if the stage's state was
        replaced since it was computed (then it is dropped)."""
        ...


@dataclass
class Kept:
    id: int
    driver: str  # the peer that made the call: only it may acknowledge
    owner: Any  # what it was computed for (the served stage): a gradient of a stage we left is dropped
    gradient: HeldGradient
    expires: float


@dataclass
class KeptStats:
    acked: int = 0  # gradients acknowledged by their driver and taken, to be added to the stage
    dropped: Counter = field(default_factory=Counter)  # why -> gradients dropped (see `KeptGradients`)
    ignored: Counter = field(default_factory=Counter)  # acks' ids that named nothing kept for the sender, by why


class KeptGradients:
    """Kept gradients by id, oldest first. Why one is dropped: `unacked` (nobody acknowledged it in `hold_s`),
    `full` (a bound), `failed` (its driver said its microbatch failed), `unsent` (the reply naming it did not go
    out), `stale` (the stage's state changed since: we moved to another stage, or loaded a peer's state). Acks' ids ignored: `unknown` (not kept:
    never, or taken or dropped already), `stranger` (kept for another driver; it stays kept)."""

    def __init__(self, *, hold_s: float, most: int = MAX_KEPT, most_per_driver: int = MAX_KEPT_PER_DRIVER,
                 most_bytes: int = MAX_KEPT_BYTES):
        self.hold_s, self.most, self.most_per_driver, self.most_bytes = hold_s, most, most_per_driver, most_bytes
        self.stats = KeptStats()
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._per_driver: Counter = Counter()
        self._bytes = 0
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def keep(self, driver: str, owner: Any, gradient: HeldGradient, now: float) -> int:
        """Keep `gradient` for `driver` (dropping the oldest past a bound); its id, for the reply."""
        self.expire(now)
        while self._per_driver[driver] >= self.most_per_driver:
            self._drop(next(k for k in self._kept.values() if k.driver == driver).id, "full")
        while self._kept and (len(self._kept) >= self.most or self._bytes + gradient.nbytes > self.most_bytes):
            self._drop(next(iter(self._kept)), "full")
        kept = Kept(next(self._ids), driver, owner, gradient, now + self.hold_s)
        self._kept[kept.id] = kept
        self._per_driver[driver] += 1
        self._bytes += gradient.nbytes
        return kept.id

    def take(self, driver: str, ids: list[int], now: float) -> list[Kept]:
        """The gradients of `ids` kept for `driver`, no longer kept (acknowledged: the caller adds them to the
        stage); the other ids are ignored (counted)."""
        out = self._claim(driver, ids, now)
        self.stats.acked += len(out)
        return out

    def drop(self, driver: str, ids: list[int], now: float) -> None:
        """Drop the gradients of `ids` kept for `driver`: their microbatch failed. The other ids are ignored."""
        for _ in self._claim(driver, ids, now):
            self.stats.dropped["failed"] += 1

    def _claim(self, driver: str, ids: list[int], now: float) -> list[Kept]:
        self.expire(now)
        out = []
        for i in dict.fromkeys(ids):  # an id twice in one ack is claimed once
            kept = self._kept.get(i)
            if kept is None:
                self.stats.ignored["unknown"] += 1
            elif kept.driver != driver:
                self.stats.ignored["stranger"] += 1
            else:
                out.append(self._pop(i))
        return out

    def discard(self, kept_id: int, why: str) -> None:
        """Drop `kept_id` if still kept (its reply did not go out, say)."""
        if kept_id in self._kept:
            self._drop(kept_id, why)

    def drop_all_but(self, owner: Any, why: str) -> None:
        """Drop every gradient not computed for `owner` (we switched stage: they belong to the one we left)."""
        for k in [k for k in self._kept.values() if k.owner is not owner]:
            self._drop(k.id, why)

    def expire(self, now: float) -> None:
        """Drop the gradients nobody acknowledged in time (all are held equally long: the oldest expire first)."""
        while self._kept:
            oldest = next(iter(self._kept.values()))
            if oldest.expires > now:
                return
            self._drop(oldest.id, "unacked")

    def _pop(self, kept_id: int) -> Kept:
        kept = self._kept.pop(kept_id)
        self._per_driver[kept.driver] -= 1
        if self._per_driver[kept.driver] <= 0:
            del self._per_driver[kept.driver]
        self._bytes -= kept.gradient.nbytes
        return kept

    def _drop(self, kept_id: int, why: str) -> None:
        self._pop(kept_id)
        self.stats.dropped[why] += 1

    def status(self) -> dict:
        return {"kept": len(self._kept), "kept_mb": round(self._bytes / 1e6, 3), "acked": self.stats.acked,
                "dropped": dict(self.stats.dropped), "acks_ignored": dict(self.stats.ignored)}

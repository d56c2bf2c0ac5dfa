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

What a driver can make a server keep is bounded in count and in bytes, per driver and in all; when a bound
is reached an oldest entry is dropped (counted), so a server never stalls for want of room. It is fair per
driver: past its own bound a driver loses its own oldest; when the book as a whole is full, the entry that goes
is the oldest of the driver holding the most (bytes, then count; the newcomer itself on a tie). So drivers that
never acknowledge only crowd each other out: a driver holding no more than any other never loses an entry to
another's. A driver learns of a lost entry from its ack's reply (the id is missing), and does not count that
microbatch as done (peer/pipeline/driver.py). Pure bookkeeping: the clock is passed in, the gradients are opaque.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from peertrain.pipeline import HeldGradient  # what a stage handler returns: the leaf's protocol

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
MAX_KEPT_BYTES_PER_DRIVER = MAX_KEPT_BYTES * MAX_KEPT_PER_DRIVER // MAX_KEPT
"""Of which one driver: the same share as its count (half), so one driver alone never fills the bytes and a
second finds room without evicting anyone."""
HOLD_MARGIN_CALLS = 3
"""Past the longest microbatch (`longest_microbatch_s`), a gradient is kept this many more `max_call_timeout`s:
the checks of its last call (two calls, verify.py) end before its attempt does, then its ack (one call)."""
STALE = "stale"  # why a gradient goes when our stage state is replaced (a move, a peer's state loaded)
MAX_STALE_REMEMBERED = 4 * MAX_KEPT
"""(driver, id) pairs dropped as stale that an ack may still name: a few books' worth (the book holds MAX_KEPT),
each answered `moved`, so the driver does not fail a microbatch for a replica that is gone."""


def longest_microbatch_s(cfg: Any, stages: int) -> float:
    """The longest one attempt of a microbatch may run at a driver with `[pipeline]` settings `cfg` over `stages`
    stages (the driver fails an attempt past it, driver.py): each of its 2 x stages - 1 calls may be sent
    `max_retries` + 1 times with the longest deadline, and it may wait `stage_wait` once for a stage with no peer."""
    return (2 * stages - 1) * (cfg.max_retries + 1) * cfg.max_call_timeout + cfg.stage_wait


def hold_s(cfg: Any, stages: int) -> float:
    """How long a server keeps an unacknowledged gradient: past the longest microbatch and its ack, so an honest
    driver's ack always finds it (with our own settings; a driver with longer ones is on its own)."""
    return longest_microbatch_s(cfg, stages) + HOLD_MARGIN_CALLS * cfg.max_call_timeout
SWEEP_S = 5.0
"""How often the daemon drops the gradients past their hold when no call or ack comes (they hold memory)."""


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
                 most_bytes: int = MAX_KEPT_BYTES, most_bytes_per_driver: int = MAX_KEPT_BYTES_PER_DRIVER):
        self.hold_s, self.most, self.most_per_driver, self.most_bytes = hold_s, most, most_per_driver, most_bytes
        self.most_bytes_per_driver = most_bytes_per_driver
        self.stats = KeptStats()
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._per_driver: Counter = Counter()
        self._bytes_per_driver: Counter = Counter()
        self._stale: OrderedDict[tuple[str, int], None] = OrderedDict()  # (driver, id) dropped as stale, newest last
        self._bytes = 0
        self._ids = itertools.count(1)
        self.released: list[HeldGradient] = []  # dropped, for the server to `release()` (a worker thread's job)

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def keep(self, driver: str, owner: Any, gradient: HeldGradient, now: float) -> int:
        """Keep `gradient` for `driver` (dropping the oldest past a bound); its id, for the reply."""
        self.expire(now)
        while self._per_driver[driver] and (self._per_driver[driver] >= self.most_per_driver or
                                            self._bytes_per_driver[driver] + gradient.nbytes > self.most_bytes_per_driver):
            self._drop(self._oldest_of(driver), "full")
        while self._kept and (len(self._kept) >= self.most or self._bytes + gradient.nbytes > self.most_bytes):
            self._drop(self._oldest_of(self._largest(driver)), "full")
        kept = Kept(next(self._ids), driver, owner, gradient, now + self.hold_s)
        self._kept[kept.id] = kept
        self._per_driver[driver] += 1
        self._bytes_per_driver[driver] += gradient.nbytes
        self._bytes += gradient.nbytes
        return kept.id

    def _largest(self, newcomer: str) -> str:
        """Whose entry goes when the book is full: the driver holding the most (bytes, then count), `newcomer` on
        a tie (it then loses its own); never one holding less than another."""
        def held(d: str) -> tuple[int, int, bool]:
            return self._bytes_per_driver[d], self._per_driver[d], d == newcomer
        return max(self._per_driver, key=held)

    def _oldest_of(self, driver: str) -> int:
        return next(k.id for k in self._kept.values() if k.driver == driver)

    def take_released(self) -> list[HeldGradient]:
        """The dropped gradients not yet released, no longer listed here."""
        out, self.released = self.released, []
        return out

    def take(self, driver: str, ids: list[int], now: float) -> list[Kept]:
        """The gradients of `ids` kept for `driver`, no longer kept (acknowledged: the caller adds them to the
        stage); the other ids are ignored (counted)."""
        out = self._claim(driver, ids, now)
        self.stats.acked += len(out)
        return out

    def drop(self, driver: str, ids: list[int], now: float) -> None:
        """Drop the gradients of `ids` kept for `driver` (their microbatch failed, or a check's call kept them): they
        are released like any other dropped gradient, or a provisional one would sit in the stage's gradient and
        hold its steps back, and a copy count against its room for good. The other ids are ignored."""
        for kept in self._claim(driver, ids, now):
            self._dropped(kept, "failed")

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

    def moved(self, driver: str, ids: list[int]) -> list[int]:
        """Of `ids`, those of `driver`'s that a state change of ours dropped (`stale`: remembered, bounded)."""
        return [i for i in ids if (driver, i) in self._stale]

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
        self._bytes_per_driver[kept.driver] -= kept.gradient.nbytes
        if self._per_driver[kept.driver] <= 0:
            del self._per_driver[kept.driver]
            del self._bytes_per_driver[kept.driver]
        self._bytes -= kept.gradient.nbytes
        return kept

    def _drop(self, kept_id: int, why: str) -> None:
        self._dropped(self._pop(kept_id), why)

    def _dropped(self, kept: Kept, why: str) -> None:
        """`kept`, out of the book, dropped for `why`: counted, and its gradient released (taken out of the stage)
        unless it went stale with the state it was computed for."""
        self.stats.dropped[why] += 1
        if why == STALE:  # the stage state it was computed for is gone, and what it added with it
            self.remember_stale(kept.driver, kept.id)
        else:
            self.released.append(kept.gradient)

    def remember_stale(self, driver: str, kept_id: int) -> None:
        """`driver`'s gradient `kept_id` went with a state change of ours: its ack is answered `moved`."""
        self._stale[(driver, kept_id)] = None
        while len(self._stale) > MAX_STALE_REMEMBERED:
            self._stale.popitem(last=False)

    def status(self) -> dict:
        return {"kept": len(self._kept), "kept_mb": round(self._bytes / 1e6, 3), "kept_drivers": len(self._per_driver),
                "hold_s": round(self.hold_s, 1), "acked": self.stats.acked,
                "dropped": dict(self.stats.dropped), "acks_ignored": dict(self.stats.ignored)}

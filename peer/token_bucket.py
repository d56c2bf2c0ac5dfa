"""A token bucket: `rate` tokens a second, at most `capacity` held (the burst).

One mechanism for every rate the daemon bounds: a relay's bandwidth (peer/nat/relay.py, waiting for tokens),
a session's view messages (peer/membership/view_driver.py, refusing past them), and the sends that only a
forwarded message vouches for (peer/membership/views.py, sans-I/O: the caller says when, `now`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio


class TokenBucket:
    def __init__(self, rate: float, capacity: float | None = None, *, clock: Callable[[], float] | None = None,
                 now: float | None = None):
        """Full at the start. `capacity` defaults to one second's worth; `clock` (e.g. trio.current_time) lets
        the caller leave out `now`; `now`: when the bucket starts (its first take refills from then)."""
        capacity = rate if capacity is None else capacity
        if not (math.isfinite(rate) and rate > 0 and math.isfinite(capacity) and capacity > 0):
            raise ValueError(f"a token bucket needs a positive, finite rate and capacity, got {rate}, {capacity}")
        self.rate, self.capacity = float(rate), float(capacity)
        self.tokens = self.capacity
        self._clock = clock
        self._last = now

    def try_take(self, n: float, now: float | None = None) -> bool:
        """Take `n` now if the bucket holds them (True), else take nothing (False): a limit that refuses rather
        than waits."""
        if now is None:
            if self._clock is None:
                raise TypeError("this token bucket has no clock: say `now`")
            now = self._clock()
        elapsed = 0.0 if self._last is None else max(0.0, now - self._last)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate)
        self._last = now
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    async def take(self, n: float) -> None:
        """Take `n`, waiting for the bucket to refill as long as it takes (a relay's circuit; needs a clock)."""
        while not self.try_take(n):
            await trio.sleep((n - self.tokens) / self.rate)

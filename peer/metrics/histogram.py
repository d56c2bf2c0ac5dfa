"""A fixed-bucket histogram of observations, kept where they happen (the gossip engine counts its exchange
times) and read by the Prometheus collector as it is: cumulative bucket counts, their sum, their number.
Plain Python, no prometheus_client: the counting code does not depend on how it is exported."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass
class Histogram:
    """`cumulative[i]` counts every observation <= `bounds[i]`; the implicit +Inf bucket is `count`."""

    bounds: tuple[float, ...]
    cumulative: list[int] = field(init=False)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.bounds or list(self.bounds) != sorted(set(self.bounds)) or not all(
                math.isfinite(b) for b in self.bounds):
            raise ValueError(f"histogram bounds must be finite and strictly increasing, got {self.bounds}")
        self.cumulative = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i in range(bisect_left(self.bounds, value), len(self.bounds)):  # every bucket with value <= bound
            self.cumulative[i] += 1

    def as_dict(self) -> dict:
        """For `peer status --json`: bounds (`le`), cumulative counts, count and sum."""
        return {"le": list(self.bounds), "counts": list(self.cumulative), "count": self.count,
                "sum": round(self.sum, 6)}

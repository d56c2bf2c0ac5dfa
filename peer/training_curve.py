"""A training job's loss and accuracy over time, for the dashboard's curves: a bounded buffer that keeps the
whole run at a resolution that halves as it grows, rather than only its latest stretch.

A trainer publishes every second or so for hours; a ring buffer of the last N publishes would show only the
last minutes. Here, when the buffer is full, every other point is dropped and from then on only every
`stride`-th publish is kept (the stride doubles each time): at most MAX_POINTS + 1 points, spread evenly
over the run, plus the latest publish, always. Only finite numbers are kept (a diverged loss is left out of
the curve; `peer status` still shows it as published).
"""

from __future__ import annotations

import math
from typing import Any

# Points a curve holds: a chart a few hundred pixels wide shows no more, and a status with one curve stays
# a few KB (each point is three numbers).
MAX_POINTS = 240


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


class TrainingCurve:
    """(time, loss, accuracy) points of one training job, `add`ed at each publish."""

    def __init__(self, max_points: int = MAX_POINTS):
        if max_points < 2:
            raise ValueError("a curve needs room for at least 2 points")
        self.max_points = max_points
        self.points: list[tuple[float, float | None, float | None]] = []
        self.stride = 1  # keep every stride-th publish with a figure
        self.seen = 0  # publishes with a loss or an accuracy
        self.latest: tuple[float, float | None, float | None] | None = None

    def add(self, t: float, loss: Any, accuracy: Any) -> None:
        point = (round(float(t), 3), _finite(loss), _finite(accuracy))
        if point[1] is None and point[2] is None:
            return
        self.seen += 1
        self.latest = point
        if (self.seen - 1) % self.stride:
            return
        self.points.append(point)
        if len(self.points) > self.max_points:
            self.points = self.points[::2]
            self.stride *= 2

    def status(self) -> list[list[float | None]]:
        """The points, oldest first, as [time, loss, accuracy] (None where a publish lacked one), the latest
        publish last."""
        out = [list(p) for p in self.points]
        if self.latest is not None and (not self.points or self.points[-1] != self.latest):
            out.append(list(self.latest))
        return out

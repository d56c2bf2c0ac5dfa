"""A peer's latest training figures, carried in its signed topology record so every daemon's dashboard can
draw every peer's loss curve (docs/design.md, "Dashboard").

The figures are the owner's claim about itself: signed, so no relay can change them, but not trusted
beyond the ranges checked here. A liar can only draw a wrong curve for its own ID.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from protocol.schema.pipeline import MAX_SAMPLES_PER_S, MAX_STEP

__all__ = ["MAX_FIGURE_LOSS", "TrainingFigures", "training_figures_signing_list"]

MAX_FIGURE_LOSS = 1e6
"""A loss no converging run reports (cross-entropy over a million classes starts near 14): a larger one has
diverged, and a chart scaled to it would flatten every other peer's curve. An owner sends None instead."""


def _check_number(what: str, value: float | None, high: float) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= high:
        raise ValueError(f"{what} must be a finite number in [0, {high:g}], got {value!r}")


@dataclass(frozen=True, slots=True)
class TrainingFigures:
    """The owner's trainer's latest published step, loss, accuracy and throughput (None: not published)."""

    step: int
    loss: float | None = None
    accuracy: float | None = None
    samples_per_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 <= self.step <= MAX_STEP:
            raise ValueError(f"training step must be in [0, {MAX_STEP}], got {self.step!r}")
        _check_number("training loss", self.loss, MAX_FIGURE_LOSS)
        _check_number("training accuracy", self.accuracy, 1.0)
        _check_number("training samples_per_s", self.samples_per_s, MAX_SAMPLES_PER_S)

    @classmethod
    def from_metrics(cls, metrics: dict) -> TrainingFigures | None:
        """The figures a trainer's published metrics hold, each dropped (None) where out of range, so what
        we sign always passes the checks above; None without a step or without a loss or an accuracy."""
        step = metrics.get("step")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            return None
        step = int(step)  # a numpy integer too
        if not 0 <= step <= MAX_STEP:
            return None

        def kept(key: str, high: float) -> float | None:
            v = metrics.get(key)
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                v = float(v)  # a numpy float too
            try:
                _check_number(key, v, high)
            except ValueError:
                return None
            return None if v is None else float(v)

        loss, accuracy = kept("loss", MAX_FIGURE_LOSS), kept("accuracy", 1.0)
        if loss is None and accuracy is None:
            return None
        return cls(step=step, loss=loss, accuracy=accuracy, samples_per_s=kept("samples_per_s", MAX_SAMPLES_PER_S))


def training_figures_signing_list(f: TrainingFigures) -> list:
    """What a record's signature covers of its figures (floats as floats, so 1 and 1.0 sign alike)."""
    return ["training", f.step, None if f.loss is None else float(f.loss),
            None if f.accuracy is None else float(f.accuracy),
            None if f.samples_per_s is None else float(f.samples_per_s)]

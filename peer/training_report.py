"""What a training job tells `peer status` and HOME/metrics.jsonl, and how a failure reads there.

A hosted trainer (peer/trainer_host.py) and an attached process (peer/attach/service.py) each report
through one `TrainingReport`; this module is theirs alone, so neither imports the other.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from peer.training_curve import TrainingCurve
from protocol.schema.training import TrainingFigures

log = logging.getLogger("peertrain.trainer")

FAILURE_CHARS = 240  # a failed trainer's cause in its status: one line a table can show; the log has the traceback


class TrainingReport:
    """What a training job tells `peer status` (its latest figures, a short loss history, the loss and accuracy
    curve of the whole run for the dashboard) and HOME/metrics.jsonl (every publish as one JSON line). A hosted
    trainer and an attached process (peer/attach/) each have one."""

    LOSS_HISTORY = 60  # points of the loss sparkline in `peer status`

    def __init__(self, peer_id: str, metrics_file: Path, metrics: dict[str, Any]):
        self.peer_id, self.metrics_file = peer_id, metrics_file
        self.metrics: dict[str, Any] = dict(metrics)
        self.loss_history: deque[float] = deque(maxlen=self.LOSS_HISTORY)
        self.curve = TrainingCurve()

    def publish(self, metrics: dict[str, Any]) -> None:
        metrics = dict(metrics)
        if metrics.get("loss") is not None:
            self.loss_history.append(float(metrics["loss"]))
        now = time.time()
        self.curve.add(now, metrics.get("loss"), metrics.get("accuracy"))
        self.metrics.update(metrics)
        line = dict(metrics, ts=round(now, 3), peer=self.peer_id)
        try:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(line, default=float) + "\n")
        except OSError as exc:
            log.warning("cannot append metrics: %s", exc)

    def figures(self) -> TrainingFigures | None:
        """The latest figures our topology record carries to every peer's dashboard (those in range)."""
        return TrainingFigures.from_metrics(self.metrics)

    def status(self) -> dict:
        return dict(self.metrics, loss_history=list(self.loss_history), curve=self.curve.status())


def failure_state(exc: BaseException) -> str:
    """The trainer's `state` after `exc`: "failed: Type: cause" on one line, cut to FAILURE_CHARS. A message
    of many lines keeps its first, unless it wraps a traceback (a DataLoader worker's), whose last line is
    the cause."""
    text = str(exc).strip()
    lines = [" ".join(ln.split()) for ln in text.splitlines() if ln.strip()] or [""]
    cause = lines[-1] if "Traceback (most recent call last)" in text else lines[0]
    state = f"failed: {type(exc).__name__}: {cause}" if cause else f"failed: {type(exc).__name__}"
    return state if len(state) <= FAILURE_CHARS else state[: FAILURE_CHARS - 1] + "…"

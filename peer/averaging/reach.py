"""How far our own steps move our model, a measurement (issue 40, item 1).

The clip radius (radius.py) comes from our partners' distances, which colluders can grow: two of them lend
each other theirs (the ratchet, docs/design.md "Robust averaging"). What our own optimizer steps do to our
model is out of their direct reach: `own_reach` per group in the daemon's status, beside each partner's
distance in `by_peer`, measures how far apart honest partners stand in units of our own steps (within
0.72x after the first seconds, AD-PSGD and local steps; docs/benchmarks.md, tenth session). Not a bound:
a cap at a multiple of it failed in the simulated ratchet, because a displaced model's own steps pull it
back harder, so its reach grows with the push it suffered.

What moved us between two snapshots of a group is our steps plus the updates exchanges applied; the updates
are known (w * s * (b - a)), so our steps' move is the difference of the snapshots less those. It is taken
on PROBE_ELEMENTS coordinates drawn at random (a private generator: no peer can aim at them) and scaled by
sqrt(n / k), so it costs a gather of a few thousand values per snapshot and per update, never a copy of
the model. A move of the whole model (a load) restarts it.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

PROBE_ELEMENTS = 4096  # coordinates the moves are taken on: a 1.6% error on a move spread over the model
REACH_WINDOW_S = 60.0  # the moves summed: as radius.py's PEAK_WINDOW_S, the time its references span
MAX_SEGMENTS = 4096  # snapshots remembered in the window: a trainer snapshots at most every few ms


class OwnReach:
    """Our own moves of one group, on a random probe of its coordinates; thread-safe."""

    def __init__(self, sizes: list[int], *, clock: Callable[[], float] = time.monotonic,
                 rng: np.random.Generator | None = None):
        total = sum(sizes)
        rng = rng or np.random.default_rng(secrets.randbits(64))
        k = min(PROBE_ELEMENTS, total)
        flat = np.sort(rng.choice(total, size=k, replace=False)) if total else np.zeros(0, dtype=np.int64)
        bounds = np.cumsum([0] + list(sizes))
        # per tensor: the flat indices of the probe that fall in it, relative to its own start
        self._index = [flat[(flat >= lo) & (flat < hi)] - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        self._scale_sq = total / k if k else 0.0
        self._clock = clock
        self._lock = threading.Lock()
        self._last: np.ndarray | None = None  # the probe at the last snapshot
        self._applied = np.zeros(k)  # what updates added to the probe since then
        self._moves: deque[tuple[float, float]] = deque(maxlen=MAX_SEGMENTS)  # (when, ||our move||^2)

    def probe(self, values: list[Any]) -> np.ndarray:
        """The probe's coordinates of `values` (the group's tensors, or a snapshot, or received copies)."""
        parts = []
        for idx, v in zip(self._index, values):
            if not idx.size:
                continue
            if isinstance(v, np.ndarray):
                parts.append(v.reshape(-1)[idx].astype(np.float64))
            else:
                import torch

                flat = v.detach().reshape(-1)
                parts.append(flat[torch.from_numpy(idx).to(flat.device)].to("cpu", torch.float64).numpy())
        return np.concatenate(parts) if parts else np.zeros(0)

    def snapshot(self, values: list[Any]) -> None:
        """A snapshot was taken: what moved us since the last one, less the updates, was our own steps."""
        now_probe = self.probe(values)
        with self._lock:
            if self._last is not None:
                own = now_probe - self._last - self._applied
                move_sq = float(np.dot(own, own)) * self._scale_sq
                if math.isfinite(move_sq):
                    self._moves.append((self._clock(), move_sq))
            self._last = now_probe
            self._applied = np.zeros_like(now_probe)

    def applied(self, factor: float, others: list[Any], own: list[Any]) -> None:
        """An update of factor * (others - own) was added (or owed: it counts as added)."""
        delta = factor * (self.probe(others) - self.probe(own))
        with self._lock:
            if self._applied.shape == delta.shape:
                self._applied += delta

    def restart(self) -> None:
        """Our tensors were replaced (a load): the next snapshot is no move of ours."""
        with self._lock:
            self._last = None
            self._applied = np.zeros_like(self._applied)

    def reach(self) -> float | None:
        """sqrt of our own moves' squares summed over the last REACH_WINDOW_S (None: none seen yet)."""
        now = self._clock()
        with self._lock:
            while self._moves and now - self._moves[0][0] >= REACH_WINDOW_S:
                self._moves.popleft()
            if not self._moves:
                return None
            return math.sqrt(sum(m for _, m in self._moves))

    def status(self) -> float | None:
        """`reach()` to 4 significant digits, for the daemon's status."""
        r = self.reach()
        return None if r is None else float(f"{r:.4g}")

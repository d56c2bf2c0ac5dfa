"""A stage handler made `factor` times slower: the benchmark's and tests' stand-in for a weaker machine.

After each computation it sleeps (factor - 1) times what the computation took, so the peer's throughput
(and what it announces) drops by `factor` while its results stay exact. Benchmark only (`slowdown` option).
"""

from __future__ import annotations

import time
from typing import Any


class Slowed:
    def __init__(self, worker, factor: float):
        if not factor >= 1.0:
            raise ValueError(f"slowdown must be >= 1, got {factor}")
        self.worker, self.factor = worker, factor
        self._rate = 0.0

    def kinds(self) -> tuple[str, ...]:
        return self.worker.kinds()

    def input_specs(self, kind: str, batch: int) -> list[tuple[str, str, list[int]]]:
        return self.worker.input_specs(kind, batch)

    def compute(self, kind: str, tensors: list[Any], seed: int) -> tuple[float | None, list[Any]]:
        t0 = time.perf_counter()
        out = self.worker.compute(kind, tensors, seed)
        time.sleep((self.factor - 1.0) * (time.perf_counter() - t0))
        return out

    def samples_per_s(self) -> float:
        return self.worker.samples_per_s() / self.factor

    @property
    def steps(self) -> int:
        return self.worker.steps

    def write_state(self, write):
        return self.worker.write_state(write)

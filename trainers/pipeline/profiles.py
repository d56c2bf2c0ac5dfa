"""The per-block costs the cut is planned from: measured by the peers that hold the blocks, shared in their
stage records, estimated for blocks nobody has measured yet (docs/design.md, "Profiles are shared").

No peer runs the whole model: each measures the blocks of the stage it serves (`partition.profile_stage`) and
announces them (protocol/schema/pipeline.py, BlockProfile). A planner takes, per block:

1. the median of the seconds the pipeline's peers (and we) measured for it: one peer's slow device or lie moves
   the median only as far as the honest measurements around it allow;
2. else the measured cost of a block of the same *signature* (type, parameter bytes, input and output shapes:
   the 8 identical layers of a transformer), the median of those;
3. else an estimate from its size: 6 x parameters x rows (the multiply-adds of a forward and a backward through
   a linear map, per row of its input) plus its output elements, in seconds at the rate the measured blocks
   show (the median of their seconds per estimated operation), or, when nothing is measured yet (the first
   peers of a pipeline), at the rate of a small matrix multiply timed on this device.

The out bytes and parameter bytes always come from the shapes (trainers/pipeline/shapes.py), never from peers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch

from protocol.schema.pipeline import MAX_BLOCK_SECONDS, MAX_PROFILED_BLOCKS, BlockProfile
from trainers.pipeline.partition import BlockCost
from trainers.pipeline.shapes import ModelShapes

PROBE_N = 256  # side of the matrices timed when nothing is measured: ~34 M operations, a millisecond or so
# On a GPU a 256-square multiply is bound by the launch and the wait (tens of microseconds), which put an
# H100's rate 60x below what its blocks then measured (docs/benchmarks.md, 2026-11-27); 4096-square ones
# (1.4e11 operations, milliseconds) time the arithmetic.
PROBE_N_GPU = 4096
PROBE_REPEATS = 5  # the median of these many multiplies


def signatures(model, traced: ModelShapes) -> list[tuple]:
    """Per block, what makes two blocks cost the same: type, parameter bytes, input and output boundary."""
    return [(type(model.on_meta(i)).__name__, traced.param_bytes[i], traced.boundary[i], traced.boundary[i + 1])
            for i in range(len(traced.param_bytes))]


def operations(traced: ModelShapes, i: int, batch: int) -> float:
    """The estimate's operation count for block i (module docstring, rule 3)."""
    inp = traced.boundary[i]
    rows = batch
    for d in inp.shape[:-1]:
        rows *= d
    params = traced.param_bytes[i] / 4  # float32 elements; a rate fitted on measured blocks absorbs the rest
    return 6.0 * params * rows + traced.out_bytes(i, batch) / traced.boundary[i + 1].dtype.itemsize


def probe_seconds_per_operation(device: torch.device) -> float:
    """Seconds per multiply-add of a PROBE_N-square matrix multiply on `device` (the median of a few)."""
    n = PROBE_N_GPU if device.type == "cuda" else PROBE_N
    a = torch.randn(n, n, device=device)
    times = []
    for _ in range(PROBE_REPEATS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        (a @ a).sum().item()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / (2.0 * n ** 3)


def swarm_costs(model, traced: ModelShapes, batch: int, measured: Iterable[BlockProfile], *,
                device: torch.device) -> tuple[list[BlockCost], dict[str, int]]:
    """Per-block costs for the planner (module docstring), and how many blocks came by each rule."""
    n = len(traced.param_bytes)
    seen: dict[int, list[float]] = {}
    for p in measured:
        if 0 <= p.block < n:
            seen.setdefault(p.block, []).append(p.seconds)
    secs: list[float | None] = [statistics.median(seen[i]) if i in seen else None for i in range(n)]
    how = {"measured": sum(s is not None for s in secs), "same_kind": 0, "estimated": 0}
    sigs = signatures(model, traced)
    by_sig: dict[tuple, list[float]] = {}
    for i, s in enumerate(secs):
        if s is not None:
            by_sig.setdefault(sigs[i], []).append(s)
    for i in range(n):
        if secs[i] is None and sigs[i] in by_sig:
            secs[i] = statistics.median(by_sig[sigs[i]])
            how["same_kind"] += 1
    if any(s is None for s in secs):
        rates = [s / operations(traced, i, batch) for i, s in enumerate(secs)
                 if s is not None and operations(traced, i, batch) > 0]
        rate = statistics.median(rates) if rates else probe_seconds_per_operation(device)
        for i in range(n):
            if secs[i] is None:
                secs[i] = max(rate * operations(traced, i, batch), 1e-9)
                how["estimated"] += 1
    costs = [BlockCost(name=f"{i}:{sigs[i][0]}", seconds=float(secs[i] or 0.0), out_bytes=traced.out_bytes(i, batch),
                       param_bytes=traced.param_bytes[i]) for i in range(n)]
    return costs, how


def announced(announcements: dict, pipeline: str, *, but: str | None = None) -> list[BlockProfile]:
    """Every block cost the peers of `pipeline` announce in their stage records (but peer `but`'s), in a fixed
    order, so two readings of the same records compare equal."""
    return sorted((p for pid, a in announcements.items() if a.pipeline == pipeline and pid != but for p in a.profiles),
                  key=lambda p: (p.block, p.seconds, p.out_bytes, p.param_bytes))


def announced_profiles(costs: list[BlockCost], lo: int) -> list[BlockProfile]:
    """Our measured costs of blocks lo.. for our stage record (the first MAX_PROFILED_BLOCKS)."""
    return [BlockProfile(lo + j, min(max(c.seconds, 1e-9), MAX_BLOCK_SECONDS), c.out_bytes, c.param_bytes)
            for j, c in enumerate(costs[:MAX_PROFILED_BLOCKS])]

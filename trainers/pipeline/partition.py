"""Where to cut a model into pipeline stages: measure each block, then PipeDream's dynamic program.

A pipeline runs at the pace of its slowest stage. A stage's time per microbatch is the larger of
its compute and the time to move the activation across the cut into it (forward activation and
backward gradient of the same size, so 2 x bytes), because transfer overlaps with compute of other
microbatches. The plan minimises the slowest stage; among equally slow plans it sends fewer bytes.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from peer.home import atomic_write
from trainers.pipeline.blocks import PipelineModel, seeded

# 1 Gbit/s: a common LAN link; the planner's default when the caller has not measured one.
DEFAULT_LINK_BYTES_PER_S = 125e6
# Forward sends the activation across a cut; backward sends its gradient, the same size, back.
CUT_TRAFFIC_FACTOR = 2


@dataclass(frozen=True)
class BlockCost:
    """One block's measured cost for one microbatch."""

    name: str
    seconds: float  # forward + backward wall time (the last block includes the loss)
    out_bytes: int  # bytes of this block's output activation
    param_bytes: int


@dataclass(frozen=True)
class StagePlan:
    """Contiguous stages over the blocks and what each costs."""

    bounds: list[tuple[int, int]]  # per stage [lo, hi) block indices
    stage_seconds: list[float]  # compute seconds per microbatch per stage
    cut_bytes: list[int]  # forward activation bytes crossing each cut (len = stages - 1)
    bottleneck: int  # index of the slowest stage: max(compute, incoming transfer)

    def stage_of_block(self, i: int) -> int:
        for s, (lo, hi) in enumerate(self.bounds):
            if lo <= i < hi:
                return s
        n = self.bounds[-1][1] if self.bounds else 0
        raise ValueError(f"block index {i} is outside the plan's blocks [0, {n})")


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_profile(path: Path, key: dict, measure: Callable[[], list[BlockCost]] | None,
                   blocks: int) -> list[BlockCost] | None:
    """`measure()`'s costs of `blocks` blocks, measured once per home and stage: a restarted peer reads its earlier
    profile from `path` when `key` (what shapes the blocks and the microbatch) is the same, because profiling
    under a small CPU share took the seconds a pipeline waits for a returning peer. A file that does not parse
    or does not fit is measured afresh and replaced (atomically). No `measure`: the saved costs, or None."""
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key and isinstance(saved.get("costs"), list) and len(saved["costs"]) == blocks:
            costs = [BlockCost(str(c["name"]), float(c["seconds"]), int(c["out_bytes"]), int(c["param_bytes"]))
                     for c in saved["costs"]]
            if all(math.isfinite(c.seconds) and c.seconds > 0 and c.out_bytes >= 0 for c in costs):
                return costs
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    if measure is None:
        return None
    costs = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"key": key, "costs": [asdict(c) for c in costs]}).encode())
    except OSError:
        pass  # no cache, no harm: the next start measures again
    return costs


def profile_blocks(model: PipelineModel, x: Tensor, y: Tensor, *, repeats: int = 3) -> list[BlockCost]:
    """Every block's cost (`profile_stage`), each built alone and dropped before the next: the peak is one block.
    For single-process tools and tests; a pipeline peer profiles only the stage it serves."""
    costs: list[BlockCost] = []
    h = x
    for i in range(len(model)):
        blk = model.build(i, x.device)
        cost, h = _profile_one(blk, i, h, y, model.loss_fn, last=i == len(model) - 1, repeats=repeats)
        costs.append(cost)
        del blk
    return costs


def profile_stage(blocks: list[nn.Module], lo: int, x: Tensor, y: Tensor, loss_fn, *, last: bool,
                  repeats: int = 3) -> list[BlockCost]:
    """Per block of a stage (blocks lo, lo+1, ...): median forward+backward seconds of `repeats` runs after one
    warm-up, on the stage's input `x` (targets `y` for the last block of the last stage).

    Runs in train mode (dropout on, as in training) under a forked RNG, and takes gradients with
    `torch.autograd.grad`, so the blocks' `.grad`s, mode and the caller's RNG are left as they were.
    A block's input is the previous block's output, detached, so each block is timed on its own.
    """
    costs: list[BlockCost] = []
    h = x
    for j, blk in enumerate(blocks):
        cost, h = _profile_one(blk, lo + j, h, y, loss_fn, last=last and j == len(blocks) - 1, repeats=repeats)
        costs.append(cost)
    return costs


def _profile_one(blk: nn.Module, i: int, h: Tensor, y: Tensor, loss_fn, *, last: bool,
                 repeats: int) -> tuple[BlockCost, Tensor]:
    if repeats < 1:
        raise ValueError(f"profile_blocks: repeats must be >= 1, got {repeats}")
    device = h.device
    with seeded(0, device):
        was_training = blk.training
        blk.train()
        params = [p for p in blk.parameters() if p.requires_grad]
        try:
            inp = h.detach().requires_grad_(h.is_floating_point())
            times: list[float] = []
            out = inp
            for r in range(repeats + 1):
                _sync(device)
                start = time.perf_counter()
                out = blk(inp)
                target = loss_fn(out, y) if last else out
                wrt = params + ([inp] if inp.requires_grad else [])
                if wrt and target.requires_grad:
                    grad_out = None if last else torch.ones_like(target)
                    torch.autograd.grad(target, wrt, grad_outputs=grad_out, allow_unused=True)
                _sync(device)
                if r:  # r == 0 is the warm-up
                    times.append(time.perf_counter() - start)
        finally:
            blk.train(was_training)
    cost = BlockCost(name=f"{i}:{type(blk).__name__}", seconds=statistics.median(times), out_bytes=_nbytes(out),
                     param_bytes=sum(_nbytes(t) for t in (*blk.parameters(), *blk.buffers())))
    return cost, out.detach()


def _check_costs(costs: list[BlockCost], stages: int, link_bytes_per_s: float) -> None:
    if stages < 1:
        raise ValueError(f"plan_stages: stages must be >= 1, got {stages}")
    if stages > len(costs):
        raise ValueError(f"plan_stages: {stages} stages need at least {stages} blocks, got {len(costs)}")
    if not (link_bytes_per_s > 0):  # also rejects NaN
        raise ValueError(f"plan_stages: link_bytes_per_s must be > 0, got {link_bytes_per_s}")
    for i, c in enumerate(costs):
        if not (math.isfinite(c.seconds) and c.seconds >= 0):
            raise ValueError(f"plan_stages: block {i} ({c.name}) has seconds {c.seconds}, need finite and >= 0")
        if c.out_bytes < 0 or c.param_bytes < 0:
            raise ValueError(f"plan_stages: block {i} ({c.name}) has negative bytes "
                             f"(out_bytes {c.out_bytes}, param_bytes {c.param_bytes})")


class DoesNotFit(ValueError):
    """No cut into that many stages gives every stage a size some peer can hold: the message says by how much."""


def plan_stages(costs: list[BlockCost], stages: int, *,
                link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
                memory: Callable[[int, int], int] | None = None, memory_cap: int | None = None) -> StagePlan:
    """PipeDream's O(S*N^2) dynamic program over contiguous blocks (no replication).

    With a memory model (`memory(lo, hi)`: bytes serving blocks [lo, hi) takes, trainers/pipeline/memory.py) and
    a `memory_cap`, a stage that would need more than the cap is not a choice: the plan is the fastest among
    those where every stage fits, or DoesNotFit saying the smallest cap that would do.

    Two passes, because "slowest stage, then fewest bytes" does not decompose over prefixes (a
    prefix with a faster bottleneck but more bytes can lose once a slower stage follows): the
    first finds the best bottleneck T*, the second the fewest cut bytes among plans whose stages
    all take <= T*. Stage times come from one table, so the comparison against T* is exact.
    """
    _check_costs(costs, stages, link_bytes_per_s)
    n = len(costs)
    inf = math.inf
    secs = [c.seconds for c in costs]
    # compute[lo][hi]: fsum is correctly rounded, so the same set of blocks always sums the same.
    compute = [[math.fsum(secs[lo:hi]) if hi > lo else 0.0 for hi in range(n + 1)] for lo in range(n + 1)]

    def transfer_in(lo: int) -> float:
        return CUT_TRAFFIC_FACTOR * costs[lo - 1].out_bytes / link_bytes_per_s if lo else 0.0

    def stage_time(lo: int, hi: int) -> float:
        if memory_cap is not None and memory is not None and memory(lo, hi) > memory_cap:
            return inf
        return max(compute[lo][hi], transfer_in(lo))

    # best[k][j]: smallest bottleneck covering blocks [0, j) with k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            best[k][j] = min((max(best[k - 1][i], stage_time(i, j)) for i in range(k - 1, j)), default=inf)
    limit = best[stages][n]
    if limit == inf:
        need = _smallest_cap(n, stages, memory) if memory is not None else 0
        raise DoesNotFit(f"the model's {n} blocks do not fit {stages} stages of at most {_mib(memory_cap or 0)} MiB "
                         f"each: the best cut needs {_mib(need)} MiB for its largest stage; use more stages, "
                         "a larger [pipeline] memory_mib, or peers with more memory")

    # fewest[k][j]: fewest cut bytes covering [0, j) with k stages, each taking <= limit.
    fewest: list[list[float]] = [[inf] * (n + 1) for _ in range(stages + 1)]
    choice = [[-1] * (n + 1) for _ in range(stages + 1)]
    fewest[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if fewest[k - 1][i] == inf or stage_time(i, j) > limit:
                    continue
                total = fewest[k - 1][i] + (costs[i - 1].out_bytes if i else 0)
                if total < fewest[k][j]:
                    fewest[k][j], choice[k][j] = total, i
    bounds: list[tuple[int, int]] = []
    j = n
    for k in range(stages, 0, -1):
        i = choice[k][j]
        bounds.append((i, j))
        j = i
    bounds.reverse()
    times = [stage_time(lo, hi) for lo, hi in bounds]
    return StagePlan(
        bounds=bounds,
        stage_seconds=[compute[lo][hi] for lo, hi in bounds],
        cut_bytes=[costs[lo - 1].out_bytes for lo, _ in bounds[1:]],
        bottleneck=times.index(max(times)),
    )


def _smallest_cap(n: int, stages: int, memory: Callable[[int, int], int]) -> int:
    """The least largest-stage memory over cuts of n blocks into `stages` (a DP like the plan's)."""
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            best[k][j] = min((max(best[k - 1][i], memory(i, j)) for i in range(k - 1, j)), default=math.inf)
    return int(best[stages][n])


def _mib(n: int) -> int:
    return -(-n // (1 << 20))


def format_plan(plan: StagePlan, costs: list[BlockCost]) -> str:
    """A small table: per stage its blocks, ms per microbatch, parameter MB, bytes in; bottleneck marked."""
    rows = [("stage", "blocks", "ms/mb", "params MB", "bytes in", "")]
    for s, (lo, hi) in enumerate(plan.bounds):
        names = ", ".join(c.name for c in costs[lo:hi])
        rows.append((
            str(s), names, f"{plan.stage_seconds[s] * 1e3:.2f}",
            f"{sum(c.param_bytes for c in costs[lo:hi]) / 1e6:.2f}",
            str(plan.cut_bytes[s - 1]) if s else "-",
            "<- bottleneck" if s == plan.bottleneck else "",
        ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)

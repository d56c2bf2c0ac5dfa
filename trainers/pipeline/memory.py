"""How much memory a stage of a pipeline needs, and whether a peer can hold it: the cut's and placement's
memory constraint (docs/design.md, "Memory is a budget").

A peer announces its budget (`[pipeline] memory_mib`, or what its host, cgroup or GPU had free at start) in its
stage record. A stage of blocks [lo, hi) needs, on the peer serving it:

  parameters + their gradient + the optimizer's per-parameter state (Adam: 2 moments; SGD: 1 momentum): what a
    plain torch loop holds. At-most-once keeps no copy of the gradient: a call's gradient goes into it at once,
    provisionally (trainers/pipeline/stage.py), and what waits for the driver's ack is the call's inputs
  + MAX_KEPT calls' inputs (the kept book's bound in count, peer/pipeline/kept.py)
  + ACTIVATION_FACTOR x the stage's block outputs for one microbatch (autograd keeps each block's
    intermediates while it recomputes the forward for a backward; a transformer block keeps ~8 outputs' worth)
  + STEP_TEMPORARIES x its largest block's parameters (the optimizer steps one parameter at a time, and Adam's
    step holds two temporaries of a parameter's size) + ALLOCATOR_SLACK x its parameters (what the allocator
    and the step's bookkeeping hold beyond those tensors) + PROCESS_GROWTH (sessions, buffers, the heap grow)

on top of what the process holds before any block (the interpreter, torch, the daemon: `baseline`, measured at
start). The model is an estimate from shapes alone (trainers/pipeline/shapes.py), so it is applied with the
budget's margin, and a peer's real use is shown in `peer status` next to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# The daemon's (peer/pipeline/memory_budget.py), re-exported: a GPU's budget keeps the host's margin, figures their unit.
from peer.pipeline.kept import MAX_KEPT
from peer.pipeline.memory_budget import AUTO_MARGIN as AUTO_MARGIN, fits as fits, mib as mib
from peer.session.buffers import MAX_IDLE_BYTES as RECEIVE_POOL_IDLE
from protocol.limits import MiB as MiB
OPTIMIZER_SLOTS = {"adam": 2, "sgd": 1}  # per-parameter state tensors each optimizer keeps (trainers/baseline.py)
ACTIVATION_FACTOR = 8
"""Block outputs' worth of memory autograd keeps per block during one backward (a pre-norm transformer block keeps
its LayerNorm, attention and MLP intermediates: about 8 outputs at 4x MLP width, measured at d 256)."""


STEP_TEMPORARIES = 2
"""Parameter-sized temporaries of one optimizer step (torch's single-tensor Adam on the CPU: sqrt, then divide)."""
ALLOCATOR_SLACK = 0.75
"""Parameter bytes' worth a stage holds beyond its tensors, what the allocator and the step's bookkeeping keep.
Measured (trainers/pipeline/memory_probe.py, 2026-11-28, `peer bench pipeline --memory`'s stages of
wide:issue_stage): above the process's baseline, a stage peaked at 4.72 x its parameter bytes with Adam (four
4096² blocks; a plain torch loop: 4.53 x), 3.72 x with SGD (torch: 3.28 x), and 5.43 x for the first and the last
two blocks (torch: 5.05 x); this slack keeps the estimate 7-16% above each."""
PROCESS_GROWTH = 64 * MiB
"""What a serving daemon's heap grows by after its stage is built (sessions, tensor buffers, the allocator):
measured 50 MiB for 4 daemons training a 151 M-parameter model (tests/test_pipeline_big.py)."""


AVERAGING_COPIES = 2
"""Parameter bytes' worth an averaging exchange of the stage holds: our snapshot, and the partner's decoded values
(peer/averaging/engine.py). Counted for one exchange at a time: a stage's peers average with one partner per
round (`average_in_background`, mode "one"); exchanges other partners offer meanwhile take the daemon's serving
slots ([gossip] max_concurrent_exchanges), each with another two copies, which this does not hold. Left out before
2026-11-30: two peers of a 134 MB stage then held 256 MiB beyond their plan and one was OOM-killed in CI."""


def state_bytes(param_bytes: int, optimizer: str) -> int:
    """A block's parameters, gradient and optimizer state."""
    return param_bytes * (2 + OPTIMIZER_SLOTS.get(optimizer, 2))


def stage_bytes(param_bytes: Sequence[int], out_bytes: Sequence[int], lo: int, hi: int, optimizer: str) -> int:
    """What serving blocks [lo, hi) holds beyond the process's baseline (module docstring); no block, nothing.
    `out_bytes[i]`: block i's output for one microbatch."""
    if hi <= lo:
        return 0
    params = sum(param_bytes[lo:hi])
    call_inputs = (out_bytes[lo - 1] if lo else out_bytes[lo]) + out_bytes[hi - 1]  # (h, grad_out), about
    return (state_bytes(params, optimizer) + MAX_KEPT * call_inputs + ACTIVATION_FACTOR * sum(out_bytes[lo:hi])
            + STEP_TEMPORARIES * max(param_bytes[lo:hi], default=0) + int(ALLOCATOR_SLACK * params)
            + PROCESS_GROWTH)


def sharing_bytes(params: int) -> int:
    """What averaging a stage of `params` parameter bytes with its peers holds on top of computing it: one
    exchange's copies and the daemon's idle receive buffers (module docstring)."""
    return AVERAGING_COPIES * params + RECEIVE_POOL_IDLE


def cap_for_stages(budgets_bytes: Sequence[int], stages: int) -> int | None:
    """The memory every stage of the cut must fit: the `stages`-th largest budget among the peers known (ours
    included), so at least `stages` peers can each hold any stage; with fewer peers known, the smallest of theirs.
    None when nobody announced a budget (no constraint)."""
    known = sorted((b for b in budgets_bytes if b > 0), reverse=True)
    if not known:
        return None
    return known[min(stages, len(known)) - 1]


def placed_rooms(announcements: Iterable, pipeline: str) -> list[int]:
    """The stage rooms (bytes) of the peers placed in `pipeline`: serving one of its stages at a measured speed,
    so they hold a stage and compute its calls (which drivers check, peer/pipeline/verify.py). A record that
    only claims a room counts for nothing here: keys are free, and a few records claiming 1 PiB would otherwise
    lift the cut's cap (`cap_for_stages`) past what any real peer holds."""
    return [a.stage_room_mib * MiB for a in announcements if a.pipeline == pipeline and a.samples_per_s > 0]


MMAP_THRESHOLD = 1 * MiB
"""Allocations of this many bytes or more get their own mapping, returned to the system when freed. glibc raises
its threshold as large blocks are freed and keeps freed memory in one arena per thread; a stage computed by a
pool of threads then held up to 7.1 x its parameter bytes where one thread held 5.1 x, and 4.4 x with the
threshold fixed at 1 MiB (/tmp probe, 2026-11-26: 7 blocks of 3072², calls and acks on 8 threads)."""
M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def fix_allocator() -> str:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD for this process (a stage's memory then follows its
    tensors); what was done, for the log. Elsewhere than glibc, nothing."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "mallopt") or not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
            return "the allocator's mmap threshold is left as it is (not glibc)"
    except OSError:
        return "the allocator's mmap threshold is left as it is (no C library found)"
    return f"allocations of {MMAP_THRESHOLD // MiB} MiB or more are mapped and returned to the system when freed"

"""What one stage really holds, against a plain torch loop over the same blocks: `peer bench pipeline --memory`
runs this twice, as two fresh processes, and compares their peaks (docs/design.md, "Memory is a budget").

  python -m trainers.pipeline.memory_probe --mode torch|stage --model M --data D --lo L --hi H

`torch`: the blocks [lo, hi) trained the way a user would without peertrain: forward, `.backward()` of the
next stage's gradient (random, of the right shape; the loss on the targets for the last stage), an optimizer
step every `--accumulate` microbatches. `stage`: the same blocks as a `StageWorker` served as the daemon serves
them: `--in-flight` forwards, then their backwards, then the acks (every `--drop-every`-th dropped instead: a
driver's check, peer/pipeline/verify.py), so provisional gradients wait for their acks and steps for them;
`--max-held` is the gradient copies its memory room holds beside the plan (trainers/swarm_pipeline.py).

Both print one JSON line: `hwm_mib` (VmHWM: the process's peak resident memory, shared libraries included),
`baseline_mib` (VmRSS after imports and the data, before any block), `above_baseline_mib`, and with `stage`
the plan's estimate for the stage (`estimate_mib`, trainers/pipeline/memory.py), to check it against.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from peer.pipeline.memory_budget import peak_rss_bytes, rss_bytes
from trainers import torch_data
from trainers.baseline import make_optimizer
from trainers.pipeline import memory, shapes
from trainers.pipeline.blocks import from_factory
from trainers.pipeline.memory import MiB
from trainers.pipeline.stage import StageWorker
from trainers.swarm_pipeline import PipelineData, sample_microbatch

SEED_X, SEED_G = 1, 2  # the inputs' and the gradients' random draws (values do not change what memory holds)


def _inputs(model, data: str, microbatch: int, lo: int, hi: int):
    """(sample x, sample y of the model, the stage's input, the gradient of its output or the targets)."""
    train, test = torch_data.load_datasets(data)
    x, y = sample_microbatch(PipelineData(train, test, data), microbatch, SEED_X)
    traced = shapes.trace(model, x, y)
    gen = torch.Generator().manual_seed(SEED_X)
    b_in, b_out = traced.boundary[lo], traced.boundary[hi]
    h = x if lo == 0 else torch.randn(microbatch, *b_in.shape, generator=gen).to(b_in.dtype)
    last = hi == len(model)
    g = y if last else torch.randn(microbatch, *b_out.shape, generator=gen.manual_seed(SEED_G)).to(b_out.dtype)
    return x, y, traced, h, g


def plain_torch(model, lo: int, hi: int, h, g, *, optimizer: str, microbatches: int, accumulate: int) -> None:
    blocks = torch.nn.Sequential(*(model.build(i) for i in range(lo, hi)))
    opt = make_optimizer(blocks.parameters(), optimizer, lr=1e-5)
    last = hi == len(model)
    for i in range(microbatches):
        out = blocks(h)
        if last:
            model.loss_fn(out, g).backward()
        else:
            out.backward(g)
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)


def as_a_stage(model, lo: int, hi: int, x, y, h, g, *, optimizer: str, microbatches: int, accumulate: int,
               in_flight: int, drop_every: int, max_held: int | None) -> None:
    first, last = lo == 0, hi == len(model)
    stages = 1 if first and last else 2 if first or last else 3
    stage = 0 if first else stages - 1 if last else 1
    worker = StageWorker(model, (lo, hi), stage=stage, stages=stages, max_batch=x.shape[0], sample_x=x,
                         sample_y=y, optimizer=lambda ps: make_optimizer(ps, optimizer, lr=1e-5))
    worker.accumulate_samples = accumulate * x.shape[0]
    worker.max_held = max_held
    kind = "loss" if worker.last else "backward"
    calls = 0
    for _ in range(0, microbatches, in_flight):
        held = []
        for _ in range(in_flight):
            if not worker.last:
                worker.compute("forward", [h], calls)
            held.append(worker.compute(kind, [h, g], calls)[2])
            calls += 1
        for i, hg in enumerate(held):
            if drop_every and (calls - in_flight + i) % drop_every == drop_every - 1:
                hg.release()
            else:
                hg.accumulate()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainers.pipeline.memory_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("torch", "stage"), required=True)
    ap.add_argument("--model", required=True, help="model factory, module:function")
    ap.add_argument("--data", required=True, help="dataset factory, module:function returning (train, test)")
    ap.add_argument("--lo", type=int, required=True)
    ap.add_argument("--hi", type=int, required=True)
    ap.add_argument("--optimizer", default="adam", choices=sorted(memory.OPTIMIZER_SLOTS))
    ap.add_argument("--microbatch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--accumulate", type=int, default=4, help="microbatches per optimizer step")
    ap.add_argument("--in-flight", type=int, default=2, help="stage: microbatches computed before their acks")
    ap.add_argument("--drop-every", type=int, default=5, help="stage: every n-th call is dropped, not acked")
    ap.add_argument("--max-held", type=int, default=0,
                    help="stage: gradient copies the room holds beside the stage's plan (default 0: a room of just "
                         "the plan; -1: no bound)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.mode == "stage":
        memory.fix_allocator()  # as the trainer does before any block (memory.py says why)
    model = from_factory(a.model)
    if not 0 <= a.lo < a.hi <= len(model):
        print(f"--lo/--hi: need 0 <= lo < hi <= {len(model)}", file=sys.stderr)
        return 2
    x, y, traced, h, g = _inputs(model, a.data, a.microbatch, a.lo, a.hi)
    baseline = rss_bytes()
    if a.mode == "torch":
        plain_torch(model, a.lo, a.hi, h, g, optimizer=a.optimizer, microbatches=a.microbatches,
                    accumulate=a.accumulate)
    else:
        as_a_stage(model, a.lo, a.hi, x, y, h, g, optimizer=a.optimizer, microbatches=a.microbatches,
                   accumulate=a.accumulate, in_flight=a.in_flight, drop_every=a.drop_every,
                   max_held=None if a.max_held < 0 else a.max_held)
    hwm = peak_rss_bytes()
    outs = [traced.out_bytes(i, a.microbatch) for i in range(len(model))]
    estimate = memory.stage_bytes(traced.param_bytes, outs, a.lo, a.hi, a.optimizer) - memory.PROCESS_GROWTH
    print(json.dumps({"mode": a.mode, "hwm_mib": round(hwm / MiB, 1), "baseline_mib": round(baseline / MiB, 1),
                      "above_baseline_mib": round((hwm - baseline) / MiB, 1),
                      "params_mib": round(sum(traced.param_bytes[a.lo:a.hi]) / MiB, 1),
                      "estimate_mib": round(estimate / MiB, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

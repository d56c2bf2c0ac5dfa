"""SWARM-style pipeline training hosted by the daemon: each peer serves one stage of a model cut into stages,
and any peer holding data drives microbatches through whichever peers of each stage are alive and fast.

Start-up: build the model's blocks (the built-in char transformer on the shipped Shakespeare corpus, or the
user's `model_factory`), profile every block's forward+backward time and activation size, cut the model with
PipeDream's dynamic program (printed), agree on one cut with the peers already serving it, pick a stage
(peer/pipeline/placement.py), keep only that stage's blocks on `[pipeline] device` (a GPU when there is one), download the stage's current state from a
peer of the stage if it is already training, and serve it.

Learning: a server keeps each backward's gradient aside until the microbatch's driver acknowledges it (the
microbatch went back through every stage; peer/pipeline/kept.py), so a gradient enters a stage at most once;
it accumulates acknowledged gradients until it has seen its share of `batch_size` samples (`batch_size` /
peers of the stage, so the stage as a whole steps once per `batch_size` samples, as one process would), steps its own optimizer (its state stays local), then averages the stage's parameters with another peer
of the same stage through the gossip engine (partners: the peers of that stage only).

Moving (trainers/pipeline/seat.py, mover.py): the daemon decides where this peer serves
(peer/pipeline/seating.py, from the figures the seat gives it and the records): to the bottleneck stage when a
move beats the measured noise, or to a stage left without peers. A background thread makes the moves it
orders, carrying the stage's weights, optimizer state and step from a live peer or the freshest copy; it backs
up the next stage's state every `copy_every` seconds and checkpoints its own every `checkpoint_every`. A restarted peer resumes its
stage from its checkpoint if nobody serves it.

Data: the built-in Shakespeare corpus, or `dataset_factory` returning (train, test) torch datasets, map-style or
iterable, `test` optional (None: no validation loss, said in the log and in status). Both go through the
adapter gossip training uses (trainers/torch_data.py): this peer's shard by rank and world, seeded batches.

Driving: microbatches of `microbatch` samples from this peer's shard (every one full, so every call has the
stage's fixed batch), at most `in_flight` at once, until it has driven `samples` of them; then a validation
pass through the pipeline (the test set's first `eval_batches` microbatches). The peer keeps serving until it
is stopped (other drivers may still need its stage); `peer status` shows the stage map throughout.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from peer.pipeline.memory_budget import rss_bytes
from peertrain.pipeline import Microbatch, PipelineKey
from peertrain.swarm import RANK_ENV
from trainers import torch_data
from trainers.datasets import load_char_corpus
from trainers.options import option, parse_options
from trainers.pipeline import memory, profiles, shapes
from trainers.pipeline.blocks import char_transformer_pipeline, from_factory
from trainers.pipeline.mover import SeatMover
from trainers.pipeline.partition import format_plan, plan_stages
from trainers.pipeline.seat import Memory, StageSeat, stage_wrapper

DRAIN_S = 600.0  # most seconds to wait for the microbatches still in flight when driving ends (each is bounded anyway)
EVAL_S = 600.0  # most seconds one validation pass may take
MOVER_STOP_S = 30.0  # most seconds to wait for the mover's round (a move's download is bounded by state_timeout)
SETTLE_S = 6.0  # seconds peers starting together take to agree on a cut and spread over the stages: 3 record intervals
BUILTIN_SOURCE = "the built-in Shakespeare corpus"
NO_TEST = "no test set: dataset_factory returned None for it"  # val_error in status, said in the log


@dataclass(frozen=True)
class SwarmPipelineOptions:
    """`[trainer.options]` of trainers.swarm_pipeline; docs/config.md's table is generated from these fields."""

    pipeline: str = option("shakespeare", "the pipeline's name: peers of one pipeline must build the same model")
    model_factory: str = option("", '"pkg.module:fn" returning `(nn.Sequential or list of modules, loss_fn)` '
                                    "(empty: the built-in char transformer on Shakespeare)")
    dataset_factory: str = option("", '"pkg.module:fn" returning `(train, test)` torch datasets of (input, '
                                      "target) samples, map-style or iterable, sharded by rank (`test` may be "
                                      "`None`: no validation loss; empty: the built-in Shakespeare corpus)")
    stages: int = option(4, "stages the model is cut into")
    role: str = option("auto", "auto (serve a stage and drive) | server | driver")
    d_model: int = option(256, "built-in model: width")
    n_layers: int = option(8, "built-in model: blocks")
    n_heads: int = option(8, "built-in model: attention heads")
    block: int = option(128, "built-in model: context length")
    dropout: float = option(0.1, "built-in model: dropout")
    optimizer: str = option("adam", "each stage's own optimizer: adam | sgd")
    lr: float = option(1e-3, "learning rate")
    weight_decay: float = option(0.0, "weight decay")
    grad_clip: float = option(1.0, "clip a stage's gradient norm to this (0: no clipping)")
    batch_size: int = option(64, "samples per optimizer step of a stage, swarm-wide")
    microbatch: int = option(16, "samples per microbatch (the largest call a stage accepts)")
    samples: int = option(20_000, "samples this peer drives (0: drive until stopped)")
    # in_flight: more fill the stages better but step them on staler gradients (6 drivers x 8 in flight: val loss
    # 2.94-3.21 where 1 in flight reached 2.56 and one process 2.58; tests/test_pipeline_swarm.py); 2 keeps 4
    # stages busy (peer bench pipeline)
    in_flight: int = option(2, "microbatches a driver keeps moving at once: more fill the stages better but step "
                               "them on staler gradients")
    forward_codec: str = option("raw", "activations on the wire: raw | float16 (half the bytes, relative error "
                                       "≤ 2⁻¹¹) | q8 (a quarter, error ≤ a block's max/254); q8 both ways: "
                                       "validation loss within 2·10⁻⁶ of raw's, relative (`peer bench pipeline "
                                       "--codec`)")
    backward_codec: str = option("raw", "gradients on the wire: raw | float16 | q8")
    average_every: int = option(1, "average the stage's parameters with another peer of the stage after this "
                                   "many optimizer steps (0: never)")
    eval_every: int = option(0, "samples driven between validation passes (0: only at the end)")
    eval_batches: int = option(4, "validation microbatches per pass")
    link_mbit: float = option(1000.0, "link speed (Mbit/s) the cut assumes between stages; the cut is planned from "
                                      "measured block times and printed")
    seed: int = option(0, "seed of the initial weights, the shards and the batch order")
    threads: int = option(1, "torch threads of this trainer")
    world: int = option(0, "data shards (0: peers seen at start)")
    join_wait: float = option(60.0, "most seconds to wait for every stage to have a peer before driving")
    slowdown: float = option(1.0, "benchmark only: this peer computes its stage this many times slower")
    stage_wrapper: str = option("", 'tests and benchmarks only: "pkg.module:fn" with fn(**stage_wrapper_options) '
                                    "returning a wrapper(handler, worker, seed) of the handler this peer's stage is "
                                    "served through (peer/testing/lying_stage.py: a server that lies); empty: none")
    stage_wrapper_options: dict = option({}, "stage_wrapper's keyword arguments")
    initial_stage: int = option(-1, "the stage this peer starts on (-1: the placement rule picks; benchmarks pin it)")
    rebalance: bool = option(True, "move between stages toward the bottleneck (when a move beats the measured "
                                   "noise, one leaver per stage at a time, carrying the stage's state), and into a "
                                   "stage left empty, while running")
    # rebalance_every: a few record intervals, so a move's effect is measured before the next is weighed
    rebalance_every: float = option(10.0, "mean seconds between rebalancing checks")
    # min_gain: above the ~5% spread of measured stage rates, so peers do not oscillate between near-equal stages
    min_gain: float = option(0.1, "a move must raise the predicted throughput by this fraction at least")
    copy_every: float = option(30.0, "seconds between backups of the next stage's state (0: none); a stage that "
                                     "loses its last peer resumes from a copy at most this old")
    checkpoint_every: float = option(60.0, "seconds between checkpoints of this peer's stage (0: only on request "
                                           "and shutdown); a restarted peer resumes its stage from it if no one "
                                           "serves it")


def _check(o: SwarmPipelineOptions) -> None:
    where = "[trainer.options]"
    if o.role not in ("auto", "server", "driver"):
        raise ValueError(f"{where} role: expected auto, server or driver, got {o.role!r}")
    for k in ("forward_codec", "backward_codec"):
        if getattr(o, k) not in ("raw", "float16", "q8"):
            raise ValueError(f"{where} {k}: expected raw, float16 or q8, got {getattr(o, k)!r}")
    for k in ("stages", "microbatch", "batch_size", "threads", "eval_batches", "d_model", "n_layers", "n_heads", "block"):
        if getattr(o, k) < 1:
            raise ValueError(f"{where} {k}: must be >= 1, got {getattr(o, k)}")
    if not -1 <= o.initial_stage < o.stages:
        raise ValueError(f"{where} initial_stage: must be -1 (automatic) or a stage in [0, {o.stages}), got {o.initial_stage}")
    if o.in_flight < 1:
        raise ValueError(f"[trainer.options] in_flight: must be >= 1, got {o.in_flight}")
    for k in ("rebalance_every",):
        v = getattr(o, k)
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"{where} {k}: must be a finite number above 0, got {v}")
    for k in ("min_gain", "copy_every", "checkpoint_every"):
        v = getattr(o, k)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{where} {k}: must be a finite number >= 0, got {v}")
    for k in ("samples", "average_every", "eval_every", "world"):
        if getattr(o, k) < 0:
            raise ValueError(f"{where} {k}: must be >= 0, got {getattr(o, k)}")
    for k, lo in (("lr", 0.0), ("link_mbit", 0.0), ("slowdown", 1.0 - 1e-9)):
        v = getattr(o, k)
        if not math.isfinite(v) or v <= lo:
            raise ValueError(f"{where} {k}: must be a finite number above {lo:g}, got {v}")
    if not (math.isfinite(o.dropout) and 0 <= o.dropout < 1):
        raise ValueError(f"{where} dropout: must be in [0, 1), got {o.dropout}")
    stage_wrapper(o)  # a ValueError naming what is wrong, before any work
    if o.batch_size < o.microbatch:
        raise ValueError(f"{where} batch_size ({o.batch_size}) must be at least microbatch ({o.microbatch})")


@dataclass(frozen=True)
class PipelineData:
    """The trainer's (train, test) torch datasets and where they came from, which every data error names."""

    train: Any
    test: Any | None
    source: str


def data_and_model(o: SwarmPipelineOptions):
    """The run's data and model, from its options (a factory's, or the built-in corpus and char transformer)."""
    corpus = None
    if o.dataset_factory:
        data = PipelineData(*torch_data.load_datasets(o.dataset_factory),
                            source=f"[trainer.options] dataset_factory {o.dataset_factory!r}")
    else:
        corpus = load_char_corpus(block=o.block)
        data = PipelineData(corpus[0], corpus[1], source=BUILTIN_SOURCE)
    if o.model_factory:
        model = from_factory(o.model_factory)
    else:
        vocab = len((corpus or load_char_corpus(block=o.block))[2])
        model = char_transformer_pipeline(vocab, d_model=o.d_model, n_layers=o.n_layers, n_heads=o.n_heads,
                                          block=o.block, dropout=o.dropout, seed=o.seed)
    return data, model


def sample_microbatch(data: PipelineData, microbatch: int, seed: int) -> torch_data.Batch:
    """The microbatch every peer measures the model on (block costs, boundary shapes): the first of the whole
    train set in the order `seed` draws, the same on every peer."""
    loader = torch_data.loader(data.train, microbatch, generator=torch.Generator().manual_seed(seed), drop_last=True)
    got = torch_data.take(loader, 1, f"{data.source}: the train set")
    if not got:
        raise torch_data.DataError(f"[trainer.options] microbatch: {data.source}'s train set has fewer samples than "
                                   f"one microbatch of {microbatch}")
    return got[0]


def training_microbatches(data: PipelineData, rank: int, world: int, *, microbatch: int,
                          seed: int) -> Iterator[torch_data.Batch]:
    """This driver's microbatches, pass after pass over its shard (rank of world), each of exactly
    `microbatch` samples: a stage takes calls of its fixed batch, so a pass's short tail is left out."""
    shard = torch_data.shard(data.train, rank, world, seed=seed)
    size = torch_data.shard_size(shard)
    where = f"this peer's shard (rank {rank} of {world}) of {data.source}'s train set"
    if size is not None and size < microbatch:
        raise torch_data.DataError(f"[trainer.options] microbatch: {where} has {size} samples, fewer than one "
                                   f"microbatch of {microbatch}")
    gen = torch.Generator().manual_seed(seed * 7919 + rank * 104729)
    loader = torch_data.loader(shard, microbatch, generator=gen, drop_last=True)
    return torch_data.endless(loader, f"{data.source}: the train set",
                              empty=f"[trainer.options] microbatch: {where} yielded no microbatch of {microbatch} "
                                    "samples; use fewer shards (world), a smaller microbatch or more data")


def validation_microbatches(data: PipelineData, microbatch: int, eval_batches: int) -> list[torch_data.Batch] | None:
    """The test set's first `eval_batches` microbatches in order, the same every pass (None without a test set).
    Read once, at start: a test set that does not load fails the run before it trains."""
    if data.test is None:
        return None
    what = f"{data.source}: the test set"
    got = torch_data.take(torch_data.loader(data.test, microbatch, shuffle=False), eval_batches, what)
    if not got:
        raise torch_data.DataError(f"{what} is empty: nothing to validate on (return None for no validation)")
    return got


def run(swarm, options: dict) -> dict:
    o = parse_options(SwarmPipelineOptions, options, trainer="trainers.swarm_pipeline")
    _check(o)
    torch.set_num_threads(o.threads)
    device = torch.device(swarm.stage_device())  # [pipeline] device: our stage's blocks live and compute there
    swarm.log("memory: %s", memory.fix_allocator())  # before any block: freed tensors go back (memory.py says why)
    data, model = data_and_model(o)
    if o.stages > len(model):
        raise ValueError(f"[trainer.options] stages: {o.stages} stages for a model of {len(model)} blocks")
    sample_x, sample_y = sample_microbatch(data, o.microbatch, o.seed)
    traced = shapes.trace(model, sample_x, sample_y)  # boundaries and block sizes, no block built
    mem = _memory(swarm, o, traced, device)
    costs, how = profiles.swarm_costs(model, traced, o.microbatch,
                                      profiles.announced(swarm.stage_announcements(), o.pipeline), device=device)
    plan = plan_stages(costs, o.stages, link_bytes_per_s=o.link_mbit * 1e6 / 8, memory=mem.need,
                       memory_cap=memory.cap_for_stages(
                           [mem.room] + memory.placed_rooms(swarm.stage_announcements().values(), o.pipeline),
                           o.stages))
    own_cuts = tuple(hi for _, hi in plan.bounds[:-1])
    swarm.log("planned cut of %s into %d stages (block costs: %d measured by the pipeline's peers, %d from blocks of "
              "the same kind, %d estimated from their size):\n%s", o.pipeline, o.stages, how["measured"],
              how["same_kind"], how["estimated"], format_plan(plan, costs))
    boundary = [(str(b.dtype).removeprefix("torch."), list(b.shape)) for b in traced.boundary[1:]]
    rank, world = swarm.rank_and_world(o.world or None)
    env_rank = rank if o.world or _launcher_numbered() else None
    rng = random.Random(hash((swarm.peer_id, o.seed)))

    state = StageSeat(swarm, o, model, sample_x, sample_y, costs, device=device, mem=mem)
    mover = None
    if o.role != "driver":
        key = PipelineKey(o.pipeline, swarm.adopted_cut(o.pipeline, own_cuts))
        state.key = key
        ckpt = _own_checkpoint(swarm, key)
        if ckpt is None or not state.resume(ckpt):
            # Joining a pipeline that already trains: the stage that needs us most, whatever our rank says.
            first = swarm.first_move(state.seat_figures(key, settling=True), env_rank)
            running = not first.starting
            state.settling = not running
            state.take(key, o.initial_stage if o.initial_stage >= 0 else first.to_stage)  # calls from join_stage on
            if not running:  # peers starting together agree on a cut and spread out; a joiner need not wait
                state.settle(own_cuts, env_rank, deadline=time.monotonic() + SETTLE_S)
        key = state.key
    else:
        key = _wait_for_cut(swarm, o, own_cuts)
    swarm.publish({"trainer": "trainers.swarm_pipeline", "pipeline": o.pipeline, "stages": o.stages,
                   "cuts": list(key.cuts), "my_stage": state.stage, "role": o.role, "state": "waiting for stages",
                   "device": str(device), "model_mib": memory.mib(sum(memory.state_bytes(b, o.optimizer)
                                                                       for b in traced.param_bytes)),
                   "plan_ms": [float(f"{s * 1000:.4g}") for s in plan.stage_seconds]})  # 4 digits: never 0
    if not _wait_for_stages(swarm, key, o.join_wait):
        swarm.log("not every stage has a peer after %.0fs; driving anyway (microbatches wait for them)", o.join_wait)
    if o.role != "driver":
        state.join_stage()
        mover = SeatMover(state, rng)
        mover.start()
    swarm.on_checkpoint_request(state.save)

    result: dict = {}
    driving = o.role != "server"
    handle = None
    if driving:
        handle = swarm.open_driver(key, reply_shapes=_reply_shapes(key, boundary),
                                   in_flight=o.in_flight,
                                   forward_codec=o.forward_codec, backward_codec=o.backward_codec)
        microbatches = training_microbatches(data, rank, world, microbatch=o.microbatch, seed=o.seed)
        validation = validation_microbatches(data, o.microbatch, o.eval_batches)
        if validation is None:
            swarm.log("%s; no validation loss", NO_TEST)

        def evaluate() -> dict:
            return _evaluate(handle, validation)

        swarm.on_evaluate_request(evaluate)
        result = _drive(swarm, o, handle, microbatches, validation, state, rank)
        result.update(evaluate())
        swarm.publish(dict(result, state="serving" if o.role != "driver" else "done", driving_done=True))
    while not swarm.should_stop() and o.role != "driver":
        state.housekeeping()
        time.sleep(0.2)
    if mover is not None:
        mover.stop(timeout=MOVER_STOP_S)
    state.save()
    return dict(result, state="done")


def _memory(swarm, o: SwarmPipelineOptions, traced: shapes.ModelShapes, device: torch.device) -> Memory:
    """This peer's memory for a stage (trainers/pipeline/memory.py): the daemon's budget, or the GPU's free
    memory less the same margin; a stage may use it less what the process holds now (before any block)."""
    budget, source = swarm.stage_memory()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        gpu = int(free * (1 - memory.AUTO_MARGIN))
        if not (source.startswith("[pipeline]") and budget < gpu):  # a configured budget below the GPU's holds
            budget, source = gpu, f"the free memory of {device}, less {memory.AUTO_MARGIN:.0%}"
        baseline = torch.cuda.memory_allocated(device)
    else:
        baseline = rss_bytes()
    room = max(1, budget - baseline) if budget > 0 else 0
    out = [traced.out_bytes(i, o.microbatch) for i in range(len(traced.param_bytes))]

    def need(lo: int, hi: int) -> int:
        return memory.stage_bytes(traced.param_bytes, out, lo, hi, o.optimizer)

    def sharing(lo: int, hi: int) -> int:  # kept beside the stage before any gradient copy, where the room holds it
        held = memory.sharing_bytes(sum(traced.param_bytes[lo:hi]))
        return held if room and memory.fits(need(lo, hi) + held, room, 0) else 0

    def max_held(lo: int, hi: int) -> int | None:  # gradient copies the room holds beside the stage and its averaging
        params = sum(traced.param_bytes[lo:hi])
        return max(0, (room - need(lo, hi) - sharing(lo, hi)) // params) if room and params else None

    whole = sum(memory.state_bytes(b, o.optimizer) for b in traced.param_bytes)
    swarm.log("memory: the model holds %d MiB (weights, gradients, %s state); this peer's budget is %s (%s), "
              "of which %s for a stage (the process holds %d MiB before any block)", memory.mib(whole), o.optimizer,
              f"{memory.mib(budget)} MiB" if budget else "unknown", source,
              f"{memory.mib(room)} MiB" if room else "all", memory.mib(baseline))
    return Memory(budget, room, need, max_held, sharing)


def _own_checkpoint(swarm, key: PipelineKey) -> dict | None:
    """Our checkpoint of a stage of this pipeline and cut (a restarted peer), else None."""
    ckpt = swarm.load_checkpoint()
    if not isinstance(ckpt, dict) or ckpt.get("pipeline") != key.name or tuple(ckpt.get("cuts", ())) != key.cuts \
            or not isinstance(ckpt.get("worker"), dict):
        return None
    return ckpt


def _launcher_numbered() -> bool:
    return RANK_ENV in os.environ


def _reply_shapes(key: PipelineKey, boundary):
    bounds = list(zip((0, *key.cuts), (*key.cuts, len(boundary))))

    def shapes(stage: int, kind: str, batch: int) -> list[tuple[str, list[int]]]:
        lo, hi = bounds[stage]
        if kind == "forward":
            d, s = boundary[hi - 1]
            return [(d, [batch, *s])]
        if kind in ("backward", "loss") and lo > 0:
            d, s = boundary[lo - 1]
            return [(d, [batch, *s])]
        return []

    return shapes


def _wait_for_cut(swarm, o, own_cuts) -> PipelineKey:
    deadline = time.monotonic() + o.join_wait
    while time.monotonic() < deadline and not swarm.should_stop():
        anns = swarm.stage_announcements()
        if any(a.pipeline == o.pipeline for a in anns.values()):
            time.sleep(SETTLE_S / 2)  # let servers starting with us agree first
            return PipelineKey(o.pipeline, swarm.adopted_cut(o.pipeline, own_cuts))
        time.sleep(0.2)
    return PipelineKey(o.pipeline, own_cuts)


def _wait_for_stages(swarm, key: PipelineKey, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not swarm.should_stop():
        if all(swarm.stage_map(key).values()):
            return True
        time.sleep(0.2)
    return False


def _drive(swarm, o, handle, microbatches: Iterator[torch_data.Batch], validation: list[torch_data.Batch] | None,
           state: StageSeat, rank: int) -> dict:
    seed_base = (rank + 1) * 1_000_000
    t0 = time.monotonic()
    submitted = done = failed = resent = samples = 0
    losses: list[float] = []
    last_pub, next_eval = 0.0, o.eval_every
    val: dict = _evaluate(handle, None) if validation is None else {}  # says there is no validation loss
    swarm.publish({"state": "training", **val})
    while (not o.samples or submitted < o.samples) and not swarm.should_stop():
        xb, yb = next(microbatches)
        handle.submit(Microbatch(id=seed_base + submitted // o.microbatch, x=xb, y=yb, seed=seed_base + submitted))
        submitted += len(yb)
        for out in handle.outcomes():
            done, failed, resent, samples = _account(out, done, failed, resent, samples, losses)
        state.housekeeping()
        now = time.monotonic()
        if o.eval_every and validation is not None and samples >= next_eval:
            next_eval += o.eval_every
            val = _evaluate(handle, validation)
        if now - last_pub > 1.0:
            last_pub = now
            swarm.publish(_progress(t0, samples, done, failed, resent, losses, state, val))
    for out in handle.drain(timeout=DRAIN_S):
        done, failed, resent, samples = _account(out, done, failed, resent, samples, losses)
    state.housekeeping()
    res = _progress(t0, samples, done, failed, resent, losses, state, val)
    swarm.publish(res)
    return res


def _account(out, done, failed, resent, samples, losses):
    if out.evaluate:
        return done, failed, resent, samples
    if out.ok:
        done += 1
        samples += out.samples
        if out.loss is not None:
            losses.append(out.loss)
    else:
        failed += 1
    return done, failed, resent + out.resent, samples


def _progress(t0, samples, done, failed, resent, losses, state, val) -> dict:
    elapsed = time.monotonic() - t0
    recent = losses[-20:]
    return {"samples": samples, "microbatches_done": done, "microbatches_failed": failed, "calls_resent": resent,
            "loss": sum(recent) / len(recent) if recent else None, "samples_per_s": round(samples / max(elapsed, 1e-9), 3),
            "elapsed_s": round(elapsed, 3), **state.figures(), **val}


def _evaluate(handle, validation: list[torch_data.Batch] | None) -> dict:
    """Validation loss through the pipeline on the validation microbatches (none without a test set)."""
    if validation is None:
        return {"val_loss": None, "val_error": NO_TEST}
    mbs = [Microbatch(id=-(i + 1), x=xb, y=yb, seed=0, evaluate=True) for i, (xb, yb) in enumerate(validation)]
    outcomes = handle.run_many(mbs, timeout=EVAL_S)
    losses = [out.loss for out in outcomes if out.ok and out.loss is not None]
    if len(losses) < len(mbs):
        return {"val_loss": None, "val_error": f"{len(mbs) - len(losses)} of {len(mbs)} validation microbatches failed"}
    return {"val_loss": sum(losses) / len(losses)}

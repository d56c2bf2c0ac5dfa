"""Decentralized SGD hosted by the daemon: AD-PSGD (default) or D-PSGD, on any torch model and optimizer.

Each peer trains on its own shard of the data and, after every `average_every` steps, averages its
parameters with neighbours through the daemon:
  * adpsgd — start one pairwise exchange with a random neighbour in the background and keep computing
    (no global rounds; a slow neighbour only delays itself);
  * dpsgd  — exchange with every neighbour before the next step (no global barrier either: a neighbour
    that misses the exchange deadline is skipped).
Optimizer state (momentum, Adam moments) stays local, as in the AD-PSGD/D-PSGD papers. Held-out accuracy
is measured on this peer's *local* model. Checkpoints (model, optimizer, step) are written atomically
every `checkpoint_every` steps and on shutdown; a restarted peer resumes from its own checkpoint, and a
new peer first downloads a neighbour's parameters so it starts where the swarm is.

Data: the model's built-in data set, or `dataset_factory` returning (train, test) torch datasets, map-style or
iterable, test optional; both are sharded by rank and batched by one adapter (trainers/torch_data.py).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from peertrain.optimizer import MODES as GOSSIP_MODES
from peertrain.optimizer import GossipOptimizer
from peertrain.outer import MODES as OUTER_MODES
from peertrain.outer import SPARSE, LocalStepsOptimizer
from protocol.tensor_codec import DENSE_CODECS
from trainers import torch_data
from trainers.baseline import RECOMMENDED, Hyperparams, make_optimizer, seeded_model

DILOCO = Hyperparams(epochs=0, batch_size=0, lr=0.0)  # a custom model's outer step: the dataclass's defaults
from trainers.datasets import head, load_factory, load_sized_model
from trainers.models import count_parameters, pick_device
from trainers.options import option, parse_options


@dataclass(frozen=True)
class GossipSGDOptions:
    """`[trainer.options]` of trainers.gossip_sgd; docs/config.md's table is generated from these fields.

    Hyperparameters left at 0 (or -1, or "") take the built-in model's recipe (trainers/baseline.py)."""

    model: str = option("digits_mlp", "built-in model: digits_mlp, digits_cnn, digits_wide_mlp, char_transformer, "
                                      "lm_14m or lm_100m (14 M and 107 M parameters, for slow links)")
    model_factory: str = option("", '"pkg.module:fn" returning an `nn.Module` (overrides `model`)')
    dataset_factory: str = option("", '"pkg.module:fn" returning `(train, test)` torch datasets, map-style or '
                                      "iterable, sharded by rank (`test` may be `None`: no accuracy)")
    loss: str = option("", '"pkg.module:fn" or a torch.nn loss class, e.g. "torch.nn.functional:mse_loss" '
                           "(empty: cross-entropy, torch_data.DEFAULT_LOSS)")
    num_workers: int = option(0, "DataLoader worker processes (0: load in the trainer's thread, enough for "
                                 "in-memory data)")
    model_options: dict = option({}, "a built-in model's size, e.g. `{d_model = 64, block = 32}`")
    mode: str = option("adpsgd", "adpsgd (one neighbour, in the background) | dpsgd (every neighbour, before the "
                                 "next step) | local (`inner_steps` local steps, then an outer step, gossiped)")
    optimizer: str = option("", "sgd | adam (empty: the model's recipe)")
    lr: float = option(0.0, "learning rate (0: the recipe's)")
    momentum: float = option(-1.0, "SGD momentum (-1: the recipe's)")
    weight_decay: float = option(-1.0, "weight decay (-1: the recipe's)")
    batch_size: int = option(0, "samples per step of this peer (0: the recipe's)")
    # default: the recipe's epochs x world, so each peer sees as many samples as the single-process recipe
    epochs: float = option(0.0, "passes over this peer's own shard (0: the recipe's epochs x world; stops "
                                "early at the target)")
    max_steps: int = option(0, "steps to run (0: from `epochs`; needed for an iterable dataset without a length)")
    warmup_steps: int = option(0, "steps of linear learning-rate warm-up")
    schedule: str = option("constant", "learning-rate schedule after warm-up: constant | cosine")
    grad_clip: float = option(0.0, "clip the gradient norm to this (0: no clipping)")
    amp: bool = option(False, "mixed precision (CUDA only)")
    average_every: int = option(1, "steps between averagings with neighbours")
    target_accuracy: float = option(0.0, "stop when the local model reaches this held-out accuracy (0: run the "
                                         "whole budget)")
    target_loss: float = option(0.0, "stop when the held-out loss falls to this (0: no such target)")
    # mode = "local" (peertrain/outer.py: DiLoCo's recipe, gossiped); the outer step's defaults are the model's
    # recipe (trainers/baseline.py: DiLoCo's 0.7 and 0.9 for Adam, plain averaging for the SGD digits models)
    inner_steps: int = option(50, "mode local: local steps per round (fewer exchanges by this factor)")
    outer_lr: float = option(0.0, "mode local: the outer step's learning rate (SGD on how far the round moved; "
                                  "0: the recipe's, DiLoCo's 0.7 for a custom model)")
    outer_momentum: float = option(-1.0, "mode local: the outer step's momentum (-1: the recipe's, DiLoCo's 0.9 "
                                         "for a custom model)")
    outer_nesterov: bool = option(True, "mode local: Nesterov momentum for the outer step")
    outer_codec: str = option("", "mode local: raw | float16 | q8 (a quarter of the bytes) for the outer "
                                  "weights' exchanges (empty: `[gossip] codec`) | sparse (each round's update, "
                                  "64 of every 4096 values, pushed to every partner: 1/108 of float32's bytes)")
    outer_resync_every: int = option(25, "outer_codec sparse: rounds between q8 averagings of the outer weights "
                                          "(bring back replicas a lost push left apart; 0: never)")
    outer_error_feedback: bool = option(True, "mode local: carry a lossy codec's rounding into the next exchange")
    outer_background: bool = option(True, "mode local: exchange while the next round's inner steps run (one "
                                          "round stale; a slow or vanished peer holds no one up)")
    outer_averaging: str = option("one", "mode local: one (a random neighbour, pairwise) | all (every neighbour, "
                                         "Metropolis weights)")
    eval_every: int = option(25, "steps between held-out evaluations")
    eval_samples: int = option(0, "evaluate on the first N held-out samples only (0: all): cheaper, as fixed a "
                                  "yardstick")
    checkpoint_every: int = option(100, "steps between checkpoints (0: only on request and shutdown)")
    checkpoint_at_end: bool = option(True, "write a checkpoint when the run ends or the daemon stops (false: a run "
                                           "whose state is not kept, as a benchmark's: four 100 M-parameter peers "
                                           "writing 2.5 GB each at once stalled a 24 GB VM for minutes)")
    seed: int = option(0, "seed of the initial weights, the shards and the batch order")
    world: int = option(0, "data shards (0: the number of peers seen at start)")
    threads: int = option(1, "torch threads of this trainer")
    min_peers: int = option(-1, "peers to wait for before the first step (-1: world - 1)")
    join_wait: float = option(30.0, "most seconds to wait for them (then start anyway)")
    step_delay: float = option(0.0, "benchmark only: extra seconds per step, to make a straggler")


def _recipe(o: GossipSGDOptions, world: int):
    r = RECOMMENDED.get(o.model)
    if r is None and (o.lr <= 0 or o.batch_size <= 0 or (o.epochs <= 0 and o.max_steps <= 0)):
        raise ValueError("[trainer.options] a custom model needs lr, batch_size and epochs or max_steps")
    return dict(
        optimizer=o.optimizer or (r.optimizer if r else "sgd"),
        lr=o.lr or r.lr,
        momentum=o.momentum if o.momentum >= 0 else (r.momentum if r else 0.9),
        weight_decay=o.weight_decay if o.weight_decay >= 0 else (r.weight_decay if r else 0.0),
        batch_size=o.batch_size or r.batch_size,
        epochs=o.epochs or ((r.epochs * world) if r else 0),
        max_steps=o.max_steps or ((r.max_steps or 0) if r else 0),
        outer_lr=o.outer_lr or (r or DILOCO).outer_lr,
        outer_momentum=o.outer_momentum if o.outer_momentum >= 0 else (r or DILOCO).outer_momentum,
    )


def _user_model(spec: str) -> torch.nn.Module:
    try:
        factory = load_factory(spec)
    except ValueError as exc:
        raise ValueError(f"[trainer.options] model_factory: {exc}") from None
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"[trainer.options] model_factory {spec!r} returned {type(model).__name__}; expected a "
                         "torch.nn.Module")
    return model


def _lr_at(step: int, base: float, warmup: int, total: int, schedule: str) -> float:
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "cosine" and total > warmup:
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return base * 0.5 * (1 + math.cos(math.pi * t))
    return base


def run(swarm, options: dict) -> dict:
    o = parse_options(GossipSGDOptions, options, trainer="trainers.gossip_sgd")
    if o.mode not in (*GOSSIP_MODES, "local"):
        raise ValueError(f"[trainer.options] mode: expected one of {', '.join(GOSSIP_MODES)}, local, got {o.mode!r}")
    if not (math.isfinite(o.target_loss) and o.target_loss >= 0):
        raise ValueError(f"[trainer.options] target_loss: expected a finite number >= 0, got {o.target_loss!r}")
    if o.outer_codec and o.outer_codec not in (*DENSE_CODECS, SPARSE):
        raise ValueError(f"[trainer.options] outer_codec: expected one of {', '.join(DENSE_CODECS)}, {SPARSE}, "
                         f"got {o.outer_codec!r}")
    if o.outer_resync_every < 0:
        raise ValueError(f"[trainer.options] outer_resync_every: expected an integer >= 0, "
                         f"got {o.outer_resync_every!r}")
    if o.outer_averaging not in OUTER_MODES:
        raise ValueError(f"[trainer.options] outer_averaging: expected one of {', '.join(OUTER_MODES)}, "
                         f"got {o.outer_averaging!r}")
    if o.schedule not in ("constant", "cosine"):
        raise ValueError(f"[trainer.options] schedule: expected 'constant' or 'cosine', got {o.schedule!r}")
    torch.set_num_threads(max(1, o.threads))
    device = pick_device()

    loss_fn = torch_data.load_loss(o.loss)
    if o.dataset_factory:
        train, test = torch_data.load_datasets(o.dataset_factory)
        model_opts: dict = {}
        source = f"[trainer.options] dataset_factory {o.dataset_factory!r}"
    else:
        train, test, model_opts = load_sized_model(o.model, o.model_options)
        source = f"the built-in data of model {o.model!r}"
    if (o.target_accuracy or o.target_loss) and test is None:
        key = "target_accuracy" if o.target_accuracy else "target_loss"
        raise torch_data.DataError(f"[trainer.options] {key}: {source} has no test set (None) to measure it on; "
                                   f"unset {key} or return a test set")
    if o.eval_samples < 0:
        raise ValueError(f"[trainer.options] eval_samples: expected an integer >= 0, got {o.eval_samples!r}")
    if o.eval_samples and test is not None:
        if torch_data.is_iterable(test):
            raise torch_data.DataError(f"[trainer.options] eval_samples: {source}'s test set is iterable; "
                                       "return a map-style test set or unset eval_samples")
        test = head(test, o.eval_samples)
    rank, world = swarm.rank_and_world(o.world or None)
    hp = _recipe(o, world)
    shard = torch_data.shard(train, rank, world, seed=o.seed)
    shard_size = torch_data.shard_size(shard)
    if shard_size == 0:
        raise torch_data.DataError(f"[trainer.options] world: shard {rank} of {world} of {source}'s train set is "
                                   "empty; use fewer shards (world) or more data")
    model = (_user_model(o.model_factory) if o.model_factory else seeded_model(o.model, o.seed, **model_opts)).to(device)
    # The same wrappers a user's own loop uses (peertrain/): they share the parameters as group "model" and
    # average every `average_every` steps, or take an outer step every `inner_steps` (mode "local").
    inner = make_optimizer(model.parameters(), hp["optimizer"], lr=hp["lr"], momentum=hp["momentum"],
                           weight_decay=hp["weight_decay"])
    if o.mode == "local":
        sparse = o.outer_codec == SPARSE  # SparseLoCo's outer step has its own lr; its decay is the momentum's part
        opt = LocalStepsOptimizer(inner, swarm, inner_steps=o.inner_steps,
                                  outer_lr=(o.outer_lr or None) if sparse else hp["outer_lr"],
                                  outer_momentum=hp["outer_momentum"], nesterov=o.outer_nesterov,
                                  codec=o.outer_codec or None, error_feedback=o.outer_error_feedback,
                                  background=o.outer_background, mode=o.outer_averaging, join=False,
                                  resync_every=o.outer_resync_every)
    else:
        opt = GossipOptimizer(inner, swarm, mode=o.mode, average_every=o.average_every, join=False)
    group, lock = opt.shared, opt.shared.lock
    # Compute seconds (issue 41's utilization = compute / wall): forward, backward and the inner optimizer's update,
    # the last timed by hooks inside the wrapper's lock, so neither a wait for the lock nor an exchange counts.
    compute = [0.0, 0.0, 0.0]  # [seconds so far, when the running inner step began, seconds evaluating]

    def inner_began(*_) -> None:
        compute[1] = time.perf_counter()

    def inner_ended(*_) -> None:
        compute[0] += time.perf_counter() - compute[1]

    inner.register_step_pre_hook(inner_began)
    inner.register_step_post_hook(inner_ended)
    use_amp = o.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if use_amp else None

    steps_per_epoch = math.ceil(shard_size / hp["batch_size"]) if shard_size is not None else None
    if not hp["max_steps"] and steps_per_epoch is None:
        raise torch_data.DataError(f"[trainer.options] max_steps: {source}'s train set is an IterableDataset without "
                                   "__len__, so epochs cannot be turned into steps; set max_steps")
    total_steps = hp["max_steps"] or int(round(hp["epochs"] * steps_per_epoch))
    step, resumed_from, joined_from = 0, None, None
    ckpt = swarm.load_checkpoint(map_location=device)
    if ckpt is not None and ckpt.get("model_name") == (o.model_factory or o.model):
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step = resumed_from = opt.local_step = int(ckpt["step"])
        swarm.log("resumed from checkpoint at step %d", step)
    else:
        # Wait (bounded) for the swarm to assemble, so peers that start together also train together: for
        # peers whose trainers are up (their records list the group), not only connected daemons.
        want = world - 1 if o.min_peers < 0 else o.min_peers
        have = swarm.wait_for_peers(want, group=opt.group_name, timeout=o.join_wait)
        if have < want:
            swarm.log("starting with %d of %d expected peers after waiting %.0fs", have, want, o.join_wait)
        if swarm.neighbours():
            joined_from = opt.join()  # the swarm is already training: start where it is
            if joined_from is not None:
                swarm.log("joined a running swarm: downloaded parameters at its step %d", joined_from)

    meta = {"trainer": "trainers.gossip_sgd", "mode": o.mode, "model": o.model_factory or o.model,
            "parameters": count_parameters(model), "device": str(device), "rank": rank, "world": world,
            "shard_size": shard_size, "total_steps": total_steps, "target_accuracy": o.target_accuracy,
            "target_loss": o.target_loss,
            "resumed_from_step": resumed_from, "joined_at_step": joined_from, "state": "training"}
    swarm.publish(meta)

    def save() -> None:
        # Streamed to disk from the live tensors, held still meanwhile: in gossip modes the group's lock holds
        # the model and the inner step (both the daemon's updates and our steps take it); in local mode the
        # outer weights and momentum (the daemon's exchanges land there), and the model, which inner steps
        # move without a lock (`peer export` may call this from another thread), is copied. Copies of all of
        # them took 1.7 GB more of a 100 M-parameter peer at the end of its run (docs/benchmarks.md,
        # 2026-11-29). An exchange that lands meanwhile owes its update until the next snapshot.
        def write(model_state: dict, opt_state: dict) -> None:
            swarm.save_checkpoint({"model": model_state, "optimizer": opt_state, "step": step,
                                   "model_name": o.model_factory or o.model, "options": asdict(o)})
        if o.mode == "local":
            with opt.locked():
                write({k: v.detach().clone() for k, v in model.state_dict().items()}, opt.state_dict(copy=False))
        else:
            with lock:
                write(model.state_dict(), opt.optimizer.state_dict())

    swarm.on_checkpoint_request(save)
    gen = torch.Generator().manual_seed(o.seed * 7919 + rank * 104729 + step)
    pin = device.type == "cuda"
    train_batches = torch_data.loader(shard, hp["batch_size"], generator=gen, num_workers=o.num_workers, pin_memory=pin)
    test_batches = None if test is None else torch_data.loader(test, torch_data.EVAL_BATCH, shuffle=False,
                                                               num_workers=o.num_workers, pin_memory=pin)

    def evaluate() -> tuple[float | None, float | None]:
        if test_batches is None:
            return None, None
        t_eval = time.perf_counter()
        with lock:
            out = torch_data.evaluate(model, test_batches, loss_fn, device, what=f"{source}: the test set")
        compute[2] += time.perf_counter() - t_eval
        return out

    passes = 0  # full passes over the shard; an epoch's length for an iterable without __len__ is learnt on the first

    def epoch_at(s: int) -> float:
        return round(s / steps_per_epoch, 3) if steps_per_epoch else float(passes)

    t0, samples, last_pub = time.monotonic(), 0, 0.0
    loss_val, acc, test_loss = None, None, None
    reached = False
    target_info: dict = {}  # when the local model first reached the target (later exchanges keep changing it)
    model.train()
    while step < total_steps and not swarm.should_stop() and not reached:
        pass_start = step
        for xb, yb in torch_data.batches(train_batches, f"{source}: the train set"):
            if step >= total_steps or swarm.should_stop():
                break
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, hp["lr"], o.warmup_steps, total_steps, o.schedule)
            opt.zero_grad(set_to_none=True)
            t_fb = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.float16) if use_amp else nullcontext():
                loss = loss_fn(model(xb), yb)
            if scaler is not None:
                scaler.scale(loss).backward()
                compute[0] += time.perf_counter() - t_fb
                if o.grad_clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                scaler.step(opt)  # the step and, every average_every steps, averaging (GossipOptimizer.step)
                scaler.update()
            else:
                loss.backward()
                if o.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
                compute[0] += time.perf_counter() - t_fb
                opt.step()
            step += 1
            samples += len(yb)
            loss_val = loss.item()
            if not math.isfinite(loss_val):
                raise FloatingPointError(f"loss became {loss_val} at step {step}; lower the learning rate")
            if o.step_delay:
                time.sleep(o.step_delay)
            evaluate_now = step % o.eval_every == 0 or step == total_steps
            if evaluate_now and test_batches is not None:
                test_loss, acc = evaluate()
                if o.target_accuracy and acc is None:
                    raise torch_data.DataError(
                        f"[trainer.options] target_accuracy: the model's output on {source}'s test set is not class "
                        "logits for integer labels, so there is no accuracy to reach; unset target_accuracy")
                if (o.target_accuracy and acc >= o.target_accuracy) or (o.target_loss and test_loss <= o.target_loss):
                    reached = True
                    target_info = {"target_step": step, "seconds_to_target": round(time.monotonic() - t0, 3),
                                   "epochs_to_target": epoch_at(step), "accuracy_at_target": acc,
                                   "loss_at_target": test_loss}
            now = time.monotonic()
            if evaluate_now or now - last_pub > 1.0:
                last_pub = now
                elapsed = now - t0
                swarm.publish({"step": step, "epoch": epoch_at(step), "loss": loss_val,
                               "accuracy": acc, "test_loss": test_loss, "samples_per_s": samples / max(elapsed, 1e-9),
                               "elapsed_s": round(elapsed, 3), "compute_s": round(compute[0], 3),
                               "eval_s": round(compute[2], 3), "consensus_distance": group.last_distance,
                               **({"rounds": opt.rounds, "rounds_skipped": opt.skipped, "rounds_pushed": opt.pushed}
                                  if o.mode == "local" else {}),
                               "neighbours": len(swarm.neighbours())})
            if o.checkpoint_every and step % o.checkpoint_every == 0:
                save()
            if reached:
                break
        else:  # a whole pass
            if step == pass_start:
                raise torch_data.DataError(f"[trainer.options] world: shard {rank} of {world} of {source}'s train "
                                           "set yielded no batch; use fewer shards (world) or more data")
            passes += 1
            if steps_per_epoch is None:
                steps_per_epoch = step - pass_start
    if o.checkpoint_at_end:
        save()
    elapsed = time.monotonic() - t0
    test_loss, acc = evaluate()
    result = {"step": step, "accuracy": acc, "test_loss": test_loss, "loss": loss_val, "elapsed_s": round(elapsed, 3),
              "compute_s": round(compute[0], 3),
              "samples_per_s": samples / max(elapsed, 1e-9), "reached_target": bool(target_info),
              "epoch": epoch_at(step), **target_info}
    swarm.publish(result)
    return result

"""The stage this peer holds: its worker, what the daemon serves for it, and moving it to another stage live.

`StageSeat` owns the peer's StageWorker for one stage of one cut of the model, tells the daemon to serve it,
shares its parameters with the stage's other peers (gossip partners: that stage's peers only), and checkpoints it.

Where it serves, the daemon decides (peer/pipeline/seating.py) from the figures this seat gives it
(`seat_figures`: each stage's compute seconds and memory, which need the model) and the records it holds; the
seat makes the moves it orders.

Moving (`move`): the peer announces the move, builds a
worker for the target stage and downloads that stage's state (weights, optimizer state, step) from the
freshest holder, a peer serving it or keeping a copy, while its old stage keeps serving. Only when the state is
loaded, and the records still say its old stage keeps another peer, does it switch: the daemon serves the new
stage at once (calls still waiting for the old one are handed back, and their drivers re-send them elsewhere:
each is counted), the old stage's parameters stop being shared, its worker (optimizer state, gradients) is
dropped, and a copy of its state is kept to hand out should that stage lose its last peer. Gradients the old
worker had accumulated toward its next step are dropped with it (at most one step's share; counted).

Copies: besides the stage it left, a peer keeps a backup of the next stage's state, pulled every `copy_every`
seconds from a live peer of it (pull, not push: nobody can make us hold what we did not ask for). A stage that
loses its last peer to a crash is taken over from the freshest copy any live peer holds, so at most
`copy_every` seconds of that stage's training are lost. The daemon holds the copies (peer/pipeline/state_transfer.py)
and announces them in our record: on disk, or in memory where the room holds them beside everything the
stage may come to hold (`_copy_in_memory`); a move first puts the copies held in memory on disk, so the
move's own memory checks hold.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from peer.pipeline.kept import MAX_KEPT, MAX_KEPT_BYTES
from peertrain.pipeline import PipelineKey, SeatFigures, StateUnavailable
from trainers.baseline import make_optimizer
from trainers.datasets import load_factory
from trainers.pipeline import memory, shapes
from trainers.pipeline.partition import cached_profile, profile_stage
from trainers.pipeline.profiles import announced, announced_profiles, swarm_costs
from trainers.pipeline.shapes import ModelShapes
from trainers.pipeline.slowed import Slowed
from trainers.pipeline.stage import StageWorker

JOIN_WAIT_S = 30.0  # most a joining peer waits for a stage's peers to hand it the state (our record reaches
#                     them within a record interval; each transfer is bounded by [pipeline] state_timeout)
JOIN_RETRY_S = 1.0  # between asks while holders do not know us yet
MAX_SOURCES_TRIED = 3  # holders asked for one stage's state before a move is given up (each bounded by state_timeout)


StageWrapper = Callable[[Any, Any, int], Any]  # (the handler served, the stage's worker, seed) -> what is served


def stage_wrapper(o) -> StageWrapper | None:
    """What `stage_wrapper` names, built from `stage_wrapper_options` (None: serve the worker as it is). The seam
    through which tests and benches serve a stage another way (peer/testing/lying_stage.py: one that lies) while
    the trainer holds no such code; every failure is a ValueError naming the option."""
    if not o.stage_wrapper:
        return None
    try:
        return load_factory(o.stage_wrapper)(**o.stage_wrapper_options)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"[trainer.options] stage_wrapper: {exc}") from None


def _stage_input(worker: StageWorker, device: torch.device) -> torch.Tensor:
    """A microbatch-sized input for profiling a stage after the first: random activations of its input shape."""
    (_, dtype, shape), *_ = worker.input_specs(worker.kinds()[0], worker.max_batch)
    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    if dt.is_floating_point:
        return torch.randn(shape, generator=gen).to(dt).to(device)
    return torch.zeros(shape, dtype=dt, device=device)


@dataclass(frozen=True)
class Memory:
    """What this peer may hold (trainers/pipeline/memory.py): `room` bytes for a stage (0: unknown, anything
    fits), `need(lo, hi)` the bytes serving blocks [lo, hi) takes, `budget` the whole budget announced."""

    budget: int
    room: int
    need: Callable[[int, int], int]
    max_held: Callable[[int, int], int | None] = lambda lo, hi: None  # gradient copies a stage may keep (stage.py)
    sharing: Callable[[int, int], int] = lambda lo, hi: 0  # kept for averaging the stage, where the room holds it

    def holds(self, nbytes: int) -> bool:
        """Whether `nbytes` fit the room (an unknown room holds anything)."""
        return memory.fits(nbytes, self.room, 0)


class StageSeat:
    def __init__(self, swarm, o, model, sample_x, sample_y, costs, *, device: torch.device | None = None,
                 mem: Memory | None = None):
        self.swarm, self.o, self.model, self.costs = swarm, o, model, costs
        self.sample_x, self.sample_y = sample_x, sample_y
        self.device = device if device is not None else torch.device("cpu")
        self.mem = mem if mem is not None else Memory(0, 0, lambda lo, hi: 0)
        self.wrap = stage_wrapper(o)  # what our stage is served through (None: the worker itself)
        self.backups_skipped = ""  # why the next stage is not backed up here (memory), said once
        self._measured: list = []  # the swarm's block measurements `costs` were last computed from
        self.key: PipelineKey | None = None
        self.stage: int | None = None
        self.worker: StageWorker | None = None
        self.group = None
        self.averaged_at = 0
        self.lock = threading.Lock()  # the worker and group swap under it; housekeeping reads them under it
        self.settling = True  # peers starting together still spread out (until `join_stage`)
        self._told: SeatFigures | None = None  # the figures the daemon last had from us
        self.dropped_samples = 0  # accumulated samples whose gradients a move dropped
        self._shadow: StageWorker | None = None  # a worker of the stage we back up, for its specs only

    # ---- building -------------------------------------------------------------------------------
    def stage_seconds(self, key: PipelineKey) -> list[float]:
        """Compute seconds per microbatch of each stage of `key`'s cut, from the block costs the pipeline's peers
        measured (profiles.py), refreshed as they announce them: the costs the cut was planned from may have been
        size estimates, which rebalancing must not weigh peers' speeds by."""
        self._refresh_costs(key)
        return [sum(c.seconds for c in self.costs[lo:hi]) for lo, hi in zip((0, *key.cuts), (*key.cuts, len(self.costs)))]

    def _refresh_costs(self, key: PipelineKey) -> None:
        measured = announced(self.swarm.stage_announcements(), key.name)
        if measured and measured != self._measured:
            self._measured = measured
            self.costs, _ = swarm_costs(self.model, self.model_shapes, self.o.microbatch, measured, device=self.device)

    def bounds(self, key: PipelineKey, stage: int) -> tuple[int, int]:
        return list(zip((0, *key.cuts), (*key.cuts, len(self.model))))[stage]

    def need(self, key: PipelineKey, stage: int) -> int:
        """Bytes serving `stage` of `key` takes (memory.py's estimate)."""
        return self.mem.need(*self.bounds(key, stage))

    def held(self, key: PipelineKey, stage: int) -> int:
        """`need`, and what averaging the stage with its peers holds where the room holds it too (memory.py)."""
        return self.need(key, stage) + self.mem.sharing(*self.bounds(key, stage))

    def seat_figures(self, key: PipelineKey, *, settling: bool) -> SeatFigures:
        """What the daemon decides our stage from (peertrain/pipeline.py): our figures for `key`'s stages."""
        o = self.o
        return SeatFigures(key, tuple(self.stage_seconds(key)), tuple(self.need(key, s) for s in range(key.stages)),
                           self.mem.room, settling, pinned=o.initial_stage >= 0,
                           rebalance_every=o.rebalance_every if o.rebalance else 0.0, min_gain=o.min_gain)

    def tell_daemon(self) -> None:
        """Give the daemon our figures for the cut we serve, if they changed (block costs get measured)."""
        if self.key is None or self.worker is None:
            return
        figures = self.seat_figures(self.key, settling=self.settling)
        if figures != self._told:
            self.swarm.seat(figures)
            self._told = figures

    def _copies_in_memory(self) -> list:
        """The copies of our cut's stages the daemon holds in memory."""
        got = (self.swarm.stage_copy(self.key, s) for s in range(self.key.stages)) if self.key is not None else ()
        return [c for c in got if c is not None and not c.on_disk]

    def _copy_in_memory(self, copy_bytes: int, stage: int) -> bool:
        """Whether a copy of `copy_bytes` (of `stage`'s state) may stay in memory: only where the room is known
        and holds, beside the stage we serve and its averaging, the copies already in memory (but an older one of
        `stage`, which it replaces) and as many gradient copies as the kept book ever keeps (peer/pipeline/kept.py;
        the stage keeps copies while a step waits, as many as the room beside its plan holds: `max_held`) — so a
        copy never takes memory the stage may need. Otherwise it goes to disk.
        (docs/design.md, "Memory is a budget")"""
        if self.mem.room <= 0 or self.key is None:
            return False
        lo, hi = self.bounds(self.key, self.stage)
        gradients = min(MAX_KEPT * sum(self.model_shapes.param_bytes[lo:hi]), MAX_KEPT_BYTES)
        others = sum(c.nbytes for c in self._copies_in_memory() if c.stage != stage)
        return self.mem.holds(self.held(self.key, self.stage) + gradients + others + copy_bytes)

    def _copies_to_disk(self) -> None:
        """Before a move: the copies held in memory go to disk (kept still, to hand out), so the move's checks
        (our stage, the target) count all this peer holds."""
        for c in self._copies_in_memory():
            tensors, step, samples = c.load()
            self.swarm.keep_stage_copy(self.key, c.stage, tensors, step, samples)

    def _worker(self, key: PipelineKey, stage: int, device: torch.device | None = None) -> StageWorker:
        o = self.o
        worker = StageWorker(
            self.model, self.bounds(key, stage), stage=stage, stages=key.stages,
            optimizer=lambda ps: make_optimizer(ps, o.optimizer, lr=o.lr, weight_decay=o.weight_decay),
            max_batch=o.microbatch, sample_x=self.sample_x, sample_y=self.sample_y, grad_clip=o.grad_clip,
            device=device if device is not None else self.device)
        lo, hi = self.bounds(key, stage)
        worker.max_held = self.mem.max_held(lo, hi)
        if self.mem.room and not self.mem.sharing(lo, hi) and worker.device.type != "meta":
            self.swarm.log("stage %d: the memory room holds the stage but not an averaging exchange beside it (%d MiB "
                           "more): should another peer serve it too, their exchanges may take this peer past its "
                           "budget", stage, memory.mib(memory.sharing_bytes(sum(self.model_shapes.param_bytes[lo:hi]))))
        if worker.max_held is not None and worker.device.type != "meta":
            self.swarm.log("stage %d: the memory room holds %d gradient copies beside the stage; calls past them "
                           "while a step waits for acks keep their inputs and compute the gradient when "
                           "acknowledged (a forward and a backward more)", stage, worker.max_held)
        return worker

    def _serve(self, *, ready: bool = True) -> None:
        self.set_accumulation()  # before serving: calls may come at once, and must not step at max_batch
        handler = Slowed(self.worker, self.o.slowdown) if self.o.slowdown > 1 else self.worker
        if self.wrap is not None:
            handler = self.wrap(handler, self.worker, self.o.seed)
        self.swarm.serve_stage(self.key, self.stage, self.o.microbatch, handler, ready=ready)

    def _announce_profile(self) -> None:
        """Announce our stage's block costs with our memory, so planners elsewhere use measurements, not estimates
        (trainers/pipeline/profiles.py). Measured once per stage and home (a restart reads them), and only when
        some block of the stage has no measurement from another peer yet: profiling holds the stage's lock, and
        a peer moving or rejoining under a small CPU share would stall its stage for seconds to measure what the
        swarm already knows (the churn bench fell from 0.61 to 0.29 of the best assignment that way)."""
        w, key, stage = self.worker, self.key, self.stage
        lo, hi = self.bounds(key, stage)
        path = self.swarm.checkpoint_dir / f"pipeline-profile-{lo}-{hi}.json"
        profile_key = {"model": self.model.name, "blocks": [lo, hi], "microbatch": self.o.microbatch,
                       "device": self.device.type, "threads": self.o.threads, "torch": torch.__version__}
        others = {p.block for p in announced(self.swarm.stage_announcements(), key.name, but=self.swarm.peer_id)}
        costs = cached_profile(path, profile_key, None, hi - lo)
        if costs is None and not set(range(lo, hi)) <= others:
            x = self.sample_x.to(self.device) if lo == 0 else _stage_input(w, self.device)
            with w.lock:
                costs = cached_profile(path, profile_key,
                                       lambda: profile_stage(list(w.module), lo, x, self.sample_y.to(self.device),
                                                             self.model.loss_fn, last=hi == len(self.model)), hi - lo)
        self.swarm.announce_stage_profile(announced_profiles(costs or [], lo), self.mem.budget, self.mem.room)

    def _free(self) -> None:
        """Stop serving and drop our worker, so its memory is free before another stage is built (a move or a
        new cut on a peer that cannot hold both)."""
        if self.worker is None:
            return
        with self.lock:
            self.swarm.stop_serving()
            if self.group is not None:
                self.swarm.unshare(self.group_name())
                self.group = None
            self.worker = None
        gc.collect()

    def take(self, key: PipelineKey, stage: int) -> None:
        """Serve `stage` with a fresh worker, not ready: the stage is announced, so its peers hand us its state,
        but calls are refused until `join_stage` loaded it (peers slow to start served untrained blocks to peers
        training for seconds, and drivers' checks struck them). A peer that cannot hold both frees the stage it
        served first."""
        if self.worker is not None and not self.mem.holds(self.held(self.key, self.stage) + self.held(key, stage)):
            self._free()
        self.worker, self.key, self.stage = self._worker(key, stage), key, stage
        self._serve(ready=False)
        self._announce_profile()
        self.tell_daemon()

    def settle(self, own_cuts, rank: int | None, *, deadline: float) -> None:
        """Agree on the cut and spread over the stages with the peers starting with us: the cut is the smallest
        serving peer ID's, and the daemon orders a peer of a crowded stage to an empty one (seating.py). A
        pinned peer (`initial_stage`) keeps its stage."""
        while time.monotonic() < deadline and not self.swarm.should_stop():
            order = self.swarm.next_move(timeout=0.5)
            cut = self.swarm.adopted_cut(self.o.pipeline, own_cuts)
            if cut != self.key.cuts:
                key = PipelineKey(self.o.pipeline, cut)
                self.swarm.log("adopting the cut %s announced by the pipeline's smallest peer ID", list(cut))
                pinned = self.o.initial_stage
                self.take(key, pinned if pinned >= 0 else
                          self.swarm.first_move(self.seat_figures(key, settling=True), rank).to_stage)
                continue
            if order is not None:
                self.swarm.log("%s", order.reason)
                self.take(self.key, order.to_stage)

    def resume(self, ckpt: dict) -> bool:
        """Take the stage our checkpoint holds if it is still needed (no live peer serves it), from the
        checkpoint or from a fresher copy a peer holds; False: leave it (the caller joins where it is needed)."""
        stage = ckpt.get("stage")
        if not isinstance(stage, int) or not 0 <= stage < self.key.stages or self.swarm.stage_map(self.key)[stage]:
            return False
        step = int(ckpt["worker"].get("steps", 0))
        self.settling = False  # the pipeline trained before: we rejoin it
        self.worker, self.stage = self._worker(self.key, stage), stage
        self._serve(ready=False)
        self._announce_profile()
        if self._adopt_as_member(stage, fresher_than=step) is None:  # nobody holds a fresher copy, or none came
            self.worker.load_state_dict(ckpt["worker"])
            self.swarm.log("resumed stage %d from our checkpoint at step %d (no peer serves it)", stage, step)
        return True

    def join_stage(self) -> None:
        """Share the stage's parameters with its other peers, starting from the freshest state a peer holds:
        a live peer's, or a copy's when no peer serves the stage (a restarted peer placed on a stage emptied by
        a kill served untrained blocks; `peer bench pipeline --churn`); the stage takes calls from here on."""
        if any(s.step > self.worker.steps for s in self.sources(self.stage)):
            got = self._adopt_as_member(self.stage, fresher_than=self.worker.steps)
            if got is not None:
                self.swarm.log("joined stage %d at its step %d", self.stage, got["step"])
            else:
                self.swarm.log("no peer of stage %d handed its state within %.0fs: serving it from our own blocks",
                               self.stage, JOIN_WAIT_S)
        self._share()
        self.swarm.stage_ready()
        self.settling = False
        self.tell_daemon()

    def _adopt_as_member(self, stage: int, *, fresher_than: int) -> dict | None:
        """`_adopt`, for a peer that has just announced the stage: holders refuse it until our record reaches
        them (`not_a_member`), so ask again each JOIN_RETRY_S, for at most JOIN_WAIT_S."""
        deadline = time.monotonic() + JOIN_WAIT_S
        while not self.swarm.should_stop():
            if not any(s.step > fresher_than for s in self.sources(stage)):
                return None
            got = self._adopt(self.worker, stage)
            if got is not None or time.monotonic() > deadline:
                return got
            time.sleep(JOIN_RETRY_S)
        return None

    def _share(self) -> None:
        self.group = self.swarm.share(self.group_name(), self.worker.params(), lock=self.worker.lock,
                                      partners=self.swarm.stage_partners)
        self.averaged_at = self.worker.steps

    def group_name(self, stage: int | None = None) -> str:
        return f"{self.key.name}/stage{self.stage if stage is None else stage}"

    # ---- state transfer -------------------------------------------------------------------------
    def sources(self, stage: int):
        """Live peers of our pipeline that can hand out `stage`'s state, freshest first (the daemon's reading)."""
        return self.swarm.state_sources(self.key, stage)

    def _adopt(self, worker: StageWorker, stage: int) -> dict | None:
        """Load `stage`'s freshest state into `worker`: from our own copy if none is fresher, else downloaded.
        Returns where it came from, or None if no holder could give it (the worker keeps what it has)."""
        own = self.swarm.stage_copy(self.key, stage)
        for src in self.sources(stage)[:MAX_SOURCES_TRIED]:
            if own is not None and own.step >= src.step:
                break
            try:
                got = self.swarm.fetch_stage_state(self.key, stage, src.peer_id, worker.check_state_specs)
            except StateUnavailable as exc:
                self.swarm.log("stage %d's state from %s: %s", stage, src.peer_id[:8], exc)
                continue
            worker.import_state(got.tensors, got.step, got.samples)
            self.swarm.log("downloaded stage %d's state (step %d, %s, %.1f MB in %.2fs) from %s", stage, got.step,
                           "live" if got.live else "copy", got.nbytes / 1e6, got.seconds, src.peer_id[:8])
            return {"source": src.peer_id[:8], "step": got.step, "live": got.live, "mb": round(got.nbytes / 1e6, 2),
                    "download_s": round(got.seconds, 3)}
        if own is not None:
            worker.import_state(*own.load())  # read from disk here, on our thread
            return {"source": "own copy", "step": own.step, "live": False, "mb": 0.0, "download_s": 0.0}
        return None

    def backup(self) -> None:
        """Keep a fresh copy of the next stage's state (see the module docstring)."""
        if self.key is None or self.key.stages < 2:
            return
        target = (self.stage + 1) % self.key.stages
        live = [s for s in self.sources(target) if s.live]
        if not live:
            return
        lo, hi = self.bounds(self.key, target)
        state = memory.state_bytes(sum(self.model_shapes.param_bytes[lo:hi]), self.o.optimizer)
        if not self.mem.holds(self.held(self.key, self.stage) + state):
            why = (f"no backup of stage {target}: its state ({memory.mib(state)} MiB) does not fit beside ours in "
                   f"this peer's budget (a stage may use {memory.mib(self.mem.room)} MiB)")
            if why != self.backups_skipped:
                self.backups_skipped = why
                self.swarm.log("%s", why)
            return
        if self._shadow is None or self._shadow.stage != target:  # the cut is fixed by now; our stage changes by moves
            self._shadow = self._worker(self.key, target, device=torch.device("meta"))  # for its specs: no storage
        shadow = self._shadow
        for src in live[:MAX_SOURCES_TRIED]:
            try:
                got = self.swarm.fetch_stage_state(self.key, target, src.peer_id, shadow.check_state_specs)
            except StateUnavailable as exc:
                self.swarm.log("backup of stage %d from %s: %s", target, src.peer_id[:8], exc)
                continue
            self.swarm.keep_stage_copy(self.key, target, got.tensors, got.step, got.samples,
                                       in_memory=self._copy_in_memory(state, target))
            return

    def move(self, to: int, reason: str, *, settle_s: float) -> dict | None:
        """Move to stage `to` (module docstring), as the daemon ordered; it is asked last whether we may leave
        our stage (`may_switch`: None, go). Returns the move's record, or None if it was given up (logged)."""
        key, old_stage, t0 = self.key, self.stage, time.monotonic()
        self._copies_to_disk()
        if not self.mem.holds(self.need(key, to)):
            self.swarm.log("move to stage %d not made: it needs %d MiB, this peer's budget leaves a stage %d MiB",
                           to, memory.mib(self.need(key, to)), memory.mib(self.mem.room))
            return None
        if not self.mem.holds(self.held(key, old_stage) + self.held(key, to)):
            return self._move_freeing_first(to, reason, settle_s=settle_s)
        self.swarm.log("moving from stage %d to stage %d: %s", old_stage, to, reason)
        self.swarm.announce_move(moving_to=to)
        try:
            worker = self._worker(key, to)
            got = self._adopt(worker, to)
            if got is None and self.swarm.stage_map(key)[to]:
                self.swarm.log("move to stage %d given up: no peer could hand out its state", to)
                return None
            if got is None:
                self.swarm.log("stage %d has no peer and nobody holds a copy: it restarts from our blocks", to)
                got = {"source": "none (restarted)", "step": 0, "live": False, "mb": 0.0, "download_s": 0.0}
            time.sleep(max(0.0, t0 + settle_s - time.monotonic()))  # let every peer see our claim first
            why = self.swarm.may_switch(old_stage)
            if why is not None:
                self.swarm.log("move to stage %d given up: %s", to, why)
                return None
            with self.lock:
                old, old_group = self.worker, self.group_name()
                dropped = old.pending_samples
                self.worker, self.stage = worker, to
                self._serve()
                self.swarm.unshare(old_group)
                self._share()
            self._announce_profile()
            self.dropped_samples += dropped
            tensors, step, samples = old.export_state()
            del old  # its optimizer state and gradients go; the copy below is what we keep of that stage
            self.swarm.keep_stage_copy(key, old_stage, tensors, step, samples,
                                       in_memory=self._copy_in_memory(sum(t.numel() * t.element_size()
                                                                          for _, t in tensors), old_stage))
            return self._moved(old_stage, to, t0, {"reason": reason, "dropped_samples": dropped, **got})
        finally:
            self.swarm.announce_move(moving_to=-1)

    def _move_freeing_first(self, to: int, reason: str, *, settle_s: float) -> dict | None:
        """`move` for a peer that cannot hold both stages: once the swarm has seen our claim and our old stage
        may lose us, keep a copy of its state (on disk: peer/pipeline/state_transfer.py), drop it, then build the new
        stage and fetch its state. Calls held for the old stage are handed back (their drivers re-send them).
        If the new stage's state cannot be had, the old stage is rebuilt from that copy and served again."""
        key, old_stage, t0 = self.key, self.stage, time.monotonic()
        self.swarm.log("moving from stage %d to stage %d, freeing the old one first (both do not fit this peer's "
                       "budget): %s", old_stage, to, reason)
        self.swarm.announce_move(moving_to=to)
        try:
            time.sleep(max(0.0, t0 + settle_s - time.monotonic()))  # let every peer see our claim first
            why = self.swarm.may_switch(old_stage)
            if why is not None:
                self.swarm.log("move to stage %d given up: %s", to, why)
                return None
            old = self.worker
            dropped = old.pending_samples
            old.write_state(lambda tensors, step, samples:  # to disk under its lock: no copy of it in memory
                            self.swarm.keep_stage_copy(key, old_stage, tensors, step, samples))
            del old
            self._free()
            worker = self._worker(key, to)
            got = self._adopt(worker, to)
            if got is None and self.swarm.stage_map(key)[to]:
                self.swarm.log("move to stage %d given up: no peer could hand out its state; back to stage %d "
                               "from our copy", to, old_stage)
                del worker
                gc.collect()
                back = self._worker(key, old_stage)
                self._adopt(back, old_stage)
                with self.lock:
                    self.worker, self.stage = back, old_stage
                    self._serve()
                    self._share()
                self._announce_profile()
                return None
            if got is None:
                got = {"source": "none (restarted)", "step": 0, "live": False, "mb": 0.0, "download_s": 0.0}
            with self.lock:
                self.worker, self.stage = worker, to
                self._serve()
                self._share()
            self._announce_profile()
            self.dropped_samples += dropped
            return self._moved(old_stage, to, t0,
                               {"reason": reason, "dropped_samples": dropped, "freed_first": True, **got})
        finally:
            self.swarm.announce_move(moving_to=-1)

    def _moved(self, old_stage: int, to: int, t0: float, facts: dict) -> dict:
        """After a switch to `to`: its copy goes (we serve it now: its state is live here), the daemon hears of
        the move (for `peer status`, and the stage we left cools down there), and our figures follow."""
        self.swarm.drop_stage_copy(self.key, to)
        self._shadow = None
        took = time.monotonic() - t0
        record = {"from": old_stage, "to": to, "took_s": round(took, 3), **facts}
        self.swarm.note_move(**record)
        self.swarm.log("now serving stage %d (was %d) after %.2fs", to, old_stage, took)
        self.tell_daemon()
        return record

    @property
    def model_shapes(self) -> ModelShapes:
        return shapes.trace(self.model, self.sample_x, self.sample_y)

    # ---- while training -------------------------------------------------------------------------
    def housekeeping(self) -> None:
        """Step size by the stage's peers, and an averaging round after every `average_every` steps."""
        with self.lock:
            w = self.worker
            if w is None or self.group is None:
                return
            n = self.set_accumulation()
            self.group.step = w.steps
            if self.o.average_every and n > 1 and w.steps - self.averaged_at >= self.o.average_every:
                if self.swarm.average_in_background(self.group_name()):
                    self.averaged_at = w.steps

    def set_accumulation(self) -> int:
        """Step after this peer's share of `batch_size` samples (the stage's peers share a batch); the peers
        of the stage counted, us included."""
        n = max(1, len([p for p in self.swarm.stage_map(self.key)[self.stage] if not p.me]) + 1)
        self.worker.accumulate_samples = max(1, self.o.batch_size // n)
        return n

    def save(self) -> None:
        """Checkpoint this peer's stage: where the model is cut, the stage's blocks and optimizer, and the
        gradient accumulated toward the next step (written atomically, streamed from the live tensors while the
        stage waits: no copy, StageWorker.checkpoint; `peer checkpoint`, shutdown and every `checkpoint_every`
        seconds)."""
        with self.lock:
            w, key, stage = self.worker, self.key, self.stage
        if w is None:
            return
        w.checkpoint(lambda state: self.swarm.save_checkpoint(
            {"pipeline": key.name, "cuts": list(key.cuts), "stage": stage, "worker": state,
             "samples": state["samples"], "options": asdict(self.o)}))

    def figures(self) -> dict:
        w = self.worker
        if w is None:
            return {}
        return {"my_stage": self.stage, "stage_steps": w.steps, "stage_samples": w.samples,
                "stage_samples_per_s": round(w.samples_per_s(), 2), "moves_dropped_samples": self.dropped_samples}

"""Hosting a training job inside the daemon.

The config names a trainer module (`[trainer] name = "trainers.gossip_sgd"`); the module defines
`run(swarm: HostedSwarm, options: dict) -> dict | None`. It runs in a worker thread (torch releases the GIL
for its kernels) while trio keeps heartbeats and exchanges going. `TrainerSwarm` implements the one narrow
interface a trainer sees (`peertrain/swarm.py`): averaging with neighbours, parameter download, metrics,
checkpoints, membership news, and pipeline stages. `peer/` never imports a specific trainer.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from peer.averaging.engine import GossipEngine
from peer.averaging.shared import SharedTensors
from peer.training_report import TrainingReport, failure_state
from peer.pipeline.copies import KeptCopy
from peer.pipeline.service import PipelineService
from peer.topology.service import TopologyService
from peer.pipeline.driver import DriverHandle
from peer.services import DaemonContext, RecordFields
from peertrain.checkpoints import load_checkpoint, save_checkpoint
from peertrain.pipeline import (FetchedState, MoveOrder, PipelineKey, ReplyShapes, SeatFigures, StageHandler,
                                StagePeer, StateSource)
from peertrain.swarm import LATEST_CHECKPOINT, ExchangeResult, TrainerStopped, shard_index, wait_for_peers
from protocol.schema.pipeline import StageAnnouncement

log = logging.getLogger("peertrain.trainer")

class TrainerSwarm:
    """The handle a hosted trainer gets: `peertrain.swarm.HostedSwarm` (the `Swarm` every handle implements,
    plus pipeline stages and the daemon's requests). Every method is safe to call from the trainer's thread."""

    def __init__(self, host: TrainerHost):
        self._host = host
        self.peer_id: str = host.daemon.peer_id
        self.home: Path = host.daemon.home.root
        self.checkpoint_dir: Path = host.daemon.home.checkpoints

    # -- averaging ------------------------------------------------------------------------------------
    def share(self, name: str, tensors: dict[str, Any], *, lock: threading.Lock | None = None,
              partners: Callable[[], set[str]] | None = None, codec: str | None = None,
              error_feedback: bool = False, averaged: bool = True, push_lr: float | None = None) -> SharedTensors:
        """Offer these tensors (e.g. model parameters) for averaging under a group name, with our topology
        neighbours, or with `partners()` (called on the daemon's thread: cheap, no blocking), say the peers
        that serve the same pipeline stage. `codec` overrides [gossip] codec for this group, `error_feedback`
        carries a lossy codec's rounding into the next exchange, `averaged=False` only serves the tensors to
        joining partners (an outer optimizer's state). `push_lr`: partners' pushed updates of this group
        (`push_update`) are added to it, times push_lr / n (None: refused)."""
        group = SharedTensors(name, tensors, lock=lock, codec=codec, error_feedback=error_feedback, averaged=averaged)
        if push_lr is not None:
            if not (isinstance(push_lr, (int, float)) and math.isfinite(push_lr) and push_lr > 0):
                raise ValueError(f"push_lr: expected a finite number > 0, got {push_lr!r}")
            group.push_lr = float(push_lr)
        self._call_sync(self._host.gossip.register, group, partners)  # the engine's state is the daemon thread's
        return group

    def unshare(self, name: str) -> None:
        """Stop sharing group `name` (what `share` offered under it is no longer averaged or served)."""
        self._call_sync(self._host.gossip.unregister, name)

    def average(self, group: str, *, mode: str = "one") -> list[ExchangeResult]:
        """Average now (blocking this thread): with one random neighbour, or with all of them."""
        return self._call(self._host.gossip.average, group, mode=mode)

    def average_in_background(self, group: str, *, mode: str = "one") -> bool:
        """Start an averaging round without waiting (AD-PSGD). False if the previous one still runs, or the
        daemon is stopping (the trainer finishes its step and saves rather than stop here)."""
        try:
            return self._call_sync(self._host.gossip.start_average, group, mode)
        except TrainerStopped:
            return False

    def push_update(self, group: str, encoded: list[Any], *, norm: float, round: int = 0,
                    support: list[Any] | None = None) -> int | None:
        """Send a round's sparse update of `group` (one EncodedTensor per tensor, in the sparse codec; `norm`: the
        update's, as decoded; `support`: its nonzero entries per tensor, (flat indices, values), against which
        partners' pushes are judged by their angle) to every partner in the background (peer/averaging/pushes.py):
        how many peers the update counts among (the partners and us), or None if it was not started (the
        previous push still runs)."""
        try:
            return self._call_sync(self._host.gossip.pushes.start, group, encoded, round, norm=norm, support=support)
        except TrainerStopped:
            return None

    def average_with(self, group: str, peer_id: str) -> ExchangeResult:
        """One exchange of `group` with the partner `peer_id` (blocking this thread), under the rules `average`
        follows (a current partner, not banned, not already exchanging with us): for a trainer that picks its
        partner, such as the test-only attacker that targets one victim (peer/testing/byzantine_trainer.py)."""
        return self._call(self._host.gossip.exchange, peer_id, group)

    def fetch_params(self, group: str, peer_id: str | None = None) -> tuple[list[Any], int] | None:
        """Download the current tensors of `group` from a neighbour (joining peers; only neighbours serve them):
        any partner that answers, or `peer_id`. The same bound against our own values applies either way."""
        if peer_id is None:
            return self._call(self._host.gossip.fetch_from_partners, group)
        got = self._call(self._host.gossip.downloads.fetch_params, group, peer_id)
        return got if isinstance(got, tuple) else None  # (a refusal says no more than "none" here)

    def download(self, group: str, *, min_step: int = 1) -> int | None:
        """Replace `group`'s tensors with a partner's if that partner is at step `min_step` or later (a peer
        joining a swarm that already trains); that step, or None."""
        got = self._call(self._host.gossip.fetch_from_partners, group, min_step)  # partners behind it refuse
        if got is None or got[1] < min_step:
            return None
        self._host.gossip.groups[group].load(got[0])
        return got[1]

    # -- pipeline stages (peer/pipeline/) --------------------------------------------------------------
    def serve_stage(self, key: PipelineKey, stage: int, max_batch: int, handler: StageHandler, *,
                    ready: bool = True) -> None:
        """Serve `stage` of pipeline `key` with `handler` (its compute runs in a worker thread of the
        daemon, one call at a time), replacing what we served; the swarm hears of it in our next record.
        `ready=False`: announce the stage (so its peers hand us its state) but refuse calls until `stage_ready()`."""
        self._call_sync(self._host.pipeline.serve, key, stage, max_batch, handler, ready=ready)

    def stage_ready(self) -> None:
        """Start taking calls for the stage announced with `serve_stage(ready=False)`."""
        self._call_sync(self._host.pipeline.set_ready)

    def stop_serving(self) -> None:
        self._call_sync(self._host.pipeline.stop_serving)

    def stage_map(self, key: PipelineKey) -> dict[int, list[StagePeer]]:
        """The live peers of each stage of pipeline `key` (us included, marked `me`)."""
        return self._call_sync(self._host.pipeline.stage_map, key)

    def stage_announcements(self) -> dict[str, StageAnnouncement]:
        """What each peer we hear of announces serving (any pipeline, any cut), by peer ID."""
        return self._call_sync(self._host.pipeline.announcements)

    def stage_partners(self) -> set[str]:
        """The live peers serving our stage. Runs on the daemon's thread: pass it as `share(partners=...)`."""
        return self._host.pipeline.stage_partners()

    def fetch_stage_state(self, key: PipelineKey, stage: int, peer_id: str, check) -> FetchedState:
        """Download stage `stage`'s state (weights, optimizer state, step) from `peer_id`, a peer serving it or
        keeping a copy; `check(specs)` refuses a list of (name, dtype, shape) that is not this stage's state
        before anything is allocated. Raises StateUnavailable (peertrain/pipeline.py) with the reason."""
        return self._call(self._host.pipeline.fetch_state, key, stage, peer_id, check)

    def keep_stage_copy(self, key: PipelineKey, stage: int, tensors: list, step: int, samples: int, *,
                        in_memory: bool = False) -> None:
        """Keep a copy of a stage's state (one we left, or back up) to hand to whoever takes the stage over: in
        a file in the daemon's home, or in memory if `in_memory` (memory allows it). Waits until it is kept
        (the daemon writes the file in a worker thread: peer/pipeline/state_transfer.py); the caller may then let go of
        `tensors`."""
        self._call(self._host.pipeline.keep_copy, key, stage, tensors, step, samples, in_memory=in_memory)

    def stage_copy(self, key: PipelineKey, stage: int) -> KeptCopy | None:
        """The copy of `stage` this daemon keeps (step, samples, specs; `load()` reads its tensors, on this
        thread, and raises CopyUnreadable if its file is gone or bad), or None."""
        return self._call_sync(self._host.pipeline.copy_of, key, stage)

    def drop_stage_copy(self, key: PipelineKey, stage: int) -> None:
        self._call(self._host.pipeline.drop_copy, key, stage)

    def announce_move(self, moving_to: int = -1) -> None:
        """Tell the swarm (our record) that we are moving to a stage (-1: not any more)."""
        self._call_sync(self._host.pipeline.announce_move, moving_to)

    def note_move(self, **move: Any) -> None:
        """Record one of our moves (from, to, reason, ...) for `peer status`; the stage left cools down."""
        self._call_sync(self._host.pipeline.note_move, move)

    # -- where we serve: the daemon decides (peer/pipeline/seating.py), the job moves ----------------------
    def seat(self, figures: SeatFigures) -> None:
        """The job's figures for the cut it serves (each stage's compute and memory): the daemon decides where
        this peer serves from them and the records, from now on."""
        self._call_sync(self._host.pipeline.seating.set_figures, figures)

    def first_move(self, figures: SeatFigures, rank: int | None) -> MoveOrder:
        """The stage to start on (a numbered peer's `rank` counts while the pipeline has not trained), and
        whether the pipeline trains yet (`starting` False: fetch the stage's state)."""
        return self._call_sync(self._host.pipeline.seating.first_order, figures, rank)

    def next_move(self, timeout: float) -> MoveOrder | None:
        """The next move the daemon decided for us, waiting at most `timeout` seconds (None: stay). Asking
        again means the last one is over, made or given up."""
        return self._call(self._host.pipeline.seating.next_order, timeout)

    def may_switch(self, from_stage: int) -> str | None:
        """None if we may stop serving `from_stage` now (it keeps a peer not itself leaving); else why not."""
        return self._call_sync(self._host.pipeline.seating.may_switch, from_stage)

    def adopted_cut(self, pipeline: str, own_cuts: tuple[int, ...]) -> tuple[int, ...]:
        """Where pipeline `pipeline` is cut: as the smallest serving peer ID announces it, else `own_cuts`."""
        return self._call_sync(self._host.pipeline.adopted_cut, pipeline, own_cuts)

    def state_sources(self, key: PipelineKey, stage: int) -> list[StateSource]:
        """Live peers that can hand out `stage`'s state (serving it or keeping a copy), freshest first."""
        return self._call_sync(self._host.pipeline.state_sources, key, stage)

    def open_driver(self, key: PipelineKey, *, reply_shapes: ReplyShapes, in_flight: int, forward_codec: str = "raw",
                    backward_codec: str = "raw") -> DriverHandle:
        """A driver of microbatches through pipeline `key`, at most `in_flight` at once (peer/pipeline/driver.py)."""
        return self._call_sync(self._host.pipeline.open_driver, key, reply_shapes=reply_shapes,
                               in_flight=in_flight, token=self._host.token, stopped=self.should_stop,
                               forward_codec=forward_codec, backward_codec=backward_codec)

    def stage_memory(self) -> tuple[int, str]:
        """This daemon's memory budget for a stage, in bytes (0: unknown), and where the figure came from
        (peer/pipeline/memory_budget.py): `[pipeline] memory_mib`, the cgroup's limit or the memory free at start."""
        b = self._host.pipeline.budget
        return b.bytes, b.source

    def announce_stage_profile(self, profiles: list, memory_bytes: int, stage_room_bytes: int) -> None:
        """Announce the costs we measured of our stage's blocks and our memory budget (what a stage may use of
        it) in our record (peer/pipeline/service.py)."""
        self._call_sync(self._host.pipeline.announce_profile, profiles, memory_bytes, stage_room_bytes)

    def stage_device(self) -> str:
        """Where a pipeline stage computes: `[pipeline] device` with 'auto' resolved ('cpu' or 'cuda:N').
        Raises ValueError naming the key if it asks for a GPU torch does not see."""
        import torch

        want = self._host.daemon.config.pipeline.device
        if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
            return "cpu"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(want.partition(":")[2] or 0) if want != "auto" else 0
        if index >= count:
            raise ValueError(f"[pipeline] device: {want!r} asked for, but torch sees {count} CUDA device(s)")
        return f"cuda:{index}"

    def on_evaluate_request(self, fn) -> None:
        """Register a thread-safe function returning evaluation figures (the control command `evaluate`)."""
        self._host.on_evaluate_request(fn)

    # -- who is around --------------------------------------------------------------------------------
    def neighbours(self) -> list[str]:
        return sorted(self._host.topology.neighbours)

    def peers(self) -> list[str]:
        return sorted(self._host.daemon.membership.connected())

    def wait_for_peers(self, n: int = 1, *, group: str | None = None, timeout: float = 30.0) -> int:
        """Wait (up to `timeout` s) until `n` other peers are connected (with `group`: peers whose records say
        they share it, i.e. their trainer is up) and we have a neighbour; how many there are."""
        def count() -> tuple[int, bool]:
            have = len(self._call_sync(self._host.gossip.peers_holding, group)) if group else len(self.peers())
            return have, bool(self.neighbours())
        return wait_for_peers(count, n, timeout, self.should_stop)

    def membership_events(self) -> list[tuple[str, str]]:
        """(peer_id, 'joined'|'left') since the last call."""
        out = []
        while self._host.events:
            out.append(self._host.events.popleft())
        return out

    def rank_and_world(self, world: int | None = None) -> tuple[int, int]:
        """A data-shard index and count (see `shard_index`)."""
        return shard_index(self.peer_id, self.peers, world, self.should_stop)

    local_rank = 0  # a hosted trainer is one process, the whole peer
    local_world = 1

    def exchanges(self) -> dict[str, Any]:
        """The daemon's exchange counts (all groups): initiated, served, failed, and the last failure's reason."""
        return self._call_sync(self._host.gossip.exchange_counts)

    # -- reporting and state --------------------------------------------------------------------------
    def publish(self, metrics: dict[str, Any]) -> None:
        """Metrics for `peer status` and one JSON line in HOME/metrics.jsonl."""
        self._host.report.publish(metrics)

    def save_checkpoint(self, state: dict[str, Any], name: str = LATEST_CHECKPOINT) -> Path:
        """torch.save to HOME/checkpoints/<name> atomically (a crash never leaves a torn file)."""
        return save_checkpoint(self.checkpoint_dir, state, name)

    def load_checkpoint(self, name: str = LATEST_CHECKPOINT, map_location: Any = "cpu") -> dict[str, Any] | None:
        """The checkpoint saved as `name`, or None if there is none or it is refused (logged)."""
        return load_checkpoint(self.checkpoint_dir, name, map_location)

    def on_checkpoint_request(self, fn) -> None:
        """Register a thread-safe function that saves a checkpoint (used by `peer export`)."""
        self._host.on_checkpoint_request(fn)

    def should_stop(self) -> bool:
        return self._host.stopping.is_set()

    def log(self, msg: str, *args: Any) -> None:
        log.info(msg, *args)

    def _call_sync(self, fn, *args, **kw):
        """Run a quick, non-blocking daemon function on the daemon's thread."""
        return self._on_daemon(trio.from_thread.run_sync, lambda: fn(*args, **kw))

    def _call(self, fn, *args, **kw):
        """Run an async daemon function on the daemon's thread and wait for it."""
        return self._on_daemon(trio.from_thread.run, lambda: fn(*args, **kw))

    def _on_daemon(self, runner, thunk):
        if self.should_stop():
            raise TrainerStopped()
        try:
            return runner(thunk, trio_token=self._host.token)
        except trio.RunFinishedError:
            raise TrainerStopped() from None


class TrainerHost:
    """The service that runs the configured trainer in a worker thread and hands it a TrainerSwarm."""

    name = "trainer"

    def __init__(self, daemon: DaemonContext, gossip: GossipEngine, pipeline: PipelineService,
                 topology: TopologyService):
        self.daemon = daemon
        self.gossip, self.pipeline, self.topology = gossip, pipeline, topology
        self.cfg = daemon.config.trainer
        self.report = TrainingReport(daemon.peer_id, daemon.home.metrics_file, {"trainer": self.cfg.name, "state": "starting"})
        self.metrics = self.report.metrics
        self.events: deque[tuple[str, str]] = deque(maxlen=1000)
        self.stopping = threading.Event()
        self.token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._done = trio.Event()
        self._checkpoint_fn = None  # set by the trainer through Swarm.on_checkpoint_request
        self._evaluate_fn = None  # set by the trainer through Swarm.on_evaluate_request
        daemon.membership.watch(lambda pid, s: self.events.append((pid, "joined" if s else "left")))

    def on_checkpoint_request(self, fn) -> None:
        """The trainer's checkpoint function (Swarm.on_checkpoint_request): `peer export` calls it."""
        self._checkpoint_fn = fn

    def on_evaluate_request(self, fn) -> None:
        """The trainer's evaluation function (Swarm.on_evaluate_request): the control command `evaluate` calls it."""
        self._evaluate_fn = fn

    def record_fields(self) -> RecordFields:
        """HasRecordFields: our record carries our training figures to the others' dashboards."""
        return RecordFields(training=self.report.figures())

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:  # in a worker thread: a trainer's imports (torch: 2 CPU seconds, 10 s under a fifth of a CPU) on the
            # event loop left heartbeats unanswered, and a restarting daemon's peers dropped every session with it
            # (`peer bench pipeline --churn`, docs/benchmarks.md 2026-11-28 (night))
            module = await trio.to_thread.run_sync(importlib.import_module, self.cfg.name)
        except ImportError as exc:
            raise ValueError(f"[trainer] name: cannot import {self.cfg.name!r}: {exc}") from None
        if not callable(getattr(module, "run", None)):
            raise ValueError(f"[trainer] name: {self.cfg.name!r} has no run(swarm, options) function")
        self.token = trio.lowlevel.current_trio_token()
        swarm = TrainerSwarm(self)
        async with trio.open_nursery() as n:
            self._nursery = n
            task_status.started()
            try:
                result = await trio.to_thread.run_sync(self._run_thread, module, swarm, abandon_on_cancel=True)
                self.metrics["state"] = "done"
                if isinstance(result, dict):
                    self.metrics.update(result)
                log.info("trainer finished: %s", json.dumps({k: v for k, v in self.metrics.items() if k not in ("loss_history", "curve")}, default=str)[:500])
            except TrainerStopped:
                self.metrics["state"] = "stopped"
            except Exception as exc:
                self.metrics["state"] = failure_state(exc)
                log.exception("trainer failed (the daemon keeps serving peers)")
            finally:
                self._done.set()
            await trio.sleep_forever()  # keep serving exchanges for the others

    def _run_thread(self, module, swarm: TrainerSwarm):
        return module.run(swarm, dict(self.cfg.options))

    async def shutdown(self) -> None:
        """Ask the trainer to stop and give it a bounded time to save its checkpoint."""
        self.stopping.set()
        with trio.move_on_after(20):
            await self._done.wait()

    def status(self) -> dict:
        return self.report.status()

    def commands(self) -> dict:
        async def checkpoint(args: dict) -> dict:
            """Ask the trainer to save now (it does so between steps); wait for it, bounded."""
            if self._checkpoint_fn is None:
                raise ValueError("this trainer does not support on-demand checkpoints")
            await trio.to_thread.run_sync(self._checkpoint_fn)
            return {"saved": True}
        async def evaluate(args: dict) -> dict:
            """Ask the trainer to evaluate its model now (a pipeline driver runs validation microbatches)."""
            if self._evaluate_fn is None:
                raise ValueError("this trainer does not evaluate on request")
            return await trio.to_thread.run_sync(self._evaluate_fn)
        return {"checkpoint": checkpoint, "evaluate": evaluate}

"""Hosting a training job inside the daemon.

The config names a trainer module (`[trainer] name = "trainers.gossip_sgd"`); the module defines
`run(swarm: Swarm, options: dict) -> dict | None`. It runs in a worker thread (torch releases the GIL
for its kernels) while trio keeps heartbeats and exchanges going. `Swarm` is the one narrow interface a
trainer sees: averaging with neighbours, parameter download, metrics, checkpoints and membership news.
`peer/` never imports a specific trainer.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from peer.averaging.engine import ExchangeResult
from peer.averaging.shared import SharedTensors
from peer.pipeline.directory import PipelineKey, StagePeer
from peer.pipeline.driver import DriverHandle
from peer.pipeline.server import StageHandler
from peer.pipeline.state import FetchedState, KeptCopy
from protocol.schema.pipeline import StageAnnouncement
from peer.home import Home, atomic_write

log = logging.getLogger("peertrain.trainer")

FAILURE_CHARS = 240  # a failed trainer's cause in its status: one line a table can show; the log has the traceback

# A launcher that knows how it cut the data (`peer local`, tests, benches) tells each daemon its shard.
RANK_ENV, WORLD_ENV = "PEERTRAIN_RANK", "PEERTRAIN_WORLD"


class CheckpointRefused(ValueError):
    """A checkpoint file that cannot be read as data alone (tensors, numbers, strings, lists and dicts)."""


def read_checkpoint(path: Path, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True: a checkpoint is data, and a pickle that would have to build other
    objects (run code) to load is refused, so a file planted in a home cannot run code in the daemon or in
    `peer export`. Raises CheckpointRefused saying why."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
        reason = next((ln for ln in lines if "GLOBAL" in ln), lines[-1])  # torch names the global it refused
        raise CheckpointRefused(f"refusing checkpoint {path}: it holds more than tensors and plain data, and "
                                f"loading it could run code ({reason})") from None
    except Exception as exc:
        raise CheckpointRefused(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from None


def save_checkpoint(directory: Path, state: dict[str, Any], name: str = Home.LATEST_CHECKPOINT) -> Path:
    """torch.save to directory/<name> atomically (a crash never leaves a torn file)."""
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    path = Path(directory) / name
    atomic_write(path, buf.getvalue(), mode=0o600)
    return path


def load_checkpoint(directory: Path, name: str = Home.LATEST_CHECKPOINT, map_location: Any = "cpu") -> dict[str, Any] | None:
    """The checkpoint saved as `name`, or None if there is none or it is refused (logged: the trainer starts
    afresh rather than run what a planted file would make it run)."""
    path = Path(directory) / name
    if not path.exists():
        return None
    try:
        return read_checkpoint(path, map_location)
    except CheckpointRefused as exc:
        log.error("%s; starting without it", exc)
        return None


def shard_index(me: str, peers: Callable[[], list[str]], world: int | None,
                stopping: Callable[[], bool] = lambda: False) -> tuple[int, int]:
    """A data-shard index and count: $PEERTRAIN_RANK/$PEERTRAIN_WORLD if set (peer local sets them), else my
    position among the sorted IDs of the peers I see (waiting up to 10 s to see `world` of them)."""
    env_rank, env_world = os.environ.get(RANK_ENV), os.environ.get(WORLD_ENV)
    if env_rank is not None and env_world is not None:
        return int(env_rank), int(env_world)
    deadline = time.monotonic() + 10
    while world and len(peers()) + 1 < world and time.monotonic() < deadline and not stopping():
        time.sleep(0.1)
    ids = sorted(set(peers()) | {me})
    w = world or len(ids)
    return ids.index(me) % w, w


WAIT_POLL_S = 0.1  # how often a trainer waiting for its peers looks again


def wait_for_peers(count: Callable[[], tuple[int, bool]], n: int, timeout: float,
                   stopping: Callable[[], bool] = lambda: False) -> int:
    """Poll `count()` -> (peers there, whether we have a neighbour) until `n` peers and a neighbour, the
    timeout, or a stop; the last count. Hosted and attached trainers wait for their peers this one way."""
    deadline = time.monotonic() + timeout
    while True:
        have, neighbour = count()
        if (have >= n and neighbour) or time.monotonic() >= deadline or stopping():
            return have
        time.sleep(WAIT_POLL_S)


class TrainingReport:
    """What a training job tells `peer status` (its latest figures, a short loss history) and HOME/metrics.jsonl
    (every publish as one JSON line). A hosted trainer and an attached process (peer/attach/) each have one."""

    LOSS_HISTORY = 60  # points of the loss sparkline in `peer status`

    def __init__(self, daemon, metrics: dict[str, Any]):
        self.daemon = daemon
        self.metrics: dict[str, Any] = dict(metrics)
        self.loss_history: deque[float] = deque(maxlen=self.LOSS_HISTORY)

    def publish(self, metrics: dict[str, Any]) -> None:
        metrics = dict(metrics)
        if metrics.get("loss") is not None:
            self.loss_history.append(float(metrics["loss"]))
        self.metrics.update(metrics)
        line = dict(metrics, ts=round(time.time(), 3), peer=self.daemon.peer_id)
        try:
            with open(self.daemon.home.metrics_file, "a") as f:
                f.write(json.dumps(line, default=float) + "\n")
        except OSError as exc:
            log.warning("cannot append metrics: %s", exc)

    def status(self) -> dict:
        return dict(self.metrics, loss_history=list(self.loss_history))


def failure_state(exc: BaseException) -> str:
    """The trainer's `state` after `exc`: "failed: Type: cause" on one line, cut to FAILURE_CHARS. A message
    of many lines keeps its first, unless it wraps a traceback (a DataLoader worker's), whose last line is
    the cause."""
    text = str(exc).strip()
    lines = [" ".join(ln.split()) for ln in text.splitlines() if ln.strip()] or [""]
    cause = lines[-1] if "Traceback (most recent call last)" in text else lines[0]
    state = f"failed: {type(exc).__name__}: {cause}" if cause else f"failed: {type(exc).__name__}"
    return state if len(state) <= FAILURE_CHARS else state[: FAILURE_CHARS - 1] + "…"


class TrainerStopped(Exception):
    """Raised inside the trainer thread when the daemon is stopping."""


class Swarm:
    """What a trainer may ask of the daemon. Every method is safe to call from the trainer's thread."""

    def __init__(self, host: "TrainerHost"):
        self._host = host
        self.peer_id: str = host.daemon.peer_id
        self.home: Path = host.daemon.home.root
        self.checkpoint_dir: Path = host.daemon.home.checkpoints

    # -- averaging ------------------------------------------------------------------------------------
    def share(self, name: str, tensors: dict[str, Any], *, lock: threading.Lock | None = None,
              partners: Callable[[], set[str]] | None = None, codec: str | None = None,
              error_feedback: bool = False, averaged: bool = True) -> SharedTensors:
        """Offer these tensors (e.g. model parameters) for averaging under a group name, with our topology
        neighbours, or with `partners()` (called on the daemon's thread: cheap, no blocking), say the peers
        that serve the same pipeline stage. `codec` overrides [gossip] codec for this group, `error_feedback`
        carries a lossy codec's rounding into the next exchange, `averaged=False` only serves the tensors to
        joining partners (an outer optimizer's state)."""
        group = SharedTensors(name, tensors, lock=lock, codec=codec, error_feedback=error_feedback, averaged=averaged)
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

    def fetch_params(self, group: str) -> tuple[list[Any], int] | None:
        """Download the current tensors of `group` from a neighbour (joining peers; only neighbours serve them)."""
        return self._call(self._host.gossip.fetch_from_partners, group)

    def download(self, group: str, *, min_step: int = 1) -> int | None:
        """Replace `group`'s tensors with a partner's if that partner is at step `min_step` or later (a peer
        joining a swarm that already trains); that step, or None."""
        got = self.fetch_params(group)
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
        self._call_sync(self._host.daemon.pipeline.serve, key, stage, max_batch, handler, ready=ready)

    def stage_ready(self) -> None:
        """Start taking calls for the stage announced with `serve_stage(ready=False)`."""
        self._call_sync(self._host.daemon.pipeline.set_ready)

    def stop_serving(self) -> None:
        self._call_sync(self._host.daemon.pipeline.stop_serving)

    def stage_map(self, key: PipelineKey) -> dict[int, list[StagePeer]]:
        """The live peers of each stage of pipeline `key` (us included, marked `me`)."""
        return self._call_sync(self._host.daemon.pipeline.stage_map, key)

    def stage_announcements(self) -> dict[str, StageAnnouncement]:
        """What each peer we hear of announces serving (any pipeline, any cut), by peer ID."""
        return self._call_sync(self._host.daemon.pipeline.announcements)

    def stage_partners(self) -> set[str]:
        """The live peers serving our stage. Runs on the daemon's thread: pass it as `share(partners=...)`."""
        return self._host.daemon.pipeline.stage_partners()

    def fetch_stage_state(self, key: PipelineKey, stage: int, peer_id: str, check) -> FetchedState:
        """Download stage `stage`'s state (weights, optimizer state, step) from `peer_id`, a peer serving it or
        keeping a copy; `check(specs)` refuses a list of (name, dtype, shape) that is not this stage's state
        before anything is allocated. Raises StateUnavailable with the reason (peer/pipeline/state.py)."""
        return self._call(self._host.daemon.pipeline.fetch_state, key, stage, peer_id, check)

    def keep_stage_copy(self, key: PipelineKey, stage: int, tensors: list, step: int, samples: int) -> None:
        """Keep a copy of a stage's state (one we left, or back up) to hand to whoever takes the stage over."""
        self._call_sync(self._host.daemon.pipeline.keep_copy, key, stage, tensors, step, samples)

    def stage_copy(self, key: PipelineKey, stage: int) -> KeptCopy | None:
        """The copy of `stage` this daemon keeps (tensors, step, samples), or None."""
        return self._call_sync(self._host.daemon.pipeline.copy_of, key, stage)

    def drop_stage_copy(self, key: PipelineKey, stage: int) -> None:
        self._call_sync(self._host.daemon.pipeline.drop_copy, key, stage)

    def announce_move(self, moving_to: int = -1, moved_from: int = -1) -> None:
        """Tell the swarm (our record) that we are moving to a stage, or lately left one (-1: neither)."""
        self._call_sync(self._host.daemon.pipeline.announce_move, moving_to, moved_from)

    def note_move(self, **move: Any) -> None:
        """Record one of our moves (from, to, reason, ...) for `peer status`."""
        self._call_sync(self._host.daemon.pipeline.note_move, move)

    def open_driver(self, key: PipelineKey, *, reply_shapes, in_flight: int, forward_codec: str = "raw",
                    backward_codec: str = "raw") -> DriverHandle:
        """A driver of microbatches through pipeline `key`, at most `in_flight` at once (peer/pipeline/driver.py)."""
        return self._call_sync(self._host.daemon.pipeline.open_driver, key, reply_shapes=reply_shapes,
                               in_flight=in_flight, token=self._host.token, stopped=self.should_stop,
                               forward_codec=forward_codec, backward_codec=backward_codec)

    def on_evaluate_request(self, fn) -> None:
        """Register a thread-safe function returning evaluation figures (the control command `evaluate`)."""
        self._host._evaluate_fn = fn

    # -- who is around --------------------------------------------------------------------------------
    def neighbours(self) -> list[str]:
        return sorted(self._host.daemon.topology.neighbours)

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

    # -- reporting and state --------------------------------------------------------------------------
    def publish(self, metrics: dict[str, Any]) -> None:
        """Metrics for `peer status` and one JSON line in HOME/metrics.jsonl."""
        self._host.report.publish(metrics)

    def save_checkpoint(self, state: dict[str, Any], name: str = Home.LATEST_CHECKPOINT) -> Path:
        """torch.save to HOME/checkpoints/<name> atomically (a crash never leaves a torn file)."""
        return save_checkpoint(self.checkpoint_dir, state, name)

    def load_checkpoint(self, name: str = Home.LATEST_CHECKPOINT, map_location: Any = "cpu") -> dict[str, Any] | None:
        """The checkpoint saved as `name`, or None if there is none or it is refused (logged)."""
        return load_checkpoint(self.checkpoint_dir, name, map_location)

    def on_checkpoint_request(self, fn) -> None:
        """Register a thread-safe function that saves a checkpoint (used by `peer export`)."""
        self._host._checkpoint_fn = fn

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
    name = "trainer"

    def __init__(self, daemon, gossip):
        self.daemon = daemon
        self.gossip = gossip
        self.cfg = daemon.config.trainer
        self.report = TrainingReport(daemon, {"trainer": self.cfg.name, "state": "starting"})
        self.metrics = self.report.metrics
        self.events: deque[tuple[str, str]] = deque(maxlen=1000)
        self.stopping = threading.Event()
        self.token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._done = trio.Event()
        self._checkpoint_fn = None  # set by the trainer through Swarm.on_checkpoint_request
        self._evaluate_fn = None  # set by the trainer through Swarm.on_evaluate_request
        daemon.membership.watch(lambda pid, s: self.events.append((pid, "joined" if s else "left")))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            module = importlib.import_module(self.cfg.name)
        except ImportError as exc:
            raise ValueError(f"[trainer] name: cannot import {self.cfg.name!r}: {exc}") from None
        if not callable(getattr(module, "run", None)):
            raise ValueError(f"[trainer] name: {self.cfg.name!r} has no run(swarm, options) function")
        self.token = trio.lowlevel.current_trio_token()
        swarm = Swarm(self)
        async with trio.open_nursery() as n:
            self._nursery = n
            task_status.started()
            try:
                result = await trio.to_thread.run_sync(self._run_thread, module, swarm, abandon_on_cancel=True)
                self.metrics["state"] = "done"
                if isinstance(result, dict):
                    self.metrics.update(result)
                log.info("trainer finished: %s", json.dumps({k: v for k, v in self.metrics.items() if k != "loss_history"}, default=str)[:500])
            except TrainerStopped:
                self.metrics["state"] = "stopped"
            except Exception as exc:
                self.metrics["state"] = failure_state(exc)
                log.exception("trainer failed (the daemon keeps serving peers)")
            finally:
                self._done.set()
            await trio.sleep_forever()  # keep serving exchanges for the others

    def _run_thread(self, module, swarm: Swarm):
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

"""The one interface a training job sees: `Swarm`, and the few names that go with it.

A job trains beside a daemon in one of three ways, and gets a handle that implements `Swarm` with the same
signatures and return types in each:

- hosted by the daemon (`[trainer] name = ...`): `peer.trainer_host.TrainerSwarm`, which also implements
  `HostedSwarm` (pipeline stages, on-request hooks);
- an attached process (`peertrain.attach()` / `peertrain.start()`): `peer.attach.client.AttachedSwarm`;
- the ranks of a torchrun job on one host, one peer: `peertrain.distributed.HostRanks`.

This module is a leaf: it imports nothing of the daemon (no trio), so `import peertrain` stays light and a
trainer module can be type-checked alone. The daemon implements these protocols; it does not define them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Protocol, runtime_checkable

from protocol.refusal import Code  # stdlib only: the refusal codes every handle reports

if TYPE_CHECKING:  # only for annotations: the pipeline's types (peertrain/pipeline.py, a leaf too)
    from peertrain.pipeline import (FetchedState, KeptStateCopy, MicrobatchDriver, MoveOrder, PipelineKey,
                                    ReplyShapes, SeatFigures, StageHandler, StagePeer, StateSource, Spec)
    from protocol.schema.pipeline import StageAnnouncement

# How `average` pairs up: "one" random neighbour (pairwise, AD-PSGD), or "all" of them at once
# (Metropolis-Hastings weights, D-PSGD). The wire of attached processes and the engine check against this.
AVERAGE_MODES = ("one", "all")

# A launcher that knows how it cut the data (`peer local`, tests, benches) tells each daemon its shard.
RANK_ENV, WORLD_ENV = "PEERTRAIN_RANK", "PEERTRAIN_WORLD"

LATEST_CHECKPOINT = "latest.pt"  # a job's current state; `peer export` and restarts read it

SHARD_WAIT_S = 10.0  # how long `shard_index` waits to see `world` peers before it counts those it sees
WAIT_POLL_S = 0.1  # how often a job waiting for its peers looks again


class TrainerStopped(Exception):
    """Raised in a job's thread when its daemon is stopping (hosted) or gone: save and return."""


@dataclass
class ExchangeResult:
    """One exchange of an averaging round, as every handle reports it."""

    peer_id: str
    ok: bool
    reason: str = ""  # why it failed ("" when ok)
    weight: float = 0.0  # the mixing weight both sides applied
    seconds: float = 0.0
    bytes_sent: int = 0
    code: Code | None = None  # why it was refused, by the peer or by our own rules (None: it ran, or failed)


class SharedGroup(Protocol):
    """Tensors shared for averaging under one name. Hold `lock` while changing them (an optimizer step):
    the daemon updates them in place. `step` is told to peers (a joiner compares steps)."""

    name: str
    step: int

    @property
    def tensors(self) -> Mapping[str, Any]: ...

    @property
    def lock(self) -> ContextManager[Any]: ...

    def sync(self) -> None:
        """Fold the daemon's updates into tensors it cannot update in place (GPU, bfloat16); else nothing."""


@runtime_checkable
class Swarm(Protocol):
    """What a training job may ask of its daemon. Every method is safe to call from the job's thread and
    blocks at most for its own deadline (an averaging round, a download, `wait_for_peers`' timeout)."""

    peer_id: str
    home: Path
    checkpoint_dir: Path

    # -- averaging ------------------------------------------------------------------------------------
    def share(self, name: str, tensors: dict[str, Any], *, codec: str | None = None, error_feedback: bool = False,
              averaged: bool = True) -> SharedGroup:
        """Offer `tensors` for averaging as group `name`. `codec` overrides [gossip] codec for it;
        `error_feedback` carries a lossy codec's rounding into the next exchange; `averaged=False` only
        serves the tensors to joining partners (an outer optimizer's state)."""
        ...

    def unshare(self, name: str) -> None:
        """Stop sharing group `name`."""
        ...

    def average(self, group: str, *, mode: str = "one") -> list[ExchangeResult]:
        """Average now and wait: with one random neighbour, or with all (AVERAGE_MODES)."""
        ...

    def average_in_background(self, group: str, *, mode: str = "one") -> bool:
        """Start a round and return at once (AD-PSGD); False while the previous one runs or when stopping."""
        ...

    def download(self, group: str, *, min_step: int = 1) -> int | None:
        """Replace `group`'s tensors with a partner's at step `min_step` or later (a late joiner): that
        step, or None."""
        ...

    # -- who is around --------------------------------------------------------------------------------
    def neighbours(self) -> list[str]: ...

    def peers(self) -> list[str]: ...

    def membership_events(self) -> list[tuple[str, str]]:
        """(peer_id, 'joined'|'left') since the last call."""
        ...

    def wait_for_peers(self, n: int = 1, *, group: str | None = None, timeout: float = 30.0) -> int:
        """Wait up to `timeout` s for `n` other peers (with `group`: peers sharing it) and a neighbour;
        how many there are."""
        ...

    def rank_and_world(self, world: int | None = None) -> tuple[int, int]:
        """This peer's data-shard index and count (see `shard_index`)."""
        ...

    @property
    def local_rank(self) -> int:
        """This process's rank among the processes that are one peer (0 outside torchrun)."""
        ...

    @property
    def local_world(self) -> int:
        """How many processes are one peer (1 outside torchrun)."""
        ...

    def exchanges(self) -> dict[str, Any]:
        """The daemon's exchange counts (initiated, served, failed, last_error)."""
        ...

    # -- reporting and state --------------------------------------------------------------------------
    def publish(self, metrics: dict[str, Any]) -> None:
        """Figures for `peer status` and one JSON line in HOME/metrics.jsonl."""
        ...

    def save_checkpoint(self, state: dict[str, Any], name: str = LATEST_CHECKPOINT) -> Path:
        """torch.save to HOME/checkpoints/<name> atomically."""
        ...

    def load_checkpoint(self, name: str = LATEST_CHECKPOINT, map_location: Any = "cpu") -> dict[str, Any] | None:
        """The checkpoint saved as `name`, or None (none, or refused as more than data: logged)."""
        ...

    def should_stop(self) -> bool: ...

    def log(self, msg: str, *args: Any) -> None: ...


@runtime_checkable
class ClosableSwarm(Swarm, Protocol):
    """A Swarm this process opened (`attach`, `start`): close it, or use it as a context manager, to detach."""

    def close(self) -> None: ...

    def __enter__(self) -> ClosableSwarm: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class HostedSwarm(Swarm, Protocol):
    """What a job hosted by the daemon gets beyond `Swarm`: pipeline stages, the daemon's requests, and pushed
    updates (the sparse outer exchange: `share(..., push_lr=)` takes partners' pushes into a group)."""

    def push_update(self, group: str, encoded: list[Any], *, norm: float, round: int = 0,
                    support: list[Any] | None = None) -> int | None:
        """Send a round's sparse update of `group` (encoded once: protocol.tensor_encoder.EncodedTensor) to every
        partner (peer/averaging/pushes.py): the peers it counts among, or None if not started. `support`: the
        update's nonzero entries per tensor, (flat indices, values), the yardstick of partners' pushes' angle."""
        ...

    def serve_stage(self, key: PipelineKey, stage: int, max_batch: int, handler: StageHandler, *,
                    ready: bool = True) -> None: ...

    def stage_ready(self) -> None: ...

    def stop_serving(self) -> None: ...

    def stage_map(self, key: PipelineKey) -> dict[int, list[StagePeer]]: ...

    def stage_announcements(self) -> dict[str, StageAnnouncement]: ...

    def stage_partners(self) -> set[str]: ...

    def fetch_stage_state(self, key: PipelineKey, stage: int, peer_id: str,
                          check: Callable[[list[Spec]], None]) -> FetchedState: ...

    def keep_stage_copy(self, key: PipelineKey, stage: int, tensors: list[Any], step: int, samples: int, *,
                        in_memory: bool = False) -> None: ...

    def stage_copy(self, key: PipelineKey, stage: int) -> KeptStateCopy | None: ...

    def drop_stage_copy(self, key: PipelineKey, stage: int) -> None: ...

    def announce_move(self, moving_to: int = -1) -> None: ...

    def note_move(self, **move: Any) -> None: ...

    # where we serve: the daemon decides from the job's figures (peer/pipeline/seating.py), the job moves
    def seat(self, figures: SeatFigures) -> None: ...

    def first_move(self, figures: SeatFigures, rank: int | None) -> MoveOrder: ...

    def next_move(self, timeout: float) -> MoveOrder | None: ...

    def may_switch(self, from_stage: int) -> str | None: ...

    def adopted_cut(self, pipeline: str, own_cuts: tuple[int, ...]) -> tuple[int, ...]: ...

    def state_sources(self, key: PipelineKey, stage: int) -> list[StateSource]: ...

    def open_driver(self, key: PipelineKey, *, reply_shapes: ReplyShapes, in_flight: int, forward_codec: str = "raw",
                    backward_codec: str = "raw") -> MicrobatchDriver: ...

    def stage_device(self) -> str:
        """Where a pipeline stage computes ('cpu' or 'cuda:N': `[pipeline] device` resolved)."""
        ...

    def stage_memory(self) -> tuple[int, str]:
        """The daemon's memory budget for a stage in bytes (0: unknown), and where it came from."""
        ...

    def announce_stage_profile(self, profiles: list[Any], memory_bytes: int, stage_room_bytes: int) -> None: ...

    def on_evaluate_request(self, fn: Callable[[], dict[str, Any]]) -> None: ...

    def on_checkpoint_request(self, fn: Callable[[], Any]) -> None: ...


def shard_index(me: str, peers: Callable[[], list[str]], world: int | None,
                stopping: Callable[[], bool] = lambda: False) -> tuple[int, int]:
    """A data-shard index and count: $PEERTRAIN_RANK/$PEERTRAIN_WORLD if set (peer local sets them), else my
    position among the sorted IDs of the peers I see (waiting up to SHARD_WAIT_S to see `world` of them)."""
    env_rank, env_world = os.environ.get(RANK_ENV), os.environ.get(WORLD_ENV)
    if env_rank is not None and env_world is not None:
        return int(env_rank), int(env_world)
    deadline = time.monotonic() + SHARD_WAIT_S
    while world and len(peers()) + 1 < world and time.monotonic() < deadline and not stopping():
        time.sleep(WAIT_POLL_S)
    ids = sorted(set(peers()) | {me})
    w = world or len(ids)
    return ids.index(me) % w, w


def wait_for_peers(count: Callable[[], tuple[int, bool]], n: int, timeout: float,
                   stopping: Callable[[], bool] = lambda: False) -> int:
    """Poll `count()` -> (peers there, whether we have a neighbour) until `n` peers and a neighbour, the
    timeout, or a stop; the last count. Every handle waits for its peers this one way."""
    deadline = time.monotonic() + timeout
    while True:
        have, neighbour = count()
        if (have >= n and neighbour) or time.monotonic() >= deadline or stopping():
            return have
        time.sleep(WAIT_POLL_S)

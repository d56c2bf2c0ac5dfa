"""Every type that crosses between a pipeline job and its daemon: what `HostedSwarm` takes and returns.

A leaf, like peertrain/swarm.py: stdlib and `protocol.*` only (no trio, no torch, nothing of `peer`), so a
trainer module names the pipeline's types without loading the daemon, and the daemon's pipeline
(peer/pipeline/) can change its internals without the job seeing it. Plain values (keys, stage maps,
microbatches and their outcomes, a fetched state) are dataclasses defined here, which the daemon builds; what
the job sees of a daemon object (the microbatch driver, a kept copy) and what the job gives the daemon (a
stage handler and the gradients it holds) are `Protocol`s. tests/swarm_conformance.py checks that the daemon's
classes and trainers/pipeline/stage.py's satisfy them (mypy).
"""

from __future__ import annotations

import math
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.refusal import Refusal
from protocol.schema.pipeline import StageAnnouncement

Named = list[tuple[str, Any]]  # (name, tensor), as a stage's write_state gives them
Spec = tuple[str, str, tuple[int, ...]]  # (name, dtype without "torch.", shape)
ReplyShapes = Callable[[int, str, int], list[tuple[str, list[int]]]]
"""(stage, kind, batch) -> the (dtype, shape) of each tensor the reply must carry (from the model's cut)."""


# -- values: the daemon builds them, the job reads them --------------------------------------------------

@dataclass(frozen=True)
class PipelineKey:
    """A pipeline is its name and where the model is cut: peers that cut it elsewhere serve other stages."""

    name: str
    cuts: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.cuts) + 1

    @classmethod
    def of(cls, ann: StageAnnouncement) -> PipelineKey:
        return cls(ann.pipeline, tuple(ann.cuts))


@dataclass(frozen=True)
class StagePeer:
    """A live peer serving a stage, as its announcement (peer/pipeline/directory.py) says."""

    peer_id: str
    stage: int
    samples_per_s: float  # as the peer announced it (0: not measured yet)
    queue: int  # calls it announced as waiting or running
    me: bool = False
    step: int = 0  # optimizer steps of its stage's state
    moving_to: int = -1  # the stage it is moving to (rebalancing), or -1
    moved_from: int = -1  # the stage it left lately, or -1
    memory_mib: int = 0  # its memory budget (0: not said)
    stage_room_mib: int = 0  # of which a stage may use (0: not said: any stage fits, as far as we know)
    memory_used_mib: int = 0  # what it holds now


@dataclass
class Microbatch:
    id: int
    x: Any  # torch tensors
    y: Any
    seed: int
    evaluate: bool = False  # forward only, the loss at the last stage: a validation microbatch

    @property
    def batch(self) -> int:
        return int(self.x.shape[0])


@dataclass
class Outcome:
    """How a microbatch ended (peer/pipeline/driver.py)."""

    id: int
    ok: bool
    samples: int
    loss: float | None = None
    resent: int = 0  # calls re-sent to another peer
    reruns: int = 0  # times the whole microbatch was run again without an outlier a check found (verify.py)
    seconds: float = 0.0
    reason: str = ""
    evaluate: bool = False


@dataclass
class FetchedState:
    """A stage's state downloaded from a peer (peer/pipeline/state_transfer.py)."""

    tensors: Named
    step: int
    samples: int
    live: bool  # from a peer serving the stage (else from a copy)
    source: str  # the peer it came from
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class StateSource:
    """A peer that can hand out a stage's state (`HostedSwarm.state_sources`): serving it (`live`) or keeping
    a copy of it, at optimizer step `step`."""

    peer_id: str
    step: int
    live: bool


@dataclass(frozen=True)
class MoveOrder:
    """The daemon's word that this peer should serve `to_stage` (peer/pipeline/seating.py says when): the job
    makes the move. `settle_s`: announce the move at least this long before switching, so peers that decided
    at the same moment see each other. `starting`: the pipeline has not trained yet, so there is no state to
    fetch (the job takes the stage fresh)."""

    to_stage: int
    reason: str
    settle_s: float
    starting: bool = False


class StateUnavailable(Exception):
    """The state could not be had from that peer; the message says why, and `refusal` what the peer said
    when it refused (None when the fetch failed otherwise: no session, a deadline, a bad reply)."""

    def __init__(self, reason: str, refusal: Refusal | None = None):
        super().__init__(reason)
        self.refusal = refusal


class CopyUnreadable(Exception):
    """A kept copy's file is gone or does not hold that copy; the message names the file and why."""


# -- values: the job builds them, the daemon reads them ----------------------------------------------------

@dataclass(frozen=True)
class SeatFigures:
    """What the daemon decides this peer's stage from (`HostedSwarm.seat`; peer/pipeline/seating.py): the job's
    figures for the cut it serves, which need the model (torch) to compute. The rest (who serves what, how
    fast, what memory they announce) the daemon reads from the records it holds."""

    key: PipelineKey
    stage_seconds: tuple[float, ...]  # compute seconds per microbatch of each stage (measured blocks where any)
    stage_bytes: tuple[int, ...]  # what serving each stage takes on a peer (trainers/pipeline/memory.py)
    room_bytes: int  # what a stage may take here (0: unknown: any stage fits)
    settling: bool  # peers starting together spread over the stages (no training yet: no state to move)
    pinned: bool = False  # the job pinned its stage (`initial_stage`): the daemon never moves it
    rebalance_every: float = 0.0  # seconds between rebalancing decisions; 0: neither rebalance nor take over
    min_gain: float = 0.0  # the least predicted gain a rebalancing move must promise

    def __post_init__(self) -> None:
        n = self.key.stages
        if len(self.stage_seconds) != n or len(self.stage_bytes) != n:
            raise ValueError(f"SeatFigures: {n} stages, but {len(self.stage_seconds)} stage seconds and "
                             f"{len(self.stage_bytes)} stage sizes")
        if not all(math.isfinite(s) and s > 0 for s in self.stage_seconds):
            raise ValueError(f"SeatFigures: stage seconds must be positive and finite, got {self.stage_seconds}")
        if any(b < 0 for b in self.stage_bytes) or self.room_bytes < 0:
            raise ValueError("SeatFigures: stage sizes and the room must not be negative")
        if not (self.rebalance_every >= 0 and self.min_gain >= 0):  # (NaN fails both)
            raise ValueError("SeatFigures: rebalance_every and min_gain must not be negative (or NaN)")


# -- daemon objects, as the job sees them ----------------------------------------------------------------

class MicrobatchDriver(Protocol):
    """Microbatches through the pipeline (`HostedSwarm.open_driver`; peer/pipeline/driver.py's DriverHandle).
    Called from the job's thread only; raises peertrain.swarm.TrainerStopped when the daemon stops."""

    def submit(self, mb: Microbatch, *, into: queue.SimpleQueue[Outcome] | None = None) -> None:
        """Start `mb` once fewer than `in_flight` are out (blocks until then); its outcome goes to `outcomes()`
        (or `into`)."""
        ...

    def outcomes(self) -> list[Outcome]:
        """The outcomes of submitted microbatches that ended since the last call."""
        ...

    def run_many(self, mbs: list[Microbatch], *, timeout: float) -> list[Outcome]:
        """Move `mbs` and wait for exactly their outcomes, at most `timeout`."""
        ...

    def drain(self, timeout: float) -> list[Outcome]:
        """Wait (at most `timeout`) for every submitted microbatch's outcome; those not collected yet."""
        ...


class KeptStateCopy(Protocol):
    """A copy of a stage's state the daemon keeps (`HostedSwarm.stage_copy`; peer/pipeline/copies.py)."""

    @property
    def key(self) -> PipelineKey: ...

    @property
    def stage(self) -> int: ...

    @property
    def step(self) -> int: ...

    @property
    def samples(self) -> int: ...

    @property
    def specs(self) -> list[Spec]: ...

    @property
    def nbytes(self) -> int:
        """The tensors' bytes (what holding it in memory costs)."""
        ...

    @property
    def on_disk(self) -> bool: ...

    def load(self) -> tuple[Named, int, int]:
        """(tensors, step, samples); reads the file on the caller's thread. Raises CopyUnreadable."""
        ...


# -- what the job gives the daemon ---------------------------------------------------------------------

class HeldGradient(Protocol):
    """One call's parameter gradient, as the stage handler computed it (trainers/pipeline/stage.py). The daemon
    only reads its figures (read-only here: a handler may compute them)."""

    @property
    def samples(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """What it holds (the daemon bounds its kept gradients' bytes)."""
        ...

    @property
    def deferred(self) -> bool:
        """Computed when acknowledged, not when called (its ack is answered before the computation)."""
        ...

    def accumulate(self) -> bool:
        """Count it in the stage (in a worker thread): False if the stage's state was replaced since it was
        computed (then it is dropped)."""
        ...

    def release(self) -> None:
        """It was dropped: leave no trace in the stage (in a worker thread; a stage may have added it
        provisionally, trainers/pipeline/stage.py)."""
        ...


class StageHandler(Protocol):
    """What a trainer gives the daemon to serve a stage (trainers/pipeline/stage.py implements it)."""

    def kinds(self) -> tuple[str, ...]: ...
    def input_specs(self, kind: str, batch: int) -> list[tuple[str, str, list[int]]]: ...
    def compute(self, kind: str, tensors: list[Any], seed: int) -> tuple[float | None, list[Any], HeldGradient | None]:
        """(loss, output tensors, the call's parameter gradient: kept until acknowledged; None for no gradient)."""
    def samples_per_s(self) -> float: ...
    def write_state(self, write: Callable[[list[tuple[str, Any]], int, int], None]) -> None:
        """Call `write(named tensors, steps, samples)` under the stage's lock with the tensors themselves, not
        copies: the daemon streams them to a file before it sends them (peer/pipeline/state_transfer.py), so
        the state a joiner asks for never takes memory beside the stage that its budget does not hold."""

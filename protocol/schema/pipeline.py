"""Pipeline-plane messages: which stage a peer serves, and the calls that move a microbatch through stages.

A server announces its stage inside its signed `TopologyRecord` (`StageAnnouncement`), so the record that
already floods, expires and is bounded carries it: a driver learns the live peers of every stage from the
view it holds anyway. A driver moves one microbatch with `StageCall` requests, one per stage and direction:

  driver → server  StageCall(kind="forward" | "backward" | "loss" | "evaluate"); its input tensors follow
  server → driver  StageReply (the output tensors follow) | ErrorReply (refused, with a code and reason)

A "backward" or "loss" call's parameter gradient does not enter the stage's accumulated gradient when it is
computed: the server keeps it aside and names it in its reply (`kept`). Once the microbatch's backward has
completed through every stage, the driver tells each server that kept one to add it; a microbatch that
failed tells them to drop it (a gradient nobody acknowledges is dropped after a while):

  driver → server  StageAck(kept ids, accumulate=True | False)
  server → driver  StageAckReply(the ids whose gradient entered the stage)

A peer moving to another stage, or taking over a stage nobody serves, downloads that stage's state (weights,
optimizer state, step) from a peer serving it or holding a copy of it (records say which, `copies`):

  mover  → holder  StageStateRequest(pipeline, cuts, stage)
  holder → mover   StageStateReply (the state's tensors follow) | ErrorReply

Servers keep nothing between a forward and its backward: "backward" carries the stage's inputs and the
gradient of its output, and the server recomputes the forward with the call's `seed` (the same dropout), so
any live peer of the stage can serve it. The last stage answers "loss" with the loss and the gradient of its
input, in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.addresses import MAX_ENTRY_ADDRESSES, parse_address, parse_relayed
from protocol.schema.gossip import TensorSpec
from protocol.bounds import MAX_ADDRESS_CHARS

from protocol.message_fields import U64
from protocol.messages import Message

__all__ = ["BlockProfile", "CALL_KINDS", "MAX_ACK_IDS", "MAX_COPIES", "MAX_STAGES", "MAX_STAGE_TENSORS", "MAX_STATE_TENSORS",
           "StageAck", "StageAckReply", "StageAnnouncement", "StageCall", "StageCopy", "StageReply", "StageStateReply",
           "StageStateRequest"]

MAX_STAGES = 64
"""Stages one pipeline may have: more than any model cut across peers needs (SWARM ran 12 - 32 layers in a
handful of stages); it bounds a driver's per-stage tables."""
MAX_BLOCKS = 1 << 16
"""Blocks a model may be cut into: far more than any sequence of layers (it only bounds the cut indices)."""
MAX_NAME_CHARS = 64
"""Characters of a pipeline's name, like a peer ID's bound in a record."""
MAX_STAGE_TENSORS = 8
"""Tensors one call or reply carries: a stage takes its input and, backward, its output gradient or the
targets (3 at most today); a few spare for models whose blocks pass more than one tensor."""
MAX_SAMPLES_PER_S = 1e9
"""A throughput no stage reaches: a larger claim is a lie that would draw every microbatch to its author."""
MAX_QUEUE = 1 << 20
"""Requests a server may claim to have queued; it only ranks the server (a real queue is far shorter)."""
MAX_STEP = 1 << 53
"""Optimizer steps a stage may claim: exact in a float, more than any run takes; it only ranks state holders."""
MAX_COPIES = 4
"""Stage copies one record may list: a peer keeps the stage it left and the one it backs up (2), with room."""
MAX_STATE_TENSORS = 1 << 14
"""Tensors of one stage's state: every weight and buffer plus up to 8 optimizer values each (the receiver
checks the exact list against its own copy of the stage's blocks before allocating; this bounds the message)."""
MAX_PROFILED_BLOCKS = 256
"""Blocks one record may give costs for (those of the stage its peer serves): more than a stage of any model
cut across a handful of peers has; a stage of more blocks announces its first 256."""
MAX_BLOCK_SECONDS = 3600.0
"""Seconds one block may claim per microbatch: a larger claim is a lie (or a peer too slow to serve anyway)."""
MAX_BLOCK_BYTES = 1 << 40
"""Bytes a block's state or activation may claim (1 TiB): beyond any host, so only a lie reaches it."""
MAX_MEMORY_MIB = 1 << 30
"""A memory budget no host has (1 PiB): it only bounds the figure."""
MAX_ACK_IDS = MAX_STAGES
"""Kept gradients one StageAck names: a driver acknowledges a microbatch's gradients at each server at once, and a
server holds at most one of them per stage (one, unless it changed stage within the microbatch)."""
CALL_KINDS = ("forward", "backward", "loss", "evaluate")


def _check_name(value: str) -> None:
    if not 0 < len(value) <= MAX_NAME_CHARS:
        raise ValueError(f"pipeline name must have 1..{MAX_NAME_CHARS} characters, got {len(value)}")


def _check_addresses(addresses: list[str]) -> None:
    """A server's addresses to dial it at: few, short, and each a direct "host:port" or a relayed one (the
    dialer's limits and per-host backoff still apply: they are the server's own claim)."""
    if len(addresses) > MAX_ENTRY_ADDRESSES:
        raise ValueError(f"{len(addresses)} addresses (at most {MAX_ENTRY_ADDRESSES})")
    for a in addresses:
        if not 0 < len(a) <= MAX_ADDRESS_CHARS:
            raise ValueError(f"an address must have 1..{MAX_ADDRESS_CHARS} characters, got {len(a)}")
        if parse_address(a) is None and parse_relayed(a) is None:
            raise ValueError(f"address {a[:40]!r} is neither host:port nor host:port/relay/<peer ID>")


def _check_stage(stage: int, stages: int) -> None:
    if not 1 <= stages <= MAX_STAGES:
        raise ValueError(f"stages must be in [1, {MAX_STAGES}], got {stages}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage}")


def _check_cut_count(cuts: list[int]) -> None:
    """A call's or request's cuts: the receiver compares them with its own, so only their number is bounded here."""
    if len(cuts) >= MAX_STAGES:
        raise ValueError(f"{len(cuts)} cuts (at most {MAX_STAGES - 1})")


def _check_kept_ids(ids: list[int], least: int) -> None:
    if not least <= len(ids) <= MAX_ACK_IDS or any(not 0 < i < U64 for i in ids):
        raise ValueError(f"{least}..{MAX_ACK_IDS} kept ids in (0, 2**64), got {len(ids)}: {ids[:4]}")


def _check_group(tensors: list, streams: list[int], most: int) -> None:
    """The tensors a message announces: one stream each, at most `most`."""
    if len(tensors) > most or len(streams) != len(tensors):
        raise ValueError(f"{len(tensors)} tensor specs and {len(streams)} streams (equal numbers, at most {most})")


@dataclass(frozen=True, slots=True)
class StageCopy:
    """A stage's state a peer keeps without serving it (the stage it left, or one it backs up), at `step`."""

    stage: int
    step: int

    def __post_init__(self) -> None:
        _check_stage(self.stage, MAX_STAGES)
        if not 0 <= self.step <= MAX_STEP:
            raise ValueError(f"copy step must be in [0, {MAX_STEP}], got {self.step}")


@dataclass(frozen=True, slots=True)
class BlockProfile:
    """One block's cost as its peer measured it on its device, for one microbatch: the cut's input
    (trainers/pipeline/profiles.py). Bounded, not trusted: a median over peers decides, and the planner
    sees only the pipeline's own peers."""

    block: int  # the model-wide block index
    seconds: float  # forward + backward (the last block: with the loss)
    out_bytes: int  # its output activation
    param_bytes: int  # its parameters and buffers

    def __post_init__(self) -> None:
        if not 0 <= self.block < MAX_BLOCKS:
            raise ValueError(f"profiled block must be in [0, {MAX_BLOCKS}), got {self.block}")
        if not 0.0 < self.seconds <= MAX_BLOCK_SECONDS:
            raise ValueError(f"block {self.block}: seconds must be in (0, {MAX_BLOCK_SECONDS:g}], got {self.seconds}")
        for name in ("out_bytes", "param_bytes"):
            if not 0 <= getattr(self, name) <= MAX_BLOCK_BYTES:
                raise ValueError(f"block {self.block}: {name} must be in [0, 2**40], got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class StageAnnouncement:
    """What a server says of itself in its record: the stage it serves, how fast and busy it is, how far its
    stage has trained, a move it is making (rebalancing), and the stage copies it could hand out."""

    pipeline: str
    stage: int
    stages: int
    samples_per_s: float = 0.0  # measured forward+backward throughput (0: not measured yet)
    queue: int = 0  # calls waiting or running at the server
    cuts: list[int] = field(default_factory=list)  # where the model is cut: stage s holds blocks [cuts[s-1], cuts[s])
    step: int = 0  # optimizer steps of the stage's state this peer serves
    moving_to: int = -1  # the stage this peer is moving to (downloading its state), or -1
    moved_from: int = -1  # the stage this peer left lately (for a while after a move: its old stage cools down), or -1
    copies: list[StageCopy] = field(default_factory=list)
    profiles: list[BlockProfile] = field(default_factory=list)  # costs of the blocks it holds, measured
    memory_mib: int = 0  # its memory budget ([pipeline] memory_mib or what was free at start; 0: not said)
    stage_room_mib: int = 0  # of which a stage may use (the budget less what the process held before any block)
    memory_used_mib: int = 0  # what it holds now
    # where to dial it (direct, then up to two relayed: its view entry's), for a driver with no session with it;
    # announced under `[membership] views = "partial"` only (a full view dials every peer anyway)
    addresses: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_name(self.pipeline)
        _check_addresses(self.addresses)
        if len(self.profiles) > MAX_PROFILED_BLOCKS:
            raise ValueError(f"{len(self.profiles)} block profiles (at most {MAX_PROFILED_BLOCKS})")
        for name in ("memory_mib", "stage_room_mib", "memory_used_mib"):
            if not 0 <= getattr(self, name) <= MAX_MEMORY_MIB:
                raise ValueError(f"{name} must be in [0, {MAX_MEMORY_MIB}], got {getattr(self, name)}")
        _check_stage(self.stage, self.stages)
        for name in ("moving_to", "moved_from"):
            v = getattr(self, name)
            if not -1 <= v < self.stages or v == self.stage:
                raise ValueError(f"{name} must be -1 or another stage in [0, {self.stages}), got {v}")
        if not 0 <= self.step <= MAX_STEP:
            raise ValueError(f"step must be in [0, {MAX_STEP}], got {self.step}")
        if len(self.copies) > MAX_COPIES or any(c.stage >= self.stages for c in self.copies):
            raise ValueError(f"at most {MAX_COPIES} copies of stages in [0, {self.stages}), got "
                             f"{[c.stage for c in self.copies[:MAX_COPIES + 1]]}")
        if len(self.cuts) != self.stages - 1 or any(not 0 < c <= MAX_BLOCKS for c in self.cuts) \
                or any(a >= b for a, b in zip(self.cuts, self.cuts[1:])):
            raise ValueError(f"cuts must be {self.stages - 1} increasing block indices in (0, {MAX_BLOCKS}], "
                             f"got {self.cuts[:MAX_STAGES]}")
        if not 0.0 <= self.samples_per_s <= MAX_SAMPLES_PER_S:
            raise ValueError(f"samples_per_s must be in [0, {MAX_SAMPLES_PER_S:g}], got {self.samples_per_s}")
        if not 0 <= self.queue <= MAX_QUEUE:
            raise ValueError(f"queue must be in [0, {MAX_QUEUE}], got {self.queue}")


@dataclass(frozen=True, slots=True)
class StageCall(Message):
    """Compute `kind` of stage `stage` on the tensors that follow on `streams` (one per spec)."""

    TYPE = "stage_call"
    pipeline: str
    stage: int
    kind: str
    batch: int  # samples in this microbatch: the server derives the shapes it accepts from it
    seed: int  # dropout seed of this microbatch at this stage: the backward recomputes with it
    tensors: list[TensorSpec]
    streams: list[int]
    cuts: list[int] = field(default_factory=list)  # the driver's cut of the model: the server's must be the same
    microbatch: int = 0  # the driver's id of the microbatch, for both sides' logs
    codec: str = "raw"  # how the server should encode the tensors of its reply
    deadline_s: float = 0.0  # the driver gives up after this long: the server holds the call no longer (0: its own bound)

    def __post_init__(self) -> None:
        _check_name(self.pipeline)
        _check_stage(self.stage, MAX_STAGES)
        if self.deadline_s < 0:
            raise ValueError(f"deadline_s must be >= 0, got {self.deadline_s}")
        _check_cut_count(self.cuts)
        if self.kind not in CALL_KINDS:
            raise ValueError(f"unknown call kind {self.kind[:20]!r} (one of {', '.join(CALL_KINDS)})")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        _check_group(self.tensors, self.streams, MAX_STAGE_TENSORS)


@dataclass(frozen=True, slots=True)
class StageReply(Message):
    """The result of a StageCall: its output tensors follow on `streams`; `loss` for "loss"/"evaluate"."""

    TYPE = "stage_reply"
    tensors: list[TensorSpec]
    streams: list[int]
    loss: float | None = None
    compute_s: float = 0.0  # seconds the server computed (the rest of the call's time is wire and queue)
    kept: int = 0  # the id of this call's gradient, kept aside until the driver acknowledges it (0: none kept)

    def __post_init__(self) -> None:
        _check_group(self.tensors, self.streams, MAX_STAGE_TENSORS)
        if self.compute_s < 0:
            raise ValueError(f"compute_s must be >= 0, got {self.compute_s}")
        if not 0 <= self.kept < U64:
            raise ValueError(f"kept must be in [0, 2**64), got {self.kept}")


@dataclass(frozen=True, slots=True)
class StageAck(Message):
    """The driver's word on gradients a server kept for it (`StageReply.kept`): add them to the stage (their
    microbatch's backward completed through every stage), or drop them (it failed)."""

    TYPE = "stage_ack"
    kept: list[int]
    accumulate: bool = True

    def __post_init__(self) -> None:
        _check_kept_ids(self.kept, 1)


@dataclass(frozen=True, slots=True)
class StageAckReply(Message):
    """Which of an ack's ids entered the stage's accumulated gradient (the others: not held for the asker any more,
    or dropped as asked), and which of the others the server's own state change dropped (`moved`)."""

    TYPE = "stage_ack_reply"
    accumulated: list[int] = field(default_factory=list)
    # of the others, those dropped because the server's stage state was replaced (it moved stage, or loaded a
    # peer's state): the replica they were bound for is gone, with what it had accumulated; not the driver's loss
    moved: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_kept_ids(self.accumulated, 0)
        _check_kept_ids(self.moved, 0)


@dataclass(frozen=True, slots=True)
class StageStateRequest(Message):
    """Send me stage `stage`'s state (weights, optimizer state, step) of pipeline `pipeline` cut at `cuts`."""

    TYPE = "stage_state_request"
    pipeline: str
    stage: int
    cuts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_name(self.pipeline)
        _check_stage(self.stage, MAX_STAGES)
        _check_cut_count(self.cuts)


@dataclass(frozen=True, slots=True)
class StageStateReply(Message):
    """A stage's state: its tensors follow on `streams`; `live` if the sender serves the stage (else a copy)."""

    TYPE = "stage_state_reply"
    tensors: list[TensorSpec]
    streams: list[int]
    step: int
    samples: int = 0  # samples the stage has trained on, for the receiver's figures
    live: bool = True

    def __post_init__(self) -> None:
        _check_group(self.tensors, self.streams, MAX_STATE_TENSORS)
        for name in ("step", "samples"):
            if not 0 <= getattr(self, name) <= MAX_STEP:
                raise ValueError(f"{name} must be in [0, {MAX_STEP}], got {getattr(self, name)}")

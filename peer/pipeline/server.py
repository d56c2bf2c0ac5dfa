"""Serving calls for the one stage this daemon holds: check, queue (bounded), compute, reply.

Every call is checked before a byte of its tensors is allocated: the pipeline and stage are ours, the kind
is one this stage serves, the batch is within the stage's `max_batch`, and the announced tensors have exactly
the specs the stage expects for that kind and batch (the session then refuses any header that contradicts
them, peer/session/groups.py). A call over `[pipeline] max_queue` (this daemon) or `max_queue_per_peer`
(that driver) is refused as busy, so a driver cannot make us hold more than those many calls' tensors; each
held call is bounded in time by the driver's deadline for it, at most `[pipeline] max_call_timeout`. A share of
both bounds is kept for backward and loss calls (`BACKWARD_SHARE`). Compute runs one call at a time in a worker
thread (the model is CPU/GPU bound; more threads would only share the same cores), backwards before forwards
(peer/pipeline/turns.py). A call whose inputs the
stage rejects (NaN, wrong values) is answered with an error naming why; a malformed call closes the session
(the router does that for a ProtocolError).

A "backward" or "loss" call's parameter gradient is kept aside (peer/pipeline/kept.py) under an id the reply
names, and enters the stage only when the driver that made the call acknowledges it (`StageAck`): at most
once per stage, and never for a microbatch whose backward did not complete. Calls from our own driver
(`compute_local`) follow the same rule.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import trio

from peer.pipeline.directory import PipelineKey
from peer.pipeline.kept import STALE, Kept, KeptGradients, hold_s
from peer.pipeline.turns import FIRST, NEXT, ComputeTurns
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from peertrain.pipeline import StageHandler  # the leaf's protocol (the job implements it)
from protocol.schema.gossip import TensorSpec
from protocol.schema.pipeline import StageAck, StageAckReply, StageCall, StageReply
from protocol.refusal import Code, Refusal, Refused
from protocol.schema.session import ErrorReply
from protocol.tensor_codec import DENSE_CODECS, FLOAT_DTYPES

log = logging.getLogger("peertrain.pipeline")

LOCAL_DRIVER = ""
"""Who our own driver's calls are kept for (no peer ID is empty)."""

FINISHING = frozenset({"backward", "loss"})
"""Calls that finish a microbatch's work at this stage: computed first (peer/pipeline/turns.py), and admitted into
a share of the queue that calls starting work cannot fill (`room`)."""
BACKWARD_SHARE = 0.25
"""The share of `max_queue` (and of `max_queue_per_peer`) only finishing calls may fill. Without it a stage full
of forwards refuses the backwards that would drain it, and new forwards take every place a call frees: a
microbatch's backward then waits behind the forwards of others, its stage steps more often meanwhile, and its
gradient is older when it enters (docs/benchmarks.md, 2026-11-28: the demo's loss). A quarter: with the
defaults (16 and 8) 4 and 2 places, the calls a stage computes in a few backwards' time."""


def room(limit: int, finishing: bool) -> int:
    """How many calls may be held when one of this sort arrives: all of `limit` for a finishing call, the rest
    of it, less the backwards' share (at least 1 place when the limit allows two), for a call that starts work."""
    return limit if finishing else limit - min(limit - 1, max(1, round(limit * BACKWARD_SHARE)))


@dataclass
class ServedStage:
    key: PipelineKey
    stage: int
    max_batch: int
    handler: StageHandler
    ready: bool = True  # False while a joining peer loads the stage's state: calls are refused (NOT_SERVING)


@dataclass
class ServerStats:
    served: int = 0
    refused: Counter = field(default_factory=Counter)  # refusal code (its wire value) -> count
    failed: int = 0  # accepted calls that did not complete (deadline, session lost, bad input)
    handed_back: int = 0  # accepted calls answered MOVED: we switched stage while they waited (re-sent elsewhere)
    queue: int = 0  # calls held now (receiving, waiting for compute, computing or replying)
    compute_s: float = 0.0
    last_error: str = ""
    accumulated_samples: int = 0  # samples whose (acknowledged) gradients entered the stages we served
    accumulated_by_stage: Counter = field(default_factory=Counter)  # stage -> those samples


class StageServer:
    def __init__(self, cfg):
        self.cfg = cfg  # [pipeline]
        self.stage: ServedStage | None = None
        self.stats = ServerStats()
        self.per_peer: Counter = Counter()  # driver -> calls held for it now
        self.turns = ComputeTurns()  # one computation at a time, finishing calls first (see module docstring)
        self.kept = KeptGradients(hold_s=hold_s(cfg, 1))  # set for the pipeline's stages when we serve one
        self._dropped = trio.Event()  # set when the kept book dropped gradients that `release_dropped` releases

    def poke(self) -> None:
        """After the kept book may have dropped gradients (a bound, an expiry, a failed microbatch): have them
        released (`release_dropped`)."""
        if self.kept.released:
            self._dropped.set()

    async def release_dropped(self) -> None:
        """Forever: take the dropped gradients out of the stage (each is a computation: a worker thread), so a
        step that waits for them comes (trainers/pipeline/stage.py). Run by the pipeline service."""
        while True:
            await self._dropped.wait()
            self._dropped = trio.Event()
            dropped = self.kept.take_released()
            if dropped:
                try:
                    await trio.to_thread.run_sync(lambda: [g.release() for g in dropped])
                except Exception as exc:  # a bug here must not take the daemon down
                    self.stats.last_error = f"releasing dropped gradients: {type(exc).__name__}: {exc}"[:300]
                    log.exception("releasing dropped gradients failed")

    def switch(self, stage: ServedStage | None) -> None:
        """Serve `stage` from now on (None: nothing); gradients kept for another stage are dropped."""
        self.stage = stage
        self.kept.drop_all_but(stage, STALE)
        if stage is not None:  # kept past the longest microbatch of this pipeline (kept.py)
            self.kept.hold_s = hold_s(self.cfg, stage.key.stages)

    def refusal(self, call: StageCall, peer_id: str) -> Refusal | None:
        """Why we will not take `call` from `peer_id`, or None."""
        st = self.stage
        if st is None:
            return Refusal(Code.NOT_SERVING, "this peer serves no pipeline stage")
        if call.pipeline != st.key.name:
            return Refusal(Code.WRONG_PIPELINE, f"this peer serves pipeline {st.key.name!r}, not {call.pipeline[:64]!r}")
        if tuple(call.cuts) != st.key.cuts:
            return Refusal(Code.WRONG_CUT, f"this peer cuts the model at {list(st.key.cuts)}, not {call.cuts}")
        if call.stage != st.stage:
            return Refusal(Code.WRONG_STAGE, f"this peer serves stage {st.stage}, not {call.stage}")
        if not st.ready:
            return Refusal(Code.NOT_SERVING, f"this peer is loading stage {st.stage}'s state from its peers")
        if call.kind not in st.handler.kinds():
            return Refusal(Code.WRONG_KIND, f"stage {st.stage} does not serve {call.kind!r} "
                                            f"(it serves {', '.join(st.handler.kinds())})")
        if call.batch > st.max_batch:
            return Refusal(Code.TOO_BIG, f"batch {call.batch} is over this stage's max_batch {st.max_batch}")
        if call.codec not in DENSE_CODECS:
            return Refusal(Code.BAD_CODEC, f"unknown codec {call.codec[:20]!r}")
        want = [(d, list(s)) for _, d, s in st.handler.input_specs(call.kind, call.batch)]
        got = [(s.dtype, list(s.shape)) for s in call.tensors]  # names are the driver's to choose
        if got != want:
            return Refusal(Code.WRONG_SPECS, f"{call.kind} of stage {st.stage} with batch {call.batch} takes "
                                             f"(dtype, shape) {want}, not {got}"[:500])
        finishing = call.kind in FINISHING
        if self.stats.queue >= room(self.cfg.max_queue, finishing):
            return Refusal(Code.BUSY, f"{self.stats.queue} calls held, the most this peer takes for a {call.kind} "
                                      f"([pipeline] max_queue {self.cfg.max_queue}, a share kept for backwards)")
        if self.per_peer[peer_id] >= room(self.cfg.max_queue_per_peer, finishing):
            return Refusal(Code.BUSY, f"{self.per_peer[peer_id]} of your calls held, the most one driver may have "
                                      f"for a {call.kind} ([pipeline] max_queue_per_peer {self.cfg.max_queue_per_peer},"
                                      " a share kept for backwards)")
        return None

    async def compute_local(self, call: StageCall, tensors: list[Any]) -> tuple[float | None, list[Any], int, float]:
        """A call from our own driver to our own stage: the same checks and compute, no wire; (loss, outputs, the
        id its gradient is kept under, 0 for none: acknowledge it with `acknowledge(LOCAL_DRIVER, ...)`, and the
        seconds it computed). Raises
        Refused when refused, as a peer would answer: by the checks, MOVED, or BAD_INPUT when the stage rejects
        the inputs."""
        refused = self.refusal(call, "")
        if refused is not None and refused.code is not Code.BUSY:  # our own calls wait for the compute lock instead
            raise Refused(refused)
        st = self.stage
        self.stats.queue += 1
        try:
            async with self.turns.turn(FIRST if call.kind in FINISHING else NEXT):
                if self.stage is not st:
                    self.stats.handed_back += 1
                    raise Refused(Refusal(Code.MOVED, "this peer moved to another stage while the call waited"))
                t0 = time.perf_counter()
                try:
                    loss, outputs, held = await trio.to_thread.run_sync(st.handler.compute, call.kind, tensors,
                                                                        call.seed)
                except ValueError as exc:  # the stage refused the inputs (NaN, out of range)
                    raise Refused(Refusal(Code.BAD_INPUT, str(exc))) from None
                seconds = time.perf_counter() - t0
        finally:
            self.stats.queue -= 1
        self.stats.compute_s += seconds
        self.stats.served += 1
        kept = 0 if held is None else self.kept.keep(LOCAL_DRIVER, st, held, trio.current_time())
        self.poke()
        return (loss if loss is None or math.isfinite(loss) else None), outputs, kept, seconds

    async def on_call(self, session, env, nursery: trio.Nursery) -> None:
        """The router's handler (in the session's dispatch task): check, then serve in `nursery`."""
        call: StageCall = env.message
        refused = self.refusal(call, session.peer_id)
        st = self.stage
        specs = [TensorSpec(s.name, s.dtype, list(s.shape)) for s in call.tensors]
        theirs = IncomingGroup(session, call.streams, specs if refused is None else [], as_torch=True)
        if refused is not None:
            theirs.discard()  # the tensors follow the call: drop them as they come
            self.stats.refused[refused.code.value] += 1
            await session.reply(env, ErrorReply.of(refused))
            return
        self.stats.queue += 1
        self.per_peer[session.peer_id] += 1
        nursery.start_soon(self._serve, session, env, st, theirs)

    async def _serve(self, session, env, st: ServedStage, theirs: IncomingGroup) -> None:
        call: StageCall = env.message
        done, kept = False, 0
        try:
            hold = min(self.cfg.max_call_timeout, call.deadline_s or self.cfg.max_call_timeout)
            with trio.fail_after(hold):  # past the driver's deadline nobody waits for the answer
                inputs = await theirs.receive(timeout=hold)
                async with self.turns.turn(FIRST if call.kind in FINISHING else NEXT):
                    if self.stage is not st:  # we moved (or stopped serving) while it waited: hand it back
                        self.stats.handed_back += 1
                        await session.reply(env, ErrorReply.of(Refusal(Code.MOVED, "this peer left the stage while "
                                                                                   "the call waited; send it to another")))
                        return
                    t0 = time.perf_counter()
                    try:
                        loss, outputs, held = await trio.to_thread.run_sync(st.handler.compute, call.kind, inputs,
                                                                            call.seed)
                    except ValueError as exc:  # the stage refused the inputs (NaN, out of range): say why
                        self.stats.failed += 1
                        self.stats.last_error = f"{session.short}: {call.kind} mb {call.microbatch}: {exc}"[:300]
                        log.warning("stage call from %s refused: %s", session.short, exc)
                        await session.reply(env, ErrorReply.of(Refusal(Code.BAD_INPUT, str(exc)[:500])))
                        return
                    seconds = time.perf_counter() - t0
                    if held is not None:
                        kept = self.kept.keep(session.peer_id, st, held, trio.current_time())
                        self.poke()
                self.stats.compute_s += seconds
                if loss is not None and not math.isfinite(loss):
                    loss = None  # the driver sees a missing loss, not a NaN on the wire (which decoding refuses)
                out_specs = [TensorSpec(f"out{i}", _dtype_name(t), list(t.shape)) for i, t in enumerate(outputs)]
                ours = OutgoingGroup(session, out_specs)
                await session.reply(env, StageReply(tensors=out_specs, streams=ours.streams, loss=loss,
                                                    compute_s=seconds, kept=kept))
                codecs = [call.codec if s.dtype in FLOAT_DTYPES else "raw" for s in out_specs]
                await ours.send([t.detach().contiguous() for t in outputs], codec=codecs)
                done = True
        except (trio.TooSlowError, SessionClosed) as exc:
            self.stats.failed += 1
            self.stats.last_error = f"{session.short}: {call.kind} mb {call.microbatch}: {str(exc) or 'deadline passed'}"
            log.info("stage call from %s not completed: %s", session.short, str(exc) or "deadline passed")
        except Exception as exc:  # a bug here must not take the daemon down: this call just fails
            self.stats.failed += 1
            self.stats.last_error = f"{session.short}: {type(exc).__name__}: {exc}"[:300]
            log.exception("serving a stage call from %s failed", session.short)
        finally:
            theirs.discard()  # whatever was not read (nothing, after a whole receive) is dropped as it comes
            self.stats.queue -= 1
            self.per_peer[session.peer_id] -= 1
            if self.per_peer[session.peer_id] <= 0:
                del self.per_peer[session.peer_id]
            if done:
                self.stats.served += 1
            elif kept:  # the driver cannot have its reply: nobody will acknowledge the gradient
                self.kept.discard(kept, "unsent")
                self.poke()

    # ---- acknowledgements ----------------------------------------------------------------------------
    def _claim(self, driver: str, ids: list[int], accumulate: bool) -> list[Kept]:
        """Take the gradients of `ids` kept for `driver` (to add them), or drop them (`accumulate` False)."""
        now = trio.current_time()
        try:
            if accumulate:
                return self.kept.take(driver, ids, now)
            self.kept.drop(driver, ids, now)
            return []
        finally:
            self.poke()

    async def _accumulate(self, taken: list[Kept]) -> list[int]:
        """Add acknowledged gradients to the stage, if they were computed for the stage we serve now and its
        state (a worker thread: the stage's lock may be held by a computation); the ids that entered it."""
        st = self.stage
        fresh = [k for k in taken if k.owner is st] if st is not None else []
        entered = await trio.to_thread.run_sync(lambda: [k.gradient.accumulate() for k in fresh]) if fresh else []
        out = []
        for k, ok in zip(fresh, entered):
            if ok and st is not None:
                self.stats.accumulated_samples += k.gradient.samples
                self.stats.accumulated_by_stage[st.stage] += k.gradient.samples
                out.append(k.id)
        entered_ids = set(out)
        for k in taken:
            if k.id not in entered_ids:  # its stage state was replaced since it was computed
                self.kept.stats.dropped[STALE] += 1
                self.kept.remember_stale(k.driver, k.id)
        return out

    async def acknowledge(self, driver: str, ids: list[int], *, accumulate: bool = True) -> list[int]:
        """Our own driver's ack (`LOCAL_DRIVER`): as a peer's, in-process; the ids whose gradient entered the stage."""
        return await self._accumulate(self._claim(driver, ids, accumulate))

    async def on_ack(self, session, env, nursery: trio.Nursery) -> None:
        """The router's handler for StageAck: claim in the dispatch task (so a repeated ack finds nothing), add in
        `nursery` (the stage's lock may be held by a computation), then reply which ids entered the stage."""
        ack: StageAck = env.message
        taken = self._claim(session.peer_id, ack.kept, ack.accumulate)
        if not taken:
            await session.reply(env, StageAckReply(moved=self.kept.moved(session.peer_id, ack.kept)))
            return
        nursery.start_soon(self._answer_ack, session, env, taken)

    async def _answer_ack(self, session, env, taken: list[Kept]) -> None:
        """Reply which ids entered the stage. A deferred gradient (computed on the ack: trainers/pipeline/stage.py)
        is answered as entered once claimed, before its computation, so the driver does not wait a forward and a
        backward per ack; it is added right after (one that a state replacement makes stale is counted there)."""
        try:
            later = [k for k in taken if k.gradient.deferred and k.owner is self.stage]
            entered = await self._accumulate([k for k in taken if k not in later])
            await session.reply(env, StageAckReply(accumulated=entered + [k.id for k in later],
                                                   moved=self.kept.moved(session.peer_id, env.message.kept)))
            if later:
                await self._accumulate(later)
        except SessionClosed as exc:  # the driver sees its ack unanswered and counts it as lost
            log.info("stage ack from %s not answered: %s", session.short, exc)
        except Exception as exc:  # a bug here must not take the daemon down
            self.stats.last_error = f"{session.short}: ack: {type(exc).__name__}: {exc}"[:300]
            log.exception("adding acknowledged gradients from %s failed", session.short)


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")

"""Handing a stage's whole state (weights, optimizer state, step) to a peer that takes the stage over.

A peer that moves to another stage (rebalancing), or takes over a stage nobody serves any more, needs that
stage's training state, not just its weights: an optimizer restarted from nothing would throw away what
Adam's moments learned. It downloads the state from a peer serving the stage (live) or from a peer holding a
copy of it (`copies`: the stage it left, or one it backs up), whichever its records say is freshest.

Serving is bounded like every other transfer: only a connected peer that announces a stage of the same
pipeline (same name, same cut) may ask (the model is for the pipeline's peers, not for anyone who dials); at
most `[pipeline] max_state_uploads` transfers at once per daemon and one per asking peer; each ends within
`[pipeline] state_timeout`. What a transfer sends is a file, read mapped: a copy's own, or, for the stage we
serve, a snapshot of it written under the stage's lock to a file of its own (copies.py says why), removed
when the transfer ends. So a transfer holds disk (a stage's state each), not memory beside the stage.

Fetching checks before it allocates: the holder names every tensor (name, dtype, shape) in its reply, and the
trainer's `check` (trainers/pipeline/stage.py, check_state_specs) refuses any list that is not exactly a state
of that stage's blocks; the session then refuses any tensor that contradicts its spec. A state with a NaN or
an infinity is refused too. What a hostile holder can still do is send finite nonsense for a stage: like a
hostile server computing wrong activations, that is Byzantine compute, out of scope (docs/design.md).

The daemon keeps the copies itself (`keep` / `drop`), at most MAX_COPIES, because they are served from here
and announced in our record (protocol/schema/pipeline.py, StageCopy). A copy lives in a file in the daemon's
home unless its keeper asks for it in memory (peer/pipeline/copies.py says why). The file is written in a trio
worker thread, not on the thread that asks (a trainer's, through `trio.from_thread`): the daemon owns the folder,
and writes, drops and evictions take one lock in turn, so a drop never removes a file a newer copy of the same
stage just replaced, and the trio thread only files the copy's metadata. The asking thread still waits until the
copy is on disk. Serving a copy reads its file in a worker thread too; a trainer adopting its own copy reads it
on its own thread (`KeptCopy.load`). Files from an earlier run are removed when the daemon starts.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from peer.membership.reach import Unreachable
from peer.pipeline.copies import KeptCopy, remove_files, remove_stale, snapshot_file
from peertrain.pipeline import CopyUnreadable, FetchedState, PipelineKey, StateUnavailable
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError
from protocol.refusal import Code, Refusal
from protocol.schema.gossip import TensorSpec
from protocol.schema.pipeline import MAX_COPIES, MAX_STEP, StageCopy, StageStateReply, StageStateRequest
from protocol.schema.session import ErrorReply

log = logging.getLogger("peertrain.pipeline")

SpecCheck = Callable[[list[tuple[str, str, list[int]]]], "str | None"]


@dataclass
class StateStats:
    served: int = 0
    refused: Counter = field(default_factory=Counter)  # refusal code (its wire value) -> count
    fetched: int = 0
    fetch_failed: int = 0
    last_error: str = ""
    copies_unreadable: int = 0  # copies whose file was gone or did not load when asked for (each then forgotten)


class StageStates:
    def __init__(self, service, cfg, directory: Path):
        self.service = service  # the pipeline service: what we serve, who announces what, sessions
        self.cfg = cfg  # [pipeline]
        self.directory = Path(directory)  # where copies on disk go (HOME/stage-copies)
        self.copies: dict[tuple[PipelineKey, int], KeptCopy] = {}
        self.uploads = 0
        self.per_peer: Counter = Counter()
        self.stats = StateStats()
        self._files = trio.Lock()  # held while a copy is filed and while files go (module docstring)
        self._orphans: list[Path] = []  # files of copies no longer kept, removed under `_files`
        self._snapshots = itertools.count()  # numbers the files of live states being sent
        remove_stale(self.directory)  # at start, before anything is kept: nobody can ask for those

    # ---- the copies we keep ---------------------------------------------------------------------
    async def keep(self, key: PipelineKey, stage: int, tensors: list[tuple[str, Any]], step: int, samples: int, *,
                   in_memory: bool = False) -> KeptCopy:
        """Keep a copy of `stage`'s state (replacing an older one of that stage; the oldest goes past
        MAX_COPIES): written to its file in a worker thread, or held in memory if `in_memory` (the caller
        knows memory allows it). Returns once it is kept; an error writing it (a full disk) is raised, and
        what we kept before stays."""
        async with self._files:
            if in_memory:
                copy = KeptCopy.in_memory(key, stage, tensors, step, samples)
            else:
                copy = await trio.to_thread.run_sync(KeptCopy.write, self.directory, key, stage, tensors, step, samples)
            old = self.copies.pop((key, stage), None)
            self.copies[(key, stage)] = copy
            gone = [old] if old is not None else []
            while len(self.copies) > MAX_COPIES:
                gone.append(self.copies.pop(min(self.copies, key=lambda k: self.copies[k].kept_at)))
            self._orphans += [c.path for c in gone if c.path is not None]
            await self._sweep()
        return copy

    async def drop(self, key: PipelineKey, stage: int) -> None:
        """Forget our copy of `stage` (if any) and remove its file."""
        async with self._files:
            gone = self.copies.pop((key, stage), None)
            if gone is not None and gone.path is not None:
                self._orphans.append(gone.path)
            await self._sweep()

    async def _sweep(self) -> None:
        """Remove the orphans' files (under `_files`), but a file a kept copy uses: a newer copy of the stage
        replaced it in place."""
        used = {c.path for c in self.copies.values()}
        doomed, self._orphans = [p for p in dict.fromkeys(self._orphans) if p not in used], []
        if doomed:
            await trio.to_thread.run_sync(remove_files, doomed)

    def get(self, key: PipelineKey, stage: int) -> KeptCopy | None:
        """Our copy of `stage`, or None; a copy whose file did not load is forgotten here (its file goes with
        the next keep or drop) so that it is neither announced nor tried again."""
        copy = self.copies.get((key, stage))
        if copy is None or not copy.unreadable:
            return copy
        del self.copies[(key, stage)]
        if copy.path is not None:
            self._orphans.append(copy.path)
        self.stats.copies_unreadable += 1
        return None

    def announced(self, key: PipelineKey, serving: int) -> list[StageCopy]:
        """Our copies of `key`'s stages (not the one we serve), for our record."""
        return [StageCopy(c.stage, min(c.step, MAX_STEP)) for (k, s), c in sorted(self.copies.items(), key=lambda kv: kv[0][1])
                if k == key and s != serving and not c.unreadable]

    # ---- serving ---------------------------------------------------------------------------------
    def refusal(self, req: StageStateRequest, peer_id: str) -> Refusal | None:
        """Why we will not send `peer_id` the state it asks for, or None."""
        key = PipelineKey(req.pipeline, tuple(req.cuts))
        theirs = self.service.announcements().get(peer_id)
        if theirs is None or PipelineKey.of(theirs) != key:
            return Refusal(Code.NOT_A_MEMBER, "only a peer announcing a stage of this pipeline (same cut) may fetch its state")
        st = self.service.server.stage
        live = st is not None and st.key == key and st.stage == req.stage
        if not live and self.get(key, req.stage) is None:
            return Refusal(Code.NO_STATE, f"this peer neither serves nor keeps stage {req.stage} of {req.pipeline[:64]!r}")
        if self.uploads >= self.cfg.max_state_uploads:
            return Refusal(Code.BUSY, f"{self.uploads} stage states being sent, the most this peer sends at once")
        if self.per_peer[peer_id]:
            return Refusal(Code.BUSY, "one stage state per peer at a time")
        return None

    async def on_request(self, session, env, nursery: trio.Nursery) -> None:
        req: StageStateRequest = env.message
        refused = self.refusal(req, session.peer_id)
        if refused is not None:
            self.stats.refused[refused.code.value] += 1
            await session.reply(env, ErrorReply.of(refused))
            return
        self.uploads += 1
        self.per_peer[session.peer_id] += 1
        nursery.start_soon(self._serve, session, env)  # not in the dispatch task: a slow reader would stall it

    async def _serve(self, session, env) -> None:
        req: StageStateRequest = env.message
        key = PipelineKey(req.pipeline, tuple(req.cuts))
        snapshot: Path | None = None
        try:
            with trio.fail_after(self.cfg.state_timeout):
                st = self.service.server.stage
                if st is not None and st.key == key and st.stage == req.stage:
                    snapshot = snapshot_file(self.directory, next(self._snapshots))
                    written = await trio.to_thread.run_sync(_write_snapshot, st.handler, snapshot, key, req.stage)
                    tensors, step, samples = await trio.to_thread.run_sync(functools.partial(written.load, mapped=True))
                    live = True
                else:
                    kept = self.get(key, req.stage)
                    if kept is None:
                        await session.reply(env, ErrorReply.of(Refusal(Code.NO_STATE, "the copy is gone")))
                        return
                    try:
                        tensors, step, samples = await trio.to_thread.run_sync(
                            functools.partial(kept.load, mapped=True))
                    except CopyUnreadable as exc:
                        log.warning("stage %d's state for %s not sent: %s", req.stage, session.short, exc)
                        self.get(key, req.stage)  # forgets it, if it is still the copy we keep
                        await session.reply(env, ErrorReply.of(Refusal(
                            Code.NO_STATE, f"this peer's copy of stage {req.stage} cannot be read")))
                        return
                    live = False
                specs = [TensorSpec(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors]
                ours = OutgoingGroup(session, specs)
                await session.reply(env, StageStateReply(tensors=specs, streams=ours.streams, step=step,
                                                         samples=samples, live=live))
                await ours.send([t for _, t in tensors])
            self.stats.served += 1
            log.info("sent stage %d's state (step %d, %s) to %s", req.stage, step, "live" if live else "copy",
                     session.short)
        except (trio.TooSlowError, SessionClosed) as exc:
            log.info("stage %d's state for %s not sent: %s", req.stage, session.short, str(exc) or "deadline passed")
        except Exception:  # a bug here must not take the daemon down: this transfer just fails
            log.exception("sending stage %d's state to %s failed", req.stage, session.short)
        finally:
            self.uploads -= 1
            self.per_peer[session.peer_id] -= 1
            if self.per_peer[session.peer_id] <= 0:
                del self.per_peer[session.peer_id]
            if snapshot is not None:  # its pages stay readable while mapped; the name goes now
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(remove_files, [snapshot])

    # ---- fetching --------------------------------------------------------------------------------
    async def fetch(self, key: PipelineKey, stage: int, peer_id: str, check: SpecCheck) -> FetchedState:
        """Download stage `stage`'s state from `peer_id`; raises StateUnavailable with the reason."""
        try:
            return await self._fetch(key, stage, peer_id, check)
        except StateUnavailable as exc:
            self.stats.fetch_failed += 1
            self.stats.last_error = f"{peer_id[:8]}: stage {stage}: {exc}"[:300]
            raise

    async def _fetch(self, key: PipelineKey, stage: int, peer_id: str, check: SpecCheck) -> FetchedState:
        try:  # under partial views a holder we have no session with is dialed (one bounded lookup)
            session = self.service.session_of(peer_id) or await self.service.reach(peer_id)
        except Unreachable as exc:
            raise StateUnavailable(f"not reached: {exc}") from None
        if session is None:
            raise StateUnavailable("no session with it")
        t0 = trio.current_time()
        theirs: IncomingGroup | None = None
        try:
            with trio.fail_after(self.cfg.state_timeout):
                env = await session.request(StageStateRequest(key.name, stage, list(key.cuts)),
                                            timeout=self.cfg.state_timeout)
                reply = env.message
                if isinstance(reply, ErrorReply):
                    refusal = reply.refusal()
                    raise StateUnavailable(str(refusal), refusal)
                if not isinstance(reply, StageStateReply):
                    raise ProtocolError(f"expected stage_state_reply, got {type(reply).__name__}")
                specs = list(reply.tensors)
                why = check([(s.name, s.dtype, list(s.shape)) for s in specs])
                if why is not None:
                    IncomingGroup(session, reply.streams, []).discard()  # drop the tensors as they come
                    raise StateUnavailable(f"not a state of stage {stage}: {why}")
                theirs = IncomingGroup(session, reply.streams, specs, as_torch=True)
                values = await theirs.receive(timeout=self.cfg.state_timeout)
        except trio.TooSlowError:
            raise StateUnavailable(f"not received within [pipeline] state_timeout {self.cfg.state_timeout:g}s") from None
        except SessionClosed as exc:
            raise StateUnavailable(f"session ended: {exc}") from None
        except ProtocolError as exc:
            await session.aclose(f"protocol error: {exc}")
            raise StateUnavailable(f"bad reply: {exc}") from None
        finally:
            if theirs is not None:
                theirs.discard()
        bad = await trio.to_thread.run_sync(_first_not_finite, specs, values)
        if bad is not None:
            raise StateUnavailable(f"tensor {bad[:80]!r} has NaN or Inf")
        self.stats.fetched += 1
        nbytes = sum(v.numel() * v.element_size() for v in values)
        return FetchedState([(s.name, v) for s, v in zip(specs, values)], reply.step, reply.samples, reply.live,
                            peer_id, nbytes, trio.current_time() - t0)

    def status(self) -> dict:
        s = self.stats
        return {"copies": [{"stage": c.stage, "step": c.step, "age_s": round(time.monotonic() - c.kept_at, 1),
                            "where": "disk" if c.on_disk else "memory", "mb": round(c.nbytes / 1e6, 2)}
                           for c in self.copies.values()],
                "served": s.served, "refused": dict(s.refused), "fetched": s.fetched, "fetch_failed": s.fetch_failed,
                "uploads": self.uploads, "last_error": s.last_error, "copies_unreadable": s.copies_unreadable}


def _write_snapshot(handler, path: Path, key: PipelineKey, stage: int) -> KeptCopy:
    """The served stage's state, written to `path` under the stage's lock (`StageHandler.write_state`)."""
    made: list[KeptCopy] = []
    handler.write_state(lambda tensors, step, samples: made.append(
        KeptCopy.write_snapshot(path, key, stage, tensors, step, samples)))
    if not made:
        raise RuntimeError(f"stage {stage}'s handler wrote no state")
    return made[0]


def _first_not_finite(specs: list[TensorSpec], values: list[Any]) -> str | None:
    import torch

    for s, v in zip(specs, values):
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            return s.name
    return None

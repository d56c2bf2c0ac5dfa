"""Driving one microbatch through the stages: forward stage by stage, the loss at the last, backward again.

Each step is one call to a peer of that stage chosen by the balancer (earliest expected finish). Servers keep
nothing between a forward and its backward, so the backward of stage s may go to any live peer of s: it
carries the stage's inputs (kept here) and the gradient of its output, and the server recomputes the forward
with the same seed. A call has a deadline scaled by its expected time there; on an error, a refusal or the
deadline it is re-sent to another peer of the stage, at most `[pipeline] max_retries` times, and the failing
peer is avoided for a growing interval. A peer that refused or failed a call another peer of its stage then
served (a refusal blaming us, a reply without its loss, a malformed one, its deadline passed) is struck in the
ban list the checks use (three strikes ban it from our calls); a refusal blaming us fails the microbatch only
when ASKERS_FAULT_AGREE peers of the stage say so, or no other is left. A stage with no usable peer is waited
for (at most `[pipeline] stage_wait`, shown in status), polling, never spinning. Every microbatch ends as an `Outcome`:
done (with how many re-sends it took) or failed with the reason; none is dropped silently.

A server keeps the parameter gradient of a "backward" or "loss" call aside and names it in its reply
(peer/pipeline/kept.py). Once the microbatch's backward has completed through every stage, the driver tells
each server that kept one to add it to its stage (`StageAck`), and counts, per stage, the samples the servers
confirm; a microbatch that failed tells them to drop theirs. A reply lost after the server computed it (the
call re-sent to another peer) is never acknowledged, so its gradient enters no stage: each stage counts a
microbatch at most once, and one that failed in none. A microbatch is done, and counted, once its acks are
answered. A stage whose server answers that it no longer has the gradient (evicted, expired) makes the
microbatch fail (`ack_lost`): its other stages took it, that one did not, and the trainer must not count it
done. One its server dropped because its own stage state was replaced since (it moved stage, or loaded a
peer's state: `moved` in the reply) fails nothing: that replica is gone with all it had accumulated, acknowledged
or not (`ack_moved`). An ack not answered (the server died) is counted lost too, but nobody can tell whether it entered. An
ack goes over the session the call used, kept up while the ack is owed (`calling`), or one a lookup redials
(partial views): peer/pipeline/acks.py sends and counts them.
An attempt runs at most `longest_microbatch_s` (kept.py), so the servers' hold outlives it.

A share of the completed calls (`[pipeline] verify_fraction`) is checked: the same call at another peer of the
stage, its answer compared with the first (peer/pipeline/verify.py), beside the microbatch's next calls. A
check that finds the outlier among three answers strikes it (banned after repeated evidence: no call goes to it
then), and a microbatch one of whose calls it answered is run again without it, its kept gradients dropped. A
check's own calls keep gradients like any; they are dropped at once, never acknowledged.
"""

from __future__ import annotations

import logging
import queue
import random
import secrets
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from peer.averaging.bans import BanList
from peer.concurrency import together
from peer.membership.reach import ReachBusy, Unreachable
from peer.pipeline.acks import WAIT_POLL_S, Acks, KeptAt
from peer.pipeline.balancer import Balancer
from peer.pipeline.directory import PipelineKey
from peer.per_peer import count
from peer.pipeline.kept import longest_microbatch_s
from peer.pipeline.verify import MAX_RERUNS, Answer, Verifier, floor
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from peertrain.pipeline import Microbatch, Outcome, ReplyShapes
from peertrain.swarm import TrainerStopped
from protocol.errors import ProtocolError
from protocol.refusal import ASKERS_FAULT, STALE_VIEW, TRY_LATER, Code, Refusal, Refused
from protocol.schema.gossip import TensorSpec
from protocol.schema.pipeline import StageCall, StageReply
from protocol.schema.session import ErrorReply
from protocol.tensor_codec import FLOAT_DTYPES

log = logging.getLogger("peertrain.pipeline")

DEADLINE_SLACK = 4.0  # a call's deadline allows this many times its expected time (plus the base timeout)
ASSUMED_BYTES_PER_S = 10e6  # for a peer whose calls we never timed: a slow link (80 Mbit/s), so deadlines err long
# A refused call is handled by its code (protocol/refusal.py): TRY_LATER (the peer is full, not broken): re-sent,
# the peer avoided only briefly (the balancer), no attempt used. ASKERS_FAULT (any peer of the stage would refuse
# it again): the microbatch fails at once instead of being retried. STALE_VIEW (our stage map was stale: the peer
# moved to another stage, is (re)starting, or just left, as a move's handed-back calls say): not the peer failing,
# re-sent without using one of `max_retries`, the peer avoided for that stage like a failing one, at most
# MAX_STALE times a call (a peer that lies this way only gets itself avoided, and the bound ends the loop).
# Any other refusal, and a call that failed without one (_CallFailed), uses up an attempt.
MAX_STALE = 16
ASKERS_FAULT_AGREE = 2
"""Peers of a stage that must refuse the same call as our fault (ASKERS_FAULT, or answer a loss call without a
loss) before the microbatch fails for it: one bad server alone cannot fail it; two honest ones agreeing on bad
inputs of ours end it after one re-send. Each such refuser is struck once another peer serves the call."""
NO_LOSS = Refusal(Code.BAD_INPUT, "the stage returned no loss (not finite?)")
"""A loss or evaluate call answered without a finite loss: our inputs give any peer of the stage the same."""
STOP_POLL_S = 0.2  # a trainer waiting for a free microbatch slot notices a stop this soon
LABEL_BITS = 31  # a call's wire id (`Driver._label`): random, as large as the ids a trainer numbers its microbatches with
RECENT_FAILURES = 20  # failed microbatches kept for status, with their reasons

class MicrobatchFailed(Exception):
    pass


class _CallFailed(Exception):
    """A call that failed without being refused: no session, no answer by its deadline, the session ended, a
    bad reply. Re-sent to another peer of the stage, using up an attempt (a refusal is `Refused`, by code).
    `fault`: the server's doing (its deadline passed, a bad reply): struck if another peer serves the call."""

    def __init__(self, why: str, *, fault: bool = False):
        super().__init__(why)
        self.fault = fault


@dataclass
class DriverStats:
    done: int = 0
    failed: int = 0
    retried: int = 0  # microbatches that needed at least one re-sent call (and finished: see `failed`)
    resent: int = 0  # calls re-sent, over all microbatches
    evaluated: int = 0
    busy: int = 0  # calls a full server refused (tried again, elsewhere or later; not failures)
    in_flight: int = 0
    samples: int = 0
    waiting: dict = field(default_factory=dict)  # stage -> since when (trio clock) we wait for a usable peer
    calls: Counter = field(default_factory=Counter)  # peer -> calls it completed for us
    deadlines: deque = field(default_factory=lambda: deque(maxlen=200))  # recent call deadlines, seconds
    failures: deque = field(default_factory=lambda: deque(maxlen=RECENT_FAILURES))  # (microbatch, reason)
    last_loss: float | None = None
    acked: int = 0  # gradients of done microbatches that their stage confirmed taking (one per stage each)
    acked_samples: Counter = field(default_factory=Counter)  # stage -> samples it confirmed taking from us
    ack_lost: int = 0  # gradients of done microbatches a stage did not confirm: missing there (or unconfirmed)
    ack_moved: int = 0  # gradients of done microbatches whose server replaced its stage state first (a move): no failure
    dropped: int = 0  # gradients of failed microbatches we told their server to drop
    struck: Counter = field(default_factory=Counter)  # peer -> strikes for calls it refused or failed (see _call)


@dataclass
class _Attempt:
    """One run of a microbatch through the stages: what its calls left behind, and what its checks found."""

    nursery: trio.Nursery  # its checks run here; the attempt ends when they have
    resent: list[int]
    avoid: set[str]  # outliers found in earlier attempts: none of this one's calls goes to them
    kept: list[KeptAt] = field(default_factory=list)
    served: set[str] = field(default_factory=set)  # peers that answered one of its calls
    found: set[str] = field(default_factory=set)  # outliers its checks named
    deadline: float = float("inf")  # trio clock: no call of it starts past this (longest_microbatch_s)


class Driver:
    def __init__(self, service, key: PipelineKey, *, reply_shapes: ReplyShapes,
                 forward_codec: str = "raw", backward_codec: str = "raw", stopped: Callable[[], bool] = lambda: False,
                 bans: BanList | None = None, rng: random.Random | None = None):
        self.service = service
        self.stopped = stopped
        self.cfg = service.cfg
        self.key, self.stages = key, key.stages
        self.reply_shapes = reply_shapes
        self.codec = {"forward": forward_codec, "backward": backward_codec}
        self.balancers = [Balancer(first_ban=self.cfg.first_ban, max_ban=self.cfg.max_ban) for _ in range(self.stages)]
        self.stats = DriverStats()
        self.verifier = Verifier(self.cfg.verify_fraction, service.me, bans if bans is not None else BanList(), rng)
        self._waiting_calls: Counter = Counter()  # stage -> calls waiting for a usable peer of it
        self.acks = Acks(service, self.stats)  # settles each microbatch's kept gradients (acks.py)
        self.longest_s = longest_microbatch_s(self.cfg, self.stages)
        self._labels = random.Random(secrets.randbits(64))  # the calls' wire ids (`_label`): unguessable

    async def run(self, mb: Microbatch) -> Outcome:
        """One microbatch, start to end; never raises for what peers do (the outcome says it). A check that finds
        an outlier among the peers that served it runs it again without them (its gradients dropped), at most
        MAX_RERUNS times."""
        t0 = trio.current_time()
        self.stats.in_flight += 1
        resent, avoid, reruns = [0], set(), 0
        try:
            while True:
                failure: MicrobatchFailed | None = None
                loss = None
                async with trio.open_nursery() as checks:  # the attempt ends once its checks have
                    at = _Attempt(checks, resent, avoid, deadline=trio.current_time() + self.longest_s)
                    try:
                        loss = await (self._evaluate(mb, at) if mb.evaluate else self._train(mb, at))
                    except MicrobatchFailed as exc:
                        failure = exc
                outliers = at.found & at.served
                if failure is None and outliers:
                    if reruns >= MAX_RERUNS:
                        failure = MicrobatchFailed(f"answered by outliers ({', '.join(p[:8] for p in outliers)}) "
                                                   f"after {reruns} re-runs")
                    else:
                        await self.acks.settle(mb.id, mb.batch, at.kept, accumulate=False)
                        avoid |= outliers
                        reruns += 1
                        self.verifier.stats.reruns += 1
                        log.warning("microbatch %d: %s answered one of its calls and a check found it the outlier; "
                                    "running it again without", mb.id, ", ".join(p[:8] for p in outliers))
                        continue
                if failure is not None:
                    await self.acks.settle(mb.id, mb.batch, at.kept, accumulate=False)
                    self.stats.failed += 1
                    self.stats.failures.append((mb.id, str(failure)))
                    log.warning("microbatch %d failed after %d re-sent calls: %s", mb.id, resent[0], failure)
                    return Outcome(mb.id, False, mb.batch, resent=resent[0], reruns=reruns,
                                   seconds=trio.current_time() - t0, reason=str(failure), evaluate=mb.evaluate)
                lost = await self.acks.settle(mb.id, mb.batch, at.kept, accumulate=True)
                if lost:  # a stage no longer had its part: not done (the others did take theirs)
                    self.stats.failed += 1
                    reason = f"stage {', '.join(map(str, lost))} no longer had its gradient (evicted or expired)"
                    self.stats.failures.append((mb.id, reason))
                    return Outcome(mb.id, False, mb.batch, loss=loss, resent=resent[0], reruns=reruns,
                                   seconds=trio.current_time() - t0, reason=reason, evaluate=mb.evaluate)
                break
        finally:
            self.stats.in_flight -= 1
        if mb.evaluate:
            self.stats.evaluated += 1
        else:
            self.stats.done += 1
            self.stats.samples += mb.batch
            self.stats.last_loss = loss
            self.stats.retried += resent[0] > 0
        return Outcome(mb.id, True, mb.batch, loss=loss, resent=resent[0], reruns=reruns,
                       seconds=trio.current_time() - t0, evaluate=mb.evaluate)

    async def _train(self, mb: Microbatch, at: _Attempt) -> float | None:
        """Forward, loss, backward; `at.kept` gets each gradient a server keeps for us as its call returns."""
        last = self.stages - 1
        inputs = [mb.x]  # inputs[s]: what stage s got forward (kept for its backward)
        for s in range(last):
            _, (out,), _ = await self._call(mb, s, "forward", [inputs[s]], at)
            inputs.append(out)
        loss, grads, kept = await self._call(mb, last, "loss", [inputs[last], mb.y], at)
        at.kept += [kept] if kept else []
        for s in range(last - 1, -1, -1):
            _, grads, kept = await self._call(mb, s, "backward", [inputs[s], grads[0]], at)
            at.kept += [kept] if kept else []
        return loss

    async def _evaluate(self, mb: Microbatch, at: _Attempt) -> float | None:
        h = mb.x
        for s in range(self.stages - 1):
            _, (h,), _ = await self._call(mb, s, "forward", [h], at)
        loss, _, _ = await self._call(mb, self.stages - 1, "evaluate", [h, mb.y], at)
        return loss

    def calling(self, peer_id: str) -> bool:
        """Whether a call of ours is out at `peer_id`, or it keeps a gradient we owe an ack for (its session must
        stay up meanwhile: partial views close idle ones, and the ack would find none)."""
        return self.acks.owes(peer_id) or any((e := b.peers.get(peer_id)) is not None and e.outstanding > 0
                                            for b in self.balancers)

    def _label(self) -> int:
        """The microbatch id a call carries on the wire (a server only logs it): drawn fresh for every call, so a
        check's call carries nothing that tells a server it repeats another (colluders comparing inputs still
        can: what holds against them is the checker drawn at random and our own compute, verify.py)."""
        return self._labels.getrandbits(LABEL_BITS)

    def _seed(self, mb: Microbatch, stage: int) -> int:
        return (mb.seed * 1_000_003 + stage * 7919) & 0x7FFF_FFFF

    def _peers(self, stage: int, now: float, avoid: set[str] = frozenset()) -> list:
        """The live peers of `stage` we may call: not banned for lying (verify.py), not in `avoid`."""
        return [p for p in self.service.stage_map(self.key)[stage]
                if p.peer_id not in avoid and not self.verifier.banned(p.peer_id, now)]

    async def _call(self, mb: Microbatch, stage: int, kind: str, tensors: list[Any],
                    at: _Attempt) -> tuple[float | None, list[Any], KeptAt | None]:
        """One stage call, re-sent to other peers of the stage until it succeeds or the attempts run out: (loss,
        outputs, the gradient its server keeps for us, if any). A completed call may be checked (verify.py)."""
        balancer = self.balancers[stage]
        attempts, stale, tried, last_error = 0, 0, set(), ""
        blamed: set[str] = set()  # peers that refused this call as our fault: never asked again
        suspects: dict[str, str] = {}  # peer -> how it refused or failed this call: struck if another serves it
        wait_started: float | None = None
        while True:
            if self.stopped():  # the daemon is stopping: no more re-sends (the outcome says so)
                raise MicrobatchFailed(f"stage {stage} {kind}: this daemon is stopping")
            now = trio.current_time()
            if now > at.deadline:
                raise MicrobatchFailed(f"stage {stage} {kind}: the microbatch ran past its longest "
                                       f"{self.longest_s:.0f}s" + (f" (last error: {last_error})" if last_error else ""))
            peers = self._peers(stage, now, at.avoid | blamed)
            fresh = {p.peer_id for p in peers} - tried
            pid = balancer.choose(peers, mb.batch, now, exclude=tried if fresh else set())
            if pid is None:  # nobody usable: wait (bounded, visible), do not spin
                if wait_started is None:
                    wait_started = now
                    self._waiting(stage, +1, now)
                if now - wait_started > self.cfg.stage_wait:
                    self._waiting(stage, -1, now)
                    raise MicrobatchFailed(f"no usable peer of stage {stage} for {self.cfg.stage_wait:.0f}s"
                                           + (f" (last error: {last_error})" if last_error else ""))
                await trio.sleep(WAIT_POLL_S)
                continue
            if wait_started is not None:
                wait_started = None
                self._waiting(stage, -1, now)
            peer = next(p for p in peers if p.peer_id == pid)
            t0 = trio.current_time()
            try:
                result = await self._call_once(pid, peer, mb, stage, kind, tensors)
            except (Refused, _CallFailed) as exc:
                code = exc.code if isinstance(exc, Refused) else None
                busy = code in TRY_LATER
                balancer.done(pid, mb.batch, trio.current_time() - t0, trio.current_time(), failure=str(exc),
                              busy=busy)
                last_error = f"{pid[:8]}: {exc}"
                if busy:  # full, not broken: avoided only briefly (the balancer), no attempt used
                    self.stats.busy += 1
                    continue
                if code in ASKERS_FAULT:  # a second opinion before we believe it (ASKERS_FAULT_AGREE)
                    blamed.add(pid)
                    if len(blamed) >= ASKERS_FAULT_AGREE or not self._peers(stage, trio.current_time(),
                                                                             at.avoid | blamed):
                        raise MicrobatchFailed(f"stage {stage} {kind}: {exc}" + (
                            f" ({len(blamed)} peers agree)" if len(blamed) > 1 else "")) from None
                if pid != self.service.me and (code in ASKERS_FAULT or getattr(exc, "fault", False)):
                    suspects[pid] = str(exc)
                tried.add(pid)
                if code in STALE_VIEW and stale < MAX_STALE:
                    stale += 1
                else:
                    attempts += 1
                if attempts > self.cfg.max_retries:
                    raise MicrobatchFailed(f"stage {stage} {kind}: {attempts} calls failed, the last at "
                                           f"{last_error}") from None
                at.resent[0] += 1
                self.stats.resent += 1
                log.info("microbatch %d: stage %d %s at %s failed (%s); re-sending", mb.id, stage, kind, pid[:8], exc)
                continue
            balancer.done(pid, mb.batch, trio.current_time() - t0, trio.current_time())
            self.stats.calls[pid] += 1
            for bad, why in suspects.items():  # the stage serves this call: theirs was no fault of ours
                self._strike(bad, f"stage {stage} {kind}: {why}; {pid[:8]} served the same call")
            loss, outputs, kept, compute_s = result
            at.served.add(pid)
            self.verifier.stats.call_compute_s += compute_s
            if self.verifier.wants(stage, kind):
                self._start_check(mb, stage, kind, tensors, Answer(pid, loss, outputs, kept, compute_s), at)
            return loss, outputs, (KeptAt(stage, pid, kept) if kept else None)

    def _strike(self, peer_id: str, reason: str) -> None:
        """A strike for a call `peer_id` refused or failed that another peer of its stage served: in the ban list
        our checks use (verify.py; three strikes ban it from our calls, for a doubling interval)."""
        count(self.stats.struck, peer_id)  # bounded to the peers most recently struck: keys are free
        if self.verifier.bans.strike(peer_id, reason, trio.current_time()):
            log.warning("banned %s from our pipeline calls: %s", peer_id[:8],
                        self.verifier.bans.banned(peer_id, trio.current_time()))
        else:
            log.info("struck %s: %s", peer_id[:8], reason)

    def _start_check(self, mb: Microbatch, stage: int, kind: str, tensors: list[Any], first: Answer,
                     at: _Attempt) -> None:
        """Check `first` in the attempt's nursery (verify.py), beside the microbatch's next calls; an outlier it
        names is struck there and, if it served this attempt, makes the microbatch run again."""
        now = trio.current_time()
        if not any(p.peer_id != first.peer for p in self._peers(stage, now)):
            self.verifier.stats.no_peer += 1
            return
        self.verifier.in_flight += 1
        direction = "backward" if kind in ("backward", "loss") else "forward"
        dtypes = [str(t.dtype).removeprefix("torch.") for t in first.outputs]
        floor_ = floor(dtypes, self.codec[direction])

        async def ask(exclude: set[str]) -> Answer | None:
            return await self._ask(mb, stage, kind, tensors, exclude)

        async def drop(answers: list[Answer]) -> None:
            async with trio.open_nursery() as n:
                for a in answers:
                    n.start_soon(self.acks.ack, a.peer, [a.kept], False)

        async def check() -> None:
            odd = await self.verifier.check(first, stage, kind, floor_, ask, drop, self.stats.done)
            if odd is not None:
                at.found.add(odd)

        at.nursery.start_soon(check)

    async def _ask(self, mb: Microbatch, stage: int, kind: str, tensors: list[Any],
                   exclude: set[str]) -> Answer | None:
        """A check's call: the same call, once, to another peer of `stage` outside `exclude`: ourselves where we
        serve the stage (our own compute is the one answer no colluders control), else one drawn at random among
        those the balancer does not avoid (its choice favours new and fast peers: a liar announcing speed would
        check itself). None if there is none, or the call fails: no verdict; the balancer counts the failure as
        any, so a peer that stalls a check is not drawn again while it is avoided."""
        balancer = self.balancers[stage]
        now = trio.current_time()
        # not one the balancer avoids (it failed or stalled a call lately, a check's too): a peer that stalls
        # checks would otherwise hold the driver's one check slot to each deadline, drawn again and again
        peers = [p for p in self._peers(stage, now) if p.peer_id not in exclude and balancer.avoided(p.peer_id, now) is None]
        if not peers:
            return None
        peer = next((p for p in peers if p.peer_id == self.service.me), None) or self.verifier.rng.choice(peers)
        pid = peer.peer_id
        t0 = trio.current_time()
        try:
            loss, outputs, kept, compute_s = await self._call_once(pid, peer, mb, stage, kind, tensors)
        except (Refused, _CallFailed) as exc:
            code = exc.code if isinstance(exc, Refused) else None
            balancer.done(pid, mb.batch, trio.current_time() - t0, trio.current_time(), failure=str(exc),
                          busy=code in TRY_LATER)
            log.info("microbatch %d: a check's stage %d %s at %s failed: %s", mb.id, stage, kind, pid[:8], exc)
            return None
        balancer.done(pid, mb.batch, trio.current_time() - t0, trio.current_time())
        return Answer(pid, loss, outputs, kept, compute_s)

    def _waiting(self, stage: int, delta: int, now: float) -> None:
        """Count the calls waiting for a usable peer of `stage`; status shows since when any has waited."""
        n = self._waiting_calls[stage] = self._waiting_calls[stage] + delta
        if n > 0:
            self.stats.waiting.setdefault(stage, now)
        else:
            self._waiting_calls.pop(stage, None)
            self.stats.waiting.pop(stage, None)

    async def _call_self(self, mb: Microbatch, stage: int, kind: str,
                         tensors: list[Any]) -> tuple[float | None, list[Any], int, float]:
        """Our own stage serves our own microbatch in-process: same checks and compute, nothing on the wire."""
        specs = [TensorSpec(f"in{i}", str(t.dtype).removeprefix("torch."), list(t.shape)) for i, t in enumerate(tensors)]
        call = StageCall(pipeline=self.key.name, cuts=list(self.key.cuts), stage=stage, kind=kind, batch=mb.batch,
                         seed=self._seed(mb, stage), tensors=specs, streams=[0] * len(specs), microbatch=self._label())
        loss, outputs, kept, seconds = await self.service.server.compute_local(call, tensors)  # Refused as a peer would
        if kind in ("loss", "evaluate") and loss is None:
            raise Refused(NO_LOSS)
        return loss, outputs, kept, seconds

    def deadline(self, pid: str, peer, batch: int, nbytes: int) -> float:
        expected = self.balancers[peer.stage].expected_seconds(pid, peer, batch) + nbytes / ASSUMED_BYTES_PER_S
        return min(self.cfg.max_call_timeout, self.cfg.call_timeout + DEADLINE_SLACK * expected)

    async def _call_once(self, pid: str, peer, mb: Microbatch, stage: int, kind: str,
                         tensors: list[Any]) -> tuple[float | None, list[Any], int, float]:
        """One call to `pid`: (loss, outputs, the id its gradient is kept under there (0 for none), the seconds
        its server says it computed)."""
        if pid == self.service.me:
            return await self._call_self(mb, stage, kind, tensors)
        try:  # under partial views a server we have no session with is dialed (one bounded lookup)
            session = await self.service.reach(pid)  # the session we have, else (partial views) a lookup
        except ReachBusy as exc:  # nothing wrong with it: avoided briefly, as a busy peer (no attempt used)
            raise Refused(Refusal(Code.BUSY, f"not reached yet: {exc}")) from None
        except Unreachable as exc:  # avoided for a growing while, as a failing peer (the balancer)
            raise _CallFailed(f"not reached: {exc}") from None
        if session is None:
            raise _CallFailed("no session with it")
        specs = [TensorSpec(f"in{i}", str(t.dtype).removeprefix("torch."), list(t.shape)) for i, t in enumerate(tensors)]
        direction = "backward" if kind == "backward" else "forward"
        send_codecs = [self.codec[direction] if s.dtype in FLOAT_DTYPES else "raw" for s in specs]
        if kind == "backward" and len(specs) == 2:
            send_codecs[0] = self.codec["forward"] if specs[0].dtype in FLOAT_DTYPES else "raw"  # the stage input
        reply_codec = self.codec["backward"] if kind in ("backward", "loss") else self.codec["forward"]
        expect = [TensorSpec(f"out{i}", d, list(shape)) for i, (d, shape) in enumerate(self.reply_shapes(stage, kind, mb.batch))]
        nbytes = sum(t.numel() * t.element_size() for t in tensors) * 2
        timeout = self.deadline(pid, peer, mb.batch, nbytes)
        self.stats.deadlines.append(timeout)
        ours = OutgoingGroup(session, specs)
        call = StageCall(pipeline=self.key.name, cuts=list(self.key.cuts), stage=stage, kind=kind, batch=mb.batch, seed=self._seed(mb, stage),
                         tensors=specs, streams=ours.streams, microbatch=self._label(), codec=reply_codec,
                         deadline_s=timeout)
        replies: list = []
        theirs: IncomingGroup | None = None
        try:
            with trio.fail_after(timeout):
                announced = trio.Event()

                async def ask() -> None:
                    nonlocal theirs
                    env = await session.request(call, timeout=timeout, sent=announced)
                    if isinstance(env.message, StageReply):  # expect its tensors at once: they are coming
                        theirs = IncomingGroup(session, env.message.streams, expect, as_torch=True)
                    replies.append(env.message)

                await together(ask, lambda: ours.send([t.detach().contiguous() for t in tensors], codec=send_codecs,
                                                      after=announced))
                reply = replies[0]
                if isinstance(reply, ErrorReply):
                    raise Refused(reply.refusal())
                if not isinstance(reply, StageReply):
                    raise ProtocolError(f"expected stage_reply, got {type(reply).__name__}")
                outputs = await theirs.receive(timeout=timeout)
        except trio.TooSlowError:
            raise _CallFailed(f"no answer within its {timeout:.1f}s deadline", fault=True) from None
        except SessionClosed as exc:
            raise _CallFailed(f"session ended: {exc}") from None
        except ProtocolError as exc:  # a malformed reply: that session is done (as for any bad message)
            await session.aclose(f"protocol error: {exc}")
            raise _CallFailed(f"bad reply: {exc}", fault=True) from None
        finally:
            if theirs is not None:
                theirs.discard()
        if kind in ("loss", "evaluate") and reply.loss is None:
            raise Refused(NO_LOSS)  # its kept gradient (if any) is never acknowledged: it expires there
        kept = reply.kept if kind in ("backward", "loss") else 0  # only those keep one: an id on others is ignored
        if kept:
            self.acks.owe(pid, +1)  # until our ack, whatever happens to the microbatch now (kept up: `calling`)
        return reply.loss, outputs, kept, reply.compute_s


class DriverHandle:
    """A driver as a trainer thread uses it: `submit` blocks while `in_flight` microbatches are out (back
    pressure), outcomes are collected as they end. Safe to call from the trainer's thread only."""

    def __init__(self, driver: Driver, nursery: trio.Nursery, token, in_flight: int, stopped: Callable[[], bool]):
        self.driver = driver
        self._nursery = nursery
        self._token = token
        self._slots = trio.Semaphore(in_flight)
        self._in_flight = in_flight
        self._outcomes: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._submitted = 0  # microbatches whose outcome goes to `outcomes()`; the trainer's thread counts both
        self._collected = 0
        self._stopped = stopped

    def submit(self, mb: Microbatch, *, into: queue.SimpleQueue | None = None) -> None:
        """Start `mb` once fewer than `in_flight` are out; its outcome goes to `outcomes()` (or `into`)."""
        sink = self._outcomes if into is None else into

        async def go() -> None:
            try:
                sink.put(await self.driver.run(mb))
            finally:
                self._slots.release()

        async def start() -> None:
            while True:  # wait for a slot, but not past a stop
                with trio.move_on_after(STOP_POLL_S):
                    await self._slots.acquire()
                    break
                if self._stopped():
                    raise TrainerStopped()
            self._nursery.start_soon(go)

        if self._stopped():
            raise TrainerStopped()
        try:
            trio.from_thread.run(start, trio_token=self._token)
        except trio.RunFinishedError:
            raise TrainerStopped() from None
        if into is None:
            self._submitted += 1

    def outcomes(self) -> list[Outcome]:
        out = []
        while True:
            try:
                out.append(self._outcomes.get_nowait())
            except queue.Empty:
                self._collected += len(out)
                return out

    def run_many(self, mbs: list[Microbatch], *, timeout: float) -> list[Outcome]:
        """Move `mbs` (beside whatever else is in flight) and wait for exactly their outcomes, at most `timeout`."""
        import time

        mine: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        for mb in mbs:
            self.submit(mb, into=mine)
        out: list[Outcome] = []
        deadline = time.monotonic() + timeout
        while len(out) < len(mbs) and time.monotonic() < deadline and not self._stopped():
            try:
                out.append(mine.get(timeout=0.1))
            except queue.Empty:
                pass
        return out

    def drain(self, timeout: float) -> list[Outcome]:
        """Wait (at most `timeout`) for the outcome of every microbatch submitted; those not collected yet.
        Counted by outcomes, not by the driver's in-flight figure: a microbatch just submitted may not have
        started yet, and would be missed."""
        import time

        deadline = time.monotonic() + timeout
        out = self.outcomes()
        while self._collected < self._submitted and time.monotonic() < deadline and not self._stopped():
            time.sleep(0.05)
            out += self.outcomes()
        return out

"""Settling a microbatch's kept gradients: after its backward completed through every stage, each server that
kept one is told to add it to its stage (`StageAck`), or, when it failed, to drop it; and what each confirmed is
counted (peer/pipeline/driver.py's module docstring says what the counts guarantee).

An ack goes over the session the call used, kept up while the ack is owed (`owes`, read by `Driver.calling`), or
one a lookup redials (partial views), all within `call_timeout`. Our own stage is acknowledged in-process.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass

import trio

from peer.membership.reach import ReachBusy, Unreachable
from peer.pipeline.server import LOCAL_DRIVER
from peer.session.transport import SessionClosed
from protocol.schema.pipeline import StageAck, StageAckReply

log = logging.getLogger("peertrain.pipeline")

WAIT_POLL_S = 0.2
"""How often a driver waiting (for a peer of a stage, for a busy lookup) looks again: a peer appears within a
record interval."""


@dataclass(frozen=True)
class KeptAt:
    """A gradient a server of `stage` keeps for one of our microbatches until we acknowledge it."""

    stage: int
    peer: str
    id: int


class Acks:
    """A driver's acknowledgements: sent, counted into its `stats`, and the ones it still owes each peer."""

    def __init__(self, service, stats) -> None:
        self.service = service
        self.cfg = service.cfg
        self.stats = stats  # the driver's DriverStats: acked, acked_samples, ack_lost, ack_moved, dropped
        self._owed: Counter = Counter()  # peer -> gradients it keeps for us that we have not acknowledged yet

    def owes(self, peer_id: str) -> bool:
        """Whether `peer_id` keeps a gradient we have not acknowledged yet."""
        return peer_id in self._owed

    async def settle(self, mb: int, batch: int, kept: list[KeptAt], *, accumulate: bool) -> list[int]:
        """Tell every server that kept a gradient of microbatch `mb` (of `batch` samples) to add it to its stage
        (`accumulate`: the backward completed through every stage) or to drop it (the microbatch failed); count
        what each confirmed; the stages whose server answered that it no longer had its gradient (evicted,
        expired: when accumulating).
        Each ack is bounded by `call_timeout`; one not answered (the server died, say) is counted lost, but
        nobody can tell whether it entered, so it fails nothing."""
        lost: list[int] = []
        if not kept:
            return lost
        by_peer: dict[str, list[KeptAt]] = defaultdict(list)
        for k in kept:
            by_peer[k.peer].append(k)

        async def settle_with(pid: str, ks: list[KeptAt]) -> None:
            answer = await self.ack(pid, [k.id for k in ks], accumulate)
            entered, moved = answer if answer is not None else (None, set())
            if not accumulate:
                self.stats.dropped += len(ks)
                return
            for k in ks:
                if entered is not None and k.id in entered:
                    self.stats.acked += 1
                    self.stats.acked_samples[k.stage] += batch
                elif k.id in moved:  # the server's replica was replaced (a move): gone with what it held
                    self.stats.ack_moved += 1
                    log.info("microbatch %d: stage %d at %s moved or replaced its state before our ack", mb,
                             k.stage, pid[:8])
                else:
                    self.stats.ack_lost += 1
                    if entered is not None:
                        lost.append(k.stage)
                    log.warning("microbatch %d: stage %d at %s %s", mb, k.stage, pid[:8],
                                "did not answer its ack" if entered is None else "no longer had its gradient")

        async with trio.open_nursery() as n:
            for pid, ks in by_peer.items():
                n.start_soon(settle_with, pid, ks)
        return sorted(lost)

    async def ack(self, pid: str, ids: list[int], accumulate: bool) -> tuple[set[int], set[int]] | None:
        """One StageAck to `pid` (in-process for our own stage); the ids whose gradient entered its stage and those
        its own state change dropped (`moved`), None if it did not answer. Its session was kept up while we owed
        it this ack (`Driver.calling`); one closed anyway is redialed (`reach`: partial views), all within
        `call_timeout`."""
        if pid == self.service.me:
            server = self.service.server
            entered = set(await server.acknowledge(LOCAL_DRIVER, ids, accumulate=accumulate))
            return entered, set(server.kept.moved(LOCAL_DRIVER, ids))
        try:
            with trio.move_on_after(self.cfg.call_timeout):
                session = await self._session_for(pid)
                if session is None:
                    return None
                env = await session.request(StageAck(kept=ids, accumulate=accumulate), timeout=self.cfg.call_timeout)
                reply = env.message
                if not isinstance(reply, StageAckReply):
                    return None
                return set(reply.accumulated) & set(ids), set(reply.moved) & set(ids)
            return None
        except (trio.TooSlowError, SessionClosed, Unreachable):
            return None
        finally:
            self.owe(pid, -len(ids))

    async def _session_for(self, pid: str):
        """The session to ack `pid` over: the one we have, else one a lookup makes (waiting while lookups are busy;
        the caller bounds it). None when nothing reaches it (full views without a session)."""
        session = self.service.session_of(pid)
        if session is not None:
            return session
        reach = getattr(self.service, "reach", None)
        if reach is None:
            return None
        while True:
            try:
                return await reach(pid)
            except ReachBusy:
                await trio.sleep(WAIT_POLL_S)

    def owe(self, pid: str, n: int) -> None:
        """Count gradients `pid` keeps for us until our ack (its session stays up meanwhile: `Driver.calling`)."""
        left = self._owed[pid] + n
        if left > 0:
            self._owed[pid] = left
        else:
            self._owed.pop(pid, None)


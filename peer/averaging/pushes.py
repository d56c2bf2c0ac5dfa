"""Every update to everyone: a round's sparse update pushed to each partner, and partners' pushes added to ours.

The sparse outer exchange (issue 41; design.md, "Sparse updates"). At a round's end the trainer forms its
update with error feedback and encodes it once (peer/averaging/sparse_updates.py: what the wire's sparse
codec keeps of it, the rest carried to later rounds) and hands it to `start`, which sends the same bytes to
every partner of the group at once (1/108 of float32's); the trainer adds outer_lr / n of it to its own
outer weights. Each partner
adds outer_lr / n of what it decodes to its own outer weights, whenever it arrives: additions commute, so
peers that took the same pushes hold the same weights, in any order. n is the group's size as each peer sees
it (its partners and itself).

Nothing is sent back and no pair's sum is kept (each peer applies the others' updates, not an exchange), so the
bound on what a push may do is the receiver's alone (peer/averaging/push_gate.py: a few times the norm of our
own last push, 1.5 pushes per our round per sender). A push that is lost (refused, a deadline, a peer that left)
leaves the replicas apart by it; the trainer's periodic dense exchange of the outer weights (pairwise, as in
every other mode) pulls them back together.

Held per daemon: one push in flight per group (a round whose previous push still runs keeps its update in
its error feedback and pushes nothing), and the pushes we read take the serving slots the exchanges and
downloads share (each decodes into a dense copy of the group).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import trio

from peer.averaging import norms
from peer.averaging.bounds import OPPOSED_MIN_ELEMENTS
from peer.averaging.budget import ServingSlots
from peer.averaging.ledger import Ledger
from peer.averaging.push_gate import PushGate
from peer.averaging.shared import SharedTensors
from peer.concurrency import together
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError
from protocol.refusal import TRY_LATER, Code, Refusal
from protocol.schema.gossip import UpdatePush, UpdateTaken
from protocol.schema.session import ErrorReply
from protocol.tensor_encoder import EncodedTensor

log = logging.getLogger("peertrain.gossip")

PUSH_CODEC = "sparse"
COSINES_KEPT = 64  # the latest pushes' cosines with ours that `peer status` summarises
PUSH_TRIES = 3  # a partner that says TOO_SOON is asked again: its first round may end a moment after ours
RETRY_S = 1.0  # ... after this, then twice this: rounds of peers started together end seconds apart


class UpdatePushes:
    """Our pushes (`start`) and partners' (`on_push`), with their counters for `peer status`."""

    def __init__(self, cfg, *, groups: Mapping[str, SharedTensors], slots: ServingSlots, ledger: Ledger,
                 may_push: Callable[[str, str], Refusal | None], holders: Callable[[str], list[str]],
                 connected: Callable[[], Mapping[str, Any]]):
        self.cfg = cfg  # [gossip]: exchange_timeout
        self.groups = groups
        self.slots = slots
        self.ledger = ledger
        self.may_push = may_push  # (peer, group) -> why that peer may not push to it, or None (a partner, unbanned)
        self.holders = holders  # group -> partners to push it to
        self.connected = connected
        self.gates: dict[str, PushGate] = {}  # group -> our pushes and partners' (push_gate.py)
        self.sending: set[str] = set()  # groups with a push in flight
        # ours: sent (taken by the partner), not_taken (refused at the last try), failed; theirs: taken, clipped
        # (among those taken), opposed (among those taken: pointing away from ours, none of it added), refused
        # (each try refused before its bytes were read)
        self.counts = {"sent": 0, "not_taken": 0, "failed": 0, "taken": 0, "clipped": 0, "opposed": 0, "refused": 0}
        self.cosines: deque[float] = deque(maxlen=COSINES_KEPT)  # partners' pushes against ours, for `peer status`
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the pushes in flight (each outlives the trainer's call that started it)."""
        async with trio.open_nursery() as n:
            self._nursery = n
            task_status.started()
            await trio.sleep_forever()

    def forget(self, group: str) -> None:
        self.gates.pop(group, None)

    # ---- ours -----------------------------------------------------------------------------------------
    def start(self, group_name: str, encoded: list[EncodedTensor], round: int = 0, *, norm: float,
              support: list[tuple[np.ndarray, np.ndarray]] | None = None) -> int | None:
        """Push `encoded` (one per tensor of the group, in the sparse codec, sent as it is) to every partner of the
        group, in the background: the number of peers the update counts among (the partners and us), or None if
        it was not started (a push of this group is still in flight, the group is not shared, or the daemon is
        stopping). `norm`: the update's as decoded, our yardstick for partners' pushes from now on; `support`:
        its nonzero entries per tensor (flat indices, values), the yardstick of their angle. On the daemon's
        thread."""
        group = self.groups.get(group_name)
        if group is None or group_name in self.sending or self._nursery is None:
            return None
        if len(encoded) != len(group.specs):
            raise ValueError(f"{len(encoded)} tensors pushed for group {group_name!r} of {len(group.specs)}")
        partners = self.recipients(group_name)
        self.sending.add(group_name)
        judged = support if group.elements >= OPPOSED_MIN_ELEMENTS else None  # (bounds.py: chance, below)
        self.gates.setdefault(group_name, PushGate()).pushed(norm, trio.current_time(), judged)
        self._nursery.start_soon(self._push_all, group, partners, encoded, round)
        return len(partners) + 1

    def recipients(self, group: str) -> list[str]:
        """The partners a push of `group` goes to, and n - 1 for the factor outer_lr / n every push is added with:
        those holding the group, less the ones we banned (a liar we caught neither gets our updates nor dilutes
        everyone's share)."""
        return [p for p in self.holders(group) if self.ledger.banned(p) is None]

    async def _push_all(self, group: SharedTensors, partners: list[str], values: list[EncodedTensor],
                        round: int) -> None:
        try:
            async with trio.open_nursery() as n:
                for peer_id in partners:
                    n.start_soon(self._push_one, group, peer_id, values, round)
        finally:
            self.sending.discard(group.name)

    async def _push_one(self, group: SharedTensors, peer_id: str, values: list[Any], round: int) -> None:
        """Push to one partner; one that says TOO_SOON (its first round not done yet, or its rate bound) is
        asked again after RETRY_S, twice, all within the exchange deadline."""
        session = self.connected().get(peer_id)
        if session is None:
            return
        t0 = trio.current_time()
        try:
            with trio.fail_after(self.cfg.exchange_timeout):
                for attempt in range(PUSH_TRIES):
                    reply = await self._push_once(session, group, values, round)
                    if not (isinstance(reply, ErrorReply) and reply.refusal().code in TRY_LATER
                            and attempt + 1 < PUSH_TRIES):
                        break
                    await trio.sleep(RETRY_S * (attempt + 1))
            if isinstance(reply, ErrorReply):
                self.counts["not_taken"] += 1
                log.info("%s did not take our update of %s: %s", session.short, group.name, reply.refusal().reason)
                return
            if not isinstance(reply, UpdateTaken):
                raise ProtocolError(f"expected update_taken, got {type(reply).__name__}")
            nbytes = group.wire_nbytes(PUSH_CODEC)
            self.counts["sent"] += 1
            self.ledger.stats.bytes_sent += nbytes
            log.debug("pushed %s to %s in %.2f s (taken x%.3g)", group.name, session.short,
                      trio.current_time() - t0, reply.scale)
        except (trio.TooSlowError, SessionClosed, ProtocolError, TimeoutError) as exc:
            self.counts["failed"] += 1
            log.info("push of %s to %s failed: %s", group.name, session.short, exc or "deadline passed")
        except Exception:  # a bug in one push must not take the daemon down
            self.counts["failed"] += 1
            log.exception("push of %s to %s failed unexpectedly", group.name, session.short)

    async def _push_once(self, session, group: SharedTensors, values: list[Any], round: int):
        """One UpdatePush with its tensors: the partner's reply message."""
        ours = OutgoingGroup(session, group.specs)
        announced = trio.Event()
        replies: list = []

        async def ask() -> None:
            replies.append(await session.request(UpdatePush(group=group.name, streams=ours.streams, round=round),
                                                 timeout=self.cfg.exchange_timeout, sent=announced))

        await together(ask, lambda: ours.send(values, codec=PUSH_CODEC, after=announced))
        return replies[0].message

    # ---- theirs ---------------------------------------------------------------------------------------
    def _refusal(self, peer_id: str, push: UpdatePush, group: SharedTensors | None) -> Refusal | None:
        if group is None:
            return Refusal(Code.NO_GROUP, f"no group {push.group[:40]!r} here")
        if group.push_lr is None:
            return Refusal(Code.NOT_AVERAGED, f"group {push.group!r} takes no pushed updates here")
        if len(push.streams) != len(group.specs):
            return Refusal(Code.WRONG_SPECS, "wrong number of streams")
        if (refused := self.may_push(peer_id, push.group)) is not None:
            return refused
        gate = self.gates.setdefault(group.name, PushGate())
        if (refused := gate.refusal(peer_id, trio.current_time())) is not None:
            return refused
        if self.slots.full():
            return Refusal(Code.BUSY, "busy")
        return None

    async def on_push(self, session, env) -> None:
        """Checked before a byte of the update is held; read and added in our own nursery (a slow sender must
        not hold the session's other messages)."""
        push: UpdatePush = env.message
        group = self.groups.get(push.group)
        refusal = self._refusal(session.peer_id, push, group)
        theirs = IncomingGroup(session, push.streams, group.specs if group is not None else [],
                               as_torch=group is not None and group.is_torch)
        if refusal is not None:
            theirs.discard()
            self.counts["refused"] += 1
            await session.reply(env, ErrorReply.of(refusal))
            return
        assert group is not None and self._nursery is not None
        self.slots.take()
        self._nursery.start_soon(self._take, session, env, group, theirs)

    async def _take(self, session, env, group: SharedTensors, theirs: IncomingGroup) -> None:
        try:
            with trio.fail_after(self.cfg.exchange_timeout):
                values = await theirs.receive(timeout=self.cfg.exchange_timeout)
            gate = self.gates.setdefault(group.name, PushGate())
            norm = await trio.to_thread.run_sync(norms.sum_sq, values) ** 0.5
            cosine = None
            if gate.own_support is not None:
                cosine = gate.cosine(norm, await trio.to_thread.run_sync(norms.dot_on_support, values,
                                                                         gate.own_support))
            if cosine is not None:
                self.cosines.append(cosine)
            scale = gate.scale(norm, cosine)
            if (why := gate.evidence(norm, cosine) or gate.turned_away(session.peer_id, cosine)) is not None:
                self.ledger.struck(session.peer_id, why)
            if gate.opposed(cosine):
                self.counts["opposed"] += 1
            if scale < 1.0:
                self.counts["clipped"] += 1
                log.info("update of %s from %s clipped x%.3g (norm %.3g, ours %.3g)", group.name, session.short,
                         scale, norm, gate.own_norm or 0.0)
            n = len(self.recipients(group.name)) + 1
            assert group.push_lr is not None
            if scale > 0.0:
                await trio.to_thread.run_sync(group.add_scaled, group.push_lr / n * scale, values)
            self.counts["taken"] += 1
            self.ledger.stats.bytes_received += group.wire_nbytes(PUSH_CODEC)
            await session.reply(env, UpdateTaken(scale=scale))
        except (trio.TooSlowError, SessionClosed, ProtocolError, TimeoutError) as exc:
            self.counts["failed"] += 1
            log.info("update of %s from %s not taken: %s", group.name, session.short, exc or "deadline passed")
            theirs.discard()
        except Exception:
            self.counts["failed"] += 1
            log.exception("taking an update of %s from %s failed unexpectedly", group.name, session.short)
            theirs.discard()
        finally:
            self.slots.give_back()

    def status(self) -> dict:
        out: dict[str, Any] = dict(self.counts)
        finite = sorted(c for c in self.cosines if np.isfinite(c))
        if finite:  # how partners' pushes point against ours: honest ones at 0 or above
            out["cosine"] = {"min": round(finite[0], 3), "median": round(statistics.median(finite), 3)}
        return out

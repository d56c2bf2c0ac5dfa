"""The averaging engine: symmetric pairwise gossip exchanges of a trainer's tensors with neighbours.

GossipEngine is the daemon's averaging service: the groups a trainer shares and who may average each
(its partners), the trainer-facing calls, and the initiator's side of an exchange. It composes the rest,
each with its own state: the server's side (serving.py, `ExchangeServer`), joining peers' downloads
(download.py, `Downloads`), the weight budget and serving slots both sides share (budget.py, with the
rules that keep every update convex), the ledger of counters and bans (ledger.py), and our partners'
distances that set each exchange's clip radius (radius.py). What an exchange is and what each of its
endings owes is exchange.py (with why it keeps the swarm-wide sum), which weight it carries weights.py,
the tensors and the update shared.py, how far an update may move us bounds.py and norms.py, and what both
sides do once it is decided settle.py. Tensors travel as tensor groups (peer/session/groups.py).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from peer.averaging.bans import BanList
from peer.averaging.bounds import hold_seconds, valid_radius
from peer.averaging.budget import ServingSlots, WeightBudget
from peer.averaging.download import Downloads, Fetched
from peer.averaging.exchange import Event, Exchange, Role, State
from peer.averaging.ledger import GossipStats, Ledger
from peer.averaging.pushes import UpdatePushes
from peer.averaging.radius import NO_DEFENCE_ENV, Radii
from peer.averaging.serving import ExchangeServer
from peer.averaging.settle import apply_committed, keep_residual, our_radius, wire_radius
from peer.averaging.shared import SharedTensors
from peer.averaging.weights import rule_cap
from peer.concurrency import together
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.services import RecordFields
from peer.session.transport import SessionClosed
from peertrain.swarm import AVERAGE_MODES, ExchangeResult
from protocol.errors import ProtocolError
from protocol.refusal import Code, Refusal
from protocol.schema.gossip import (
    AverageAbort, AverageAccept, AverageCommit, AverageOffer, AverageReject, ParamsRequest, UpdatePush)

if TYPE_CHECKING:
    from peer.services import DaemonContext
    from peer.topology.service import TopologyService

log = logging.getLogger("peertrain.gossip")


class GossipEngine:
    name = "gossip"

    def __init__(self, daemon: DaemonContext, topology: TopologyService):
        self.daemon = daemon
        self.cfg = daemon.config.gossip
        self.me = daemon.peer_id
        self.topology = topology
        self.membership = daemon.membership
        self.groups: dict[str, SharedTensors] = {}
        self._partners: dict[str, Callable[[], set[str]]] = {}  # group -> who may average it (register)
        self.budget = WeightBudget(self.me)
        self.ledger = Ledger()
        # the clip radius and its evidence; off only for `peer bench average --no-defence`, on every daemon of
        # its swarm (one side without it would apply unclipped what the other clips: the sum would change)
        self.radii: Radii | None = Radii(max_ratio=self.cfg.max_update_ratio, byzantine_share=self.cfg.byzantine_share)
        if os.environ.get(NO_DEFENCE_ENV) == "1":
            log.warning("%s=1: averaging never clips and judges no partner (a benchmark's switch, not for a swarm "
                        "that may hold a lying peer)", NO_DEFENCE_ENV)
            self.radii = None
        slots = ServingSlots(self.cfg.max_concurrent_exchanges)
        self.server = ExchangeServer(self.cfg, groups=self.groups, budget=self.budget, slots=slots,
                                     ledger=self.ledger, may_average=self.role_refusal, links=topology,
                                     radii=self.radii)
        self.downloads = Downloads(self.cfg, groups=self.groups, slots=slots, ledger=self.ledger,
                                   may_download=self.role_refusal, holders=self.holders,
                                   connected=self.membership.connected)
        self.pushes = UpdatePushes(self.cfg, groups=self.groups, slots=slots, ledger=self.ledger,
                                   may_push=self.role_refusal, holders=self.holders,
                                   connected=self.membership.connected)
        self._nursery: trio.Nursery | None = None
        self._background: set[str] = set()  # groups with a background round running (start_average)
        self._shard_bytes: int | None = None  # the largest group's bytes when one was last shared
        r = daemon.router
        r.register(AverageOffer, self.server.on_offer)
        r.register(AverageCommit, self.server.on_commit)
        r.register(AverageAbort, self.server.on_abort)
        r.register(ParamsRequest, self.downloads.on_request)
        r.register(UpdatePush, self.pushes.on_push)

    def record_fields(self) -> RecordFields:
        """HasRecordFields: our record lists the groups we share, and the rewiring plans with their size."""
        return RecordFields(groups=sorted(self.groups), shard_bytes=self._shard_bytes)

    @property
    def stats(self) -> GossipStats:
        return self.ledger.stats

    @property
    def bans(self) -> BanList:
        return self.ledger.bans

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n  # owns the background rounds (start_average)
            await n.start(self.server.run)
            await n.start(self.downloads.run)
            await n.start(self.pushes.run)
            task_status.started()
            await trio.sleep_forever()

    def register(self, group: SharedTensors, partners: Callable[[], set[str]] | None = None) -> None:
        """Share `group`. `partners` says who may average it with us (the peers that hold the same group,
        say those serving one pipeline stage); by default, our topology neighbours."""
        self.groups[group.name] = group
        if partners is None:
            self._partners.pop(group.name, None)
        else:
            self._partners[group.name] = partners
        self._shard_bytes = max((g.nbytes for g in self.groups.values()), default=self._shard_bytes)
        self.topology.announce_soon()

    def unregister(self, name: str) -> None:
        """Stop sharing group `name` (a peer that moved to another pipeline stage): later offers for it are
        refused as for any group we do not hold; an exchange already under way finishes on its own tensors."""
        self.groups.pop(name, None)
        self._partners.pop(name, None)
        if self.radii is not None:
            self.radii.forget(name)
        self.pushes.forget(name)
        self.topology.announce_soon()

    # ---- the trainer-facing calls -------------------------------------------------------------------
    async def average(self, group: str, *, mode: str = "one") -> list[ExchangeResult]:
        """`one`: with one random neighbour, pairwise weight (AD-PSGD); `all`: with every neighbour at
        once, Metropolis-Hastings weights (D-PSGD)."""
        if mode not in AVERAGE_MODES:
            raise ValueError(f"unknown averaging mode {mode!r} (choose 'one' or 'all')")
        nbrs = [p for p in self.holders(group) if p not in self.budget.initiating and self.ledger.banned(p) is None
                and self._over_share(group, p) is None]
        g = self.groups.get(group)
        if not nbrs or g is None or not g.averaged:  # (unshared meanwhile, or download only)
            return []
        targets = [random.choice(nbrs)] if mode == "one" else nbrs
        rule = "pairwise" if mode == "one" else "metropolis"
        results: list[ExchangeResult] = []
        async with trio.open_nursery() as n:
            for p in targets:
                n.start_soon(self._collect, results, p, group, rule)
        return results

    def start_average(self, group: str, mode: str = "one") -> bool:
        """Start a round of `average` in the background (AD-PSGD: the trainer keeps computing). False while
        the previous round of that group still runs (one at a time per group), or if it is not shared."""
        if group in self._background or group not in self.groups or self._nursery is None:
            return False
        self._background.add(group)

        async def go() -> None:
            try:
                await self.average(group, mode=mode)
            finally:
                self._background.discard(group)

        self._nursery.start_soon(go)
        return True

    def averaging(self, group: str) -> bool:
        """Is a background round of `group` running?"""
        return group in self._background

    async def _collect(self, out: list, peer_id: str, group: str, rule: str) -> None:
        try:
            out.append(await self.exchange(peer_id, group, rule=rule))
        except Exception as exc:  # a bug in one exchange must not take the daemon (and its trainer) down
            log.exception("exchange with %s failed unexpectedly", peer_id[:8])
            self.ledger.stats.failed += 1
            out.append(ExchangeResult(peer_id, False, f"internal error: {type(exc).__name__}: {exc}"))

    async def fetch_from_partners(self, group: str, min_step: int = 0) -> Fetched | None:
        """A joining peer's download of `group` from a partner at `min_step` or later: (values, their step), or
        None (download.py)."""
        return await self.downloads.fetch_from_partners(group, min_step)

    async def exchange(self, peer_id: str, group_name: str, *, rule: str = "pairwise") -> ExchangeResult:
        """One symmetric exchange with `peer_id`, initiated by us, bounded by the configured deadline."""
        group = self.groups.get(group_name)
        if group is None:
            return ExchangeResult(peer_id, False, f"group {group_name!r} is not shared (any more)", code=Code.NO_GROUP)
        cap = rule_cap(rule, self.topology.degree)
        session = self.membership.connected().get(peer_id)
        if session is None or peer_id not in self.partners(group_name):
            return ExchangeResult(peer_id, False, "not a connected partner for this group", code=Code.NOT_NEIGHBOUR)
        banned = self.ledger.banned(peer_id)
        if banned is not None:
            return ExchangeResult(peer_id, False, banned, code=Code.BANNED)
        if self.budget.busy_with(peer_id):
            return ExchangeResult(peer_id, False, "exchange with this peer already in flight", code=Code.BUSY)
        if (over := self._over_share(group_name, peer_id)) is not None:
            return ExchangeResult(peer_id, False, over, code=Code.BUSY)
        max_weight = self.budget.offerable(cap)
        if max_weight is None:
            return ExchangeResult(peer_id, False, "too much weight in flight", code=Code.BUSY)
        self.budget.initiating[peer_id] = max_weight  # set aside now: exchanges we serve meanwhile cannot take it
        x = Exchange(Role.INITIATOR)
        t0 = trio.current_time()
        own: list[Any] | None = None
        theirs: IncomingGroup | None = None
        offer_rid = 0
        w = 0.0
        codec = group.codec or self.cfg.codec  # the exchange's: named in the offer, the server replies in it
        carried = committed = False  # error feedback: our residual rides on this exchange / it committed
        try:  # from the reservation on: whatever happens, the finally below gives it back
            own = await trio.to_thread.run_sync(group.snapshot)
            carried = await trio.to_thread.run_sync(group.add_residual, own, codec)
            sent = await trio.to_thread.run_sync(group.as_sent, own, codec)
            radius = await our_radius(self.radii, group, peer_id, sent)
            if peer_id in self.budget.serving:  # their offer won a collision while we took the snapshot
                x.handle(Event.FAIL, "lost a collision")
                return ExchangeResult(peer_id, False, "exchange with this peer already in flight", code=Code.BUSY)
            ours = OutgoingGroup(session, group.specs)
            offer = AverageOffer(group=group_name, tensors=group.specs, streams=ours.streams, max_weight=max_weight,
                                 rule=rule, codec=codec, step=group.step, radius=wire_radius(radius))
            with trio.fail_after(hold_seconds(group.nbytes, self.cfg.exchange_timeout)):
                replies: list = []
                offer_rid = session.new_request_id()
                x.handle(Event.OFFER)
                announced = trio.Event()  # our tensors follow the offer on the wire (peer/session/groups.py)

                async def ask() -> None:
                    nonlocal theirs
                    env = await session.request(offer, timeout=self.cfg.exchange_timeout, rid=offer_rid, sent=announced)
                    if isinstance(env.message, AverageAccept):  # expect their tensors at once: they are coming
                        theirs = IncomingGroup(session, env.message.streams, group.specs, as_torch=group.is_torch)
                    replies.append(env)

                await together(ask, lambda: ours.send(own, codec=codec, after=announced))
                env = replies[0]
                reply = env.message
                if isinstance(reply, AverageReject):
                    refusal = reply.refusal()
                    x.handle(Event.REFUSE)
                    self.ledger.stats.rejected += 1
                    return ExchangeResult(peer_id, False, f"refused: {refusal.reason}", code=refusal.code)
                if not isinstance(reply, AverageAccept):
                    raise ProtocolError(f"expected avg_accept, got {type(reply).__name__}")
                x.handle(Event.ACCEPT)
                if len(reply.streams) != len(own) or not 0.0 < reply.weight <= max_weight:
                    raise ProtocolError(f"inconsistent accept (weight {reply.weight}, offered at most {max_weight})")
                if not valid_radius(reply.radius):
                    raise ProtocolError(f"inconsistent accept (radius {reply.radius}: an older peer, or none)")
                w = reply.weight
                self.budget.initiating[peer_id] = w  # the rest of what we set aside is free again
                others = await theirs.receive(timeout=self.cfg.exchange_timeout)
                x.handle(Event.RECEIVED)
                # Shielded: a commit cut off mid-write would still reach them ahead of any later frame (its
                # sealed tail is kept, see Session._write) and they would apply while we did not.
                with trio.CancelScope(shield=True):
                    await session.send_message(AverageCommit(exchange=env.reply_to))
                x.handle(Event.COMMIT)
                committed = True
            # committed: the server applies, so we must too (the sum)
            await apply_committed(group, w, others, sent, peer_id=peer_id, radius=radius, theirs=reply.radius,
                                  radii=self.radii, ledger=self.ledger)
        except (trio.TooSlowError, SessionClosed, ProtocolError, TimeoutError) as exc:
            # (TimeoutError: the group's lock, held past its bound by an attached process, before the offer)
            reason = "deadline passed" if isinstance(exc, trio.TooSlowError) else str(exc)
            x.end(reason)
            if isinstance(exc, ProtocolError):
                log.warning("exchange with %s failed: %s", session.short, exc)
            self.ledger.failed(session.short, reason)
            return ExchangeResult(peer_id, False, reason)
        finally:
            # Also when we give up before their reply: they may have accepted and be waiting for our tensor
            # (cut short, it is called off: see OutgoingGroup.send) or for our verdict. An abort for an
            # offer they never saw is ignored.
            owed = x.end("cancelled")
            if owed.send_abort:
                await session.send_best_effort(AverageAbort(exchange=offer_rid, reason=x.reason))
            self.budget.initiating.pop(peer_id, None)
            if carried:
                await keep_residual(group, own, sent if committed else None)
            # (their tensors are expected from the accept on, also when we failed before handling it)
            if theirs is not None and (owed.discard_incoming or x.state is State.FAILED):
                theirs.discard()
            if own is not None:
                group.release(own)  # sent, and applied or abandoned: nothing reads it anymore
        seconds = trio.current_time() - t0
        nbytes = group.wire_nbytes(codec)  # each way: the server sends in the offer's codec too
        self.topology.record_transfer(peer_id, nbytes, seconds)
        self.ledger.completed(peer_id, seconds, sent=nbytes, received=nbytes)
        return ExchangeResult(peer_id, True, weight=w, seconds=seconds, bytes_sent=nbytes)

    # ---- partners -----------------------------------------------------------------------------------
    def partners(self, group: str) -> list[str]:
        """Who may average `group` with us or download it: its partners (register), else our neighbours."""
        fn = self._partners.get(group)
        return sorted(self.topology.neighbours if fn is None else fn() - {self.me})

    def peers_holding(self, group: str) -> list[str]:
        """Connected peers whose record says they share `group` (their trainer is up): who a peer waits for
        before its first step, so that peers started together train together."""
        return sorted(p for p in self.membership.connected() if self.topology.holds(p, group))

    def holders(self, group: str) -> list[str]:
        """The partners worth asking to average or download `group`: those whose record does not say they lack
        it (they would refuse); one we have no record of yet is asked."""
        return [p for p in self.partners(group) if self.topology.holds(p, group) is not False]

    def _over_share(self, group: str, peer_id: str) -> str | None:
        """Why `peer_id` has moved our `group` past its share lately (shares.py), or None."""
        return None if self.radii is None else self.radii.shares.over(group, peer_id, trio.current_time())

    def role_refusal(self, peer_id: str, group: str) -> Refusal | None:
        """Who may average `group` with us or download it: a current partner for it (a neighbour, unless the
        group names its partners) that is not banned. Why not, or None."""
        if peer_id not in self.partners(group):
            return Refusal(Code.NOT_NEIGHBOUR, "only neighbours (for a stage's group: peers of that stage) "
                           "average with us or download our tensors")
        if (banned := self.ledger.banned(peer_id)) is not None:
            return Refusal(Code.BANNED, banned)
        return None

    def commands(self) -> dict:
        async def group_stats(args: dict) -> dict:
            want_values = bool(args.get("values"))
            out = {}
            for g in list(self.groups.values()):
                if want_values and g.nbytes > (64 << 20):
                    raise ValueError(f"group {g.name} is too large to return its values")
                out[g.name] = await trio.to_thread.run_sync(lambda g=g: g.stats(values=want_values))
            return out
        return {"group_stats": group_stats}

    def exchange_counts(self) -> dict[str, Any]:
        """What a training job sees of its exchanges (Swarm.exchanges): initiated, served, failed, the last error."""
        st = self.stats
        return {"initiated": st.exchanges - st.served, "served": st.served, "failed": st.failed,
                "last_error": st.last_error}

    def status(self) -> dict:
        return {"groups": {g.name: {"tensors": len(g.specs), "bytes": g.nbytes, "own_reach": g.reach.status()}
                           for g in self.groups.values()},
                **self.ledger.status(), "inflight": self.budget.in_flight(), "pushes": self.pushes.status(),
                "defence": self.radii is not None}  # False only under a benchmark's switch (radius.py)

    def ban_list(self) -> list[dict]:
        """Bans in force for `peer status`: peer, until (unix time), reason."""
        return self.ledger.ban_list()

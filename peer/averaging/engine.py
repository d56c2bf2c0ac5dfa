"""The averaging engine: symmetric pairwise gossip exchanges of a trainer's tensors with neighbours.

The modules beside it hold the pieces: what an exchange is and what each of its endings owes
(exchange.py, with why it keeps the swarm-wide sum), which weight it carries (weights.py), the tensors a
trainer shares and the exchange's update (shared.py). This module does the initiator's I/O of an
exchange, over tensor groups (peer/session/groups.py), and keeps each peer's budget of weight in flight;
the server's side is in serving.py and a joining peer's download in download.py (GossipEngine inherits both).

Convexity under concurrency: a peer runs at most one exchange per neighbour at a time (when both
initiate at once, the smaller peer ID's offer wins) and never lets the weights of exchanges in flight add
up to more than 1, so each update stays a convex combination even with many exchanges at once. An
initiator sets its weight aside before it offers, so exchanges it serves meanwhile cannot take it; a
server may accept with less than offered (down to a quarter of the rule's weight) rather than refuse.
When both ends initiate at once, the winner's offer is served with the loser's own reservation: the
loser's offer is refused or never sent, so no weight is counted twice, and D-PSGD rounds, where every
peer initiates with every neighbour at once, do not starve each other's budgets.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import trio

from peer.averaging.bans import BanList
from peer.averaging.bounds import hold_seconds
from peer.averaging.download import ParamsDownload
from peer.averaging.exchange import Event, Exchange, Role, State
from peer.averaging.serving import ExchangeServing, ServedExchange
from peer.averaging.shared import SharedTensors
from peer.averaging.weights import MIN_WEIGHT_SHARE, rule_cap
from peer.concurrency import together
from peer.metrics.histogram import Histogram
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError
from protocol.schema.gossip import (
    AverageAbort, AverageAccept, AverageCommit, AverageOffer, AverageReject, ParamsRequest)

log = logging.getLogger("peertrain.gossip")


@dataclass
class ExchangeResult:
    peer_id: str
    ok: bool
    reason: str = ""
    weight: float = 0.0
    seconds: float = 0.0
    bytes_sent: int = 0


# Upper bounds, in seconds, of the exchange-duration histogram (`peer status`, Prometheus): from a small
# vector on loopback (a few ms) to [gossip] exchange_timeout's default (30 s), about x2-2.5 a step, so an
# exchange that takes twice as long lands a bucket higher; slower ones count in +Inf only.
EXCHANGE_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class GossipStats:
    exchanges: int = 0
    served: int = 0
    failed: int = 0
    rejected: int = 0
    bytes_sent: int = 0
    last_seconds: float = 0.0
    last_error: str = ""
    recent: list = field(default_factory=list)  # seconds of the last exchanges
    clipped: dict = field(default_factory=dict)  # peer -> exchanges whose update was clipped (bounds.py)
    lapsed: dict = field(default_factory=dict)  # peer -> exchanges it let lapse or aborted after we accepted
    params_refused: int = 0  # parameter requests refused (not a neighbour, banned, no such group)
    by_peer: dict = field(default_factory=dict)  # peer -> PeerExchanges (peers we averaged with: bounded by membership)
    durations: Histogram = field(default_factory=lambda: Histogram(EXCHANGE_SECONDS_BUCKETS))  # completed ones


@dataclass
class PeerExchanges:
    """Exchanges with one peer, for `peer status` and `peer bench nat` (which link paths carry averaging)."""

    exchanges: int = 0
    bytes: int = 0  # sent (as many arrive: exchanges are symmetric)
    first_at: float = 0.0  # wall clock of the first one
    last_s: float = 0.0


class GossipEngine(ExchangeServing, ParamsDownload):
    name = "gossip"

    def __init__(self, daemon, topology):
        self.daemon = daemon
        self.cfg = daemon.config.gossip
        self.me = daemon.peer_id
        self.topology = topology
        self.membership = daemon.membership
        self.groups: dict[str, SharedTensors] = {}
        self._partners: dict[str, Callable[[], set[str]]] = {}  # group -> who may average it (register)
        self.inflight: dict[str, float] = {}  # peer -> weight of the exchange we serve for it
        self.initiating: dict[str, float] = {}  # peer -> weight set aside for the exchange we initiated
        self.served: dict[tuple[str, int], ServedExchange] = {}  # (peer, offer rid) -> exchange we serve
        self.stats = GossipStats()
        self.bans = BanList()
        self._nursery: trio.Nursery | None = None
        self._serving = 0
        self._background: set[str] = set()  # groups with a background round running (start_average)
        topology.announce_groups = lambda: sorted(self.groups)  # our record lists what we share
        r = daemon.router
        r.register(AverageOffer, self._on_offer)
        r.register(AverageCommit, self._on_commit)
        r.register(AverageAbort, self._on_abort)
        r.register(ParamsRequest, self._on_params_request)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
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
        self.topology.shard_bytes = max((g.nbytes for g in self.groups.values()), default=self.topology.shard_bytes)
        self.topology.announce_soon()

    def unregister(self, name: str) -> None:
        """Stop sharing group `name` (a peer that moved to another pipeline stage): later offers for it are
        refused as for any group we do not hold; an exchange already under way finishes on its own tensors."""
        self.groups.pop(name, None)
        self._partners.pop(name, None)
        self.topology.announce_soon()

    # ---- the trainer-facing calls -------------------------------------------------------------------
    async def average(self, group: str, *, mode: str = "one") -> list[ExchangeResult]:
        """`one`: with one random neighbour, pairwise weight (AD-PSGD); `all`: with every neighbour at
        once, Metropolis-Hastings weights (D-PSGD)."""
        if mode not in ("one", "all"):
            raise ValueError(f"unknown averaging mode {mode!r} (choose 'one' or 'all')")
        now = trio.current_time()
        nbrs = [p for p in self.holders(group) if p not in self.initiating and self.bans.banned(p, now) is None]
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
            self.stats.failed += 1
            out.append(ExchangeResult(peer_id, False, f"internal error: {type(exc).__name__}: {exc}"))

    def _room(self) -> float:
        """Weight still free in our budget: all exchanges in flight, served or initiated, add up to <= 1."""
        return 1.0 - sum(self.inflight.values()) - sum(self.initiating.values())

    async def exchange(self, peer_id: str, group_name: str, *, rule: str = "pairwise") -> ExchangeResult:
        """One symmetric exchange with `peer_id`, initiated by us, bounded by the configured deadline."""
        group = self.groups.get(group_name)
        if group is None:
            return ExchangeResult(peer_id, False, f"group {group_name!r} is not shared (any more)")
        cap = rule_cap(rule, self.topology.degree)
        session = self.membership.connected().get(peer_id)
        if session is None or peer_id not in self.partners(group_name):
            return ExchangeResult(peer_id, False, "not a connected partner for this group")
        banned = self.bans.banned(peer_id, trio.current_time())
        if banned is not None:
            return ExchangeResult(peer_id, False, banned)
        if peer_id in self.inflight or peer_id in self.initiating:
            return ExchangeResult(peer_id, False, "exchange with this peer already in flight")
        max_weight = min(cap, self._room())
        if max_weight < MIN_WEIGHT_SHARE * cap - 1e-12:
            return ExchangeResult(peer_id, False, "too much weight in flight")
        self.initiating[peer_id] = max_weight  # set aside now: exchanges we serve meanwhile cannot take it
        x = Exchange(Role.INITIATOR)
        t0 = trio.current_time()
        own: list[Any] | None = None
        theirs: IncomingGroup | None = None
        offer_rid = 0
        w = 0.0
        codec = group.codec or self.cfg.codec
        carried = committed = False  # error feedback: our residual rides on this exchange / it committed
        try:  # from the reservation on: whatever happens, the finally below gives it back
            own = await trio.to_thread.run_sync(group.snapshot)
            carried = await trio.to_thread.run_sync(group.add_residual, own, codec)
            sent = await trio.to_thread.run_sync(group.as_sent, own, codec)
            if peer_id in self.inflight:  # their offer won a collision while we took the snapshot
                x.handle(Event.FAIL, "lost a collision")
                return ExchangeResult(peer_id, False, "exchange with this peer already in flight")
            ours = OutgoingGroup(session, group.specs)
            offer = AverageOffer(group=group_name, tensors=group.specs, streams=ours.streams, max_weight=max_weight,
                                 rule=rule, codec=codec, step=group.step)
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
                    x.handle(Event.REFUSE)
                    self.stats.rejected += 1
                    return ExchangeResult(peer_id, False, f"refused: {reply.reason}")
                if not isinstance(reply, AverageAccept):
                    raise ProtocolError(f"expected avg_accept, got {type(reply).__name__}")
                x.handle(Event.ACCEPT)
                if len(reply.streams) != len(own) or not 0.0 < reply.weight <= max_weight:
                    raise ProtocolError(f"inconsistent accept (weight {reply.weight}, offered at most {max_weight})")
                w = reply.weight
                self.initiating[peer_id] = w  # the rest of what we set aside is free again
                others = await theirs.receive(timeout=self.cfg.exchange_timeout)
                x.handle(Event.RECEIVED)
                # Shielded: a commit cut off mid-write would still reach them ahead of any later frame (its
                # sealed tail is kept, see Session._write) and they would apply while we did not.
                with trio.CancelScope(shield=True):
                    await session.send_message(AverageCommit(exchange=env.reply_to))
                x.handle(Event.COMMIT)
                committed = True
            with trio.CancelScope(shield=True):  # committed: the server applies, so we must too (the sum)
                scale = await trio.to_thread.run_sync(
                    lambda: group.apply(w, others, sent, max_ratio=self.cfg.max_update_ratio))
            self._check_scale(peer_id, scale)
            group.release(others)  # the received copies become later snapshots' buffers
        except (trio.TooSlowError, SessionClosed, ProtocolError) as exc:
            reason = "deadline passed" if isinstance(exc, trio.TooSlowError) else str(exc)
            x.end(reason)
            if isinstance(exc, ProtocolError):
                log.warning("exchange with %s failed: %s", session.short, exc)
            self.stats.failed += 1
            self.stats.last_error = f"{session.short}: {reason}"
            return ExchangeResult(peer_id, False, reason)
        finally:
            # Also when we give up before their reply: they may have accepted and be waiting for our tensor
            # (cut short, it is called off: see OutgoingGroup.send) or for our verdict. An abort for an
            # offer they never saw is ignored.
            owed = x.end("cancelled")
            if owed.send_abort:
                await session.send_best_effort(AverageAbort(exchange=offer_rid, reason=x.reason))
            self.initiating.pop(peer_id, None)
            if carried:
                await self._keep_residual(group, own, sent if committed else None)
            # (their tensors are expected from the accept on, also when we failed before handling it)
            if theirs is not None and (owed.discard_incoming or x.state is State.FAILED):
                theirs.discard()
            if own is not None:
                group.release(own)  # sent, and applied or abandoned: nothing reads it anymore
        seconds = trio.current_time() - t0
        sent_bytes = group.wire_nbytes(codec)
        self.topology.record_transfer(peer_id, sent_bytes, seconds)
        self._count(seconds, sent_bytes, peer_id)
        return ExchangeResult(peer_id, True, weight=w, seconds=seconds, bytes_sent=sent_bytes)

    def _count(self, seconds: float, nbytes: int, peer_id: str) -> None:
        self.stats.exchanges += 1
        self.stats.bytes_sent += nbytes
        self.stats.last_seconds = seconds
        self.stats.recent = (self.stats.recent + [round(seconds, 4)])[-20:]
        self.stats.durations.observe(seconds)
        p = self.stats.by_peer.get(peer_id)
        if p is None:
            p = self.stats.by_peer[peer_id] = PeerExchanges(first_at=time.time())
        p.exchanges += 1
        p.bytes += nbytes
        p.last_s = round(seconds, 4)

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

    def _role_refusal(self, peer_id: str, group: str) -> tuple[str, str] | None:
        """Who may average `group` with us or download it: a current partner for it (a neighbour, unless the
        group names its partners) that is not banned. The refusal's code (an ErrorReply's) and reason, or None."""
        if peer_id not in self.partners(group):
            return "not_neighbour", "only neighbours (for a stage's group: peers of that stage) average with us or download our tensors"
        if (banned := self.bans.banned(peer_id, trio.current_time())) is not None:
            return "banned", banned
        return None

    # ---- what both sides settle: the residual, lapses, clipped updates, strikes ---------------------
    @staticmethod
    async def _keep_residual(group: SharedTensors, own: list[Any], sent: list[Any] | None) -> None:
        """Settle an exchange's error-feedback reservation, in a worker thread (a pass over the whole group),
        shielded: a reservation left unsettled would keep every later exchange from carrying the residual."""
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(group.keep_residual, own, sent)

    def _lapsed(self, peer_id: str, reason: str) -> None:
        """An exchange we accepted held our weight for nothing: count it, and ban a peer that keeps doing it."""
        self.stats.lapsed[peer_id] = self.stats.lapsed.get(peer_id, 0) + 1
        self._strike(peer_id, reason)

    def _check_scale(self, peer_id: str, scale: float) -> None:
        """An update that had to be clipped (both sides clipped it alike) is logged, counted and struck."""
        if scale >= 1.0:
            return
        self.stats.clipped[peer_id] = self.stats.clipped.get(peer_id, 0) + 1
        log.warning("update from %s clipped to %.3g of its size (past max_update_ratio %g)",
                    peer_id[:8], scale, self.cfg.max_update_ratio)
        self._strike(peer_id, "sent an update past max_update_ratio")

    def _strike(self, peer_id: str, reason: str) -> None:
        if self.bans.strike(peer_id, reason, trio.current_time()):
            log.warning("banned %s from averaging with us: %s", peer_id[:8], self.bans.banned(peer_id, trio.current_time()))

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

    def status(self) -> dict:
        s = self.stats
        return {"groups": {g.name: {"tensors": len(g.specs), "bytes": g.nbytes} for g in self.groups.values()},
                "exchanges": s.exchanges, "served": s.served, "failed": s.failed, "rejected": s.rejected,
                "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_sent,  # symmetric exchanges: as many in as out
                "last_exchange_s": round(s.last_seconds, 4), "recent_s": s.recent, "last_error": s.last_error,
                "exchange_seconds": s.durations.as_dict(),  # completed exchanges, both roles (histogram)
                "inflight": len(self.inflight.keys() | self.initiating.keys()),
                "clipped": dict(s.clipped), "lapsed": dict(s.lapsed), "params_refused": s.params_refused,
                "bans": self.ban_list(),
                "by_peer": {pid: dataclasses.asdict(p) for pid, p in s.by_peer.items()}}

    def ban_list(self) -> list[dict]:
        """Bans in force for `peer status`: peer, until (unix time), reason."""
        wall, now = time.time(), trio.current_time()
        return [{"peer": p, "until": round(wall + left, 1), "reason": reason}
                for p, left, reason in self.bans.active(now)]

"""Serving exchanges that partners offer: checking an offer, accepting it with the weight we can spare,
sending our tensors, and applying once the initiator commits (or dropping it on their abort or a lapse).

The server's half of an exchange (its initiating half is GossipEngine.exchange, peer/averaging/engine.py;
the steps both follow are peer/averaging/exchange.py). `ExchangeServer` holds the exchanges it serves and
is given what it reads of the rest of the engine: the groups, the weight budget and the serving slots it
shares with the initiator and downloads, the ledger, who may average with us, and the links' degree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from peer.averaging.bounds import COMMIT_SLACK_S, hold_seconds, valid_radius
from peer.averaging.budget import ServingSlots, WeightBudget
from peer.averaging.exchange import Event, Exchange, Role, State
from peer.averaging.ledger import Ledger
from peer.averaging.radius import Radii
from peer.averaging.settle import apply_committed, keep_residual, our_radius, wire_radius
from peer.averaging.shared import SharedTensors
from peer.averaging.weights import WEIGHT_RULES, rule_cap
from peer.concurrency import together
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError
from protocol.refusal import Code, Refusal
from protocol.schema.gossip import AverageAccept, AverageOffer, AverageReject
from protocol.tensor_codec import DENSE_CODECS

log = logging.getLogger("peertrain.gossip")

class Links(Protocol):
    """What an exchange reads of the topology: our degree (the Metropolis rule's cap) and where to report a
    transfer's bytes and seconds (the link measurements rewiring uses)."""

    @property
    def degree(self) -> int: ...

    def record_transfer(self, peer_id: str, nbytes: int, seconds: float) -> None: ...


@dataclass
class ServedExchange:
    """An exchange we accepted and serve: where it stands, the initiator's tensors, and its verdict."""

    exchange: Exchange
    theirs: IncomingGroup
    decided: trio.Event = field(default_factory=trio.Event)  # set by the commit or the abort
    abort_reason: str | None = None


class ExchangeServer:
    """The exchanges partners offer us, from the offer to the apply; `served` holds those under way."""

    def __init__(self, cfg, *, groups: Mapping[str, SharedTensors], budget: WeightBudget, slots: ServingSlots,
                 ledger: Ledger, may_average: Callable[[str, str], Refusal | None], links: Links,
                 radii: Radii | None):
        self.cfg = cfg  # [gossip]: exchange_timeout
        self.groups = groups
        self.budget = budget
        self.slots = slots
        self.ledger = ledger
        self.may_average = may_average  # (peer, group) -> why that peer may not average it with us, or None
        self.links = links
        self.radii = radii  # our partners' distances and the radius they set (None: the bench's switch, no clip)
        self.served: dict[tuple[str, int], ServedExchange] = {}  # (peer, offer rid) -> exchange we serve
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the exchanges we serve (each outlives the offer's dispatch)."""
        async with trio.open_nursery() as n:
            self._nursery = n
            task_status.started()
            await trio.sleep_forever()

    def _refusal(self, peer_id: str, offer: AverageOffer) -> Refusal | None:
        """Why we do not serve this offer at all, before any weight is looked at; None if we may."""
        group = self.groups.get(offer.group)
        if group is None:
            return Refusal(Code.NO_GROUP, f"no group {offer.group!r} here")
        if not group.averaged:
            return Refusal(Code.NOT_AVERAGED,
                           f"group {offer.group!r} is not averaged here (only downloaded by joining peers)")
        if [(s.name, s.dtype, list(s.shape)) for s in offer.tensors] != [(s.name, s.dtype, list(s.shape)) for s in group.specs]:
            return Refusal(Code.WRONG_SPECS, "tensor specs differ from ours")
        if len(offer.streams) != len(group.specs):
            return Refusal(Code.WRONG_SPECS, "wrong number of streams")
        if offer.rule not in WEIGHT_RULES:
            return Refusal(Code.BAD_RULE, f"unknown weight rule {offer.rule[:40]!r}")
        if not 0.0 < offer.max_weight <= 0.5:
            return Refusal(Code.BAD_WEIGHT, f"impossible weight {offer.max_weight}")
        if offer.codec not in DENSE_CODECS:
            return Refusal(Code.BAD_CODEC, f"unknown codec {offer.codec[:40]!r}")
        if not valid_radius(offer.radius):
            return Refusal(Code.BAD_RADIUS, f"no radius or an impossible one ({offer.radius}): a peer older "
                           "than averaging protocol 3, whose clip we cannot match")
        if (refused := self.may_average(peer_id, offer.group)) is not None:
            return refused
        if self.radii is not None and (over := self.radii.shares.over(offer.group, peer_id, trio.current_time())):
            return Refusal(Code.BUSY, over)  # no strike: an honest neighbour of low degree may get here too
        if self.budget.loses_collision(peer_id):
            return Refusal(Code.BUSY, "exchange already in flight")  # on collision the smaller peer ID's offer wins
        if self.slots.full():
            return Refusal(Code.BUSY, "busy")
        return None

    async def on_offer(self, session, env) -> None:
        offer: AverageOffer = env.message
        peer_id = session.peer_id
        group = self.groups.get(offer.group)
        refusal = self._refusal(peer_id, offer)
        w = None
        if refusal is None:
            # If we also initiated with this peer, their offer won the collision and ours will be refused
            # (it reaches them while they still initiate, since our reply follows it on the session), and
            # we never send it if it is not out yet: its reservation is ours to serve them with.
            w = self.budget.acceptable(peer_id, offer.max_weight, rule_cap(offer.rule, self.links.degree))
            if w is None:
                refusal = Refusal(Code.BUSY, "too much weight in flight")
        x = Exchange(Role.SERVER)
        theirs = IncomingGroup(session, offer.streams, group.specs if group is not None else [],
                               as_torch=group is not None and group.is_torch)
        if refusal is not None:
            x.handle(Event.REFUSE, refusal.reason)
            if x.cleanup.discard_incoming:
                theirs.discard()  # their tensors follow the offer: drop them as they come
            self.ledger.stats.rejected += 1
            await session.reply(env, AverageReject.of(refusal))
            return
        assert group is not None and w is not None and self._nursery is not None
        self.budget.serving[peer_id] = w
        self.slots.take()
        key = (peer_id, env.rid)
        self.served[key] = ServedExchange(x, theirs)
        self._nursery.start_soon(self._serve, session, env, group, w, offer.codec, offer.radius, key)

    async def _serve(self, session, env, group: SharedTensors, w: float, codec: str, their_radius: float,
                     key) -> None:
        """Accept, trade tensors in the offer's `codec`, wait for the verdict, apply on a commit (clipped by
        the smaller of our radius and `their_radius`, the offer's)."""
        served = self.served[key]
        x, theirs = served.exchange, served.theirs
        t0 = trio.current_time()
        own: list[Any] | None = None
        carried = committed = False  # error feedback, as in GossipEngine.exchange
        try:
            # The initiator commits within hold_seconds of its offer or not at all; the slack lets a commit in
            # flight arrive. Past that, the weight we hold for it is freed and the lapse counts against it.
            with trio.fail_after(hold_seconds(group.nbytes, self.cfg.exchange_timeout) + COMMIT_SLACK_S):
                own = await trio.to_thread.run_sync(group.snapshot)
                carried = await trio.to_thread.run_sync(group.add_residual, own, codec)
                sent = await trio.to_thread.run_sync(group.as_sent, own, codec)
                radius = await our_radius(self.radii, group, session.peer_id, sent)
                if served.abort_reason is not None:  # they gave up while we took the snapshot: send nothing
                    x.handle(Event.ABORT, served.abort_reason)
                    self.ledger.failed(session.short, f"aborted by them before we accepted: {served.abort_reason}")
                    return
                ours = OutgoingGroup(session, group.specs)
                x.handle(Event.ACCEPT)
                await session.reply(env, AverageAccept(weight=w, streams=ours.streams, step=group.step,
                                                       radius=wire_radius(radius)))
                others: list = []

                async def receive() -> None:
                    others.extend(await theirs.receive(timeout=self.cfg.exchange_timeout))

                # Even after an abort both transfers run to their end (the initiator's is already
                # complete by then): a tensor cut off mid-stream would stay half-received at the other end.
                await together(receive, lambda: ours.send(own, codec=codec))
                x.handle(Event.RECEIVED)
                await served.decided.wait()
            if served.abort_reason is not None:
                x.handle(Event.ABORT, served.abort_reason)
                self.ledger.failed(session.short, f"aborted by them: {served.abort_reason}")
                self.ledger.lapsed(session.peer_id, "aborted an exchange we had accepted")
                return
            x.handle(Event.COMMIT)
            committed = True
            # the initiator committed and applies: so must we (the sum)
            await apply_committed(group, w, others, sent, peer_id=session.peer_id, radius=radius, theirs=their_radius,
                                  radii=self.radii, ledger=self.ledger)
            seconds = trio.current_time() - t0
            self.ledger.stats.served += 1
            nbytes = group.wire_nbytes(codec)  # each way: both sides send in the offer's codec
            self.links.record_transfer(session.peer_id, nbytes, seconds)
            self.ledger.completed(session.peer_id, seconds, sent=nbytes, received=nbytes)
        except (trio.TooSlowError, SessionClosed, ProtocolError, TimeoutError) as exc:
            # (TimeoutError: the group's lock, held past its bound by an attached process, before the commit)
            reason = "no commit before the deadline" if x.state is State.DECIDING else str(exc) or "deadline passed"
            accepted = x.state in (State.TRANSFER, State.DECIDING)
            x.end(reason)
            if accepted and isinstance(exc, trio.TooSlowError):
                self.ledger.lapsed(session.peer_id, "let an exchange we had accepted lapse")
            self.ledger.failed(session.short, reason)
            if isinstance(exc, ProtocolError):
                log.warning("exchange served to %s failed: %s", session.short, exc)
        except Exception as exc:  # a bug here must not take the daemon down: this exchange just fails
            log.exception("exchange served to %s failed unexpectedly", session.short)
            x.end(f"internal error: {type(exc).__name__}")
            self.ledger.stats.failed += 1
        finally:
            if x.end("cancelled").discard_incoming:
                theirs.discard()
            if carried:
                await keep_residual(group, own, sent if committed else None)
            if own is not None:
                group.release(own)  # sent, and applied or abandoned: nothing reads our cut anymore
            self.served.pop(key, None)
            self.budget.serving.pop(session.peer_id, None)
            self.slots.give_back()

    async def on_commit(self, session, env) -> None:
        served = self.served.get((session.peer_id, env.message.exchange))
        if served is not None and not served.decided.is_set():
            served.decided.set()

    async def on_abort(self, session, env) -> None:
        served = self.served.get((session.peer_id, env.message.exchange))
        if served is not None and not served.decided.is_set():
            served.abort_reason = env.message.reason[:200] or "no reason given"
            served.decided.set()

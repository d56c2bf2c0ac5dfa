"""Serving exchanges that partners offer: checking an offer, accepting it with the weight we can spare,
sending our tensors, and applying once the initiator commits (or dropping it on their abort or a lapse).

A part of the averaging engine (GossipEngine inherits it), as download.py is: it shares the engine's
groups, its budget of weight in flight, its stats and bans (see peer/averaging/engine.py for the attributes
it uses, the initiator's side and the rules of the budget).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import trio

from peer.averaging.bounds import COMMIT_SLACK_S, hold_seconds
from peer.averaging.exchange import Event, Exchange, Role, State
from peer.averaging.shared import SharedTensors
from peer.averaging.weights import MIN_WEIGHT_SHARE, WEIGHT_RULES, rule_cap
from peer.concurrency import together
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError
from protocol.schema.gossip import AverageAccept, AverageOffer, AverageReject

log = logging.getLogger("peertrain.gossip")


@dataclass
class ServedExchange:
    """An exchange we accepted and serve: where it stands, the initiator's tensors, and its verdict."""

    exchange: Exchange
    theirs: IncomingGroup
    decided: trio.Event = field(default_factory=trio.Event)  # set by the commit or the abort
    abort_reason: str | None = None


class ExchangeServing:
    """The serving half of an exchange, for GossipEngine (its initiating half is in peer/averaging/engine.py)."""

    async def _on_offer(self, session, env) -> None:
        offer: AverageOffer = env.message
        peer_id = session.peer_id
        reason = None
        group = self.groups.get(offer.group)
        if group is None:
            reason = f"no group {offer.group!r} here"
        elif not group.averaged:
            reason = f"group {offer.group!r} is not averaged here (only downloaded by joining peers)"
        elif [(s.name, s.dtype, list(s.shape)) for s in offer.tensors] != [(s.name, s.dtype, list(s.shape)) for s in group.specs]:
            reason = "tensor specs differ from ours"
        elif len(offer.streams) != len(group.specs):
            reason = "wrong number of streams"
        elif offer.rule not in WEIGHT_RULES:
            reason = f"unknown weight rule {offer.rule[:40]!r}"
        elif not 0.0 < offer.max_weight <= 0.5:
            reason = f"impossible weight {offer.max_weight}"
        elif (refused := self._role_refusal(peer_id, offer.group)) is not None:
            reason = refused[1]
        elif peer_id in self.inflight or (peer_id in self.initiating and peer_id > self.me):
            reason = "exchange already in flight"  # on collision the smaller peer ID's offer wins
        elif self._serving >= self.cfg.max_concurrent_exchanges:
            reason = "busy"
        if reason is None:
            full = rule_cap(offer.rule, self.topology.degree)
            # If we also initiated with this peer, their offer won the collision and ours will be refused
            # (it reaches them while they still initiate, since our reply follows it on the session), and
            # we never send it if it is not out yet: its reservation is ours to serve them with.
            room = self._room() + self.initiating.get(peer_id, 0.0)
            w = min(offer.max_weight, full, room)
            if w < MIN_WEIGHT_SHARE * full - 1e-12:
                reason = "too much weight in flight"
        x = Exchange(Role.SERVER)
        theirs = IncomingGroup(session, offer.streams, group.specs if group is not None else [],
                               as_torch=group is not None and group.is_torch)
        if reason is not None:
            x.handle(Event.REFUSE, reason)
            if x.cleanup.discard_incoming:
                theirs.discard()  # their tensors follow the offer: drop them as they come
            self.stats.rejected += 1
            await session.reply(env, AverageReject(reason=reason))
            return
        self.inflight[peer_id] = w
        self._serving += 1
        key = (peer_id, env.rid)
        self.served[key] = ServedExchange(x, theirs)
        self._nursery.start_soon(self._serve_exchange, session, env, group, w, key)

    async def _serve_exchange(self, session, env, group: SharedTensors, w: float, key) -> None:
        served = self.served[key]
        x, theirs = served.exchange, served.theirs
        t0 = trio.current_time()
        own: list[Any] | None = None
        codec = group.codec or self.cfg.codec
        carried = committed = False  # error feedback, as in `exchange`
        try:
            # The initiator commits within hold_seconds of its offer or not at all; the slack lets a commit in
            # flight arrive. Past that, the weight we hold for it is freed and the lapse counts against it.
            with trio.fail_after(hold_seconds(group.nbytes, self.cfg.exchange_timeout) + COMMIT_SLACK_S):
                own = await trio.to_thread.run_sync(group.snapshot)
                carried = await trio.to_thread.run_sync(group.add_residual, own, codec)
                sent = await trio.to_thread.run_sync(group.as_sent, own, codec)
                if served.abort_reason is not None:  # they gave up while we took the snapshot: send nothing
                    x.handle(Event.ABORT, served.abort_reason)
                    self.stats.failed += 1
                    self.stats.last_error = f"{session.short}: aborted by them before we accepted: {served.abort_reason}"
                    return
                ours = OutgoingGroup(session, group.specs)
                x.handle(Event.ACCEPT)
                await session.reply(env, AverageAccept(weight=w, streams=ours.streams, step=group.step))
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
                self.stats.failed += 1
                self.stats.last_error = f"{session.short}: aborted by them: {served.abort_reason}"
                self._lapsed(session.peer_id, "aborted an exchange we had accepted")
                return
            x.handle(Event.COMMIT)
            committed = True
            with trio.CancelScope(shield=True):  # the initiator committed and applies: so must we (the sum)
                scale = await trio.to_thread.run_sync(
                    lambda: group.apply(w, others, sent, max_ratio=self.cfg.max_update_ratio))
            self._check_scale(session.peer_id, scale)
            group.release(others)
            seconds = trio.current_time() - t0
            self.stats.served += 1
            sent_bytes = group.wire_nbytes(codec)
            self.topology.record_transfer(session.peer_id, sent_bytes, seconds)
            self._count(seconds, sent_bytes, session.peer_id)
        except (trio.TooSlowError, SessionClosed, ProtocolError) as exc:
            reason = "no commit before the deadline" if x.state is State.DECIDING else str(exc) or "deadline passed"
            accepted = x.state in (State.TRANSFER, State.DECIDING)
            x.end(reason)
            if accepted and isinstance(exc, trio.TooSlowError):
                self._lapsed(session.peer_id, "let an exchange we had accepted lapse")
            self.stats.failed += 1
            self.stats.last_error = f"{session.short}: {reason}"
            if isinstance(exc, ProtocolError):
                log.warning("exchange served to %s failed: %s", session.short, exc)
        except Exception as exc:  # a bug here must not take the daemon down: this exchange just fails
            log.exception("exchange served to %s failed unexpectedly", session.short)
            x.end(f"internal error: {type(exc).__name__}")
            self.stats.failed += 1
        finally:
            if x.end("cancelled").discard_incoming:
                theirs.discard()
            if carried:
                await self._keep_residual(group, own, sent if committed else None)
            if own is not None:
                group.release(own)  # sent, and applied or abandoned: nothing reads our cut anymore
            self.served.pop(key, None)
            self.inflight.pop(session.peer_id, None)
            self._serving -= 1

    async def _on_commit(self, session, env) -> None:
        served = self.served.get((session.peer_id, env.message.exchange))
        if served is not None and not served.decided.is_set():
            served.decided.set()

    async def _on_abort(self, session, env) -> None:
        served = self.served.get((session.peer_id, env.message.exchange))
        if served is not None and not served.decided.is_set():
            served.abort_reason = env.message.reason[:200] or "no reason given"
            served.decided.set()

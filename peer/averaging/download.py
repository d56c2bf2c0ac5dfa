"""Joining: downloading a partner's current tensors of a group, and serving ours to partners that ask.

`Downloads` is given what it reads of the averaging engine: its groups, who may download from us, the
partners worth asking, the serving slots it shares with the exchanges we serve (a download holds a snapshot
and our upload as one does), and the ledger. A download replaces the downloader's tensors, so it must be
within `[gossip] max_update_ratio` of the smaller norm, and one past it is refused, never clipped
(peer/averaging/bounds.py, `download_ok`). A model of all zeros has no norm to bound by: it takes a
download only when a second partner's agrees with it (`agree`), so one liar cannot hand a joiner a model
1e17 long that its honest partners then strike it for; two colluders who send the same one still can.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import trio

from peer.averaging import norms
from peer.averaging.bounds import download_ok, within_ratio
from peer.averaging.budget import ServingSlots
from peer.averaging.ledger import Ledger
from peer.averaging.shared import SharedTensors
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError
from protocol.refusal import TRY_LATER, Code, Refusal
from protocol.schema.gossip import ParamsReply, ParamsRequest
from protocol.schema.session import ErrorReply

log = logging.getLogger("peertrain.gossip")

DOWNLOAD_TRIES = 3  # partners asked in turn before a join gives up (each bounded by the exchange deadline)

Fetched = tuple[list[Any], int]  # a partner's tensors of a group, and its step


def agree(a: list[Any], b: list[Any], ratio: float) -> bool:
    """Two partners' downloads are within `ratio` times the smaller norm of each other, as `download_ok` bounds
    a download against our own model (two models of zeros agree)."""
    return within_ratio(norms.diff_sq(a, b), norms.sum_sq(a), norms.sum_sq(b), ratio)


class Downloads:
    """Parameter downloads, both ways: `fetch_from_partners` for a joining peer, `on_request` for partners."""

    def __init__(self, cfg, *, groups: Mapping[str, SharedTensors], slots: ServingSlots, ledger: Ledger,
                 may_download: Callable[[str, str], Refusal | None], holders: Callable[[str], list[str]],
                 connected: Callable[[], Mapping[str, Any]]):
        self.cfg = cfg  # [gossip]: exchange_timeout, max_update_ratio
        self.groups = groups
        self.slots = slots
        self.ledger = ledger
        self.may_download = may_download  # (peer, group) -> why that peer may not download it from us, or None
        self.holders = holders  # group -> partners worth asking for it
        self.connected = connected  # peer -> session, the sessions open now
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the downloads we serve (each outlives the request's dispatch)."""
        async with trio.open_nursery() as n:
            self._nursery = n
            task_status.started()
            await trio.sleep_forever()

    async def on_request(self, session, env) -> None:
        """Served to current neighbours only: a joining peer asks one (the model is not for anyone who dials)."""
        group = self.groups.get(env.message.group)
        if group is None:
            refusal = Refusal(Code.NO_GROUP, f"no group {env.message.group[:40]!r} here")
        else:
            refusal = self.may_download(session.peer_id, env.message.group)
        if refusal is None and group is not None and group.step < env.message.min_step:
            refusal = Refusal(Code.NO_STATE, f"at step {group.step}, before the {env.message.min_step} asked for")
        if refusal is None and self.slots.full():
            refusal = Refusal(Code.BUSY, "serving as many transfers as it may; ask again later")
        if refusal is not None:
            self.ledger.stats.params_refused += 1
            await session.reply(env, ErrorReply.of(refusal))
            return
        assert group is not None and self._nursery is not None
        self.slots.take()  # a download counts against the same cap as the exchanges we serve
        self._nursery.start_soon(self._serve, session, env, group)

    async def _serve(self, session, env, group: SharedTensors) -> None:
        """Stream a snapshot to the neighbour that asked, in our own nursery and under the exchange deadline:
        from the session's dispatch task a slow downloader would hold that session's other messages, its
        pings included, and get itself (or an honest peer) declared dead."""
        own: list[Any] | None = None
        try:
            with trio.fail_after(self.cfg.exchange_timeout):
                own = await trio.to_thread.run_sync(group.snapshot)
                ours = OutgoingGroup(session, group.specs)
                await session.reply(env, ParamsReply(tensors=group.specs, streams=ours.streams, step=group.step))
                await ours.send(own)
        except (trio.TooSlowError, SessionClosed, TimeoutError) as exc:  # (TimeoutError: the group's lock)
            log.info("parameters for %s not sent: %s", session.short, exc or "deadline passed")
        except Exception:  # a bug here must not take the daemon down: this download just fails
            log.exception("serving parameters to %s failed unexpectedly", session.short)
        finally:
            self.slots.give_back()
            if own is not None:
                group.release(own)

    async def fetch_params(self, group_name: str, peer_id: str, min_step: int = 0) -> Fetched | Refusal | None:
        """Download `peer_id`'s current tensors of a group if it has trained to `min_step`: (values, their step),
        the peer's refusal, or None (it has none, the transfer failed or its deadline passed, or the values are
        past our bound)."""
        group = self.groups[group_name]
        session = self.connected().get(peer_id)
        if session is None:
            return None
        theirs: IncomingGroup | None = None
        try:
            with trio.fail_after(self.cfg.exchange_timeout * 2):
                env = await session.request(ParamsRequest(group=group_name, min_step=min_step),
                                            timeout=self.cfg.exchange_timeout)
                reply = env.message
                if isinstance(reply, ErrorReply):
                    refusal = reply.refusal()
                    log.info("%s will not send parameters: %s", session.short, refusal.reason[:200])
                    return refusal
                if not isinstance(reply, ParamsReply) or not reply.available:
                    return None
                if reply.step < min_step:  # (an older peer, which does not read min_step: its tensors still come)
                    session.discard(reply.streams)
                    return None
                theirs = IncomingGroup(session, reply.streams, group.specs, as_torch=group.is_torch)
                if len(reply.streams) != len(group.specs):
                    raise ProtocolError("params reply has the wrong number of tensors")
                values = await theirs.receive(timeout=self.cfg.exchange_timeout)
            # Bounded against our model: a download replaces it, so refuse, never clip. A group still all zeros
            # (a fresh linear model, a fresh outer momentum) has no norm to bound against and takes any finite
            # values: a model's exchanges then judge it against the swarm (radius.py); a momentum's trainer
            # bounds it against the weights it downloaded with it (peertrain/outer.py, `join`).
            dist = await trio.to_thread.run_sync(group.distance_sq, values)
            if not download_ok(*dist, self.cfg.max_update_ratio):
                log.warning("refused parameters from %s: %.3g from ours, past max_update_ratio %g of the norms",
                            session.short, dist[0] ** 0.5, self.cfg.max_update_ratio)
                self.ledger.refused_download(peer_id, "sent parameters past max_update_ratio")
                return None
            return values, reply.step
        except (trio.TooSlowError, SessionClosed, ProtocolError, TimeoutError) as exc:
            log.warning("could not download parameters from %s: %s", session.short, exc)
            if theirs is not None:
                theirs.discard()
            return None

    async def fetch_from_partners(self, group: str, min_step: int = 0) -> Fetched | None:
        """A joining peer's download: ask partners of `group` that have trained to `min_step` (the others refuse
        before sending a byte), in random order, for their tensors; the first
        complete answer within bounds wins (values, their step), else None. Up to DOWNLOAD_TRIES partners are
        tried; one that is only busy now (a TRY_LATER refusal) uses up no try. A model of zeros takes the first
        answer a second one agrees with; one answer alone only from its only partner."""
        partners = self.holders(group)
        random.shuffle(partners)
        tries = 0
        zeros: bool | None = None  # our model all zeros: read at the first answer
        answers: list[Fetched] = []
        for pid in partners:
            if tries >= DOWNLOAD_TRIES or group not in self.groups:
                break
            got = await self.fetch_params(group, pid, min_step)
            if isinstance(got, tuple):
                if zeros is None:
                    zeros = await trio.to_thread.run_sync(self.groups[group].norm_sq) == 0.0
                if not zeros:
                    return got
                ratio = self.cfg.max_update_ratio
                for earlier in answers:
                    if await trio.to_thread.run_sync(agree, earlier[0], got[0], ratio):
                        return earlier
                answers.append(got)
                tries += 1
            elif not (isinstance(got, Refusal) and got.code in TRY_LATER):
                tries += 1
        if len(answers) == 1 and len(partners) == 1:
            return answers[0]  # our only partner: nothing to compare it with (a swarm of two)
        if answers:
            log.warning("refused %d downloads of %s that did not agree with each other (our model is all zeros: "
                        "only a second partner's answer can vouch for one)", len(answers), group)
        return None

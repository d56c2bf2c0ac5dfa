"""Joining: downloading a partner's current tensors of a group, and serving ours to partners that ask.

A part of the averaging engine (GossipEngine inherits it): it shares the engine's groups, partners, bans
and its cap on transfers served at once. A download replaces the downloader's tensors, so the same bound
as an exchange applies, and a download past it is refused, never clipped (peer/averaging/bounds.py).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import trio

from peer.averaging.bounds import download_ok
from peer.averaging.shared import SharedTensors
from peer.session.groups import IncomingGroup, OutgoingGroup
from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError
from protocol.schema.gossip import ParamsReply, ParamsRequest
from protocol.schema.session import ErrorReply

log = logging.getLogger("peertrain.gossip")

DOWNLOAD_TRIES = 3  # partners asked in turn before a join gives up (each bounded by the exchange deadline)


class ParamsDownload:
    """The download half of GossipEngine (see peer/averaging/engine.py for the attributes it uses)."""

    async def _on_params_request(self, session, env) -> None:
        """Served to current neighbours only: a joining peer asks one (the model is not for anyone who dials)."""
        group = self.groups.get(env.message.group)
        if group is None:
            refusal = ("no_group", f"no group {env.message.group[:40]!r} here")
        else:
            refusal = self._role_refusal(session.peer_id, env.message.group)
        if refusal is None and self._serving >= self.cfg.max_concurrent_exchanges:
            refusal = ("busy", "serving as many transfers as it may; ask again later")
        if refusal is not None:
            self.stats.params_refused += 1
            await session.reply(env, ErrorReply(code=refusal[0], message=refusal[1]))
            return
        self._serving += 1  # a download counts against the same cap as the exchanges we serve
        self._nursery.start_soon(self._serve_params, session, env, group)

    async def _serve_params(self, session, env, group: SharedTensors) -> None:
        """Stream a snapshot to the neighbour that asked, in the engine's nursery and under the exchange
        deadline: from the session's dispatch task a slow downloader would hold that session's other
        messages, its pings included, and get itself (or an honest peer) declared dead."""
        own: list[Any] | None = None
        try:
            with trio.fail_after(self.cfg.exchange_timeout):
                own = await trio.to_thread.run_sync(group.snapshot)
                ours = OutgoingGroup(session, group.specs)
                await session.reply(env, ParamsReply(tensors=group.specs, streams=ours.streams, step=group.step))
                await ours.send(own)
        except (trio.TooSlowError, SessionClosed) as exc:
            log.info("parameters for %s not sent: %s", session.short, exc or "deadline passed")
        except Exception:  # a bug here must not take the daemon down: this download just fails
            log.exception("serving parameters to %s failed unexpectedly", session.short)
        finally:
            self._serving -= 1
            if own is not None:
                group.release(own)

    async def fetch_params(self, group_name: str, peer_id: str) -> tuple[list[Any], int] | None:
        """Download `peer_id`'s current tensors of a group (None if it has none or the deadline passes)."""
        group = self.groups[group_name]
        session = self.membership.connected().get(peer_id)
        if session is None:
            return None
        theirs: IncomingGroup | None = None
        try:
            with trio.fail_after(self.cfg.exchange_timeout * 2):
                env = await session.request(ParamsRequest(group=group_name), timeout=self.cfg.exchange_timeout)
                reply = env.message
                if isinstance(reply, ErrorReply):
                    log.info("%s will not send parameters: %s", session.short, reply.message[:200])
                    return None
                if not isinstance(reply, ParamsReply) or not reply.available:
                    return None
                theirs = IncomingGroup(session, reply.streams, group.specs, as_torch=group.is_torch)
                if len(reply.streams) != len(group.specs):
                    raise ProtocolError("params reply has the wrong number of tensors")
                values = await theirs.receive(timeout=self.cfg.exchange_timeout)
            # The same bound as an exchange, against our model: a download replaces it, so refuse, never clip.
            # A download-only group still all zeros (a fresh outer momentum) has no norm to bound against: its
            # trainer bounds it against the weights it downloaded with it (peertrain/outer.py, `join`).
            dist = await trio.to_thread.run_sync(group.distance_sq, values)
            fresh_state = not group.averaged and dist[1] == 0.0
            if not fresh_state and not download_ok(*dist, self.cfg.max_update_ratio):
                self.stats.clipped[peer_id] = self.stats.clipped.get(peer_id, 0) + 1
                log.warning("refused parameters from %s: %.3g from ours, past max_update_ratio %g of the norms",
                            session.short, dist[0] ** 0.5, self.cfg.max_update_ratio)
                self._strike(peer_id, "sent parameters past max_update_ratio")
                return None
            return values, reply.step
        except (trio.TooSlowError, SessionClosed, ProtocolError) as exc:
            log.warning("could not download parameters from %s: %s", session.short, exc)
            if theirs is not None:
                theirs.discard()
            return None

    async def fetch_from_partners(self, group: str) -> tuple[list[Any], int] | None:
        """A joining peer's download: ask up to DOWNLOAD_TRIES partners of `group`, in random order, for their
        tensors; the first complete answer within bounds wins (values, their step), else None."""
        partners = self.holders(group)
        random.shuffle(partners)
        for pid in partners[:DOWNLOAD_TRIES]:
            if group not in self.groups:
                return None
            got = await self.fetch_params(group, pid)
            if got is not None:
                return got
        return None

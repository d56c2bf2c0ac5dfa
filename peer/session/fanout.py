"""Messages to many sessions at once, waiting on none of them (issue 15: broadcasts must not stall on one
peer that stops reading). Each session's sends run in their own task, bounded by its send deadline."""

from __future__ import annotations

from typing import Any

import trio

from peer.session.transport import Session, SessionClosed


async def _send_in_order(session: Session, messages) -> None:
    """Send `messages` to one session in order; a session that closes meanwhile is simply skipped."""
    try:
        for message in messages:
            await session.send_message(message)
    except SessionClosed:
        pass


async def send_to_each(sessions, *messages: Any) -> None:
    """Send `messages`, in order, to every session at once; a closed session is skipped.

    Why concurrent: a broadcast (topology records, peer exchange) that sent to one session after another
    waited on each, so one peer that stopped reading stalled it for everyone. Here each session's sends
    run in their own task, and the slowest is bounded by its send deadline, after which its session is
    closed (drop-session, not a queue: these messages are periodic snapshots that the next round
    supersedes, so nothing is worth queueing for a peer that cannot take one in time). At most one task
    per session, and sessions are bounded by `max_connections`.
    """
    async with trio.open_nursery() as nursery:
        for session in sessions:
            nursery.start_soon(_send_in_order, session, messages)


class Fanout:
    """Periodic snapshots (topology records, peer exchange) to many sessions, waiting on none of them.

    Each `send` starts one task per session in the owner's nursery and returns at once. A session whose
    previous snapshot is still being written is skipped this round (it gets the next, newer one): an
    outbox of one per session, dropping the newest, because a snapshot supersedes the last and nothing
    is worth queueing for a peer that is behind. A peer that takes nothing is closed by its send
    deadline (drop-session). So there is at most one task per session, bounded by `max_connections`.
    """

    def __init__(self) -> None:
        self._busy: set[Session] = set()

    def send(self, nursery: trio.Nursery, sessions, *messages: Any) -> int:
        """Start sending `messages` to each session that is not still busy; how many were skipped."""
        skipped = 0
        for session in sessions:
            if session in self._busy:
                skipped += 1
                continue
            if not session.closed.is_set():
                self._busy.add(session)
                nursery.start_soon(self._one, session, messages)
        return skipped

    async def _one(self, session: Session, messages: tuple) -> None:
        try:
            await _send_in_order(session, messages)
        finally:
            self._busy.discard(session)

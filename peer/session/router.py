"""Routes incoming messages to the service that handles their type.

Services register a handler per message class once, while the daemon is built; after that the table is
only read. A handler gets the session and the envelope (to reply), and runs in the session's dispatch
task: a handler that needs long work starts it in its own service's nursery instead of blocking.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError

log = logging.getLogger("peertrain.router")

Handler = Callable[[Any, Any], Awaitable[None]]


class Router:
    def __init__(self) -> None:
        self._handlers: dict[type, Handler] = {}

    def register(self, message_type: type, handler: Handler) -> None:
        if message_type in self._handlers:
            raise ValueError(f"{message_type.__name__} already has a handler")
        self._handlers[message_type] = handler

    async def dispatch(self, session, envelope) -> None:
        """Run the handler; a ProtocolError or any other exception closes that session with a logged
        reason, and never leaves the daemon's nursery (docs/design.md, "Invariants", 6): a message that
        trips a bug in a handler is as bad as a malformed one, and dropping its sender bounds what the
        sender can make us do with more of it.

        A session that ends while its handler replies (the peer left, or a simultaneous connection
        replaced it) is not a bug: the handler's reply is lost with the session, and the asking side
        sees the session end (or its request time out) and changes nothing. One line says so.
        """
        handler = self._handlers.get(type(envelope.message))
        if handler is None:
            log.debug("no handler for %s from %s; ignored", type(envelope.message).__name__, session.short)
            return
        try:
            await handler(session, envelope)
        except SessionClosed as exc:
            log.info("%s from %s not answered: session ended (%s)", type(envelope.message).__name__, session.short, exc)
        except ProtocolError as exc:
            log.warning("closing session with %s: %s", session.short, exc)
            await session.aclose(f"protocol error: {exc}")
        except Exception as exc:  # a bug in a handler must not take the daemon down with it
            what = type(envelope.message).__name__
            log.exception("handler for %s failed; closing the session with %s", what, session.short)
            await session.aclose(f"internal error handling {what}: {type(exc).__name__}: {str(exc)[:200]}")

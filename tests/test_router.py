"""The router's outcomes for a handler: done, or a bad peer or a bug (logged, that session closed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from peer.session.router import Router
from peer.session.transport import SessionClosed
from protocol.errors import ProtocolError


@dataclass
class _Session:
    short: str = "abcd1234"
    closed_with: list = field(default_factory=list)

    async def aclose(self, reason: str) -> None:
        self.closed_with.append(reason)


@dataclass
class _Envelope:
    message: object


class _Ping:
    pass


def _dispatch(raising: BaseException | None) -> _Session:
    async def handler(session, env):
        if raising is not None:
            raise raising

    router = Router()
    router.register(_Ping, handler)
    session = _Session()
    trio.run(router.dispatch, session, _Envelope(_Ping()))
    return session


def test_a_session_that_ends_under_a_handler_is_one_info_line_not_an_error(caplog):
    caplog.set_level(logging.INFO, logger="peertrain.router")
    session = _dispatch(SessionClosed("duplicate session"))
    assert session.closed_with == []
    [record] = caplog.records
    assert record.levelno == logging.INFO and record.exc_info is None
    assert "_Ping from abcd1234 not answered: session ended (duplicate session)" in record.getMessage()


def test_a_protocol_error_or_a_bug_closes_the_session_with_a_logged_reason(caplog):
    caplog.set_level(logging.INFO, logger="peertrain.router")
    assert _dispatch(ProtocolError("bad field")).closed_with == ["protocol error: bad field"]
    session = _dispatch(RuntimeError("oops"))
    assert session.closed_with == ["internal error handling _Ping: RuntimeError: oops"]
    assert caplog.records[-1].levelno == logging.ERROR and caplog.records[-1].exc_info is not None

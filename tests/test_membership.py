"""Membership's dialer, in-process: what it dials, and that a leaving daemon dials nothing."""

from __future__ import annotations

import socket

import trio

from peer.config import from_mapping
from peer.membership.service import Membership
from peer.session.router import Router
from peer.session.transport import TransportConfig
from protocol.identity import generate_identity


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bootstrap_failures_after(seconds: float, *, leaving: bool) -> int:
    """Failed dials of a refusing bootstrap address, retried every 0.05-0.15 s; `leaving` once the first failed."""
    cfg = from_mapping({"daemon": {"join": [f"127.0.0.1:{_closed_port()}"]},
                        "membership": {"reconnect_min": 0.05, "reconnect_max": 0.1}})
    m = Membership(config=cfg, transport=TransportConfig(identity=generate_identity(), swarm="t"),
                   peer_id="a" * 20, router=Router(), listen_port=lambda: 0)

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(m.run)
            with trio.fail_after(10):
                while m.bootstrap[0].failures < 1:
                    await trio.sleep(0.01)
            if leaving:
                m.stop_dialing()
            await trio.sleep(seconds)
            n.cancel_scope.cancel()

    trio.run(main)
    return m.bootstrap[0].failures


def test_a_refused_bootstrap_address_is_dialed_and_counted():
    assert _bootstrap_failures_after(1.0, leaving=False) >= 3


def test_a_leaving_daemon_dials_nothing_new():
    assert _bootstrap_failures_after(1.0, leaving=True) == 1

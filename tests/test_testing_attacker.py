"""peer.testing.attacker: a fresh identity completes the real handshake with a real daemon and talks to it."""

from __future__ import annotations

import pytest
import trio

from peer.testing.attacker import attacker_session
from protocol.schema import Ping, Pong
from tests.daemons import config_file, unique_swarm, wait_for

pytestmark = pytest.mark.slow


def test_attacker_session_reaches_a_real_daemon(cluster, tmp_path):
    d = cluster.start("victim", config=config_file(tmp_path / "c.toml", swarm=unique_swarm(), mdns=False))
    status = d.wait_ready()
    seen: list[str] = []

    async def attack() -> None:
        async with attacker_session(status) as s:
            seen.append(s.peer_id)
            reply = await s.request(Ping(sent=7.0), timeout=10)
            assert isinstance(reply.message, Pong) and reply.message.echo == 7.0
    trio.run(attack)
    assert seen == [status["peer_id"]]
    wait_for(lambda: any(p["state"] != "connected" for p in d.status()["peers"]) or not d.status()["peers"],
             timeout=20, what="the attacker's session to end at the daemon")

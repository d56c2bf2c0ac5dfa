"""peer.testing.attacker: a fresh identity completes the real handshake with a real daemon and talks to it."""

from __future__ import annotations

import pytest
import trio

from peer.testing.attacker import attacker_session
from protocol.schema import Ping, Pong
from tests.daemons import config_file, unique_swarm, wait_for
from peer.testing.pace import scaled

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


def test_the_attacker_process_knows_every_scenario():
    """`python -m peer.testing.attacks` (what `peer bench hostile` runs per class) lists the classes other
    modules register too: as a script the file is a second copy of the module, with a registry of its own."""
    import subprocess
    import sys

    from peer.testing.attacks import SCENARIOS
    from tests.daemons import REPO

    r = subprocess.run([sys.executable, "-m", "peer.testing.attacks", "--help"], capture_output=True, text=True,
                       cwd=REPO, timeout=scaled(60))
    assert r.returncode == 0 and all(name in r.stdout for name in SCENARIOS), r.stdout
    assert "mute_peer" in SCENARIOS and "slowloris" in SCENARIOS

"""Attack tests against a real daemon (issue 15): memory a hostile peer can make it hold through tensor
streams and queued messages."""

from __future__ import annotations

import pytest
import trio

from peer.session.streams import PARKED_HEADER_SECONDS
from peer.testing.attacker import attacker_session
from peer.testing.process import proc_status_mb
from peer.testing.attacks import run_scenario
from protocol.schema import Ping, Pong
from tests.daemons import config_file, unique_swarm, wait_for

pytestmark = pytest.mark.slow


def test_an_unsolicited_4gib_tensor_header_allocates_nothing_and_the_session_is_dropped(cluster, tmp_path):
    """One ~60-byte header announcing 4 GiB (within max_tensor_mib, 8 GiB by default) used to make the daemon
    zero-fill 4 GiB on its event loop and keep it forever. Now: RSS grows < 64 MiB, the session is closed
    within the header's lifetime, the daemon stays up and still answers an honest peer."""
    swarm = unique_swarm()
    d = cluster.start("victim", config=config_file(tmp_path / "c.toml", swarm=swarm, mdns=False))
    status = d.wait_ready()
    rss0 = proc_status_mb(d.pid, "VmRSS")
    obs = run_scenario("huge_tensor_header", status)
    rss1 = proc_status_mb(d.pid, "VmRSS")
    assert rss1 - rss0 < 64, (rss0, rss1)
    assert obs.closed_after_s is not None and obs.closed_after_s < PARKED_HEADER_SECONDS + 15, obs
    assert d.running
    wait_for(lambda: "sent unasked" in d.log_tail(80), timeout=10, what="the daemon to log why it closed the session")

    async def honest() -> None:
        async with attacker_session(status) as s:
            reply = await s.request(Ping(sent=3.0), timeout=10)
            assert isinstance(reply.message, Pong) and reply.message.echo == 3.0
    trio.run(honest)
    wait_for(lambda: d.running, timeout=5, what="the daemon to stay up")


def test_a_flood_of_large_queued_messages_is_backpressured_not_held(cluster, tmp_path):
    """A peer that floods large control messages (offers naming 50 fat specs, ~60 KB decoded each) grows the
    daemon's memory by no more than the queue's byte bound plus TCP buffers, and the daemon stays up."""
    d = cluster.start("victim", config=config_file(tmp_path / "c.toml", swarm=unique_swarm(), mdns=False))
    status = d.wait_ready()
    rss0 = proc_status_mb(d.pid, "VmRSS")
    run_scenario("control_flood", status)
    rss1 = proc_status_mb(d.pid, "VmRSS")
    assert rss1 - rss0 < 64, (rss0, rss1)
    assert d.running and d.status()["peer_id"] == status["peer_id"]

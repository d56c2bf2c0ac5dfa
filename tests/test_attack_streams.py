"""Attack tests against a real daemon (issue 15): memory a hostile peer can make it hold through tensor
streams and queued messages."""

from __future__ import annotations

import pytest
import trio

from peer.session.streams import PARKED_HEADER_SECONDS
from peer.testing.attacker import attacker_session
from peer.testing.process import proc_status_mb
from protocol.limits import GiB
from protocol.schema import Ping, Pong, TensorHeader
from protocol.schema.gossip import AverageOffer, TensorSpec
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
    closed_after: list[float] = []

    async def attack() -> None:
        async with attacker_session(status) as s:
            t0 = trio.current_time()
            await s.send_message(TensorHeader(stream=1, name="w", dtype="float32", shape=[1 << 30], codec="raw",
                                              nbytes=4 * GiB))
            async with trio.open_nursery() as n:
                async def keep_alive() -> None:  # so the daemon does not drop us as silent first
                    while not s.closed.is_set():
                        await s.send_best_effort(Ping(sent=0.0))
                        await trio.sleep(0.5)
                n.start_soon(keep_alive)
                with trio.fail_after(PARKED_HEADER_SECONDS + 15):
                    await s.closed.wait()
                closed_after.append(trio.current_time() - t0)
    trio.run(attack)
    rss1 = proc_status_mb(d.pid, "VmRSS")
    assert rss1 - rss0 < 64, (rss0, rss1)
    assert closed_after and closed_after[0] < PARKED_HEADER_SECONDS + 15
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
    fat = AverageOffer(group="g", tensors=[TensorSpec("x" * 1000 + str(i), "float32", [1]) for i in range(50)],
                       streams=[], max_weight=0.1, rule="pairwise", codec="raw", step=0)

    async def attack() -> None:
        async with attacker_session(status) as s:
            with trio.move_on_after(10):
                for _ in range(2000):  # ~120 MB decoded if all were held
                    await s.send_message(fat)
    trio.run(attack)
    rss1 = proc_status_mb(d.pid, "VmRSS")
    assert rss1 - rss0 < 64, (rss0, rss1)
    assert d.running and d.status()["peer_id"] == status["peer_id"]

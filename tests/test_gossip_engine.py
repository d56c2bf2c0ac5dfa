"""The gossip engine's exchange protocol, two engines in one process over a real encrypted loopback session.

The multi-daemon tests (test_gossip.py) show the sum is kept in a live swarm; these pin down the races
behind it deterministically: a degree that changes while an offer is being served, and an initiator
that gives up after the accept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import trio

from peer.config import GossipSection
from peer.gossip import GossipEngine, SharedTensors
from peer.router import Router
from peer.transport import TransportConfig, dial, open_listeners, serve
from protocol.identity import generate_identity, peer_id_from_public_bytes, public_key_bytes


@dataclass
class FakeTopology:
    """Just what the engine asks of the topology service: who the neighbours are and our degree."""

    neighbours: list[str]
    degrees: list[int] = field(default_factory=lambda: [1])  # successive reads of `degree`; the last one sticks
    shard_bytes: int = 0

    @property
    def degree(self) -> int:
        return self.degrees.pop(0) if len(self.degrees) > 1 else self.degrees[0]

    def is_neighbour(self, peer_id: str) -> bool:
        return peer_id in self.neighbours

    def record_transfer(self, peer_id: str, nbytes: int, seconds: float) -> None:
        pass


def _peer_id(identity) -> str:
    return peer_id_from_public_bytes(public_key_bytes(identity))


def make_engine(identity, other_id: str, session_box: dict, **gossip) -> GossipEngine:
    daemon = SimpleNamespace(
        config=SimpleNamespace(gossip=GossipSection(**{"exchange_timeout": 30.0, **gossip})),
        peer_id=_peer_id(identity), router=Router(),
        membership=SimpleNamespace(connected=lambda: dict(session_box)))
    engine = GossipEngine(daemon, FakeTopology(neighbours=[other_id]))
    engine.register(SharedTensors("params", {"w": np.full(50_000, float(len(session_box) + 1), np.float32)}))
    return engine


async def run_pair(body, **gossip) -> None:
    """Two engines, a and b, joined by one real session; `body(a, b)` runs while both serve."""
    ida, idb = generate_identity(), generate_identity()
    a_sessions: dict = {}
    b_sessions: dict = {}
    a = make_engine(ida, _peer_id(idb), a_sessions, **gossip)
    b = make_engine(idb, _peer_id(ida), b_sessions, **gossip)
    b.groups["params"].tensors["w"][:] = 3.0
    a.groups["params"].tensors["w"][:] = 1.0

    async def pump(session, engine) -> None:
        async for env in session.incoming:
            await engine.daemon.router.dispatch(session, env)

    async with trio.open_nursery() as n:
        await n.start(a.run)
        await n.start(b.run)
        listeners, (_, port) = await open_listeners("127.0.0.1", 0)
        accepted = trio.Event()

        async def on_session(session):
            b_sessions[_peer_id(ida)] = session
            accepted.set()
            async with trio.open_nursery() as sn:
                sn.start_soon(session.run)
                await pump(session, b)

        n.start_soon(lambda: serve(listeners, TransportConfig(identity=idb, swarm="t"), on_session))
        session = await dial("127.0.0.1", port, TransportConfig(identity=ida, swarm="t"))
        a_sessions[_peer_id(idb)] = session
        n.start_soon(session.run)
        n.start_soon(pump, session, a)
        with trio.fail_after(5):
            await accepted.wait()
        with trio.fail_after(20):
            await body(a, b)
        n.cancel_scope.cancel()


def total(engine) -> float:
    return float(engine.groups["params"].tensors["w"].astype(np.float64).sum())


def test_accept_reports_the_degree_its_weight_came_from_even_if_the_degree_changes_meanwhile():
    """The server's degree grows from 1 to 2 between reading the offer and replying: the accept must carry
    the degree the weight was computed from (1), or the initiator sees an inconsistent accept and the
    exchange fails (the race behind a flaky CI run)."""
    async def body(a, b):
        b.topology.degrees = [1, 2]
        before = total(a) + total(b)
        result = await a.exchange(b.me, "params")
        assert result.ok, result.reason
        assert result.weight == 0.5
        with trio.fail_after(5):
            while b.stats.served < 1:
                await trio.sleep(0.01)
        assert abs(total(a) + total(b) - before) < 1e-3
        np.testing.assert_allclose(a.groups["params"].tensors["w"], 2.0)
        np.testing.assert_allclose(b.groups["params"].tensors["w"], 2.0)

    trio.run(run_pair, body)


def test_initiator_that_gives_up_after_the_accept_frees_the_server_at_once():
    """If the initiator cannot commit (here: its weight budget filled up meanwhile) it sends an abort; the
    server applies nothing and releases the exchange's weight well before its 30 s deadline, and no
    tensor stream is left half-received."""
    async def body(a, b):
        a.inflight["someone-else"] = 0.6  # 0.6 + 0.5 would exceed the budget once b's weight is known
        before_a, before_b = total(a), total(b)
        result = await a.exchange(b.me, "params")
        assert not result.ok and result.reason == "too much weight in flight"
        with trio.fail_after(3):
            while b.inflight:
                await trio.sleep(0.01)
        assert "aborted by them: too much weight in flight" in b.stats.last_error
        a_session = a.membership.connected()[b.me]
        with trio.fail_after(3):
            while a_session._streams:  # b's tensors still arrive whole, and a drops them: nothing half-received
                await trio.sleep(0.01)
        assert (total(a), total(b)) == (before_a, before_b)  # neither side applied anything
        del a.inflight["someone-else"]
        result = await a.exchange(b.me, "params")  # and the pair still exchanges afterwards
        assert result.ok, result.reason

    trio.run(run_pair, body)

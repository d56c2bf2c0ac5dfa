"""The gossip engine's exchange protocol, two engines in one process over a real encrypted loopback session.

The multi-daemon tests (test_gossip.py) show the sum is kept in a live swarm; these pin down how the two
sides agree on the weight (the rule, each side's budget of weight in flight) and what happens when an
initiator gives up after the accept, deterministically.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import trio

from peer.config import GossipSection
from peer.averaging.engine import GossipEngine
from peer.averaging.ledger import EXCHANGE_SECONDS_BUCKETS
from peer.averaging.shared import SharedTensors
from peer.session.router import Router
from peer.session.connect import dial, open_listeners, serve
from peer.session.transport import TransportConfig
from protocol.identity import generate_identity, peer_id_from_public_bytes, public_key_bytes
from protocol.schema.gossip import AverageOffer


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

    def holds(self, peer_id: str, group: str) -> bool | None:
        return None  # no records here: every neighbour may hold any group

    def announce_soon(self) -> None:
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


async def until(condition, timeout: float) -> None:
    """Poll `condition` until it holds; fail the test after `timeout` seconds."""
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.01)


def exchange_and_wait(a, b, **kw):
    """a initiates one exchange with b; returns its result once b has applied it too (if it succeeded)."""
    async def go():
        served = b.stats.served
        result = await a.exchange(b.me, "params", **kw)
        if result.ok:
            await until(lambda: b.stats.served > served, 5)
        return result
    return go()


def test_pairwise_exchange_moves_both_sides_a_third_of_the_way():
    """The pairwise rule (one random neighbour, AD-PSGD) uses w = 1/3 whatever the degrees: each side moves
    a third of the way to the other."""
    async def body(a, b):
        a.topology.degrees, b.topology.degrees = [4], [6]
        result = await exchange_and_wait(a, b, rule="pairwise")
        assert result.ok, result.reason
        assert result.weight == 1 / 3
        np.testing.assert_allclose(a.groups["params"].tensors["w"], 1 + 2 / 3, rtol=1e-6)
        np.testing.assert_allclose(b.groups["params"].tensors["w"], 3 - 2 / 3, rtol=1e-6)
        assert not a.budget.initiating and not b.budget.serving  # every weight set aside is free again

    trio.run(run_pair, body)


def test_each_completed_exchange_is_counted_in_the_duration_histogram_by_both_ends():
    """The histogram `peer status` and Prometheus show (`exchange_seconds`): cumulative bucket counts, sum and
    count, one observation per completed exchange at each end; a refused offer adds nothing."""
    async def body(a, b):
        for _ in range(3):
            assert (await exchange_and_wait(a, b, rule="pairwise")).ok
        for eng in (a, b):
            h = eng.status()["exchange_seconds"]
            assert h["count"] == 3 == eng.stats.exchanges and h["le"] == list(EXCHANGE_SECONDS_BUCKETS)
            assert h["counts"] == sorted(h["counts"]) and h["counts"][-1] <= 3  # cumulative, +Inf is count
            assert 0 < h["sum"] < 3 * 30
        b.topology.neighbours = []  # b now refuses a's offers
        assert not (await a.exchange(b.me, "params")).ok
        assert a.stats.durations.count == 3 and b.stats.durations.count == 3

    trio.run(run_pair, body)


def test_metropolis_weight_is_the_smaller_of_the_two_sides_caps_even_if_a_degree_changes_meanwhile():
    """All-neighbour averaging (D-PSGD) gets 1/(1+max(d_i, d_j)): each side caps at 1/(1+own degree).
    The server's degree grows from 3 to 5 between reading the offer and replying; the weight it
    accepted with (1/4) is the one both apply (a mismatch here once made the initiator fail the exchange)."""
    async def body(a, b):
        a.topology.degrees, b.topology.degrees = [2], [3, 5]
        before = total(a) + total(b)
        result = await exchange_and_wait(a, b, rule="metropolis")
        assert result.ok, result.reason
        assert result.weight == 0.25
        assert abs(total(a) + total(b) - before) < 1e-6 * before  # float32 rounding only
        np.testing.assert_allclose(a.groups["params"].tensors["w"], 1.5)  # 1 + (3 - 1) / 4
        np.testing.assert_allclose(b.groups["params"].tensors["w"], 2.5)

    trio.run(run_pair, body)


def test_a_busy_server_accepts_with_the_weight_it_has_room_for_or_refuses():
    """Weights in flight at a peer never add up to more than 1. A server with 0.7 in flight accepts a
    pairwise offer with 0.3 (and both sides apply 0.3, so the sum holds); with 0.95 in flight the room
    left (0.05) is under a quarter of the rule's 1/3, and it refuses."""
    async def body(a, b):
        b.budget.serving["someone-else"] = 0.7
        before = total(a) + total(b)
        result = await exchange_and_wait(a, b)
        assert result.ok, result.reason
        assert abs(result.weight - 0.3) < 1e-12
        assert abs(total(a) + total(b) - before) < 1e-6 * before  # float32 rounding only
        np.testing.assert_allclose(a.groups["params"].tensors["w"], 1.6, rtol=1e-6)  # 1 + 0.3 * (3 - 1)
        b.budget.serving["someone-else"] = 0.95
        result = await a.exchange(b.me, "params")
        assert not result.ok and "too much weight in flight" in result.reason
        assert abs(total(a) + total(b) - before) < 1e-6 * before  # float32 rounding only

    trio.run(run_pair, body)


def test_initiator_sets_its_weight_aside_before_it_offers():
    """An initiator with 0.8 in flight offers at most 0.2; with 0.95 it does not offer at all."""
    async def body(a, b):
        a.budget.serving["someone-else"] = 0.8
        result = await exchange_and_wait(a, b)
        assert result.ok and abs(result.weight - 0.2) < 1e-12, result
        a.budget.serving["someone-else"] = 0.95
        result = await a.exchange(b.me, "params")
        assert not result.ok and result.reason == "too much weight in flight"
        assert b.stats.rejected == 0  # decided before any offer went out

    trio.run(run_pair, body)


def test_initiator_that_gives_up_after_the_accept_frees_the_server_at_once():
    """A lying server accepts with more weight than was offered: the initiator refuses to commit and sends
    an abort; the server applies nothing and releases the exchange's weight well before its 30 s
    deadline, and no tensor stream is left half-received."""
    async def body(a, b):
        router = b.daemon.router
        honest = router._handlers[AverageOffer]

        async def ignore_the_offered_cap(session, env):  # b reads 1/2 where a offered only 0.3, accepts 1/3
            await honest(session, dataclasses.replace(env, message=dataclasses.replace(env.message, max_weight=0.5)))

        router._handlers[AverageOffer] = ignore_the_offered_cap
        a.budget.serving["someone-else"] = 0.7
        before_a, before_b = total(a), total(b)
        result = await a.exchange(b.me, "params")
        assert not result.ok and "inconsistent accept" in result.reason, result
        await until(lambda: not b.budget.serving, 3)
        assert "aborted by them: inconsistent accept" in b.stats.last_error
        a_session = a.membership.connected()[b.me]
        # b's tensors still arrive whole, and a drops them: nothing half-received
        await until(lambda: not a_session._streams, 3)
        assert (total(a), total(b)) == (before_a, before_b)  # neither side applied anything
        router._handlers[AverageOffer] = honest
        del a.budget.serving["someone-else"]
        result = await a.exchange(b.me, "params")  # and the pair still exchanges afterwards
        assert result.ok, result.reason

    trio.run(run_pair, body)


def test_colliding_offers_the_winner_is_served_with_the_losers_reservation():
    """Both ends initiate at once (as every peer does in a D-PSGD round). The smaller peer ID's offer wins;
    the loser serves it with the weight it had set aside for its own offer, which is refused or never
    sent. Here the loser has 1/2 in flight elsewhere, so without that hand-over it would have no room."""
    async def body(a, b):
        small, large = (a, b) if a.me < b.me else (b, a)
        large.budget.serving["someone-else"] = 0.5
        before = total(a) + total(b)
        results = {}

        async def go(x, y):
            results[x.me] = await x.exchange(y.me, "params", rule="metropolis")

        async with trio.open_nursery() as n:
            n.start_soon(go, small, large)
            n.start_soon(go, large, small)
        assert results[small.me].ok, results[small.me].reason
        assert results[small.me].weight == 0.5
        assert not results[large.me].ok and "already in flight" in results[large.me].reason
        await until(lambda: large.stats.served >= 1, 5)
        assert abs(total(a) + total(b) - before) < 1e-6 * before
        np.testing.assert_allclose(a.groups["params"].tensors["w"], 2.0)
        np.testing.assert_allclose(b.groups["params"].tensors["w"], 2.0)
        assert not small.budget.initiating and not large.budget.initiating and list(large.budget.serving) == ["someone-else"]

    trio.run(run_pair, body)


def test_a_failed_snapshot_gives_the_reservation_back():
    """Whatever stops an exchange after the initiator set its weight aside (here the snapshot raises; a
    cancellation is the same path) returns that weight: a leak would block this neighbour for good."""
    async def body(a, b):
        group = a.groups["params"]
        real = group.snapshot

        def broken():
            raise RuntimeError("disk on fire")

        group.snapshot = broken
        try:
            await a.exchange(b.me, "params")
        except RuntimeError:
            pass
        else:
            raise AssertionError("the snapshot's error should reach the caller")
        assert not a.budget.initiating
        group.snapshot = real
        result = await a.exchange(b.me, "params")
        assert result.ok, result.reason

    trio.run(run_pair, body)


def test_a_bad_tensor_from_the_server_changes_nothing():
    """A server whose tensor turns out short, or holds an Inf near its end, fails the exchange with the
    reason; neither side applies anything, and the pair exchanges normally afterwards."""
    from peer.session.groups import OutgoingGroup

    real_send = OutgoingGroup.send

    async def body(a, b):
        bad_session = b.membership.connected()[a.me]
        before_a, before_b = total(a), total(b)
        for lie, reason in (("short", "does not match"), ("inf", "NaN/Inf")):
            async def lying_send(group, arrays, codec="raw", **kw):
                if group.session is bad_session:
                    arr = arrays[0].copy()
                    if lie == "short":
                        arr = arr[:-10]
                    else:
                        arr[-3] = np.inf
                    arrays = [arr]
                await real_send(group, arrays, codec=codec, **kw)

            OutgoingGroup.send = lying_send
            try:
                result = await a.exchange(b.me, "params")
            finally:
                OutgoingGroup.send = real_send
            assert not result.ok and reason in result.reason, (lie, result)
            await until(lambda: not b.budget.serving, 3)
            assert (total(a), total(b)) == (before_a, before_b), lie
        result = await exchange_and_wait(a, b)
        assert result.ok, result.reason
        np.testing.assert_allclose(a.groups["params"].tensors["w"], 1 + 2 / 3, rtol=1e-6)

    trio.run(run_pair, body)


def test_an_initiator_that_gives_up_before_the_reply_still_calls_the_exchange_off():
    """The server is slow to accept (its snapshot does not finish until the initiator has given up) and the
    initiator's 0.5 s deadline passes first. The initiator still sends an abort naming its offer, so the
    server, finding it as its snapshot is done, neither accepts nor sends anything and is free at once,
    instead of streaming its tensor to nobody and then waiting its own 30 s deadline for a commit."""
    import threading

    async def body(a, b):
        a.cfg = dataclasses.replace(a.cfg, exchange_timeout=0.5)
        group = b.groups["params"]
        real = group.snapshot
        released = threading.Event()

        def slow():
            released.wait(10)
            return real()

        group.snapshot = slow
        before_a, before_b = total(a), total(b)
        result = await a.exchange(b.me, "params")
        assert not result.ok and result.reason == "deadline passed", result
        # the abort reached b while its snapshot still runs
        await until(lambda: any(s.abort_reason for s in b.server.served.values()), 5)
        released.set()
        await until(lambda: not b.budget.serving, 5)
        assert "aborted by them before we accepted: deadline passed" in b.stats.last_error
        assert (total(a), total(b)) == (before_a, before_b)
        assert not a.membership.connected()[b.me]._streams  # nothing of b's arrived for nobody
        group.snapshot = real
        a.cfg = dataclasses.replace(a.cfg, exchange_timeout=30.0)
        result = await exchange_and_wait(a, b)
        assert result.ok, result.reason

    trio.run(run_pair, body)


def test_apply_adds_the_weighted_difference_block_by_block_and_leaves_the_received_copy_alone(monkeypatch):
    """Blocks smaller than the tensor, and a last block shorter than the others, give the whole-tensor result."""
    import peer.averaging.shared

    monkeypatch.setattr(peer.averaging.shared, "APPLY_BLOCK_BYTES", 4 * 1000)  # 1000 floats a block, 3 blocks and a tail
    rng = np.random.default_rng(3)
    x, other = rng.standard_normal(3500).astype(np.float32), rng.standard_normal(3500).astype(np.float32)
    own, received, start = x.copy(), other.copy(), x.copy()
    group = SharedTensors("g", {"x": x})
    group.apply(0.25, [received], [own])
    np.testing.assert_allclose(x, start + 0.25 * (other - start), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(received, other)  # only read: it becomes a later snapshot's buffer
    expected = np.linalg.norm(other.astype(np.float64) - start) / np.linalg.norm(start.astype(np.float64))
    assert abs(group.last_distance - expected) < 1e-5 * expected


def test_torch_cpu_tensors_take_the_blocked_update_and_give_the_same_result(monkeypatch):
    import torch

    import peer.averaging.shared

    monkeypatch.setattr(peer.averaging.shared, "APPLY_BLOCK_BYTES", 4 * 1000)
    rng = np.random.default_rng(4)
    start, other = rng.standard_normal((50, 70)).astype(np.float32), rng.standard_normal((50, 70)).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(start.copy()))  # requires grad, as a model's would
    group = SharedTensors("g", {"w": param})
    calls = []
    monkeypatch.setattr(torch.Tensor, "add_", lambda *a, **k: calls.append(a))  # the whole-tensor path's last step
    group.apply(0.25, [torch.from_numpy(other.copy())], [torch.from_numpy(start.copy())])
    assert not calls
    np.testing.assert_allclose(param.detach().numpy(), start + 0.25 * (other - start), rtol=0, atol=1e-6)


def test_a_group_refuses_a_non_contiguous_tensor():
    import pytest

    with pytest.raises(ValueError, match="not contiguous"):
        SharedTensors("g", {"w": np.zeros((4, 6), dtype=np.float32)[:, ::2]})



def test_a_group_refuses_integer_tensors_with_a_reason():
    """w * (b - a) cannot land in an integer tensor (numpy and torch both refuse the cast, mid-update):
    refused when the trainer shares it, not at its first exchange."""
    import pytest
    import torch

    with pytest.raises(ValueError, match=r"'steps' of group 'g' is int64: .*floating-point"):
        SharedTensors("g", {"w": np.zeros(4, np.float32), "steps": np.zeros(1, np.int64)})
    with pytest.raises(ValueError, match="num_batches_tracked"):
        SharedTensors("g", {"n": torch.zeros(1, dtype=torch.int64)})
    for dtype in (np.float16, np.float32, np.float64):
        SharedTensors("g", {"w": np.zeros(4, dtype)})
    SharedTensors("g", {"w": torch.zeros(4, dtype=torch.bfloat16)})

def test_bfloat16_tensors_which_numpy_cannot_view_use_the_torch_update():
    import torch

    start, other = torch.arange(12, dtype=torch.bfloat16), torch.full((12,), 4.0, dtype=torch.bfloat16)
    x = start.clone()
    SharedTensors("g", {"w": x}).apply(0.5, [other.clone()], [start.clone()])
    torch.testing.assert_close(x, (start.float() + 0.5 * (other.float() - start.float())).to(torch.bfloat16))


def test_float16_distance_is_summed_wide_enough_not_to_overflow():
    start = np.full(4096, 100.0, dtype=np.float16)  # squares sum to 4.1e7, far past float16's 65504
    x = start.copy()
    group = SharedTensors("g", {"w": x})
    group.apply(0.5, [np.full(4096, 300.0, dtype=np.float16)], [start.copy()])
    np.testing.assert_array_equal(x, np.full(4096, 200.0, dtype=np.float16))
    assert abs(group.last_distance - 2.0) < 1e-6


def test_the_server_sends_in_the_offers_codec_whatever_its_own_group_says():
    """The offer names the exchange's codec: a server whose group is set to q8 still answers a raw offer raw
    (it used to send in its own codec), and a q8 offer gets q8 from a raw server."""
    async def body(a, b):
        rng = np.random.default_rng(6)
        start_a = rng.standard_normal(50_000).astype(np.float32)
        start_b = rng.standard_normal(50_000).astype(np.float32)
        a.groups["params"].tensors["w"][:] = start_a
        b.groups["params"].tensors["w"][:] = start_b
        b.groups["params"].codec = "q8"
        assert (await exchange_and_wait(a, b)).ok
        raw = a.groups["params"].wire_nbytes("raw")
        assert b.stats.bytes_sent == raw  # (q8 would be about a quarter)
        # a received b's exact values: raw, not quantized
        np.testing.assert_allclose(a.groups["params"].tensors["w"], start_a + (start_b - start_a) / 3, rtol=0, atol=1e-6)
        a.groups["params"].codec, b.groups["params"].codec = "q8", None
        assert (await exchange_and_wait(a, b)).ok
        assert b.stats.bytes_sent == raw + b.groups["params"].wire_nbytes("q8")

    trio.run(run_pair, body)


def test_what_one_end_counts_as_sent_the_other_counts_as_received():
    """`bytes_received` is its own count (it used to repeat `bytes_sent`): over exchanges in both directions
    and codecs set differently at each end, each end's received bytes are the other's sent bytes."""
    async def body(a, b):
        b.groups["params"].codec = "float16"
        for x, y in ((a, b), (b, a), (a, b)):
            assert (await exchange_and_wait(x, y)).ok
        sa, sb = a.status(), b.status()
        assert sa["bytes_sent"] == sb["bytes_received"] and sb["bytes_sent"] == sa["bytes_received"]
        assert sa["bytes_sent"] == 2 * a.groups["params"].wire_nbytes("raw") + b.groups["params"].wire_nbytes("float16")

    trio.run(run_pair, body)


def test_a_refused_offer_carries_a_code_the_initiator_reads():
    """The initiator's result says why in a code (protocol/refusal.py), not only in words, whether the server
    refused or our own budget did."""
    from protocol.refusal import Code

    async def body(a, b):
        b.budget.serving["someone-else"] = 0.95
        result = await a.exchange(b.me, "params")
        assert not result.ok and result.code is Code.BUSY and "too much weight in flight" in result.reason
        del b.budget.serving["someone-else"]
        b.topology.neighbours = []
        result = await a.exchange(b.me, "params")
        assert not result.ok and result.code is Code.NOT_NEIGHBOUR, result
        a.budget.serving["someone-else"] = 0.95
        result = await a.exchange(b.me, "params")
        assert result.code is Code.BUSY and b.stats.rejected == 2  # ours: decided before any offer went out
        assert (await a.exchange(b.me, "nothing")).code is Code.NO_GROUP

    trio.run(run_pair, body)


def test_a_partner_past_its_share_of_our_moves_is_refused_as_busy_both_ways():
    """peer/averaging/shares.py at the door: a partner that moved our group past its share lately is refused
    when it offers (a code, no strike) and never picked or offered to by us, until its window drains."""
    from protocol.refusal import Code

    async def body(a, b):
        now = trio.current_time()
        b.radii.shares.record("params", "someone-else", 1.0, now)
        for _ in range(3):  # moves that do not close in (one alone, or shrinking ones, have a floor: shares.py)
            b.radii.shares.record("params", a.me, 10.0, now)
        result = await a.exchange(b.me, "params")
        assert not result.ok and result.code is Code.BUSY and "moved our 'params'" in result.reason, result
        assert b.ledger.banned(a.me) is None  # no strike for it
        a.radii.shares.record("params", "someone-else", 1.0, now)
        for _ in range(3):
            a.radii.shares.record("params", b.me, 10.0, now)
        rejected = b.stats.rejected
        result = await a.exchange(b.me, "params")
        assert result.code is Code.BUSY and "moved our" in result.reason and b.stats.rejected == rejected  # ours
        assert await a.average("params") == []  # b is the only neighbour, and past its share
        a.radii.shares.forget("params")
        b.radii.shares.forget("params")
        result = await exchange_and_wait(a, b)
        assert result.ok, result.reason

    trio.run(run_pair, body)

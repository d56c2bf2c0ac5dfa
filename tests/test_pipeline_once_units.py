"""At most once per stage (issue 28), without daemons: the book of gradients a server keeps until their driver
acknowledges them, a stage server's rules for acks (added once, dropped unacknowledged, a repeat or a
stranger's ack ignored, the bounds), the driver's acks around a lost reply and a failed microbatch, and the
ack messages' range checks on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from peer.averaging.bans import BAN_AFTER
from peer.config import PipelineSection
from peer.pipeline.driver import NO_LOSS, Driver, _CallFailed
from peer.pipeline.kept import KeptGradients
from peer.pipeline.server import LOCAL_DRIVER, ServedStage, StageServer
from peer.testing.verify_sim import PeerSession
from peertrain.pipeline import Microbatch, PipelineKey, StagePeer
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.messages import Envelope
from protocol.refusal import Code, Refusal, Refused
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.pipeline import MAX_ACK_IDS, StageAck, StageAckReply, StageCall, StageReply
from tests.test_pipeline_units import roundtrip, tampered

HOLD = 100.0
BATCH = 8


@dataclass(eq=False)
class Held:
    """A stage handler's held gradient: adds `samples` to its stage's tally when accumulated."""

    stage: "FakeStage"
    samples: int = BATCH
    nbytes: int = 1000
    stale: bool = False
    deferred: bool = False

    def accumulate(self) -> bool:
        if self.stale:
            return False
        self.stage.taken.append(self.samples)
        return True

    def release(self) -> None:
        self.stage.released.append(self.samples)


class FakeStage:
    """A stage handler whose "backward" and "loss" hold a gradient; accepts any call (no tensors)."""

    def __init__(self, kinds=("forward", "backward")):
        self._kinds, self.taken, self.released = kinds, [], []

    def kinds(self):
        return self._kinds

    def input_specs(self, kind, batch):
        return []

    def compute(self, kind, tensors, seed):
        held = Held(self) if kind in ("backward", "loss") else None
        return (1.5 if kind in ("loss", "evaluate") else None), [0], held


def book(**kw) -> KeptGradients:
    return KeptGradients(hold_s=HOLD, **kw)


# ---- the book of kept gradients ---------------------------------------------------------------------------

def test_a_kept_gradient_is_taken_once_and_a_repeat_finds_nothing():
    b, st = book(), FakeStage()
    i = b.keep("d", "owner", Held(st), 0.0)
    assert len(b) == 1 and b.nbytes == 1000
    [k] = b.take("d", [i, i], 1.0)  # the same id twice in one ack: taken once
    assert k.id == i and k.driver == "d" and len(b) == 0 and b.nbytes == 0
    assert b.take("d", [i], 2.0) == []
    assert b.stats.acked == 1 and b.stats.ignored == {"unknown": 1}


def test_an_ack_from_a_stranger_changes_nothing_and_the_driver_still_takes_it():
    b = book()
    i = b.keep("d", "owner", Held(FakeStage()), 0.0)
    assert b.take("eve", [i, 12345], 1.0) == []
    b.drop("eve", [i], 1.0)  # nor can a stranger drop it
    assert len(b) == 1 and b.stats.ignored == {"stranger": 2, "unknown": 1}
    assert [k.id for k in b.take("d", [i], 2.0)] == [i]


def test_an_unacknowledged_gradient_is_dropped_after_the_hold():
    b = book()
    old = b.keep("d", "owner", Held(FakeStage()), 0.0)
    new = b.keep("d", "owner", Held(FakeStage()), 50.0)
    b.expire(HOLD - 0.01)
    assert len(b) == 2
    b.expire(HOLD)
    assert len(b) == 1 and b.stats.dropped == {"unacked": 1}
    assert b.take("d", [old], HOLD) == [] and [k.id for k in b.take("d", [new], HOLD)] == [new]


def test_a_failed_microbatch_drops_its_gradients_and_a_stage_switch_drops_the_old_stages():
    b = book()
    gi, gj, gk = Held(FakeStage()), Held(FakeStage()), Held(FakeStage())
    i, j = b.keep("d", "s1", gi, 0.0), b.keep("d", "s1", gj, 0.0)
    k = b.keep("d", "s2", gk, 0.0)
    b.drop("d", [i], 1.0)
    b.drop_all_but("s2", "stale")
    b.discard(k, "unsent")
    b.discard(k, "unsent")  # gone already: nothing more
    assert len(b) == 0 and b.stats.dropped == {"failed": 1, "stale": 1, "unsent": 1} and b.stats.acked == 0
    assert b.take("d", [i, j, k], 2.0) == []
    # a failed microbatch's gradient (and a check's) is released: taken out of the stage, or its steps wait for it
    # (a stage of the verify swarm test never stepped); a stale one went with the state it was computed for
    assert b.take_released() == [gi, gk]


def test_the_bounds_drop_the_oldest_a_driver_only_its_own():
    b = book(most=4, most_per_driver=2, most_bytes=10_000)
    st = FakeStage()
    a1, a2 = b.keep("a", 0, Held(st), 0.0), b.keep("a", 0, Held(st), 1.0)
    c1 = b.keep("c", 0, Held(st), 2.0)
    a3 = b.keep("a", 0, Held(st), 3.0)  # a's third: a's oldest goes, not c's
    assert b.stats.dropped == {"full": 1} and b.take("a", [a1], 4.0) == []
    c2 = b.keep("c", 0, Held(st), 4.0)
    e1 = b.keep("e", 0, Held(st), 5.0)  # a fifth in all: the oldest of the largest holders (a and c: a2) goes
    assert b.stats.dropped == {"full": 2} and len(b) == 4
    assert [k.id for k in b.take("a", [a2, a3], 6.0)] == [a3]
    b.keep("e", 0, Held(st, nbytes=9_000), 7.0)  # bytes: the largest holder's oldest go until it fits
    # c held the most (c1 goes), then c and e tie: the newcomer e loses its own (e1), never c's last
    assert b.nbytes <= 10_000 and [k.id for k in b.take("c", [c1, c2], 8.0)] == [c2]
    assert b.take("e", [e1], 8.0) == [] and b.stats.dropped == {"full": 4}
    huge = b.keep("e", 0, Held(st, nbytes=50_000), 9.0)  # larger than the bound alone: kept alone
    assert len(b) == 1 and [k.id for k in b.take("e", [huge], 10.0)] == [huge]


def test_drivers_that_never_ack_only_evict_each_other_and_the_bytes_are_bounded_per_driver():
    """Three drivers keep gradients and never acknowledge; an honest driver's few (its microbatches in flight)
    stay, however much the others push: the full book's entry to go is the largest holder's oldest."""
    b = book(most=12, most_per_driver=6, most_bytes=1 << 30, most_bytes_per_driver=1 << 29)
    st = FakeStage()
    honest = [b.keep("honest", 0, Held(st), 0.0) for _ in range(3)]
    t = 1.0
    for _ in range(40):
        for bad in ("bad1", "bad2", "bad3"):
            b.keep(bad, 0, Held(st), t)
            t += 0.1
    assert len(b) == 12 and b.stats.dropped["full"] > 0
    # room for 12: the honest three stay, the three others share the rest and evict only one another
    assert [k.id for k in b.take("honest", honest, t)] == honest
    # bytes per driver: past its share a driver loses its own oldest, nobody else's
    small = book(most_bytes_per_driver=2_500)
    other = small.keep("x", 0, Held(st), 0.0)
    mine = [small.keep("y", 0, Held(st), 0.0) for _ in range(3)]
    assert [k.id for k in small.take("y", mine, 1.0)] == mine[1:] and small.take("x", [other], 1.0)


# ---- a stage server's rules ----------------------------------------------------------------------------------

KEY = PipelineKey("p", (2,))


def stage_call(stage: int, kind: str) -> StageCall:
    return StageCall(pipeline="p", stage=stage, kind=kind, batch=BATCH, seed=1, tensors=[], streams=[], cuts=[2])


def served(stage: int = 1, kinds=("loss", "evaluate")) -> tuple[StageServer, FakeStage]:
    handler = FakeStage(kinds)
    srv = StageServer(PipelineSection(max_call_timeout=HOLD / 2))
    srv.switch(ServedStage(KEY, stage, 16, handler))
    return srv, handler


class AckSession:
    """A session that records the replies a server sends."""

    def __init__(self, peer_id: str):
        self.peer_id, self.short, self.replies = peer_id, peer_id[:8], []

    async def reply(self, env, message):
        self.replies.append(message)


def run(fn):
    return trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_served_gradient_enters_the_stage_once_on_its_drivers_ack():
    srv, stage = served()

    async def main():
        loss, _, i, _ = await srv.compute_local(stage_call(1, "loss"), [])
        assert loss == 1.5 and i and stage.taken == [] and srv.stats.accumulated_samples == 0
        _, _, none, _ = await srv.compute_local(stage_call(1, "evaluate"), [])
        assert none == 0 and len(srv.kept) == 1  # no gradient, nothing kept
        assert await srv.acknowledge("stranger", [i]) == [] and stage.taken == []
        assert await srv.acknowledge(LOCAL_DRIVER, [i]) == [i]
        assert await srv.acknowledge(LOCAL_DRIVER, [i]) == []  # a repeat
        assert stage.taken == [BATCH] and srv.stats.accumulated_samples == BATCH
        assert srv.stats.accumulated_by_stage == {1: BATCH}
        assert srv.kept.stats.ignored == {"stranger": 1, "unknown": 1} and srv.kept.stats.acked == 1
    run(main)


def test_a_peers_ack_is_answered_with_what_entered_and_a_drop_with_nothing():
    srv, stage = served()

    async def main():
        ids = []
        for _ in range(3):
            ids.append((await srv.compute_local(stage_call(1, "loss"), []))[2])
        for k in srv.kept._kept.values():  # kept for a peer "drv", as a call over the wire is
            k.driver = "drv"
        drv, eve = AckSession("drv"), AckSession("eve")
        async with trio.open_nursery() as n:
            await srv.on_ack(eve, Envelope(StageAck(kept=ids), 7, 0), n)
            await srv.on_ack(drv, Envelope(StageAck(kept=[ids[0], ids[1]]), 8, 0), n)
            await srv.on_ack(drv, Envelope(StageAck(kept=[ids[2]], accumulate=False), 9, 0), n)
        assert eve.replies == [StageAckReply()]
        # the drop is answered at once; the ack once its gradients entered the stage (in a worker thread)
        assert drv.replies == [StageAckReply(), StageAckReply(accumulated=ids[:2])]
        assert stage.taken == [BATCH, BATCH] and len(srv.kept) == 0
        assert srv.kept.stats.dropped == {"failed": 1} and srv.kept.stats.ignored == {"stranger": 3}
    run(main)


def test_a_deferred_gradient_is_answered_as_entered_then_added():
    """A gradient computed on its ack (deferred: trainers/pipeline/stage.py) is answered once claimed, without
    waiting for its computation, and added right after; held ones in the same ack are added before the reply."""
    srv, stage = served()

    async def main():
        ids = [(await srv.compute_local(stage_call(1, "loss"), []))[2] for _ in range(2)]
        kept = list(srv.kept._kept.values())
        for k in kept:
            k.driver = "drv"
        kept[1].gradient.deferred = True
        drv = AckSession("drv")
        async with trio.open_nursery() as n:
            await srv.on_ack(drv, Envelope(StageAck(kept=ids), 8, 0), n)
        assert drv.replies == [StageAckReply(accumulated=ids)]
        assert stage.taken == [BATCH, BATCH] and srv.stats.accumulated_by_stage == {1: 2 * BATCH}
    run(main)


def test_unacknowledged_gradients_expire_and_a_stage_switch_or_new_state_drops_them():
    srv, stage = served()

    async def main():
        _, _, lost, _ = await srv.compute_local(stage_call(1, "loss"), [])
        await trio.sleep(srv.kept.hold_s + 1)  # past the longest microbatch (kept.py): nobody acknowledged it
        assert await srv.acknowledge(LOCAL_DRIVER, [lost]) == [] and srv.kept.stats.dropped == {"unacked": 1}
        _, _, moved, _ = await srv.compute_local(stage_call(1, "loss"), [])
        _, _, replaced, _ = await srv.compute_local(stage_call(1, "loss"), [])
        srv.kept._kept[replaced].gradient.stale = True  # the stage loaded a peer's state since
        srv.switch(ServedStage(KEY, 1, 16, stage))  # a new serving of stage 1: what was kept is another's
        assert await srv.acknowledge(LOCAL_DRIVER, [moved, replaced]) == []
        srv.switch(srv.stage)  # the same: nothing dropped
        _, _, kept, _ = await srv.compute_local(stage_call(1, "loss"), [])
        srv.kept._kept[kept].gradient.stale = True
        srv.switch(srv.stage)
        assert await srv.acknowledge(LOCAL_DRIVER, [kept]) == []
        assert stage.taken == [] and srv.stats.accumulated_samples == 0
        assert srv.kept.stats.dropped == {"unacked": 1, "stale": 3}
    run(main)


# ---- the driver's acks ---------------------------------------------------------------------------------------

DRIVER_CFG = PipelineSection(max_retries=2, verify_fraction=0.0)


def swarm(stages: int, peers_per_stage: dict[int, int], script) -> tuple[Driver, dict[str, tuple[StageServer, FakeStage]]]:
    """A driver over `stages` stages served by in-process servers ("s<stage>p<i>"); `script(pid, stage, kind, n)`
    may raise to make the n-th call of that kind to that stage fail after (or instead of) computing it: an
    exception class raised after the server computed (its reply lost), an instance raised instead."""
    key = PipelineKey("p", tuple(range(1, stages)))
    servers = {}
    smap = {}
    for s in range(stages):
        smap[s] = []
        for i in range(peers_per_stage.get(s, 1)):
            pid = f"s{s}p{i}"
            kinds = ("loss", "evaluate") if s == stages - 1 else ("forward", "backward")
            srv = StageServer(PipelineSection(max_call_timeout=HOLD / 2))
            srv.switch(ServedStage(key, s, 16, FakeStage(kinds)))
            servers[pid] = (srv, srv.stage.handler)
            smap[s].append(StagePeer(pid, s, 10.0, 0))
    service = SimpleNamespace(cfg=DRIVER_CFG, me="me", stage_map=lambda k: smap,
                              session_of=lambda pid: PeerSession(servers[pid][0]))
    driver = Driver(service, key, reply_shapes=lambda *a: [])
    calls: dict = {}

    async def call_once(pid, peer, mb, stage, kind, tensors):
        n = calls[(stage, kind)] = calls.get((stage, kind), 0) + 1
        fault = script(pid, stage, kind, n)
        if isinstance(fault, BaseException):
            raise fault
        call = StageCall(pipeline="p", stage=stage, kind=kind, batch=mb.batch, seed=1, tensors=[], streams=[],
                         cuts=list(key.cuts))
        result = await servers[pid][0].compute_local(call, [])
        if fault is not None:
            raise fault(f"{kind} reply from {pid} lost after its compute")
        return result

    driver._call_once = call_once
    return driver, servers


def microbatches(driver: Driver, n: int, *, gap: float = 0.0) -> list:
    """`n` microbatches in turn, `gap` seconds apart (virtual time)."""
    async def one(i):
        await trio.sleep(gap)
        return await driver.run(Microbatch(i, SimpleNamespace(shape=(BATCH,)), None, seed=i))

    async def main():
        return [await one(i) for i in range(n)]
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def taken(servers, stage: int) -> int:
    return sum(sum(h.taken) for pid, (_, h) in servers.items() if pid.startswith(f"s{stage}p"))


def test_a_reply_lost_after_the_compute_and_sent_again_enters_its_stage_once():
    lose_first_loss = lambda pid, stage, kind, n: _CallFailed if (stage, kind, n) == (2, "loss", 1) else None  # noqa: E731
    driver, servers = swarm(3, {2: 2}, lose_first_loss)
    outs = microbatches(driver, 3)
    assert all(o.ok for o in outs) and outs[0].resent == 1
    assert sum(srv.stats.served for pid, (srv, _) in servers.items() if pid.startswith("s2")) == 4  # one twice
    for s in range(3):
        assert taken(servers, s) == 3 * BATCH, s
    d = driver.stats
    assert d.done == 3 and d.samples == 3 * BATCH and d.acked == 9 and d.ack_lost == 0
    assert [d.acked_samples[s] for s in range(3)] == [3 * BATCH] * 3  # done x microbatch, every stage
    assert sum(len(srv.kept) for srv, _ in servers.values()) == 1  # the lost reply's, until it expires


def test_a_microbatch_failed_at_the_first_stage_leaves_no_gradient_in_the_later_ones():
    bad = Refused(Refusal(Code.BAD_INPUT, "injected"))
    fail_first_backward = lambda pid, stage, kind, n: bad if (stage, kind, n) == (0, "backward", 1) else None  # noqa: E731
    driver, servers = swarm(3, {}, fail_first_backward)
    outs = microbatches(driver, 3)
    assert [o.ok for o in outs] == [False, True, True]
    for s in range(3):
        assert taken(servers, s) == 2 * BATCH, s
    assert sum(len(srv.kept) for srv, _ in servers.values()) == 0  # dropped at once, as the driver asked
    assert [servers[f"s{s}p0"][0].kept.stats.dropped.get("failed", 0) for s in range(3)] == [0, 1, 1]
    d = driver.stats
    assert d.done == 2 and d.failed == 1 and d.dropped == 2 and d.acked == 6
    assert [d.acked_samples[s] for s in range(3)] == [2 * BATCH] * 3


def test_an_ack_that_finds_its_gradient_gone_is_counted_lost_and_the_microbatch_not_done():
    driver, servers = swarm(2, {}, lambda *a: None)
    servers["s1p0"][0].kept.hold_s = 0.0  # the last stage drops its gradient before the ack comes
    [out] = microbatches(driver, 1)
    assert not out.ok and "stage 1 no longer had its gradient" in out.reason
    assert driver.stats.ack_lost == 1 and driver.stats.acked == 1
    assert driver.stats.done == 0 and driver.stats.failed == 1
    assert [driver.stats.acked_samples[s] for s in range(2)] == [BATCH, 0]
    assert taken(servers, 1) == 0 and taken(servers, 0) == BATCH


def test_a_server_blaming_the_driver_is_struck_banned_and_its_calls_retried_elsewhere_once_each():
    """Issue 39: a bad server of stage 1 refuses every call as the driver's fault (or answers its loss call
    without a loss, its gradient kept). No microbatch fails: each is re-sent to the honest peer of the stage,
    the bad one is struck each time and banned after three, and each stage still takes each microbatch once."""
    blame = Refused(Refusal(Code.WRONG_SPECS, "your tensors are wrong (a lie)"))
    script = lambda pid, stage, kind, n: blame if pid == "s1p0" else None  # noqa: E731
    driver, servers = swarm(2, {1: 2}, script)
    fast = driver._call_once

    async def honest_is_slower(pid, peer, mb, stage, kind, tensors):  # so the balancer keeps trying the liar
        if pid == "s1p1":
            await trio.sleep(2.0)
        return await fast(pid, peer, mb, stage, kind, tensors)

    driver._call_once = honest_is_slower
    n = 12
    outs = microbatches(driver, n, gap=DRIVER_CFG.max_ban)  # past the balancer's avoidance: it is tried again
    assert all(o.ok for o in outs), [o.reason for o in outs]
    assert driver.stats.struck["s1p0"] >= BAN_AFTER  # banned each time its strikes add up again
    assert [p for p, _, _ in driver.verifier.bans.active(0.0)] == ["s1p0"]
    for s in range(2):
        assert taken(servers, s) == n * BATCH, s
    assert servers["s1p0"][0].stats.served == 0

    # a loss-less reply: the bad server computes (and keeps its gradient), then answers without the loss
    driver, servers = swarm(2, {1: 2}, lambda *a: None)
    answered = driver._call_once

    async def lossless(pid, peer, mb, stage, kind, tensors):
        if pid == "s1p1":
            await trio.sleep(2.0)
        loss, outputs, kept, seconds = await answered(pid, peer, mb, stage, kind, tensors)
        if pid == "s1p0":  # what the real _call_once makes of a loss call answered without a loss
            raise Refused(NO_LOSS)
        return loss, outputs, kept, seconds

    driver._call_once = lossless
    outs = microbatches(driver, 6, gap=DRIVER_CFG.max_ban)
    assert all(o.ok for o in outs) and driver.stats.struck["s1p0"] >= 1
    assert servers["s1p0"][0].stats.served >= 1 and sum(servers["s1p0"][1].taken) == 0  # its gradients never enter
    assert taken(servers, 1) == 6 * BATCH


def test_a_blamed_call_with_no_other_peer_of_its_stage_fails_at_once_and_strikes_nobody():
    blame = Refused(Refusal(Code.BAD_INPUT, "NaN"))
    driver, servers = swarm(2, {}, lambda pid, stage, kind, n: blame if stage == 1 else None)
    [out] = microbatches(driver, 1)
    assert not out.ok and out.resent == 0 and not driver.stats.struck
    assert sum(len(srv.kept) for srv, _ in servers.values()) == 0


def test_an_ack_nobody_answers_is_counted_lost_but_fails_nothing():
    """The server died after keeping the gradient: nobody can tell whether it entered, so the microbatch is done
    (a kill of a stage peer loses no microbatch), and the lost ack counted."""
    from peer.session.transport import SessionClosed

    class Dead:
        async def request(self, message, *, timeout):
            raise SessionClosed("remote closed the connection")

    driver, servers = swarm(2, {}, lambda *a: None)
    driver.service.session_of = lambda pid: Dead() if pid == "s1p0" else PeerSession(servers[pid][0])
    [out] = microbatches(driver, 1)
    assert out.ok and driver.stats.ack_lost == 1 and driver.stats.acked == 1 and driver.stats.done == 1


def test_an_ack_after_the_idle_session_closed_redials_and_its_gradient_enters():
    """Partial views close a session idle for 30 s; an ack then finds none and redials (`reach`), waiting out a
    busy lookup, instead of leaving the gradient to expire there."""
    from peer.membership.reach import ReachBusy

    driver, servers = swarm(2, {}, lambda *a: None)
    busy = {"left": 2}
    redialed: list[str] = []

    async def reach(pid):
        if busy["left"]:
            busy["left"] -= 1
            raise ReachBusy("4 lookups pending")
        redialed.append(pid)
        return PeerSession(servers[pid][0])

    driver.service.session_of = lambda pid: None  # idle: closed by the view driver
    driver.service.reach = reach
    outs = microbatches(driver, 2)
    assert all(o.ok for o in outs) and driver.stats.ack_lost == 0 and driver.stats.acked == 4
    assert taken(servers, 0) == taken(servers, 1) == 2 * BATCH and redialed


def test_a_server_keeping_a_gradient_for_us_keeps_its_session_until_the_ack():
    driver, servers = swarm(2, {}, lambda *a: None)
    srv = servers["s1p0"][0]

    async def main():
        call = StageCall(pipeline="p", stage=1, kind="loss", batch=BATCH, seed=1, tensors=[], streams=[], cuts=[1])
        _, _, kept, _ = await srv.compute_local(call, [])
        driver.acks.owe("s1p0", +1)  # as _call_once does for a reply naming a kept gradient
        assert driver.calling("s1p0") and not driver.calling("s0p0")
        assert await driver.acks.ack("s1p0", [kept], True) == ({kept}, set())
        assert not driver.calling("s1p0")
    run(main)


# ---- wire ------------------------------------------------------------------------------------------------

def test_acks_and_kept_ids_round_trip():
    for m in (StageAck(kept=[1]), StageAck(kept=list(range(1, MAX_ACK_IDS + 1)), accumulate=False),
              StageAck(kept=[2**64 - 1]), StageAckReply(), StageAckReply(accumulated=[5, 6]),
              StageReply(tensors=[], streams=[], kept=2**64 - 1)):
        assert roundtrip(m) == m


@pytest.mark.parametrize("msg, path, value", [
    (StageAck(kept=[1]), ["kept"], []),
    (StageAck(kept=[1]), ["kept"], [0]),
    (StageAck(kept=[1]), ["kept"], [-1]),
    (StageAck(kept=[1]), ["kept"], list(range(1, MAX_ACK_IDS + 2))),
    (StageAck(kept=[1]), ["kept"], ["1"]),
    (StageAck(kept=[1]), ["accumulate"], 1),
    (StageAckReply(), ["accumulated"], [0]),
    (StageAckReply(), ["accumulated"], list(range(1, MAX_ACK_IDS + 2))),
    (StageReply(tensors=[], streams=[]), ["kept"], -1),
    (StageReply(tensors=[], streams=[]), ["kept"], 1.5),
])
def test_an_ack_or_kept_id_out_of_range_is_a_protocol_error(msg, path, value):
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(msg, path, value), DEFAULT_LIMITS)


def test_an_ack_to_a_server_that_moved_stage_since_is_answered_moved_and_fails_nothing():
    """A server that moves stage (or loads a peer's state) drops what it kept for the stage it left, and with it
    everything that replica had accumulated: its ack is answered `moved`, counted, and the microbatch is done
    (failing the few still in flight would single them out of all the replica lost)."""
    moved_server: list = []

    def move_stage_1_before_the_ack(pid, stage, kind, n):
        if (stage, kind) == (0, "backward"):  # the last call: stage 1 kept its gradient and now moves
            srv = servers["s1p0"][0]
            srv.switch(ServedStage(PipelineKey("p", (1,)), 0, 16, FakeStage(("forward", "backward"))))
            moved_server.append(srv)
        return None
    driver, servers = swarm(2, {}, move_stage_1_before_the_ack)
    [out] = microbatches(driver, 1)
    assert out.ok and moved_server
    d = driver.stats
    assert d.done == 1 and d.failed == 0 and d.ack_moved == 1 and d.ack_lost == 0 and d.acked == 1
    assert moved_server[0].kept.stats.dropped == {"stale": 1}


def test_a_peers_ack_of_gradients_its_server_dropped_in_a_move_names_them_moved():
    srv, stage = served()

    async def main():
        ids = [(await srv.compute_local(stage_call(1, "loss"), []))[2] for _ in range(2)]
        for k in srv.kept._kept.values():
            k.driver = "drv"
        srv.switch(None)  # the stage left: what it kept goes, remembered as stale
        drv, eve = AckSession("drv"), AckSession("eve")
        async with trio.open_nursery() as n:
            await srv.on_ack(drv, Envelope(StageAck(kept=ids + [999]), 7, 0), n)
            await srv.on_ack(eve, Envelope(StageAck(kept=ids), 8, 0), n)
        assert drv.replies == [StageAckReply(moved=ids)]  # 999 was never kept: not moved
        assert eve.replies == [StageAckReply()]  # another driver's ids are not its to learn about
        assert stage.taken == []
    run(main)

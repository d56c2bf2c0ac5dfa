"""Stage servers in-process for a driver's checks (peer/pipeline/verify.py): each peer of a stage a real
`StageServer` over a handler that multiplies by its weight (a liar multiplies its answers by `lie`), the driver a
real `Driver` whose calls reach them without sockets. The verification tests' harness, and `peer bench sybil`'s
colluding servers."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import trio
import trio.testing

from peer.config import PipelineSection
from peer.pipeline.driver import Driver
from peer.pipeline.server import LOCAL_DRIVER, ServedStage, StageServer
from peertrain.pipeline import Microbatch, PipelineKey, StagePeer
from protocol.messages import Envelope
from protocol.schema.pipeline import StageAck, StageAckReply, StageCall

BATCH = 4


@contextmanager
def inline_compute() -> Iterator[None]:
    """The servers compute in the trio thread, not in a worker thread: under `MockClock(autojump_threshold=0)`
    a call waiting on a thread leaves the run loop idle, so the clock jumps to the next deadline (the call's
    timeout) while the thread computes, and the run spins the loop against the thread for the GIL. How long a
    thread took then decided whether calls timed out: 1 s alone, 25-300 s inside the unit tier (2026-11-28)."""
    async def run_sync(fn, *args, **kwargs):
        return fn(*args)
    saved = trio.to_thread.run_sync
    trio.to_thread.run_sync = run_sync
    try:
        yield
    finally:
        trio.to_thread.run_sync = saved


class Stage:
    """A stage handler that multiplies by its weight: forward x -> x w; backward g -> g w (the input's gradient),
    its parameter gradient held; loss: mean(x w), gradient w. A liar multiplies its answers by `lie`."""

    def __init__(self, last: bool, weight: float, lie: float = 1.0):
        self.last, self.weight, self.lie, self.taken = last, weight, lie, []

    def kinds(self):
        return ("loss", "evaluate") if self.last else ("forward", "backward")

    def input_specs(self, kind, batch):
        return []

    def compute(self, kind, tensors, seed):
        x = tensors[0] * self.weight
        if kind == "forward":
            return None, [x * self.lie], None
        if kind == "evaluate":
            return float(x.mean()), [], None
        held = SimpleNamespace(samples=BATCH, nbytes=100, deferred=False, accumulate=lambda: self.taken.append(BATCH) or True,
                               release=lambda: None)
        if kind == "loss":
            return float(x.mean()), [torch.full_like(tensors[0], self.weight) * self.lie], held
        return None, [tensors[1] * self.weight * self.lie], held


class PeerSession:
    """A peer's stage server reached in-process: the driver's acks go to its `acknowledge`."""

    def __init__(self, server: StageServer):
        self.server = server

    async def request(self, message, *, timeout):
        assert isinstance(message, StageAck)
        got = await self.server.acknowledge(LOCAL_DRIVER, message.kept, accumulate=message.accumulate)
        return Envelope(StageAckReply(accumulated=got, moved=self.server.kept.moved(LOCAL_DRIVER, message.kept)), 0, 1)


def pipeline(peers: dict[int, list[tuple[str, float]]], *, me: str = "me", fraction: float = 1.0):
    """A driver over stages whose peers are (id, lie) (lie 1.0: honest; each honest peer's weight a little
    different, as after its own steps); `me` is the driver's own peer ID."""
    stages = len(peers)
    key = PipelineKey("p", tuple(range(1, stages)))
    servers, smap = {}, {}
    for s, ps in peers.items():
        smap[s] = []
        for i, (pid, lie) in enumerate(ps):
            srv = StageServer(PipelineSection(max_call_timeout=50.0))
            srv.switch(ServedStage(key, s, 16, Stage(s == stages - 1, 1.0 + 0.002 * i, lie)))
            servers[pid] = srv
            smap[s].append(StagePeer(pid, s, 10.0, 0, me=pid == me))
    service = SimpleNamespace(cfg=PipelineSection(verify_fraction=fraction, max_retries=2), me=me,
                              stage_map=lambda k: smap, session_of=lambda pid: PeerSession(servers[pid]),
                              server=servers.get(me))
    driver = Driver(service, key, reply_shapes=lambda *a: [], rng=random.Random(1))
    for b in driver.balancers:
        b.rng = random.Random(2)

    async def call_once(pid, peer, mb, stage, kind, tensors):
        await trio.sleep(0.001 if pid == "liar" else 0.01)  # the liar is fast: the balancer gives it most calls
        call = StageCall(pipeline="p", stage=stage, kind=kind, batch=BATCH, seed=1, tensors=[], streams=[],
                         cuts=list(key.cuts))
        return await servers[pid].compute_local(call, tensors)

    driver._call_once = call_once
    return driver, servers


def drive(driver: Driver, n: int, evaluate: bool = False) -> list:
    gen = torch.Generator().manual_seed(0)

    async def main():
        return [await driver.run(Microbatch(i, torch.randn(BATCH, 3, generator=gen) + 2.0,
                                            torch.zeros(BATCH), seed=i, evaluate=evaluate)) for i in range(n)]
    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def taken(servers, pids) -> int:
    return sum(sum(servers[p].stage.handler.taken) for p in pids)

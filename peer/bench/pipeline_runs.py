"""One run of `peer bench pipeline --uneven/--churn` (peer/bench/pipeline_uneven.py): its daemons started with
their stages pinned, polled without waiting on a slow one, moved to their uneven CPU caps once every driver is
going, killed and restarted on their own homes; and the figures of a window of it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, wait
from contextlib import ExitStack
from pathlib import Path

from peer.bench import pipeline as base
from peer.bench import pipeline_rebalance as pr
from peer.bench.cpu_caps import CpuCaps
from peer.bench.pipeline_figures import Poll, driver_of
from peer.testing.swarm import LocalSwarm, rank_env, unique_swarm

STAGES = base.STAGES


class Poller(base.Poller):
    """Every daemon's status each POLL_S, without waiting for a slow one: a daemon whose last question is still
    open (a capped daemon busy computing, one starting again) is None in this round and asked again once it
    has answered, so the rounds stay POLL_S apart and the others' counts keep their pace."""

    def __init__(self, swarm: LocalSwarm, t0: float):
        super().__init__(swarm, t0)
        self.pending: dict[int, tuple[Future, object]] = {}
        self.since: dict[int, float] = {}  # daemon -> when it was last started again: older answers are stale

    def _one(self, i: int) -> dict | None:
        d = self.swarm.daemons[i]
        d.check_alive()
        return d.try_status(timeout=base.STATUS_TIMEOUT_S)

    def poll(self) -> Poll:
        t = self.now()
        n = len(self.swarm.daemons)
        for i in range(n):
            if i not in self.dead and i not in self.pending:
                self.pending[i] = (self._pool.submit(self._one, i), self.swarm.daemons[i].proc)
        wait([f for f, _ in self.pending.values()], timeout=base.POLL_S)
        sts: list[dict | None] = [None] * n
        for i, (f, proc) in list(self.pending.items()):
            if not f.done():
                continue
            del self.pending[i]
            if i in self.dead or proc is not self.swarm.daemons[i].proc:
                continue  # asked before it was killed
            exc = f.exception()
            if exc is not None:
                raise exc
            sts[i] = f.result()
        p = Poll(t + (self.now() - t) / 2, sts)
        self.polls.append(p)
        return p

    def latest(self) -> Poll:
        """Each daemon's latest status (None: never answered, or dead) as one round."""
        n = len(self.swarm.daemons)
        sts: list[dict | None] = [None] * n
        for p in self.polls:
            for i, st in enumerate(p.statuses):
                if st is not None and p.t >= self.since.get(i, 0.0):
                    sts[i] = st
        return Poll(self.now(), [None if i in self.dead else st for i, st in enumerate(sts)])


class Swarm:
    """One run's daemons: started pinned as told, polled, resized to their uneven caps once ready."""

    def __init__(self, stack: ExitStack, a, root: Path, lan, caps: CpuCaps | None, cpus: list[float],
                 label: str, options: dict, assignment: tuple[int, ...] | None, rebalance: bool):
        self.a, self.lan, self.caps, self.cpus, self.label = a, lan, caps, cpus, label
        self.options = options
        self.name = unique_swarm("bu")
        self.swarm = stack.enter_context(LocalSwarm(root / label))
        if caps is not None:
            for i in range(a.daemons):
                caps.set(i, a.cpus / a.daemons)  # start-up under equal caps (pipeline_uneven.py)
        self.t_launch = time.monotonic()
        for i in range(a.daemons):
            opts = dict(options, rebalance=rebalance, initial_stage=assignment[i] if assignment else -1)
            d = self.swarm.start(f"p{i}", config=base.daemon_config(self.name, i, lan, opts),
                                 host=lan.hosts[i] if lan else None,
                                 env={**rank_env(i, a.daemons), "OMP_NUM_THREADS": "1"})
            if caps is not None:
                caps.add(i, d.pid)
        self.poller = Poller(self.swarm, self.t_launch)
        stack.callback(self.poller.close)
        self.t_ready = self._wait_ready()
        if caps is not None:
            for i, c in enumerate(cpus):
                caps.set(i, c)
        self.startup_s = round(self.t_ready, 1)
        self.killed_in_flight = 0

    def _wait_ready(self) -> float:
        while True:
            t = self.poller.poll().t
            if base._ready(self.poller.latest()):
                return t
            time.sleep(max(0.0, base.POLL_S - (self.poller.now() - t)))
            if self.poller.now() > base.START_TIMEOUT_S:
                raise TimeoutError(f"{self.label}: not every driver finished a microbatch within "
                                   f"{base.START_TIMEOUT_S:.0f}s")

    def now(self) -> float:
        return self.poller.now() - self.t_ready  # seconds since every driver was going

    def until(self, t: float) -> None:
        self.poller.until(self.t_ready + t)

    @property
    def polls(self):
        return self.poller.polls

    def series(self, key: str = "samples") -> list[tuple[float, float]]:
        return [(t - self.t_ready, v) for t, v in pr.cumulative(self.polls, key)]

    def last(self, i: int) -> dict | None:
        return next((p.statuses[i] for p in reversed(self.polls) if p.statuses[i] is not None), None)

    def assignment(self) -> list[int | None]:
        return [pr.my_stage(self.last(i)) for i in range(self.a.daemons)]

    def kill(self, i: int) -> None:
        self.killed_in_flight += driver_of(self.last(i)).get("in_flight", 0) or 0
        self.poller.dead.add(i)
        self.swarm.daemons[i].kill()

    def restart(self, i: int) -> None:
        opts = dict(self.options, rebalance=True, initial_stage=-1)
        d = self.swarm.restart(self.swarm.daemons[i], config=base.daemon_config(self.name, i, self.lan, opts))
        if self.caps is not None:
            self.caps.add(i, d.pid)
        self.poller.since[i] = self.poller.now()
        self.poller.dead.discard(i)


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds process `pid` has used (all its threads), from /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = text[text.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def window(s: Swarm, t0: float, t1: float) -> dict:
    """Poll until t1 (run seconds); throughput, each peer's stage, samples/s and share of its cap used in [t0, t1]."""
    s.until(t0)
    c0 = [cpu_seconds(d.pid) for d in s.swarm.daemons]
    load0 = os.getloadavg()[0]
    s.until(t1)
    c1 = [cpu_seconds(d.pid) for d in s.swarm.daemons]
    n = s.a.daemons
    sps = [pr.own_samples_per_s(s.polls, i, s.t_ready + t0, s.t_ready + t1) for i in range(n)]
    stages = s.assignment()
    cap = [0.0] * STAGES
    for st, r in zip(stages, sps):
        if st is not None and r is not None:
            cap[st] += r
    return {"samples_per_s": pr.series_rate(s.series(), t0, t1), "window_s": [t0, t1], "assignment": stages,
            "peer_samples_per_s": sps, "stage_capacity_samples_per_s": [round(c, 2) for c in cap],
            "cpu_used_of_cap": [None if x is None or y is None else round((y - x) / (t1 - t0) / s.cpus[i], 2)
                                for i, (x, y) in enumerate(zip(c0, c1))],
            "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def lost(s: Swarm, t0: float, t1: float) -> int:
    f = [v for t, v in s.series("failed") if t0 - 1e-9 <= t <= t1 + 1e-9]
    return int(f[-1] - f[0]) if f else 0

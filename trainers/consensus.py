"""A job with no training: every peer holds a random vector and the swarm gossip-averages them.

It isolates the averaging machinery: the swarm-wide sum must never change (so `initial_sum` is
published), and the consensus error sum_i ||x_i - mean||^2 must fall geometrically at a rate set by the
spectral gap. Tests and `peer bench gossip` use it; each peer publishes `err_num` (its own
||x_i - mean||^2, against the exact mean it can compute because every peer's start vector is a
function of (seed, rank)) and `err_den` (its starting value), so a reader sums them over peers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from trainers.options import parse_options


@dataclass(frozen=True)
class ConsensusOptions:
    size: int = 4096  # float32 elements per peer
    seed: int = 0
    world: int = 0  # peers expected (0: whoever is there after a short wait)
    rounds: int = 200  # exchanges this peer initiates (0: until stopped)
    initiate: bool = True  # False: only serve exchanges that others start
    mode: str = "one"  # one neighbour per round (AD-PSGD style) or all neighbours (D-PSGD style)
    interval: float = 0.0  # seconds between rounds
    start_delay: float = 0.0  # wait before the first round (lets the topology settle)
    track_error: bool = True  # compute the exact mean (needs world x size floats once)
    # > 0: after `rounds`, keep initiating while this peer's error is above tolerance x its starting error, and
    # wake again if a late peer's exchange pulls it back out. Without it a peer that finished early freezes
    # whatever a late one averages into it (it only serves), so a run whose peers started seconds apart under
    # load ends far from consensus. The run then returns only when stopped; state "converged" while lingering.
    tolerance: float = 0.0


def start_vector(seed: int, rank: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, rank]).standard_normal(size).astype(np.float32)


def run(swarm, options: dict) -> dict:
    o = parse_options(ConsensusOptions, options, trainer="trainers.consensus")
    if o.mode not in ("one", "all"):
        raise ValueError(f"[trainer.options] mode: expected 'one' or 'all', got {o.mode!r}")
    if not 0.0 <= o.tolerance < 1.0:
        raise ValueError(f"[trainer.options] tolerance: expected 0 <= tolerance < 1, got {o.tolerance!r}")
    if o.tolerance and not o.track_error:
        raise ValueError("[trainer.options] tolerance needs track_error = true (it compares against the exact mean)")
    rank, world = swarm.rank_and_world(o.world or None)
    x = start_vector(o.seed, rank, o.size)
    mean = None
    if o.track_error:
        acc = np.zeros(o.size, dtype=np.float64)
        for r in range(world):
            acc += start_vector(o.seed, r, o.size)
        mean = (acc / world).astype(np.float32)
    group = swarm.share("vector", {"x": x})
    initial_sum = float(np.sum(x, dtype=np.float64))
    err0 = float(np.sum((x - mean) ** 2, dtype=np.float64)) if mean is not None else None
    mean_norm_sq = float(np.dot(mean.astype(np.float64), mean.astype(np.float64))) if mean is not None else None
    swarm.publish({"rank": rank, "world": world, "initial_sum": initial_sum, "err_den": err0, "err_num": err0,
                   "mean_norm_sq": mean_norm_sq,  # with the peers' sums of squares: an exact consensus error
                   "exchanges": 0, "state": "running"})
    deadline = time.monotonic() + o.start_delay
    while time.monotonic() < deadline and not swarm.should_stop():
        time.sleep(0.05)
    done = 0
    t0 = time.monotonic()
    last_pub = 0.0
    while not o.initiate and not swarm.should_stop():
        time.sleep(0.1)
    def error() -> float | None:
        with group.lock:
            return float(np.sum((x - mean) ** 2, dtype=np.float64)) if mean is not None else None

    def within_tolerance() -> bool:
        return bool(o.tolerance) and error() <= o.tolerance * err0

    lingering = False
    while o.initiate and not swarm.should_stop():
        if o.rounds and done >= o.rounds:
            if not o.tolerance:
                break
            if within_tolerance():
                if not lingering:
                    lingering = True
                    swarm.publish({"state": "converged", "err_num": error()})
                time.sleep(0.05)
                continue
        if lingering:
            lingering = False
            swarm.publish({"state": "running"})
        results = swarm.average("vector", mode=o.mode)
        done += sum(1 for r in results if r.ok)
        if not results:
            time.sleep(0.05)  # no neighbours yet
        if o.interval:
            time.sleep(o.interval)
        now = time.monotonic()
        if now - last_pub > 0.1 or (o.rounds and done >= o.rounds):
            last_pub = now
            swarm.publish({"exchanges": done, "err_num": error(), "elapsed_s": round(now - t0, 3), "step": done})
    return {"exchanges": done, "err_num": error(), "elapsed_s": round(time.monotonic() - t0, 3)}

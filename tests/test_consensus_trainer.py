"""trainers.consensus on a fake swarm: its options are checked, and with `tolerance` a peer whose rounds ran out
starts again when a late exchange pulls it away from the mean (tests/test_gossip.py relies on it under load)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from trainers import consensus


class FakeSwarm:
    """Two ranks; every `average` halves this peer's distance to the exact mean (what a pairwise exchange with a
    peer at the mean does). `pull` plays a late peer: it moves x away at the first convergence."""

    def __init__(self, pull: bool = False, stop_after: int = 60):
        self.published: list[dict] = []
        self.calls = 0
        self.pull, self.stop_after = pull, stop_after
        self.x = None
        self.converged = 0
        self.stop_at_convergence = 2 if pull else 1
        self.mean = (consensus.start_vector(0, 0, 8).astype(np.float64) + consensus.start_vector(0, 1, 8)) / 2

    def rank_and_world(self, world=None):
        return 0, 2

    def share(self, name, tensors):
        self.x = tensors["x"]
        return SimpleNamespace(lock=threading.Lock())

    def publish(self, metrics):
        self.published.append(dict(metrics))
        if metrics.get("state") == "converged":
            self.converged += 1
            if self.pull:
                self.x += 5.0  # a late peer's exchange: this peer is far from the mean again
                self.pull = False

    def average(self, group, mode="one"):
        self.calls += 1
        self.x[:] = (self.x + self.mean) / 2
        return [SimpleNamespace(ok=True)]

    def should_stop(self):
        return self.calls >= self.stop_after or self.converged >= self.stop_at_convergence

    def error(self):
        return float(np.sum((self.x - self.mean) ** 2))


@pytest.mark.parametrize("bad, why", [({"tolerance": -0.1}, "tolerance"), ({"tolerance": 1.0}, "tolerance"),
                                      ({"tolerance": float("nan")}, "tolerance"),
                                      ({"tolerance": 0.1, "track_error": False}, "track_error")])
def test_bad_tolerance_is_refused_with_its_name(bad, why):
    with pytest.raises(ValueError, match=why):
        consensus.run(FakeSwarm(), {"rounds": 2, **bad})


def test_without_tolerance_the_rounds_end_the_run():
    swarm = FakeSwarm()
    out = consensus.run(swarm, {"size": 8, "rounds": 3})
    assert swarm.calls == 3 and out["exchanges"] == 3


def test_a_converged_peer_pulled_away_starts_again_until_within_tolerance():
    swarm = FakeSwarm(pull=True)
    consensus.run(swarm, {"size": 8, "rounds": 2, "tolerance": 1e-3})
    states = [m["state"] for m in swarm.published if "state" in m]
    assert states[-3:] == ["converged", "running", "converged"], states
    assert swarm.calls < swarm.stop_after and swarm.converged == 2
    assert swarm.error() <= 1e-3 * float(np.sum((consensus.start_vector(0, 0, 8) - swarm.mean) ** 2))

"""Real daemons for tests: a thin layer over `peer.testing` (the `cluster` fixture is in conftest.py)."""

from __future__ import annotations

from pathlib import Path

from peer.testing.process import wait_for
from peer.testing.swarm import FAST_MEMBERSHIP, rank_env, swarm_config, unique_swarm, write_config

REPO = Path(__file__).resolve().parent.parent

# Membership tests want a killed peer noticed in about 2 s; swarms that train keep FAST_MEMBERSHIP,
# whose 4 s leave room for a loaded 2-core machine.
QUICK_FAILURE_DETECTION = {**FAST_MEMBERSHIP, "heartbeat_interval": 0.3, "dead_after": 2.0,
                           "reconnect_max": 2.0, "pex_interval": 0.5}

__all__ = ["QUICK_FAILURE_DETECTION", "REPO", "config_file", "rank_env", "steps_done", "trainer_steps", "unique_swarm",
           "wait_for"]


def trainer_steps(statuses) -> int:
    """Trainer steps in these statuses (None, a daemon that did not answer, counts 0): the progress a wait on
    training bounds its stall by (`wait_for`'s `progress`), so a machine loaded by the parallel tier fails a
    swarm that stopped, not one that trains slowly."""
    return sum(int(((s or {}).get("trainer") or {}).get("step") or 0) for s in statuses)


def steps_done(daemons) -> int:
    """`trainer_steps` of the daemons' statuses now."""
    return trainer_steps(d.try_status() for d in daemons)


def config_file(path: Path, **kw) -> Path:
    """Write a validated config (`peer.testing.swarm.swarm_config(**kw)`) as TOML; its path."""
    return write_config(path, swarm_config(**kw))

"""Read by mypy only (pyproject.toml's [tool.mypy] files): each handle is assignable to the protocol it
claims, so their methods' parameter and return types agree with peertrain/swarm.py's."""

from __future__ import annotations

from peer.attach.client import AttachedSwarm
from peer.trainer_host import TrainerSwarm
from peertrain.distributed import HostRanks
from peertrain.swarm import ClosableSwarm, HostedSwarm, Swarm


def hosted(handle: TrainerSwarm) -> HostedSwarm:
    return handle


def attached(handle: AttachedSwarm) -> ClosableSwarm:
    return handle


def ranks(handle: HostRanks) -> ClosableSwarm:
    return handle


def any_handle(handle: TrainerSwarm | AttachedSwarm | HostRanks) -> Swarm:
    return handle

"""Read by mypy only (pyproject.toml's [tool.mypy] files): each handle is assignable to the protocol it
claims, so their methods' parameter and return types agree with peertrain/swarm.py's; and the pipeline's
objects that cross between a job and its daemon agree with peertrain/pipeline.py's protocols."""

from __future__ import annotations

from peer.attach.client import AttachedSwarm
from peer.pipeline.copies import KeptCopy
from peer.pipeline.driver import DriverHandle
from peer.trainer_host import TrainerSwarm
from peertrain import pipeline
from peertrain.distributed import HostRanks
from peertrain.swarm import ClosableSwarm, HostedSwarm, Swarm
from trainers.pipeline import stage


def hosted(handle: TrainerSwarm) -> HostedSwarm:
    return handle


def attached(handle: AttachedSwarm) -> ClosableSwarm:
    return handle


def ranks(handle: HostRanks) -> ClosableSwarm:
    return handle


def any_handle(handle: TrainerSwarm | AttachedSwarm | HostRanks) -> Swarm:
    return handle


# -- the pipeline: the daemon's objects as the job sees them, the job's as the daemon does ------------------
def driver(handle: DriverHandle) -> pipeline.MicrobatchDriver:
    return handle


def kept_copy(copy: KeptCopy) -> pipeline.KeptStateCopy:
    return copy


def stage_handler(worker: stage.StageWorker) -> pipeline.StageHandler:
    return worker


def held_gradient(held: stage.HeldGradient) -> pipeline.HeldGradient:
    return held

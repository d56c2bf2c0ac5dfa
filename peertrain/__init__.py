"""peertrain's Python API: train in your own script, with your own model, data and loop.

    import peertrain
    swarm = peertrain.attach()            # the daemon of this host (`peer start`); or peertrain.start(...)
    opt = peertrain.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm)
    loader = DataLoader(peertrain.shard(train_set, swarm), batch_size=64, shuffle=True)

Across slow links, `LocalStepsOptimizer` (many local steps, then an outer step, gossiped: peertrain/outer.py)
takes GossipOptimizer's place. `attach` and `start` return a `Swarm` (peertrain/swarm.py: the one interface a
training job sees, hosted or attached): share tensors, average (blocking or in the background), download
parameters on join, publish metrics, checkpoints, membership news. Inside a torchrun job on one host every
rank calls the same functions and the job is one peer (peertrain/distributed.py). The daemon averages the
shared tensors in place, in shared memory.

`import peertrain` loads only the leaf modules (peertrain/swarm.py): the optimizers (torch) and the attach
client are imported on first use, so a trainer module or a type checker can name `peertrain.Swarm` without
pulling in torch, trio or the daemon.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from peertrain.swarm import ClosableSwarm, ExchangeResult, HostedSwarm, SharedGroup, Swarm, TrainerStopped

if TYPE_CHECKING:
    from peer.attach.client import AttachedSwarm, AttachError, DaemonGone
    from peertrain.data import shard
    from peertrain.optimizer import GossipOptimizer
    from peertrain.outer import LocalStepsOptimizer

__all__ = ["AttachError", "AttachedSwarm", "ClosableSwarm", "DaemonGone", "ExchangeResult", "GossipOptimizer", "HostedSwarm",
           "LocalStepsOptimizer", "SharedGroup", "Swarm", "TrainerStopped", "attach", "shard", "start"]

# name -> module that defines it, imported on first use (PEP 562)
_LAZY = {"AttachedSwarm": "peer.attach.client", "AttachError": "peer.attach.client", "DaemonGone": "peer.attach.client",
         "shard": "peertrain.data", "GossipOptimizer": "peertrain.optimizer", "LocalStepsOptimizer": "peertrain.outer"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'peertrain' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def attach(home: str | Path | None = None, *, label: str = "", wait: float = 30.0, process_group: Any = None) -> ClosableSwarm:
    """Attach this process to the daemon of `home` (default $PEERTRAIN_HOME or ~/.peertrain), waiting up to
    `wait` seconds for one that is still starting. In a multi-rank torch.distributed job (torchrun), call it on
    every rank: rank 0 attaches and the ranks act as one peer."""
    from peer.attach.client import AttachedSwarm
    from peertrain.distributed import HostRanks, is_multi_rank

    if is_multi_rank(process_group):
        return HostRanks(lambda: AttachedSwarm(home, label=label, wait=wait), process_group)
    return AttachedSwarm(home, label=label, wait=wait)


def start(config: str | Path | None = None, *, home: str | Path | None = None, listen: str | None = None,
          join: list[str] | None = None, swarm: str | None = None, mdns: bool | None = None, label: str = "",
          process_group: Any = None) -> ClosableSwarm:
    """Run a daemon inside this process (a config file, then these overrides, as `peer start` takes them) and
    attach to it; `close()` on the result stops it. In a torchrun job only rank 0 runs one."""
    from peer.attach.embedded import start as start_embedded
    from peertrain.distributed import HostRanks, is_multi_rank

    def go() -> ClosableSwarm:
        return start_embedded(config, home=home, listen=listen, join=join, swarm=swarm, mdns=mdns, label=label)

    if is_multi_rank(process_group):
        return HostRanks(go, process_group)
    return go()

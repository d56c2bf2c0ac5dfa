"""peertrain's Python API: train in your own script, with your own model, data and loop.

    import peertrain
    swarm = peertrain.attach()            # the daemon of this host (`peer start`); or peertrain.start(...)
    opt = peertrain.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm)
    loader = DataLoader(peertrain.shard(train_set, swarm), batch_size=64, shuffle=True)

Across slow links, `LocalStepsOptimizer` (many local steps, then an outer step, gossiped: peertrain/outer.py)
takes GossipOptimizer's place. `attach` and `start` return the Swarm handle a hosted trainer gets (peer/trainer_host.py): share tensors,
average (blocking or in the background), download parameters on join, publish metrics, checkpoints,
membership news. Inside a torchrun job on one host every rank calls the same functions and the job is one
peer (peertrain/distributed.py). The daemon averages the shared tensors in place, in shared memory.
"""

from __future__ import annotations

from pathlib import Path

from peer.attach.client import AttachedSwarm, AttachError, DaemonGone
from peertrain.data import shard
from peertrain.optimizer import GossipOptimizer
from peertrain.outer import LocalStepsOptimizer

__all__ = ["AttachError", "AttachedSwarm", "DaemonGone", "GossipOptimizer", "LocalStepsOptimizer", "attach", "shard",
           "start"]


def attach(home: str | Path | None = None, *, label: str = "", wait: float = 30.0, process_group=None):
    """Attach this process to the daemon of `home` (default $PEERTRAIN_HOME or ~/.peertrain), waiting up to
    `wait` seconds for one that is still starting. In a multi-rank torch.distributed job (torchrun), call it on
    every rank: rank 0 attaches and the ranks act as one peer."""
    from peertrain.distributed import HostRanks, is_multi_rank

    if is_multi_rank(process_group):
        return HostRanks(lambda: AttachedSwarm(home, label=label, wait=wait), process_group)
    return AttachedSwarm(home, label=label, wait=wait)


def start(config: str | Path | None = None, *, home: str | Path | None = None, listen: str | None = None,
          join: list[str] | None = None, swarm: str | None = None, mdns: bool | None = None, label: str = "",
          process_group=None):
    """Run a daemon inside this process (a config file, then these overrides, as `peer start` takes them) and
    attach to it; `close()` on the result stops it. In a torchrun job only rank 0 runs one."""
    from peer.attach.embedded import start as start_embedded
    from peertrain.distributed import HostRanks, is_multi_rank

    def go():
        return start_embedded(config, home=home, listen=listen, join=join, swarm=swarm, mdns=mdns, label=label)

    if is_multi_rank(process_group):
        return HostRanks(go, process_group)
    return go()

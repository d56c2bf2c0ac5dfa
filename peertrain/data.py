"""This process's part of a dataset: disjoint shards by peer (and, in a torchrun job, by local rank)."""

from __future__ import annotations

from typing import Any

from peertrain.swarm import Swarm


def shard(dataset: Any, swarm: Swarm, *, world: int | None = None, seed: int = 0) -> Any:
    """The part of `dataset` (any map-style torch Dataset, or an IterableDataset) this process trains on.

    The peer's index and count come from `swarm.rank_and_world(world)` ($PEERTRAIN_RANK/$PEERTRAIN_WORLD, or
    its place among the peers it sees); inside a torchrun job each local rank takes its own part of the host's
    shard. Map-style: a seeded disjoint partition (torch.utils.data.Subset); iterable: every n-th item."""
    from trainers.torch_data import shard as shard_dataset

    rank, count = swarm.rank_and_world(world)
    local_rank, local_world = swarm.local_rank, swarm.local_world
    return shard_dataset(dataset, rank * local_world + local_rank, count * local_world, seed=seed)


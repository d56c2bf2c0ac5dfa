"""This process's part of a dataset: disjoint shards by peer (and, in a torchrun job, by local rank)."""

from __future__ import annotations

from typing import Any

from peertrain.swarm import Swarm


def shard(dataset: Any, swarm: Swarm, *, world: int | None = None, seed: int = 0) -> Any:
    """The part of `dataset` (any map-style torch Dataset, or an IterableDataset) this process trains on.

    The peer's index and count come from `swarm.rank_and_world(world)` ($PEERTRAIN_RANK/$PEERTRAIN_WORLD, or
    its place among the peers it sees); inside a torchrun job each local rank takes its own part of the host's
    shard. Map-style: a seeded disjoint partition (torch.utils.data.Subset); iterable: every n-th item. A
    Hugging Face `datasets.Dataset` gets the same partition through its own `select`, so it stays one (a
    Trainer drops its unused columns only from those)."""
    from trainers.torch_data import partition
    from trainers.torch_data import shard as shard_dataset

    rank, count = swarm.rank_and_world(world)
    local_rank, local_world = swarm.local_rank, swarm.local_world
    index, parts = rank * local_world + local_rank, count * local_world
    if is_hf_dataset(dataset):
        return dataset.select(partition(len(dataset), index, parts, seed=seed).tolist())
    return shard_dataset(dataset, index, parts, seed=seed)


def is_hf_dataset(dataset: Any) -> bool:
    """A Hugging Face `datasets.Dataset` (map-style, with columns), told by its API: `datasets` is not ours to
    import."""
    return callable(getattr(dataset, "select", None)) and hasattr(dataset, "column_names") and hasattr(dataset, "__len__")


"""Several GPUs, one peer: the ranks of a torch.distributed job on one host share one daemon.

Why: a host gossips once, not once per GPU (hivemind makes every GPU a peer, multiplying traffic by G).
The ranks keep their gradients in step the usual way (DistributedDataParallel: an all-reduce over NVLink/
PCIe with NCCL, or gloo on CPUs), so their parameters stay identical; rank 0 alone attaches to the daemon,
and after each averaging it broadcasts its parameters to the others.

Every method that needs rank 0's answer is a collective (a broadcast on the job's process group): call the
same Swarm methods on every rank, in the same order, as with any torch.distributed call. `publish`,
`save_checkpoint` and `log` act on rank 0 only and are not collectives.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from peertrain.swarm import LATEST_CHECKPOINT, ClosableSwarm, ExchangeResult, SharedGroup


def is_multi_rank(group=None) -> bool:
    """Is this process one of several ranks of an initialized torch.distributed job?"""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class _RankGroup:
    """What `share` returns on ranks other than 0 (a SharedGroup): the tensors, a lock no one else takes, a step."""

    def __init__(self, name: str, tensors: dict[str, Any]):
        self.name, self.tensors, self.step = name, dict(tensors), 0
        self.lock = threading.Lock()

    def sync(self) -> None:
        pass


class HostRanks:
    """The Swarm handle (peertrain/swarm.py) for every rank of a one-host torch.distributed job; rank 0 holds
    the real one."""

    def __init__(self, connect: Callable[[], ClosableSwarm], group: Any = None):
        """`connect()` attaches (or starts) on rank 0; its failure is raised on every rank, not only rank 0
        (the others would wait in the next collective forever)."""
        self.pg = group
        self.rank, self.local_world = dist.get_rank(group), dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        swarm, error = None, None
        if self.rank == 0:
            try:
                swarm = connect()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = self._from_root(error)
        if error is not None:
            raise RuntimeError(f"rank 0 could not attach to the daemon: {error}")
        self.swarm: ClosableSwarm | None = swarm
        self.peer_id: str = self._from_root(swarm.peer_id if swarm else None)
        self.home = Path(self._from_root(str(swarm.home) if swarm else None))
        self.checkpoint_dir = self.home / "checkpoints"
        self._groups: dict[str, Any] = {}

    def _from_root(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._root, group=self.pg)
        return box[0]

    def _broadcast_tensors(self, name: str) -> None:
        """Rank 0's current values of group `name` to every rank (flattened per dtype and device: one
        collective each, not one per tensor). Nothing for a group not shared: every rank holds the same groups
        (share and unshare run on all), so all skip alike, and averaging it returns nothing as on any handle."""
        g = self._groups.get(name)
        if g is None:
            return
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for t in g.tensors.values():
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for ts in by_kind.values():
            with g.lock if self.rank == 0 else nullcontext():  # the daemon updates rank 0's in place
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, src=self._root, group=self.pg)
            if self.rank != 0:
                with torch.no_grad():
                    offset = 0
                    for t in ts:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()

    # -- averaging ------------------------------------------------------------------------------------
    def share(self, name: str, tensors: dict[str, Any], *, codec: str | None = None, error_feedback: bool = False,
              averaged: bool = True) -> SharedGroup:
        g: SharedGroup
        if self.rank == 0:
            g = self._root_swarm.share(name, tensors, codec=codec, error_feedback=error_feedback, averaged=averaged)
        else:
            g = _RankGroup(name, tensors)
        self._groups[name] = g
        self._broadcast_tensors(name)  # every rank starts from rank 0's values
        return g

    def unshare(self, name: str) -> None:
        """Stop sharing `name` (on rank 0; every rank forgets it). Not a collective."""
        self._groups.pop(name, None)
        if self.rank == 0:
            self._root_swarm.unshare(name)

    @property
    def _root_swarm(self) -> ClosableSwarm:
        """Rank 0's real handle (only rank 0 calls this)."""
        assert self.swarm is not None, "only rank 0 holds the daemon's handle"
        return self.swarm

    def average(self, group: str, *, mode: str = "one") -> list[ExchangeResult]:
        results = self._from_root(self._root_swarm.average(group, mode=mode) if self.rank == 0 else None)
        self._broadcast_tensors(group)
        return results

    def average_in_background(self, group: str, *, mode: str = "one") -> bool:
        """Start a round on rank 0 and give every rank rank 0's parameters now (with the rounds that ended
        since the last call): between calls, ranks other than 0 run on values at most one interval old."""
        started = self._from_root(self._root_swarm.average_in_background(group, mode=mode) if self.rank == 0 else None)
        self._broadcast_tensors(group)
        return started

    def download(self, group: str, *, min_step: int = 1) -> int | None:
        step = self._from_root(self._root_swarm.download(group, min_step=min_step) if self.rank == 0 else None)
        if step is not None:
            self._broadcast_tensors(group)
        return step

    # -- who is around (collectives) ------------------------------------------------------------------
    def neighbours(self) -> list[str]:
        return self._from_root(self._root_swarm.neighbours() if self.rank == 0 else None)

    def peers(self) -> list[str]:
        return self._from_root(self._root_swarm.peers() if self.rank == 0 else None)

    def membership_events(self) -> list[tuple[str, str]]:
        return self._from_root(self._root_swarm.membership_events() if self.rank == 0 else None)

    def wait_for_peers(self, n: int = 1, *, group: str | None = None, timeout: float = 30.0) -> int:
        return self._from_root(self._root_swarm.wait_for_peers(n, group=group, timeout=timeout) if self.rank == 0 else None)

    def rank_and_world(self, world: int | None = None) -> tuple[int, int]:
        """This host's shard index and count (rank 0's view); split further by local rank with `local_rank`."""
        return tuple(self._from_root(self._root_swarm.rank_and_world(world) if self.rank == 0 else None))

    def should_stop(self) -> bool:
        return bool(self._from_root(self._root_swarm.should_stop() if self.rank == 0 else None))

    @property
    def local_rank(self) -> int:
        return self.rank

    # -- rank 0 only (not collectives) ----------------------------------------------------------------
    def publish(self, metrics: dict[str, Any]) -> None:
        if self.rank == 0:
            self._root_swarm.publish(dict(metrics, local_ranks=self.local_world))

    def exchanges(self) -> dict[str, Any]:
        return self._root_swarm.exchanges() if self.rank == 0 else {}

    def save_checkpoint(self, state: dict[str, Any], name: str = LATEST_CHECKPOINT) -> Path:
        if self.rank == 0:
            return self._root_swarm.save_checkpoint(state, name)
        return self.checkpoint_dir / name

    def load_checkpoint(self, name: str = LATEST_CHECKPOINT, map_location: Any = "cpu") -> dict[str, Any] | None:
        from peertrain.checkpoints import load_checkpoint

        return load_checkpoint(self.checkpoint_dir, name, map_location)

    def log(self, msg: str, *args: Any) -> None:
        if self.rank == 0:
            self._root_swarm.log(msg, *args)

    def close(self) -> None:
        if self.rank == 0 and self.swarm is not None:
            self.swarm.close()

    def __enter__(self) -> "HostRanks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

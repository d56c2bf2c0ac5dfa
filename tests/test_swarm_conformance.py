"""Every Swarm handle keeps the protocol's promises (peer/testing/conformance.py `check_swarm`), each on a swarm of
two real daemons on 127.0.0.1: the hosted trainer's `TrainerSwarm`, an attached process's `AttachedSwarm`, and a
torch.distributed job's `HostRanks` (one gloo rank here: its collectives run, over a group of one)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from peer.attach.client import AttachedSwarm
from peer.testing.conformance import Outcome, check_closable, check_pair, check_swarm
from peer.testing.swarm import LocalSwarm, swarm_config, unique_swarm
from peertrain.swarm import Swarm

RUN_S = 120.0  # both checks, each bounded by CHECK_TIMEOUT_S, on a loaded 2-core host


def _two(cluster: LocalSwarm, trainer: str = "") -> LocalSwarm:
    cluster.start_nodes(2, swarm_config(swarm=unique_swarm("conf"), trainer=trainer))
    cluster.wait_connected()
    return cluster


def _both(handles: list[Swarm]) -> list[Outcome]:
    """check_swarm on both handles at once (each waits for the other's exchange), in threads."""
    out: list[Any] = [None, None]

    def one(i: int) -> None:
        try:
            out[i] = check_swarm(handles[i])
        except BaseException as exc:  # noqa: BLE001  (reported below, with the other side's)
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RUN_S)
    for o in out:
        if isinstance(o, BaseException):
            raise o
    assert all(isinstance(o, Outcome) for o in out), out
    return out


def test_hosted_handles_keep_the_swarm_promises(cluster):
    _two(cluster, trainer="peer.testing.conformance")
    cluster.wait(lambda sts: all(s and s.get("trainer", {}).get("conformance") for s in sts), timeout=RUN_S,
                 what="both hosted checks to finish", interval=0.5)
    got = [s["trainer"] for s in cluster.statuses()]
    assert all(g["conformance"] == "passed" for g in got), [g["conformance"] for g in got]
    fields = ("peer_id", "partner", "initiator", "weight", "value")
    check_pair(*(Outcome(**{k: g[k] for k in fields}) for g in got))


def test_attached_handles_keep_the_swarm_promises(cluster):
    _two(cluster)
    handles = [AttachedSwarm(d.home, label="conformance") for d in cluster.daemons]
    try:
        check_pair(*_both(handles))
    finally:
        for h in handles:
            h.close()
    for d in cluster.daemons:
        check_closable(AttachedSwarm(d.home, label="closing"))


@pytest.fixture
def gloo_of_one(tmp_path):
    """A torch.distributed process group of this process alone (HostRanks' collectives over it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'gloo'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_host_ranks_keep_the_swarm_promises(cluster, gloo_of_one):
    from peertrain.distributed import HostRanks

    _two(cluster)
    node1, node2 = cluster.daemons
    connect: Callable[[], AttachedSwarm] = lambda: AttachedSwarm(node1.home, label="ranks")  # noqa: E731
    ranks, other = HostRanks(connect), AttachedSwarm(node2.home, label="conformance")
    try:
        check_pair(*_both([ranks, other]))
    finally:
        other.close()
    check_closable(ranks)

"""A torchrun job on each of two hosts (network namespaces the test builds), beside that host's daemon.

What a user does on each machine: `peer start`, then `torchrun --nproc-per-node 2 train.py` with only
$PEERTRAIN_HOME saying which daemon (no --home): the two gloo ranks of each job act as one peer
(peertrain/distributed.py HostRanks), and the two hosts average with each other over the virtual LAN.
"""

from __future__ import annotations

import pytest

from peer.testing.netns import netns_available, our_namespaces, virtual_lan
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm
from tests.test_attach import _example, _results, _torchrun, _trained_together

pytestmark = [pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 to create network namespaces")]

PREFIX = "ptj"  # namespaces "ptj{pid}h0", "ptj{pid}h1", "ptj{pid}br"


def test_torchrun_jobs_on_two_namespaced_hosts_are_two_peers(tmp_path):
    cfg = swarm_config(swarm=unique_swarm("tj"), listen="0.0.0.0:7100", interfaces=[])
    with virtual_lan(2, prefix=PREFIX, subnet="10.79.0") as lan, LocalSwarm(tmp_path / "daemons") as swarm:
        daemons = swarm.start_nodes(2, cfg, hosts=lan.hosts)
        swarm.wait_connected()
        jobs = [_example(f"job{i}", tmp_path, "--world", "2", launcher=_torchrun(2), host=host,
                         env={"PEERTRAIN_HOME": str(d.home), **rank_env(i, 2)})  # the environment, no --home
                for i, (d, host) in enumerate(zip(daemons, lan.hosts))]
        results = _results(jobs, swarm)
        _trained_together(results, every_peer=False)  # exchanged between the hosts: the swarm has no one else
        for job in jobs:
            summaries = [ln for ln in job.log_path.read_text().splitlines() if ln.startswith("{")]
            assert len(summaries) == 1, f"only rank 0 reports (and attaches):\n{job.log_tail(60)}"
        statuses = swarm.statuses()
        assert [r["peer_id"] for r in results] == [s["peer_id"] for s in statuses]  # each job is its host's peer
        for st, other in zip(statuses, reversed(lan.hosts)):
            attach = st["attach"]
            assert attach["clients"] == [] and len(attach["ended"]) == 1, attach  # two ranks, one attach
            assert "detached" in attach["ended"][0], attach
            assert st["connected"] == 1, st["peers"]  # two peers in all
            assert {p["address"].rsplit(":", 1)[0] for p in st["peers"]} == {other.ip}, st["peers"]
        assert swarm.stop() == [0, 0]
    assert our_namespaces(PREFIX) == []

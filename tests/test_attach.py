"""Your own training script with peertrain: the shipped example (examples/train_digits.py) run as real
processes attached to real daemons, inside its own embedded daemons, and as a torchrun job of two gloo
ranks that is one peer (with local steps); a killed process frees its shared memory. (peer/attach/, peertrain/)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from peer.home import Home
from peer.testing.process import ManagedProcess, stop_all, wait_for
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm, write_config
from tests.daemons import REPO

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "train_digits.py"
TARGET = 0.93  # held-out accuracy every process must reach (the example's default is 0.95; this is quicker)
RUN_TIMEOUT = 120.0  # three processes import torch and train a small MLP on 2 loaded cores: ~15 s


def _example(name: str, tmp: Path, *args: str, env: dict | None = None, launcher: list[str] | None = None,
             host: Any = None) -> ManagedProcess:
    """The example as a child process (its output in tmp/NAME.log), told its data shard by `env`; inside the
    network namespace of `host` (a `peer.testing.netns.Host`) if given."""
    argv = (launcher or [sys.executable]) + [str(EXAMPLE), "--threads", "1", "--target", str(TARGET), *args]
    return ManagedProcess(name=name, argv=argv, log_path=tmp / f"{name}.log", env={"OMP_NUM_THREADS": "1", **(env or {})},
                          cwd=REPO, host=host).start()


def _results(procs: list[ManagedProcess], swarm: LocalSwarm | None = None) -> list[dict]:
    """Wait for every process to exit; each one's JSON summary (its last output line)."""
    try:
        wait_for(lambda: not any(p.running for p in procs), timeout=RUN_TIMEOUT, what="the training processes to end")
        for p in procs:
            assert p.returncode == 0, f"{p.name} exited with {p.returncode}:\n{p.log_tail(60)}"
    except BaseException:
        for p in procs:
            print(f"===== {p.name} =====\n{p.log_tail(60)}", file=sys.stderr)
        if swarm is not None:
            swarm.dump_logs()
        raise
    finally:
        stop_all(procs)
    out = []
    for p in procs:
        lines = [ln for ln in p.log_path.read_text().splitlines() if ln.startswith("{")]
        assert lines, f"{p.name} printed no summary:\n{p.log_tail(40)}"
        out.append(json.loads(lines[-1]))
    return out


def _trained_together(results: list[dict], every_peer: bool) -> None:
    """Each process reached the target, and exchanges completed: in every process when it averaged in the
    foreground (dpsgd waits for its neighbours each step); in the swarm when in the background (adpsgd, and
    local steps' outer rounds: the example here trains 100 steps in a tenth of a second, the time of a few rounds, so a process may finish before
    one of its own completes). Failed exchanges are not bounded: the first process to reach the target
    leaves while its partners may be mid-exchange with it ("peer said goodbye")."""
    done = [r["exchanges"]["initiated"] + r["exchanges"]["served"] for r in results]
    for r in results:
        assert r["accuracy"] >= TARGET, r
        assert r["exchanges"]["failed"] == 0 or r["exchanges"]["last_error"], r  # a failure carries its reason
    assert (min(done) if every_peer else sum(done)) > 0, results
    assert len({r["peer_id"] for r in results}) == len(results)


def _daemons(tmp: Path, n: int) -> LocalSwarm:
    swarm = LocalSwarm(tmp / "daemons")
    cfg = swarm_config(swarm=unique_swarm("att"))
    swarm.start_nodes(n, cfg)
    swarm.wait_connected()
    return swarm


def test_example_attached_to_three_daemons_reaches_target(tmp_path):
    with _daemons(tmp_path, 3) as swarm:
        procs = [_example(f"client{i}", tmp_path, "--home", str(d.home), "--world", "3", env=rank_env(i, 3))
                 for i, d in enumerate(swarm.daemons)]
        results = _results(procs, swarm)
        _trained_together(results, every_peer=False)
        assert {r["peer_id"] for r in results} == {s["peer_id"] for s in swarm.statuses()}
        for s in swarm.statuses():  # each detached cleanly, and its figures filled the training panel
            assert s["attach"]["clients"] == [] and any("detached" in e for e in s["attach"]["ended"]), s["attach"]
            assert (Home(Path(s["home"])).checkpoints / "own_loop.pt").exists()


def test_example_with_embedded_daemons_reaches_target(tmp_path):
    config = write_config(tmp_path / "embedded.toml", swarm_config(swarm=unique_swarm("emb")))
    procs = [_example(f"embedded{i}", tmp_path, "--embedded", "--config", str(config), "--home",
                      str(tmp_path / f"home{i}"), "--world", "3", "--mode", "dpsgd", env=rank_env(i, 3))
             for i in range(3)]
    _trained_together(_results(procs), every_peer=True)


def test_torchrun_two_gloo_ranks_are_one_peer_with_local_steps(tmp_path):
    with _daemons(tmp_path, 3) as swarm:
        node1, node2, node3 = swarm.daemons
        torchrun = _torchrun(2)
        local = ("--world", "3", "--mode", "local", "--inner-steps", "5")  # LocalStepsOptimizer across ranks too
        procs = [_example("torchrun", tmp_path, "--home", str(node1.home), *local, env=rank_env(0, 3), launcher=torchrun),
                 _example("client2", tmp_path, "--home", str(node2.home), *local, env=rank_env(1, 3)),
                 _example("client3", tmp_path, "--home", str(node3.home), *local, env=rank_env(2, 3))]
        # while it trains: one process attached to node1 (rank 0), and the others see three peers in all
        wait_for(lambda: len((node1.try_status() or {}).get("attach", {}).get("clients", [])) == 1 or
                 not procs[0].running, timeout=RUN_TIMEOUT, what="rank 0 to attach")
        results = _results(procs, swarm)
        _trained_together(results, every_peer=False)  # local steps exchange in the background
        job = [ln for ln in (tmp_path / "torchrun.log").read_text().splitlines() if ln.startswith("{")]
        assert len(job) == 1, "only rank 0 reports (and attaches)"
        st = node1.status()
        assert len(st["attach"]["ended"]) == 1, st["attach"]  # two ranks, one attach
        for s in swarm.statuses():
            assert s["connected"] == 2  # three peers: the two-rank job is one of them


def test_killed_process_frees_its_shared_memory(tmp_path, cluster):
    daemon = cluster.start("d", config=swarm_config(swarm=unique_swarm("kill"), mdns=False))
    daemon.wait_ready()
    script = ("import sys, time, torch, peertrain\n"
              f"s = peertrain.attach({str(daemon.home)!r})\n"
              "w = {'w': torch.ones(8 << 20)}\n"  # 32 MiB
              "s.share('big', w)\n"
              "print('shared', flush=True)\n"
              "time.sleep(600)\n")
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert client.stdout.readline().strip() == "shared"
        maps = Path(f"/proc/{daemon.pid}/maps")
        assert "memfd:peertrain:big" in maps.read_text()
        st = daemon.status()
        assert [c["pid"] for c in st["attach"]["clients"]] == [client.pid]
        assert "big" in st["gossip"]["groups"]
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        wait_for(lambda: "memfd:peertrain:big" not in maps.read_text(), timeout=10,
                 what="the daemon to unmap the killed process's segment")
        st = daemon.status()
        assert st["attach"]["clients"] == [] and "big" not in st["gossip"]["groups"]
        assert any(f"pid {client.pid}" in e and "ended" in e for e in st["attach"]["ended"]), st["attach"]["ended"]
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)


def _torchrun(nproc: int) -> list[str]:
    """torchrun (as `python -m`, so it is this interpreter's) for `nproc` ranks of a job on one host."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}"]


def _free_port() -> int:
    from peer.bench.hosts import free_port

    return free_port()


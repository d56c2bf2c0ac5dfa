"""The pieces of attaching a training process (peer/attach/, peertrain/), each on its own: the local wire's
checks, segment layout and adoption, the cross-process lock, records listing groups, the optimizer wrapper
and the attach service's answers to bad requests (one real daemon)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

import peertrain
from peer.attach import wire
from peer.attach.client import AttachedSwarm, AttachError, SharedGroup
from peer.attach.shm import ALIGN, LockTimeout, Segment, SegmentLock, layout
from peer.control import pack
from peer.home import Home, default_home
from peer.testing.swarm import swarm_config, unique_swarm
from protocol import identity as ident
from protocol.schema.topology import MAX_RECORD_GROUPS, TopologyRecord, topology_record_signing_bytes

# ---- the local wire --------------------------------------------------------------------------------


def test_every_request_round_trips():
    reqs = [wire.Share("model", [("w", "float32", (3, 4)), ("b", "float16", ())]), wire.Unshare("model"),
            wire.Average("model", "one", False, 7), wire.Download("model", 1), wire.Publish({"loss": 0.5, "x": None}),
            wire.Poll(), wire.Detach()]
    for r in reqs:
        assert wire.decode(wire.unpack(pack(wire.encode(r))[4:])) == r


@pytest.mark.parametrize("obj, says", [
    ([1, 2], "a map with an 'op'"),
    ({"op": "launch"}, "unknown op"),
    ({"op": "share", "group": "g", "specs": []}, "share.specs"),
    ({"op": "share", "group": "g", "specs": [["w", "int64", [2]]]}, "share.specs[0].dtype"),
    ({"op": "share", "group": "g", "specs": [["w", "float32", [2]], ["w", "float32", [2]]]}, "named twice"),
    ({"op": "share", "group": "g", "specs": [["w", "float32", [-1]]]}, "share.specs[0].shape"),
    ({"op": "share", "group": "g", "specs": [["w", "float32", [1] * 9]]}, "dimensions"),
    ({"op": "share", "group": "x" * 65, "specs": [["w", "float32", [1]]]}, "share.group"),
    ({"op": "average", "group": "g", "mode": "all", "wait": 1, "step": 0}, "average.wait"),
    ({"op": "average", "group": "g", "mode": "ring", "wait": True, "step": 0}, "average.mode"),
    ({"op": "average", "group": "g", "mode": "one", "wait": True, "step": True}, "average.step"),
    ({"op": "download", "group": "g", "min_step": -1}, "download.min_step"),
    ({"op": "publish", "metrics": {"loss": math.nan}}, "publish.metrics['loss']"),
    ({"op": "publish", "metrics": {str(i): i for i in range(wire.MAX_METRICS + 1)}}, "publish.metrics"),
])
def test_malformed_requests_are_named(obj, says):
    with pytest.raises(wire.WireError, match=None) as err:
        wire.decode(obj)
    assert says in str(err.value)


def test_unpack_refuses_garbage():
    with pytest.raises(wire.WireError):
        wire.unpack(b"\xc1\xc1")


def test_the_default_home_is_peertrain_home_else_dot_peertrain(monkeypatch, tmp_path):
    """What `peertrain.attach()` without a home (AttachedSwarm) attaches to: in a torchrun job the environment
    names the host's daemon (a job on each of two hosts: tests/test_netns_torchrun.py)."""
    monkeypatch.setenv("PEERTRAIN_HOME", str(tmp_path / "h"))
    assert default_home() == tmp_path / "h"
    monkeypatch.delenv("PEERTRAIN_HOME")
    assert default_home() == Path.home() / ".peertrain"


# ---- segments and the lock -------------------------------------------------------------------------


def test_layout_aligns_every_slot_and_refuses_bfloat16():
    slots, size = layout([("a", "float32", (3,)), ("b", "float64", (2, 2)), ("c", "float16", (0,))])
    assert [s.offset % ALIGN for s in slots] == [0, 0, 0]
    assert slots[1].offset == ALIGN and slots[1].nbytes == 32 and size == 2 * ALIGN
    with pytest.raises(ValueError, match="bfloat16"):
        layout([("w", "bfloat16", (2,))])


def test_adopted_segment_is_the_same_memory_and_is_checked():
    slots, size = layout([("w", "float32", (4, 4))])
    mine = Segment.create("t", slots, size)
    theirs = Segment.adopt(os.dup(mine.fd), slots, size)
    mine.tensors()["w"].fill_(3.0)
    assert np.all(theirs.arrays()["w"] == 3.0)
    with pytest.raises(ValueError, match="holds"):
        Segment.adopt(os.dup(mine.fd), *layout([("w", "float32", (5, 5))]))
    with tempfile.TemporaryFile() as f:
        f.truncate(size)
        with pytest.raises(ValueError, match="memfd"):
            Segment.adopt(os.dup(f.fileno()), slots, size)


@pytest.mark.process
def test_lock_excludes_another_process_and_is_released_when_it_dies():
    slots, size = layout([("w", "float32", (4,))])
    seg = Segment.create("lock", slots, size)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open('/proc/self/fd/{seg.fd}', os.O_RDWR)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
        pass_fds=[seg.fd], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = SegmentLock(os.open(f"/proc/self/fd/{seg.fd}", os.O_RDWR), wait_s=0.3)
        with pytest.raises(LockTimeout, match="held its tensors' lock"):
            lock.acquire()
        holder.kill()
        holder.wait(10)
        with lock:  # the kernel dropped the dead holder's lock
            pass
        lock.close()
        with lock:  # closed: threads of this process only
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def test_mirrored_tensor_takes_the_daemons_update_and_publishes_its_own():
    """A tensor that cannot be re-homed (bfloat16 here, a GPU tensor in practice) keeps a float32 mirror."""
    class NoWire(AttachedSwarm):
        def __init__(self):  # no daemon: only SharedGroup's own logic
            pass

    t = torch.full((4,), 2.0, dtype=torch.bfloat16)
    g = SharedGroup(NoWire(), "m", {"w": t})
    assert not g.in_place
    mirror, _ = g._mirrored["w"]
    mirror += 1.0  # what an exchange applied by the daemon does
    t += 0.5  # a local step meanwhile
    g.sync()
    assert torch.equal(t, torch.full((4,), 3.5, dtype=torch.bfloat16)) and torch.equal(mirror, torch.full((4,), 3.5))
    g.close()


# ---- records list the groups a peer shares ---------------------------------------------------------


def test_record_signature_covers_its_groups_and_groups_are_bounded():
    key = ident.generate_identity()
    pid = ident.peer_id_from_public_bytes(ident.public_key_bytes(key))
    base = TopologyRecord(peer_id=pid, public_key=ident.public_key_bytes(key), version=1, issued=1.0,
                          neighbours=[], links=[], signature=b"")
    with_groups = TopologyRecord(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "groups": ["model"]})
    assert topology_record_signing_bytes(base) != topology_record_signing_bytes(with_groups)
    assert msgpack.unpackb(topology_record_signing_bytes(base))[-1] == []  # without groups: signs as before
    with pytest.raises(ValueError, match="groups"):
        TopologyRecord(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                          "groups": [f"g{i}" for i in range(MAX_RECORD_GROUPS + 1)]})


# ---- the optimizer wrapper, and the service's answers (one real daemon) ----------------------------


@pytest.fixture
def daemon(cluster):
    d = cluster.start("d", config=swarm_config(swarm=unique_swarm("unit"), mdns=False))
    d.wait_ready()
    return d


@pytest.mark.slow
def test_optimizer_wrapper_works_with_schedulers_amp_clipping_and_checkpoints(daemon):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    with peertrain.attach(daemon.home) as swarm:
        for bad, says in ((dict(mode="ring"), "mode"), (dict(average_every=0), "average_every")):
            with pytest.raises(ValueError, match=says):
                peertrain.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, group="bad", **bad)
        with pytest.raises(TypeError, match="torch.optim.Optimizer"):
            peertrain.GossipOptimizer(object(), swarm)
        opt = peertrain.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), swarm,
                                        average_every=2)
        assert opt.shared.in_place  # CPU float32: the model now lives in shared memory
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu")
        x, y = torch.randn(16, 8), torch.randn(16, 2)
        for _ in range(4):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
        assert opt.local_step == 4 and opt.averaged == 2
        assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4)
        state = opt.state_dict()
        fresh = peertrain.GossipOptimizer(torch.optim.SGD(torch.nn.Linear(8, 2).parameters(), lr=0.1, momentum=0.9),
                                          swarm, group="copy")
        fresh.load_state_dict(state)
        assert fresh.local_step == 4 and fresh.optimizer.state_dict()["state"].keys() == state["optimizer"]["state"].keys()
        fresh.load_state_dict(opt.optimizer.state_dict())  # a plain inner state dict works too
        with pytest.raises(RuntimeError, match="parameter groups"):
            opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})
        path = swarm.save_checkpoint({"model": model.state_dict()}, "unit.pt")
        assert torch.equal(swarm.load_checkpoint("unit.pt")["model"]["weight"], model.weight.detach())
        assert path.parent == Home(daemon.home).checkpoints


@pytest.mark.slow
def test_service_refuses_bad_requests_and_keeps_serving(daemon):
    with peertrain.attach(daemon.home, label="unit") as swarm:
        swarm.share("g", {"w": torch.ones(4)})
        with pytest.raises(AttachError, match="already shared"):
            AttachedSwarm(daemon.home).share("g", {"w": torch.ones(4)})
        with pytest.raises(AttachError, match="not shared by this process"):
            swarm._request(wire.Average("other", "one", True, 0))
        with pytest.raises(AttachError, match="one segment descriptor"):
            swarm._request(wire.Share("nofd", [("w", "float32", (1,))]))
        assert swarm.average("g") == []  # the session goes on after refusals
        assert daemon.status()["attach"]["clients"][0]["label"] == "unit"

    raw = socket.socket(socket.AF_UNIX)
    raw.connect(str(Home(daemon.home).control_socket))
    raw.sendall(pack({"cmd": "attach", "args": {"protocol": 99}}))
    assert b"attach protocol" in raw.recv(4096)
    raw.close()

    raw = socket.socket(socket.AF_UNIX)
    raw.settimeout(10)
    raw.connect(str(Home(daemon.home).control_socket))
    raw.sendall(pack({"cmd": "attach", "args": {"protocol": wire.PROTOCOL, "pid": 1}}))
    raw.recv(4096)
    raw.sendall(pack({"op": "share", "group": "g2", "specs": "all of them"}))
    reply = raw.recv(4096)
    assert b"bad request" in reply and raw.recv(4096) == b""  # answered, then the session ended
    raw.close()
    st = daemon.status()
    assert st["attach"]["clients"] == [] and any("bad request" in e for e in st["attach"]["ended"])

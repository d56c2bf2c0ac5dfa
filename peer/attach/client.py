"""A training process attached to its host's daemon: the same narrow Swarm handle a hosted trainer gets.

`AttachedSwarm` speaks the attach wire (peer/attach/wire.py) over the daemon's control socket with plain
blocking sockets (a user's script needs no trio). `share` moves the tensors into a shared segment
(peer/attach/shm.py) that the daemon averages in place:
  * a tensor in CPU memory of a dtype numpy can view is re-homed (`t.data` becomes its slot), so averaging
    needs no copy at all: an exchange's update lands in the very memory the model reads;
  * any other (on a GPU, or bfloat16) gets a float mirror in the segment; `SharedGroup.sync()` folds what
    the daemon added to the mirror since the last sync into the tensor, then copies the tensor back, both
    under the lock. Everything the daemon adds (exchanges we start and those we serve) is kept that way.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from peer.attach import wire
from peer.attach.shm import SEGMENT_DTYPES, Segment, layout
from peer.control import pack, receive_message_blocking
from peer.home import Home, default_home
from peertrain.checkpoints import load_checkpoint, save_checkpoint
from peertrain.swarm import AVERAGE_MODES, LATEST_CHECKPOINT, ExchangeResult, shard_index, wait_for_peers
from protocol.errors import LimitExceeded
from protocol.refusal import Code
from protocol.tensor_codec import DENSE_CODECS
from protocol.frames import LengthPrefixedReader

log = logging.getLogger("peertrain.attach")

CONNECT_WAIT_S = 30.0  # how long attach waits for a daemon that is still starting (its socket not there yet)
REPLY_WAIT_S = 60.0  # a quick request's reply; averaging and downloads wait as long as the daemon's deadlines


class AttachError(RuntimeError):
    """The daemon refused to attach this process, or a request; the message says why."""


class DaemonGone(ConnectionError):
    """The daemon this process was attached to stopped or crashed: nothing is averaged any more."""


class SharedGroup:
    """Tensors shared for averaging as one group; the daemon updates them in place (see the module docstring).

    `lock` must be held while the tensors change (an optimizer step): `with group.lock: opt.step()`.
    `step` is the trainer's step, sent with each averaging request (peers joining compare steps)."""

    def __init__(self, swarm: "AttachedSwarm", name: str, tensors: dict[str, Any]):
        import torch

        self.swarm, self.name, self.step = swarm, name, 0
        self.tensors = dict(tensors)
        specs, self._mirrored = [], {}
        for key, t in self.tensors.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"tensor {key!r} of group {name!r}: only floating-point torch tensors can be averaged")
            dtype = str(t.dtype).removeprefix("torch.")
            in_place = t.device.type == "cpu" and dtype in SEGMENT_DTYPES
            specs.append((key, dtype if in_place else "float32", tuple(t.shape)))
            if not in_place:
                self._mirrored[key] = None
        slots, size = layout(specs)
        self.segment = Segment.create(name, slots, size)
        self.lock = self.segment.lock
        self.nbytes = size
        views = self.segment.tensors()
        with torch.no_grad():
            for key, t in self.tensors.items():
                views[key].copy_(t.detach())
                if key in self._mirrored:
                    self._mirrored[key] = (views[key], views[key].clone())  # (mirror, what we last put there)
                else:
                    t.data = views[key]  # re-homed: the model now reads and writes the shared slot
        self.specs = specs

    def sync(self) -> None:
        """Fold the daemon's updates of mirrored tensors into them and publish their current values (a no-op
        when every tensor is re-homed in place)."""
        if not self._mirrored:
            return
        import torch

        with self.lock, torch.no_grad():
            for key, (mirror, base) in self._mirrored.items():
                t = self.tensors[key]
                t.add_((mirror - base).to(t.device, t.dtype))
                mirror.copy_(t)
                base.copy_(mirror)

    @property
    def in_place(self) -> bool:
        return not self._mirrored

    def close(self) -> None:
        self.segment.close()


class AttachedSwarm:
    """The Swarm (peertrain/swarm.py) of a process attached to the daemon of `home`."""

    def __init__(self, home: str | Path | None = None, *, label: str = "", wait: float = CONNECT_WAIT_S):
        self.home = Path(home).expanduser() if home else default_home()
        self.checkpoint_dir = Home(self.home).checkpoints
        self._lock = threading.Lock()
        self._groups: dict[str, SharedGroup] = {}
        self._closed = False
        self._sock = _connect(Home(self.home).control_socket, wait, self.home)
        self._replies = LengthPrefixedReader(wire.MAX_REPLY)
        try:
            self._sock.settimeout(REPLY_WAIT_S)
            self._sock.sendall(pack({"cmd": "attach", "args": {
                "protocol": wire.PROTOCOL, "pid": os.getpid(), "label": label[:wire.MAX_NAME]}}))
            hello = self._read_reply()
        except BaseException:
            self._sock.close()
            raise
        self.peer_id: str = hello["peer_id"]
        self.swarm_name: str = hello["swarm"]
        self._news: list[tuple[str, str]] = []
        self._last_poll: dict = {}

    # -- averaging ------------------------------------------------------------------------------------
    def share(self, name: str, tensors: dict[str, Any], *, codec: str | None = None, error_feedback: bool = False,
              averaged: bool = True) -> SharedGroup:
        """Share `tensors` (pass parameters themselves, e.g. dict(model.named_parameters()): a CPU tensor is
        re-homed into shared memory, so a copy such as `p.data` would leave the model out) as group `name`.
        `codec`, `error_feedback`, `averaged`: as `Swarm.share` (peertrain/swarm.py)."""
        if not (isinstance(name, str) and 0 < len(name) <= wire.MAX_GROUP):  # as SharedTensors refuses it
            raise ValueError(f"group name {name!r}: expected a string of 1 to {wire.MAX_GROUP} characters")
        if codec is not None and codec not in DENSE_CODECS:  # refused here, as the hosted handle does: to the daemon a
            #                                             request it refuses is a broken client, and ends our session
            raise ValueError(f"group {name!r}: codec {codec!r} is not one of {', '.join(DENSE_CODECS)}")
        group = SharedGroup(self, name, tensors)
        try:
            self._request(wire.Share(name, group.specs, codec or "", error_feedback, averaged), fds=[group.segment.fd])
        except BaseException:
            group.close()
            raise
        self._groups[name] = group
        return group

    def unshare(self, name: str) -> None:
        group = self._groups.pop(name, None)
        if group is None:  # not shared (any more): nothing to stop, as for the other handles
            return
        self._request(wire.Unshare(name))
        group.close()

    def _averaged(self, group: str, mode: str) -> SharedGroup | None:
        """`group`'s tensors synced for a round, or None where it is not shared (no round); a mode the daemon
        would refuse is a ValueError here (Swarm.average's contract), not the end of our session."""
        if mode not in AVERAGE_MODES:
            raise ValueError(f"unknown averaging mode {mode!r} (choose {' or '.join(map(repr, AVERAGE_MODES))})")
        g = self._groups.get(group)
        if g is not None:
            g.sync()
        return g

    def average(self, group: str, *, mode: str = "one") -> list[ExchangeResult]:
        """Average now and wait: with one random neighbour (pairwise) or with all of them (Metropolis-Hastings)."""
        g = self._averaged(group, mode)
        if g is None:
            return []
        out = self._request(wire.Average(group, mode, True, g.step), timeout=None)["results"]
        g.sync()
        return [ExchangeResult(**dict(r, code=Code.parse(r["code"]) if r.get("code") else None)) for r in out]

    def average_in_background(self, group: str, *, mode: str = "one") -> bool:
        """Start an averaging round and return at once (AD-PSGD); False while the previous one still runs."""
        g = self._averaged(group, mode)
        return g is not None and bool(self._request(wire.Average(group, mode, False, g.step))["started"])

    def download(self, group: str, *, min_step: int = 1) -> int | None:
        """Replace `group`'s tensors with a partner's, if one is at step `min_step` or later (a process joining a
        swarm that already trains): that step, or None."""
        g = self._groups[group]
        step = self._request(wire.Download(group, min_step), timeout=None)["step"]
        if step is not None:
            g.step = step
            if g._mirrored:
                import torch

                with g.lock, torch.no_grad():  # the daemon wrote the mirrors: take them whole
                    for key, (mirror, base) in g._mirrored.items():
                        g.tensors[key].copy_(mirror.to(g.tensors[key].device, g.tensors[key].dtype))
                        base.copy_(mirror)
        return step

    # -- who is around --------------------------------------------------------------------------------
    def poll(self) -> dict:
        """Neighbours, peers, membership news and each group's state, in one round trip."""
        got = self._request(wire.Poll())
        self._news.extend((p, e) for p, e in got["events"])
        self._last_poll = got
        return got

    def neighbours(self) -> list[str]:
        return list(self.poll()["neighbours"])

    def peers(self) -> list[str]:
        return list(self.poll()["peers"])

    def membership_events(self) -> list[tuple[str, str]]:
        """(peer_id, 'joined'|'left') since the last call."""
        self.poll()
        out, self._news = self._news, []
        return out

    def consensus_distance(self, group: str) -> float | None:
        """||other - own|| / ||own|| at the group's last exchange, as the daemon measured it."""
        return self.poll()["groups"].get(group, {}).get("distance")

    def wait_for_peers(self, n: int = 1, *, group: str | None = None, timeout: float = 30.0) -> int:
        """Wait (up to `timeout` s) until `n` other peers are connected (with `group`: peers that share that
        group, as their records say) and we have a neighbour, so processes started together also train
        together; how many there are (fewer if the wait ran out)."""
        def count() -> tuple[int, bool]:
            got = self.poll()
            have = len(got["groups"].get(group, {}).get("holders", [])) if group else len(got["peers"])
            return have, bool(got["neighbours"])
        return wait_for_peers(count, n, timeout, self.should_stop)

    def exchanges(self) -> dict:
        """The daemon's exchange counts (all groups): initiated, served, failed, and the last failure's reason."""
        return dict(self.poll()["exchanges"])

    local_rank = 0  # one process, the whole peer (a torchrun job wraps this in HostRanks)
    local_world = 1

    def rank_and_world(self, world: int | None = None) -> tuple[int, int]:
        """A data-shard index and count: $PEERTRAIN_RANK/$PEERTRAIN_WORLD, else my place among the peers seen."""
        return shard_index(self.peer_id, self.peers, world, self.should_stop)

    # -- reporting and state --------------------------------------------------------------------------
    def publish(self, metrics: dict[str, Any]) -> None:
        """Figures for `peer status` (its training panel) and HOME/metrics.jsonl; numbers, short strings, None."""
        clean = {}
        for k, v in metrics.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, float) and v != v:
                v = None
            clean[str(k)] = v
        self._request(wire.Publish(clean))

    def save_checkpoint(self, state: dict[str, Any], name: str = LATEST_CHECKPOINT) -> Path:
        """torch.save to the daemon's HOME/checkpoints/<name> atomically."""
        return save_checkpoint(self.checkpoint_dir, state, name)

    def load_checkpoint(self, name: str = LATEST_CHECKPOINT, map_location: Any = "cpu") -> dict[str, Any] | None:
        return load_checkpoint(self.checkpoint_dir, name, map_location)

    def should_stop(self) -> bool:
        """True once the daemon has gone (stopped or crashed): there is no one left to average with."""
        if self._closed:
            return True
        with self._lock:
            self._sock.settimeout(0.0)  # a peek that never waits (with a timeout set, recv first polls for it)
            try:
                return self._sock.recv(1, socket.MSG_PEEK) == b""  # the daemon sends nothing unasked: EOF only
            except BlockingIOError:
                return False
            except OSError:
                return True

    def log(self, msg: str, *args: Any) -> None:
        log.info(msg, *args)

    def close(self) -> None:
        """Detach: the daemon stops averaging our groups and lets go of their memory."""
        if self._closed:
            return
        try:
            self._request(wire.Detach())
        except (DaemonGone, AttachError, OSError):
            pass
        self._closed = True
        self._sock.close()
        for g in self._groups.values():
            g.close()

    def __enter__(self) -> "AttachedSwarm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the wire -------------------------------------------------------------------------------------
    def _request(self, req: wire.Request, *, fds: list[int] = (), timeout: float | None = REPLY_WAIT_S) -> Any:
        if self._closed:
            raise DaemonGone("this process has detached")
        frame = pack(wire.encode(req))
        with self._lock:
            try:
                self._sock.settimeout(timeout)
                if fds:
                    socket.send_fds(self._sock, [frame], list(fds))
                else:
                    self._sock.sendall(frame)
                return self._read_reply()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise DaemonGone(f"the daemon at {self.home} is gone ({exc.strerror})") from None
            except socket.timeout:
                raise DaemonGone(f"the daemon at {self.home} did not answer within {timeout:.0f}s") from None

    def _read_reply(self) -> Any:
        try:
            body = receive_message_blocking(self._sock, self._replies)
        except ConnectionResetError:
            body = None
        except LimitExceeded as exc:
            raise AttachError(f"a reply from the daemon too large: {exc}") from None
        if body is None:
            raise DaemonGone(f"the daemon at {self.home} closed the connection (it stopped or crashed)")
        reply = wire.unpack(body)
        if not isinstance(reply, dict) or not reply.get("ok"):
            raise AttachError(str(reply.get("error", "malformed reply")) if isinstance(reply, dict) else "malformed reply")
        return reply.get("result")


def _connect(path: Path, wait: float, home: Path) -> socket.socket:
    deadline = time.monotonic() + wait
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return s
        except (FileNotFoundError, ConnectionRefusedError):
            s.close()
            if time.monotonic() >= deadline:
                raise DaemonGone(f"no daemon is running with home {home} (waited {wait:.0f}s); start one with "
                                 f"`peer start --home {home}`, or use peertrain.start() for one inside this process") from None
            time.sleep(0.1)

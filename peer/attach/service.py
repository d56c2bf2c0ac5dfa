"""The daemon's side of attached training processes: a user's own script shares tensors through its host's
daemon, which averages them in place, in shared memory (peer/attach/shm.py).

A client sends the control command `attach` and keeps that connection (peer/attach/wire.py). What it may
make the daemon hold is bounded: `[attach] max_clients` sessions, MAX_GROUPS_PER_CLIENT groups each, and
`[attach] max_shared_mib` of shared tensors in all (the daemon keeps snapshot buffers of that size per
group). A malformed request ends the session with the reason logged; a refused one (a limit, a group name
already shared) gets an error and the session goes on. When the session ends — detach, a crash, a kill —
its groups stop being averaged and the daemon drops its mapping and descriptor, so the segments' memory is
freed (an exchange still running finishes on its own views first).
"""

from __future__ import annotations

import array
import logging
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from peer.attach import wire
from peer.attach.shm import Segment, layout
from peer.averaging.shared import SharedTensors
from peer.control import pack
from peer.services import RecordFields
from peer.training_report import TrainingReport
from protocol.schema.training import TrainingFigures
from protocol.errors import LimitExceeded
from protocol.frames import LengthPrefixedReader

if TYPE_CHECKING:
    from peer.services import DaemonContext
    from peer.averaging.engine import GossipEngine

log = logging.getLogger("peertrain.attach")

MAX_GROUPS_PER_CLIENT = 8  # a model, an EMA copy, optimizer moments...: far above one script's needs
MAX_FDS_PENDING = 4  # descriptors received ahead of the request they belong to; more end the session
MAX_EVENTS = 1000  # membership news kept for a client that does not poll (oldest dropped)
RECV_BYTES = 64 << 10  # one recvmsg


class AttachRefused(Exception):
    """A well-formed request the daemon will not serve (a limit, a name already taken); the session goes on."""


class _RequestReader:
    """Length-prefixed requests (protocol/frames.py's reader, at most wire.MAX_FRAME bytes each) from a Unix
    stream socket, with the descriptors that came with them.

    Every read is a recvmsg: a plain recv would drop (close) descriptors riding on the bytes it reads."""

    def __init__(self, sock: trio.socket.SocketType):
        self.sock = sock
        self.reader = LengthPrefixedReader(wire.MAX_FRAME)
        self.fds: list[int] = []

    async def frame(self) -> bytes | None:
        """The next request's body, or None when the client closed the connection."""
        while True:
            try:
                body = self.reader.next_message()
            except LimitExceeded as exc:
                raise wire.WireError(f"a request too large: {exc}") from None
            if body is not None:
                return body
            data, anc, flags, _ = await self.sock.recvmsg(RECV_BYTES, socket.CMSG_SPACE(MAX_FDS_PENDING * 4))
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(cdata[:len(cdata) - len(cdata) % fds.itemsize])
                    self.fds.extend(fds)
            if flags & socket.MSG_CTRUNC or len(self.fds) > MAX_FDS_PENDING:
                raise wire.WireError(f"more than {MAX_FDS_PENDING} descriptors sent at once")
            if not data:
                return None
            self.reader.feed(data)

    def take_fds(self) -> list[int]:
        fds, self.fds = self.fds, []
        return fds

    def close(self) -> None:
        _close_all(self.take_fds())


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass
class AttachedClient:
    """One attached process: what it shares and what it reported."""

    id: int
    pid: int
    label: str
    since: float
    report: TrainingReport
    segments: dict[str, Segment] = field(default_factory=dict)
    events: deque = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))

    def nbytes(self) -> int:
        return sum(s.size for s in self.segments.values())


class AttachService:
    name = "attach"

    def __init__(self, daemon: DaemonContext, gossip: GossipEngine):
        self.daemon = daemon
        self.gossip = gossip
        self.cfg = daemon.config.attach
        self.clients: dict[int, AttachedClient] = {}
        self.refused = 0  # attaches and requests refused, for status
        self.ended: deque[str] = deque(maxlen=8)  # why the last sessions ended
        self._next_id = 1
        self._nursery: trio.Nursery | None = None
        daemon.membership.watch(self._on_membership)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self._nursery = n
            task_status.started()
            await trio.sleep_forever()

    def sessions(self) -> dict:
        return {"attach": self._session}

    def _on_membership(self, peer_id: str, session) -> None:
        for c in self.clients.values():
            c.events.append((peer_id, "joined" if session is not None else "left"))

    # ---- one client's session -----------------------------------------------------------------------
    async def _session(self, args: dict, stream: trio.SocketStream) -> None:
        pid = args.get("pid") if isinstance(args.get("pid"), int) else 0
        label = str(args.get("label", ""))[:wire.MAX_NAME]
        refusal = None
        if args.get("protocol") != wire.PROTOCOL:
            refusal = (f"this daemon speaks attach protocol {wire.PROTOCOL}, the client {args.get('protocol')!r}: "
                       "use the same peertrain version for both")
        elif not self.cfg.enabled:
            refusal = "attaching is off on this daemon ([attach] enabled = false)"
        elif len(self.clients) >= self.cfg.max_clients:
            refusal = f"{len(self.clients)} processes are attached already ([attach] max_clients)"
        if refusal is not None:
            self.refused += 1
            await _send(stream, {"ok": False, "error": refusal})
            return
        client = AttachedClient(self._next_id, pid, label, time.time(),
                                TrainingReport(self.daemon.peer_id, self.daemon.home.metrics_file, {"trainer": f"attached pid {pid}", "state": "attached"}))
        self._next_id += 1
        self.clients[client.id] = client
        d = self.daemon
        await _send(stream, {"ok": True, "result": {
            "peer_id": d.peer_id, "swarm": d.config.daemon.swarm, "home": str(d.home.root),
            "client": client.id, "protocol": wire.PROTOCOL}})
        log.info("process %d attached (%s)", pid, label or "no label")
        reader = _RequestReader(stream.socket)
        reason = "detached"
        try:
            while True:
                body = await reader.frame()
                if body is None:
                    reason = "connection closed (the process ended)"
                    break
                req = wire.decode(wire.unpack(body))
                fds = reader.take_fds()
                try:
                    result = await self._serve(client, req, fds)
                    reply = {"ok": True, "result": result}
                except AttachRefused as exc:
                    self.refused += 1
                    reply = {"ok": False, "error": str(exc)}
                finally:
                    _close_all(fds)  # a share adopts (and closes) its descriptor; any other is stray
                await _send(stream, reply)
                if isinstance(req, wire.Detach):
                    break
        except wire.WireError as exc:
            reason = f"bad request: {exc}"
            log.warning("attached process %d: %s; ending its session", pid, exc)
            await _send(stream, {"ok": False, "error": f"bad request: {exc}"})
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            reason = f"connection lost: {exc}"
        except Exception as exc:  # a bug here ends this session, never the daemon
            reason = f"internal error: {type(exc).__name__}: {exc}"
            log.exception("attached process %d: session failed", pid)
            await _send(stream, {"ok": False, "error": reason})
        finally:
            reader.close()
            with trio.CancelScope(shield=True):
                await self._release(client)
            self.ended.append(f"pid {pid}: {reason}")
            log.info("process %d detached: %s", pid, reason)

    async def _release(self, client: AttachedClient) -> None:
        """Stop averaging the client's groups and drop our hold on its segments."""
        self.clients.pop(client.id, None)
        for name, seg in list(client.segments.items()):
            self.gossip.unregister(name)
            await trio.to_thread.run_sync(seg.close)  # waits for a thread of ours inside the lock
        client.segments.clear()

    async def _serve(self, client: AttachedClient, req: wire.Request, fds: list[int]):
        if isinstance(req, wire.Share):
            return await self._share(client, req, fds)
        if isinstance(req, (wire.Unshare, wire.Average, wire.Download)) and req.group not in client.segments:
            raise AttachRefused(f"group {req.group!r} is not shared by this process")
        if isinstance(req, wire.Unshare):
            self.gossip.unregister(req.group)
            await trio.to_thread.run_sync(client.segments.pop(req.group).close)
            return None
        if isinstance(req, wire.Average):
            self.gossip.groups[req.group].step = req.step
            if not req.wait:
                return {"started": self.gossip.start_average(req.group, req.mode)}
            results = await self.gossip.average(req.group, mode=req.mode)
            return {"results": [{"peer_id": r.peer_id, "ok": r.ok, "reason": r.reason, "weight": r.weight,
                                 "seconds": r.seconds, "bytes_sent": r.bytes_sent,
                                 "code": r.code.value if r.code is not None else None} for r in results]}
        if isinstance(req, wire.Download):
            got = await self.gossip.fetch_from_partners(req.group, req.min_step)
            if got is None or got[1] < req.min_step or req.group not in self.gossip.groups:
                return {"step": None}
            group = self.gossip.groups[req.group]
            await trio.to_thread.run_sync(group.load, got[0])
            group.step = got[1]
            return {"step": got[1]}
        if isinstance(req, wire.Publish):
            client.report.publish(req.metrics)
            return None
        if isinstance(req, wire.Poll):
            events = list(client.events)
            client.events.clear()
            groups = {name: {"averaging": self.gossip.averaging(name),
                             "distance": self.gossip.groups[name].last_distance,
                             "holders": self.gossip.peers_holding(name)}
                      for name in client.segments if name in self.gossip.groups}
            return {"neighbours": sorted(self.gossip.topology.neighbours),
                    "peers": sorted(self.daemon.membership.connected()), "events": events, "groups": groups,
                    "exchanges": self.gossip.exchange_counts()}
        return None  # Detach: the session ends after the reply

    async def _share(self, client: AttachedClient, req: wire.Share, fds: list[int]):
        if len(fds) != 1:
            raise AttachRefused(f"a share carries one segment descriptor, this one {len(fds)}")
        if req.group in self.gossip.groups:
            raise AttachRefused(f"group {req.group!r} is already shared on this daemon (by its hosted trainer or "
                                "another attached process): pick another name")
        if len(client.segments) >= MAX_GROUPS_PER_CLIENT:
            raise AttachRefused(f"a process may share at most {MAX_GROUPS_PER_CLIENT} groups")
        slots, size = layout(req.specs)
        held = sum(c.nbytes() for c in self.clients.values())
        cap = self.cfg.max_shared_mib << 20
        if held + size > cap:
            raise AttachRefused(f"sharing {size / 2**20:.1f} MiB more would pass [attach] max_shared_mib "
                                f"({self.cfg.max_shared_mib} MiB; {held / 2**20:.1f} MiB shared now)")
        try:
            seg = Segment.adopt(fds.pop(), slots, size)
        except (ValueError, OSError) as exc:
            raise AttachRefused(f"cannot map the segment of group {req.group!r}: {exc}") from None
        client.segments[req.group] = seg
        self.gossip.register(SharedTensors(req.group, seg.arrays(), lock=seg.lock, codec=req.codec or None,
                                           error_feedback=req.error_feedback, averaged=req.averaged))
        log.info("process %d shares group %s: %d tensors, %.1f MiB", client.pid, req.group, len(slots), size / 2**20)
        return {"bytes": size}

    # ---- daemon-facing ------------------------------------------------------------------------------
    def status(self) -> dict:
        return {"clients": [{"id": c.id, "pid": c.pid, "label": c.label, "since": round(c.since, 3),
                             "groups": {n: s.size for n, s in c.segments.items()},
                             "metrics": c.report.status()} for c in self.clients.values()],
                "refused": self.refused, "ended": list(self.ended),
                "max_clients": self.cfg.max_clients, "max_shared_mib": self.cfg.max_shared_mib}

    def record_fields(self) -> RecordFields:
        """HasRecordFields: our record carries an attached process's figures, unless this daemon hosts a trainer
        (whose figures the record carries then, as the status panel shows them: one source, whatever the order)."""
        return RecordFields(training=None if self.daemon.config.trainer.name else self._figures())

    def _figures(self) -> TrainingFigures | None:
        """The figures of the first attached process that published some in range, as `training` picks."""
        for c in self.clients.values():
            if (figures := c.report.figures()) is not None:
                return figures
        return None

    def training(self) -> dict | None:
        """The training figures of the first attached process that published any, for `peer status`'s training
        panel when the daemon hosts no trainer itself."""
        for c in self.clients.values():
            if len(c.report.metrics) > 2 or c.report.loss_history:
                out = c.report.status()
                group = self.gossip.groups.get(next(iter(c.segments), ""))
                if group is not None and "consensus_distance" not in out:
                    out["consensus_distance"] = group.last_distance
                return out
        return None


async def _send(stream: trio.SocketStream, obj: dict) -> None:
    try:
        await stream.send_all(pack(obj))
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass

"""The daemon: one trio nursery that owns every service of one peer.

    Daemon.run
    ├── control socket     (peer status / stop / ...)
    ├── TCP listener       (handshake under deadline → membership.own_session)
    ├── membership         (dialer, sessions, heartbeats, peer exchange)
    ├── mDNS discovery     (zeroconf thread bridged into trio)
    ├── extra services     (topology, gossip, trainer host, metrics: see peer/services.py)
    └── signal watcher     (SIGINT/SIGTERM → graceful stop)

Stopping is one path for every trigger (signal, `peer stop`, a test): set `_stop`, stop dialing, let
services save state (checkpoints, peer cache), say goodbye to peers, then cancel the nursery.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from peer import __version__
from peer.session.cipher_choice import resolve_ciphers
from peer.config import Config, parse_hostport
from peer.control import claim_socket_path, serve_control
from peer.home import Home, HomeClaim, atomic_write
from peer.attach.service import AttachService
from peer.averaging.engine import GossipEngine
from peer.membership.service import Membership
from peer.membership.store import PeerStore, StoredPeer, entries_from_peers
from peer.nat.service import NatService
from peer.pipeline.service import PipelineService
from peer.session.router import Router
from peer.services import DaemonContext, HasCommands, HasSessions, HasShutdown, HasTraining, Services
from peer.session.connect import ListenerStats, open_listeners, serve
from peer.session.handshake_slots import HandshakeSlots
from peer.session.transport import TransportConfig
from peer.topology.service import TopologyService
from protocol import PROTOCOL_VERSION
from protocol import identity as ident
from protocol.limits import KiB, MiB, WireLimits

log = logging.getLogger("peertrain.daemon")


def wire_limits(cfg: Config) -> WireLimits:
    lim = cfg.limits
    return WireLimits(
        max_frame_bytes=lim.max_frame_kib * KiB,
        max_message_bytes=lim.max_message_kib * KiB,
        max_tensor_bytes=lim.max_tensor_mib * MiB,
        max_inflight_tensor_bytes=lim.max_inflight_tensor_mib * MiB,
        max_queued_messages=lim.max_queued_messages,
    )


def read_swarm_key(cfg: Config) -> bytes | None:
    path = cfg.security.swarm_key_file
    if not path:
        return None
    p = Path(path)
    if not p.is_absolute() and cfg.source:
        p = Path(cfg.source).parent / p
    try:
        key = p.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"[security] swarm_key_file: cannot read {p}: {exc.strerror}") from None
    if len(key) < 16:
        raise ValueError(f"[security] swarm_key_file: {p} holds {len(key)} bytes; use at least 16 random bytes "
                         "(e.g. `head -c 32 /dev/urandom | base64 > swarm.key`)")
    return key


@dataclass
class DaemonInfo:
    peer_id: str
    listen: tuple[str, int]
    started: float


class Daemon:
    def __init__(self, config: Config, home: Home, *, claim: HomeClaim | None = None, signals: bool = True):
        self.config = config
        self.signals = signals  # SIGINT/SIGTERM stop it; off for a daemon embedded in a training process (peer/attach/embedded.py)
        self.home = home.ensure()
        # the home first, then its key: a second daemon on this home is refused before it touches the key
        # (held for the life of this process; `claim` is the one `peer start` took before logging)
        self.claim = claim or home.claim()
        self.identity = home.load_or_create_identity(config.membership.identity_bits)
        self.peer_id = ident.peer_id_from_public_bytes(ident.public_key_bytes(self.identity))
        self.psk = read_swarm_key(config)
        self.ciphers = resolve_ciphers(config.security.ciphers)
        self.router = Router()
        self.listener_stats = ListenerStats()
        self.handshake_slots: HandshakeSlots[trio.CancelScope] = HandshakeSlots()
        self.listen_addr: tuple[str, int] = ("", 0)
        self.started = time.time()
        self._stop = trio.Event()
        self.stop_reason = ""
        self.membership: Membership | None = None
        self.services = Services()

    # ---- lifecycle ----------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            self._stop.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        claim_socket_path(self.home.control_socket)  # refuse early if a live daemon owns this home
        host, port = parse_hostport(cfg.daemon.listen, what="[daemon] listen")
        listeners, self.listen_addr = await open_listeners(host, port)
        transport = TransportConfig(
            identity=self.identity, swarm=cfg.daemon.swarm, psk=self.psk, ciphers=self.ciphers,
            allowed_peer_ids=frozenset(cfg.security.allow_peers) or None, identity_bits=cfg.membership.identity_bits,
            limits=wire_limits(cfg),
            handshake_timeout=cfg.membership.handshake_timeout,
            app_payload={"port": self.listen_addr[1], "ver": __version__},
            chunk_bytes=cfg.gossip.chunk_kib * KiB)
        self.transport = transport
        self.services = Services()  # membership asks it at run time (peer/services.py); load_services fills it
        self.membership = m = Membership(config=cfg, transport=transport, peer_id=self.peer_id,
                                         router=self.router, listen_port=lambda: self.listen_addr[1],
                                         services=self.services)
        if host not in ("0.0.0.0", "::", ""):
            m.bound_hosts.append(host)
        load_services(self)
        relay = self.services.get(NatService).relay
        atomic_write(self.home.config_snapshot, _snapshot(cfg).encode(), mode=0o600)

        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_control(
                self.home.control_socket, self._control_commands(), sessions=self._control_sessions(),
                task_status=task_status))
            if self.signals:
                nursery.start_soon(self._watch_signals)
            nursery.start_soon(lambda: serve(listeners, transport, m.own_session,
                                             max_connections=cfg.membership.max_connections,
                                             max_connections_per_ip=cfg.membership.max_connections_per_ip,
                                             stats=self.listener_stats, slots=self.handshake_slots,
                                             idle_victim=m.idle_victim, on_circuit=relay.accept_circuit,
                                             circuits_expected=relay.expecting_circuits))
            await nursery.start(m.run)
            for peer in self._load_peer_cache():  # dial hints from an earlier run (peer/membership/store.py)
                m.learn_addresses(peer.peer_id, peer.addresses, source="cache")
            if cfg.discovery.mdns:
                nursery.start_soon(self._run_mdns)
            for svc in self.services:
                await nursery.start(svc.run)
            nursery.start_soon(self._save_peer_cache_periodically)
            log.info("peer %s (swarm %s) listening on %s:%d, mDNS %s, home %s, cipher preference %s",
                     self.peer_id, cfg.daemon.swarm, *self.listen_addr,
                     "on" if cfg.discovery.mdns else "off", self.home.root, "/".join(self.ciphers))
            task_status.started(DaemonInfo(self.peer_id, self.listen_addr, self.started))
            await self._stop.wait()
            log.info("stopping (%s)", self.stop_reason)
            m.stop_dialing()
            with trio.move_on_after(30) as cs:
                cs.shield = True
                for stoppable in reversed(self.services.providing(HasShutdown)):
                    await stoppable.shutdown()
                await m.say_goodbye(self.stop_reason or "shutting down")
                self._save_peer_cache()
            nursery.cancel_scope.cancel()
        log.info("stopped")

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self._stop.is_set():
                    log.warning("second %s: exiting now", signal.Signals(signum).name)
                    os._exit(130)
                self.request_stop(f"received {signal.Signals(signum).name}")

    async def _run_mdns(self) -> None:
        from peer.membership.mdns import MdnsDiscovery  # zeroconf is only imported when mDNS is on

        cfg = self.config.discovery
        disc = MdnsDiscovery(peer_id=self.peer_id, swarm=self.config.daemon.swarm, port=self.listen_addr[1],
                             protocol_version=PROTOCOL_VERSION, interfaces=list(cfg.interfaces) or None,
                             advertise_addresses=list(cfg.advertise) or None)
        send, receive = trio.open_memory_channel(256)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(disc.run, send)
                async for ann in receive:
                    self.membership.learn(ann.peer_id, list(ann.addresses), source="mdns")
        except Exception as exc:  # e.g. port 5353 unusable, or our name already announced by another daemon
            log.error("mDNS discovery stopped: %s: %s (peers can still join with --join)", type(exc).__name__, exc)

    # ---- peer cache ---------------------------------------------------------------------------------
    def _load_peer_cache(self) -> list[StoredPeer]:
        return PeerStore(self.home.peer_cache, swarm=self.config.daemon.swarm).load()

    def _save_peer_cache(self) -> None:
        try:
            PeerStore(self.home.peer_cache, swarm=self.config.daemon.swarm).save(
                entries_from_peers(self.membership.peers.values()))
        except OSError as exc:
            log.warning("cannot save peer cache: %s", exc)

    async def _save_peer_cache_periodically(self) -> None:
        while True:
            await trio.sleep(30)
            self._save_peer_cache()

    # ---- control ------------------------------------------------------------------------------------
    def _control_commands(self):
        async def status(args: dict) -> dict:
            return self.status()

        async def stop(args: dict) -> dict:
            self.request_stop("`peer stop`")
            return {"stopping": True, "pid": os.getpid()}

        commands = {"status": status, "stop": stop}
        for svc in self.services.providing(HasCommands):
            commands.update(svc.commands())
        return commands

    def _control_sessions(self):
        sessions = {}
        for svc in self.services.providing(HasSessions):
            sessions.update(svc.sessions())
        return sessions

    def status(self) -> dict:
        now = time.time()
        peers = []
        for p in sorted(self.membership.peers.values(), key=lambda p: p.peer_id):
            s = p.session
            peers.append({
                "peer_id": p.peer_id, "state": p.state, "source": p.source,
                "address": (f"{s.remote_addr[0]}:{s.remote_addr[1]}" if s else
                            (f"{p.addresses[0][0]}:{p.addresses[0][1]}" if p.addresses else "")),
                "direction": ("out" if s.initiator else "in") if s else "",
                "cipher": s.cipher if s else "",
                "path": s.path if s else "", "via": s.via if s else "",
                "clock_offset_s": round(s.clock_offset, 3) if s and s.clock_offset is not None else None,
                "bytes_by_path": _by_path(p.bytes_by_path, s),
                "first_connected": round(p.first_connected, 3), "connected_since": round(p.connected_since, 3) if s else None,
                "rtt_ms": round(p.rtt * 1000, 3) if p.rtt is not None else None,
                "bytes_in": p.bytes_in_closed + (s.stats.bytes_in if s else 0),
                "bytes_out": p.bytes_out_closed + (s.stats.bytes_out if s else 0),
                "last_seen_s": round(now - p.last_seen, 1) if p.last_seen else None,
                "reason": p.dead_reason,
            })
        out = {
            "peer_id": self.peer_id, "swarm": self.config.daemon.swarm, "version": __version__,
            "protocol_version": PROTOCOL_VERSION, "pid": os.getpid(), "home": str(self.home.root),
            "listen": f"{self.listen_addr[0]}:{self.listen_addr[1]}", "uptime_s": round(now - self.started, 1),
            "started_at": round(self.started, 3),
            "mdns": self.config.discovery.mdns, "ciphers": list(self.ciphers),
            "connected": sum(1 for p in peers if p["state"] == "connected"), "peers": peers,
            "bootstrap": self.membership.bootstrap_status(),
            "listener": {"accepted": self.listener_stats.accepted, "refused": self.listener_stats.refused,
                         "handshake_failures": self.listener_stats.handshake_failures,
                         "evicted": self.listener_stats.evicted, "handshaking": len(self.handshake_slots),
                         "handshakes_evicted": self.listener_stats.handshakes_evicted,
                         "circuits_dropped": self.listener_stats.circuits_dropped},
        }
        for svc in self.services:
            out[svc.name] = svc.status()
        for reporter in self.services.providing(HasTraining):  # no hosted trainer: an attached process's figures fill the panel
            if "trainer" not in out and (figures := reporter.training()) is not None:
                out["trainer"] = figures
        out["bans"] = out.get("gossip", {}).get("bans", [])  # peers we do not average with for now, and why
        return out


def load_services(daemon: DaemonContext) -> Services:
    """The services this daemon's config asks for, built with what each uses, added in start order to
    `daemon.services` (empty before; membership already holds it). `peer/` never imports a specific trainer:
    the config names the trainer module, and TrainerHost loads it."""

    services = daemon.services
    services.add(NatService(daemon))
    topology = services.add(TopologyService(daemon))
    gossip = services.add(GossipEngine(daemon, topology))
    pipeline = services.add(PipelineService(daemon, topology))
    services.add(AttachService(daemon, gossip))
    if daemon.config.trainer.name:
        from peer.trainer_host import TrainerHost

        services.add(TrainerHost(daemon, gossip, pipeline, topology))
    if daemon.config.metrics.listen:
        from peer.metrics.service import MetricsService  # prometheus_client is only imported when asked for

        services.add(MetricsService(daemon))
    if daemon.config.dashboard.listen:
        from peer.dashboard.service import DashboardService

        services.add(DashboardService(daemon, topology))
    return services


def _by_path(closed: dict[str, int], session) -> dict[str, int]:
    """Bytes (in + out) with one peer by the path they took: ended sessions plus the current one."""
    out = dict(closed)
    if session is not None:
        out[session.path] = out.get(session.path, 0) + session.stats.bytes_in + session.stats.bytes_out
    return out


def _snapshot(cfg: Config) -> str:
    from peer.config import to_toml

    return f"# effective config of this daemon, written at start\n{to_toml(cfg)}"

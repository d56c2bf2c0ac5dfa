"""The daemon's NAT service: reachability, relaying for others, relays for us, hole punching.

    NatService.run
    ├── Reachability.run   dial-back rounds → verdict public / nat / unknown
    ├── RelayServer.run    circuit set-ups (we relay only while public and `[relay] enabled`)
    ├── RelayClient.run    reservations while we are behind NAT; circuits to us
    └── HolePuncher.run    relayed sessions we dialed → direct ones

It plugs into membership as `ShapesAddresses` (peer/services.py: which of our addresses to advertise, our
relayed ones, how to dial a relayed address) and `KeepsSessions` (the sessions relay reservations ride on),
which membership asks when it needs them, and a watcher; into the listener through `accept_circuit`.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from peer.nat.addresses import ip_literal
from peer.nat.punch import HolePuncher
from peer.nat.reachability import Reachability
from peer.nat.relay import RelayServer
from peer.nat.relay_client import RelayClient
from protocol.refusal import Code, Refusal

if TYPE_CHECKING:
    from peer.membership.dialing import DialRelayed
    from peer.services import DaemonContext

log = logging.getLogger("peertrain.nat")

MAPPINGS = 8  # recent observations of how our NAT maps ports, for `nat_mapping`


class NatService:
    name = "nat"

    def __init__(self, daemon: DaemonContext):
        cfg = daemon.config
        m = self.membership = daemon.membership
        self.cfg = cfg
        self.reach = Reachability(cfg.nat, membership=m, transport=daemon.transport, router=daemon.router,
                                  listen_port=lambda: daemon.listen_addr[1], seen_hosts=lambda: self._seen_ips)
        self.relay = RelayServer(cfg.relay, daemon.router, offering=self._offering)
        self.client = RelayClient(cfg.nat, membership=m, transport=daemon.transport, router=daemon.router,
                                  wanted=lambda: cfg.nat.use_relays and self.reach.verdict == "nat")
        self.punch = HolePuncher(membership=m, transport=daemon.transport, router=daemon.router,
                                 public_ip=self.public_ip, enabled=cfg.nat.hole_punching, mapping=self.nat_mapping)
        self.mappings: deque[str] = deque(maxlen=MAPPINGS)
        self._seen_ips: list[str] = []  # our IPs as peers we dialed report them, newest last
        self._outside_ips: list[str] = []  # those of them that differ from our end of the connection (a NAT)
        m.watch(self._on_peer)

    # ---- what membership asks (ShapesAddresses, KeepsSessions) ----------------------------------------
    def advertise_observed(self) -> bool:
        """Not behind NAT as dial-back found: the addresses peers observe us at are worth advertising (asked
        from the start: a peer set to `private` once advertised its direct addresses in the entry partial views
        sent while joining, and peers dialed them)."""
        return self.reach.verdict != "nat"

    def verified_hosts(self) -> list[str]:
        return self.reach.verified_hosts()

    def relayed_addresses(self) -> list[str]:
        return self.client.addresses()

    def dial_relayed(self) -> DialRelayed | None:
        return self.client.dial_via

    def keeps_session(self, peer_id: str) -> bool:
        """Never closed as idle: a session a relay reservation rides on (ours with a relay, or a client's with us)."""
        return peer_id in self.client.held or peer_id in self.relay.reservations

    def _offering(self) -> Refusal | None:
        """Why we do not relay for others now, or None while we do."""
        if not self.cfg.relay.enabled:
            return Refusal(Code.DISABLED, "relaying is off ([relay] enabled = false)")
        if self.reach.verdict != "public":
            return Refusal(Code.DISABLED, f"not publicly reachable ({self.reach.verdict})")
        return None

    def public_ip(self) -> str | None:
        """Our IP as the outside sees it, for a punch (which proves itself by the handshake): the latest a
        peer reported seeing us at through a NAT (another IP than our end of the connection); with no NAT
        seen, one that peers agree on, else the latest one reported. A LAN neighbour's report (our private
        address) once made a punch aim at a LAN address from the other side of the internet."""
        if self._outside_ips:
            return self._outside_ips[-1]
        agreed = self.membership.observed_hosts
        return agreed[-1] if agreed else (self._seen_ips[-1] if self._seen_ips else None)

    def nat_mapping(self) -> str:
        """'none' (peers see our own address), 'preserving' (a NAT keeps our local ports), 'random' (a NAT
        gives each connection a new port: punching cannot work), or 'unknown'."""
        outside = [m for m in self.mappings if m != "none"]  # a NAT between us and some peers: they decide
        seen = outside or list(self.mappings)
        return max(set(seen), key=seen.count) if seen else "unknown"

    def _on_peer(self, peer_id: str, session) -> None:
        if session is None:
            self.relay.forget(peer_id)
            return
        app = session.remote_app if isinstance(session.remote_app, dict) else {}
        ip, port = ip_literal(str(app.get("observed", ""))), app.get("observed_port")
        if session.initiator and session.path == "direct" and ip and isinstance(port, int):
            local_ip, local_port = session.stream.socket.getsockname()[:2]
            if ip_literal(session.remote_addr[0]) == ip:
                pass  # a peer on our own host: says nothing about a NAT
            elif ip == ip_literal(local_ip):
                self.mappings.append("none")
            else:
                self.mappings.append("preserving" if port == local_port else "random")
                if ip not in self._outside_ips[-1:]:
                    self._outside_ips = (self._outside_ips + [ip])[-4:]
            if ip not in self._seen_ips[-1:]:
                self._seen_ips = (self._seen_ips + [ip])[-4:]
        self.punch.consider(session)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for part in (self.reach, self.relay, self.client, self.punch):
                await nursery.start(part.run)
            task_status.started()
            known: list[str] = []
            verdict = self.reach.verdict
            while True:  # follow what we know about ourselves into the next check
                if self.reach.verdict != verdict:
                    verdict = self.reach.verdict
                    self.client.wake()  # behind NAT now (or no longer): relays at once, not at the next tick
                if self.reach.candidates() != known:
                    known = self.reach.candidates()
                    self.reach.addresses_changed()
                await trio.sleep(0.25)

    def status(self) -> dict:
        m = self.membership
        return {**self.reach.status(), "observed": list(m.observed_hosts), "nat_mapping": self.nat_mapping(),
                "advertised": list(m.own_record().addresses), "relays": self.client.status(),
                "relay_server": self.relay.status(), "punches": self.punch.status()}

"""Who is in the swarm, and a live session to each peer we can reach.

Peers are learned from mDNS, `--join` addresses, peer exchange (signed records that others forward)
and inbound connections. Membership dials them with exponential backoff and jitter, keeps exactly one
session per pair (when both sides dial at once, both keep the session *initiated by the smaller peer
ID* and close the other, so they always agree), pings every session, and marks a peer dead when its
session ends or its pongs stop for `dead_after` (replies, not just any bytes: a peer that sends but does
not read is dead too); a frame it does not take within `dead_after` closes its session as well.

Ownership: `run()` owns the dialer, the view mode's loop (peer exchange, or the partial views) and (through
`own_session`) every session's reader, heartbeat and dispatcher tasks. Cancelling `run()` closes them all. The dialer (what to dial
when, and the backoff) is a `peer.membership.dialing.Dialer` that `Membership` owns, sharing its peer table.
The view mode (`views`: the full view, partial views, or "auto", one then the other:
peer/membership/view_mode.py) decides what spreads and whom the dialer dials.

Membership is built before the daemon's services and holds their registry (`services`, peer/services.py):
what it needs of them it asks there when it needs it: which of our addresses to advertise and how to dial
through a relay (`ShapesAddresses`, the NAT service), which sessions never to close as idle (`KeepsSessions`),
link figures and who follows the partial views' edges (`MeasuresLinks`, `FollowsViewEdges`). The view driver
and the lookups (peer/membership/reach.py) use its public surface below, not its peer table or dialer.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import trio

from peer.config import Config
from peer.nat.addresses import format_hostport, parse_address, parse_relayed
from peer.session.router import Router
from peer.session.fanout import send_to_each
from peer.membership.dialing import Dialer, DialRelayed
from peer.membership.view_driver import ViewDriver, gap_config, view_config
from peer.membership.view_mode import FullView, ViewMode
from peer.membership.auto_view import AutoView
from peer.services import FollowsViewEdges, KeepsSessions, MeasuresLinks, Providers, Services, ShapesAddresses
from peer.membership.peers import (IDLE_ROUNDS, MAX_ADDRESSES, MAX_OBSERVED_CANDIDATES, MAX_PEERS, MAX_RELAYED,
                                   OBSERVED_QUORUM, SECOND_HAND, BootstrapTarget, PeerInfo,
                                   is_public_address, pick_idle)
from peer.session.transport import Session, SessionClosed, TransportConfig
from protocol import identity as ident
from protocol.schema import Goodbye, PeerRecord, Ping, Pong, peer_record_signing_bytes

if TYPE_CHECKING:
    from peer.topology.graph import LinkEstimate

log = logging.getLogger("peertrain.membership")

RTT_REFRESH_S = 10.0
"""A busy session (its peer answers our other requests) is still pinged this often, and at once while it has
no RTT: the figure `peer status` shows and the link estimates start from."""
REPLACED_DRAIN_S = 2.0
"""A relayed session replaced by a direct one (a hole punch) stays open this long, unused for anything new,
so a request or a reply already on its way over it still arrives: closing it at once lost them (a view's
edge request, then its answer), and the peers gave up on each other for a retry interval."""


class Membership:
    def __init__(self, *, config: Config, transport: TransportConfig, peer_id: str, router: Router,
                 listen_port: Callable[[], int], services: Providers | None = None):
        self.cfg = config.membership
        self.swarm = config.daemon.swarm
        self.transport = transport
        self.peer_id = peer_id
        self.router = router
        self._listen_port = listen_port
        self.services: Providers = services if services is not None else Services()  # none: a bare membership
        self.peers: dict[str, PeerInfo] = {}
        self.dialer = Dialer(self.cfg, transport, peer_id=peer_id, peers=self.peers,
                             bootstrap=[BootstrapTarget(*parse_address(a)) for a in config.daemon.join],
                             start_session=self._start_session, policy=self)
        self.advertise_hosts: list[str] = list(config.discovery.advertise)
        self.bound_hosts: list[str] = []  # the host of `[daemon] listen`, unless it is a wildcard
        self.observed_hosts: list[str] = []  # reported by OBSERVED_QUORUM peers at distinct IPs
        self._observed_votes: dict[str, dict[str, str]] = {}  # address -> reporter IP -> reporter peer ID
        self.private_addresses = config.discovery.private_addresses
        self._nursery: trio.Nursery | None = None
        self._leaving = False
        self._watchers: list[Callable[[str, Session | None], None]] = []
        router.register(Ping, self._on_ping)
        router.register(Goodbye, self._on_goodbye)
        # `[membership] views = "partial"`: a bounded partial view drives whom we dial and keep, and peer
        # records are not flooded (peer/membership/view_driver.py); "full": the full view, as always; "auto":
        # the full view until the swarm is big, then partial views (peer/membership/auto_view.py)
        self.views: ViewMode = (ViewDriver(self, view_config(config), gap=gap_config(config))
                                if self.cfg.views == "partial" else FullView(self) if self.cfg.views == "full"
                                else AutoView(self, config))

    # ---- what the services say (peer/services.py) ---------------------------------------------------
    def _nat(self) -> list[ShapesAddresses]:
        return self.services.providing(ShapesAddresses)

    def advertise_observed(self) -> bool:
        """Whether the addresses peers observe us at are worth advertising (yes, unless NAT says no)."""
        return all(n.advertise_observed() for n in self._nat())

    def dial_relayed(self) -> DialRelayed | None:
        """How the dialer reaches a peer through a relay (the NAT service's relay client); None: it does not."""
        return next((d for n in self._nat() if (d := n.dial_relayed()) is not None), None)

    def keeps_session(self, peer_id: str) -> bool:
        """Whether a service needs the session with `peer_id` kept (never closed as idle)."""
        return any(k.keeps_session(peer_id) for k in self.services.providing(KeepsSessions))

    def link_estimate(self, peer_id: str) -> LinkEstimate | None:
        """Our link to `peer_id` as measured (the topology service), or None."""
        return next((e for s in self.services.providing(MeasuresLinks) if (e := s.link_estimate(peer_id)) is not None),
                    None)

    def view_edge(self, peer_id: str, up: bool, reason: str, degree: int) -> None:
        """The partial views made `peer_id` a gossip neighbour, or no longer one: tell who follows them."""
        for f in self.services.providing(FollowsViewEdges):
            try:
                f.view_edge(peer_id, up, reason, degree)
            except Exception:
                log.exception("partial views: an edge follower failed")

    # ---- the dialer's policy (peer/membership/dialing.py, DialPolicy) -------------------------------
    def wants_dial(self, peer_id: str) -> bool:
        return self.views.wants_dial(peer_id)

    def wants_contact(self) -> bool:
        return self.views.wants_contact()

    def stop_dialing(self) -> None:
        """We are leaving: make no new connections. Sessions we have stay up for the goodbye; peers that
        leave with us would otherwise be re-dialed, and each failure logged, while we shut down."""
        self._leaving = True
        self.dialer.stop()

    # ---- queries ------------------------------------------------------------------------------------
    def connected(self) -> dict[str, Session]:
        return {pid: p.session for pid, p in self.peers.items() if p.state == "connected" and p.session is not None}

    def idle_victim(self, sessions: list[Session]) -> Session | None:
        """`serve`'s question when its slots are full: which of these inbound sessions may go (pick_idle)."""
        return pick_idle(sessions, now=trio.current_time(), idle_after=IDLE_ROUNDS * self.cfg.pex_interval,
                         keep=self.keeps_session)

    def watch(self, callback: Callable[[str, Session | None], None]) -> None:
        """`callback(peer_id, session_or_None)` whenever a peer connects (session) or disconnects (None)."""
        self._watchers.append(callback)

    def _notify(self, peer_id: str, session: Session | None) -> None:
        for cb in self._watchers:
            try:
                cb(peer_id, session)
            except Exception:
                log.exception("membership watcher failed")

    def bootstrap_status(self) -> list[dict]:
        """`peer status`'s view of the `--join` addresses (and `peer doctor`'s)."""
        return self.dialer.bootstrap_status()

    # ---- the surface the view driver and the lookups use --------------------------------------------
    def peer_info(self, peer_id: str) -> PeerInfo | None:
        return self.peers.get(peer_id)

    def known_peers(self) -> Mapping[str, PeerInfo]:
        """The peer table, read-only (entries change through learn / forget / the dialer)."""
        return MappingProxyType(self.peers)

    def forget(self, peer_id: str) -> None:
        """Drop a peer we have no session with from the table (the partial views' unused peers)."""
        info = self.peers.get(peer_id)
        if info is not None and info.session is None:
            del self.peers[peer_id]

    def bootstrap_ids(self) -> list[str]:
        """The peer IDs of the `--join` addresses, as far as we know them (in their order)."""
        return [t.peer_id for t in self.dialer.bootstrap if t.peer_id]

    def has_bootstrap(self) -> bool:
        """Whether any `--join` address was given."""
        return bool(self.dialer.bootstrap)

    def retry_bootstrap(self) -> None:
        """Dial the `--join` addresses now, backoff or not (the views need a contact)."""
        for t in self.dialer.bootstrap:
            t.next_attempt = 0.0
        self.dialer.wake()

    def dial_soon(self) -> None:
        """Something to dial changed (a message waits for a peer, a lookup started): look now."""
        self.dialer.wake()

    # ---- learning of peers --------------------------------------------------------------------------
    def learn(self, peer_id: str, addresses, *, source: str) -> None:
        """A peer was announced (mDNS, pex, ...). New or changed addresses make it dialable now."""
        if peer_id == self.peer_id:
            return
        second_hand = source in SECOND_HAND
        if second_hand and not self.private_addresses:
            addresses = [a for a in addresses if is_public_address(a[0])]
            if not addresses:
                return
        info = self._entry(peer_id, source, f"at {', '.join(f'{h}:{p}' for h, p in addresses) or '?'}")
        if info is None:
            return
        if info.add_addresses(addresses) and info.state != "connected" and not second_hand:
            info.failures = 0  # first-hand news (a peer restarted on a new port): dial now
            info.next_attempt = 0.0
        if not second_hand:
            info.firsthand.update((str(h), int(p)) for h, p in list(addresses)[:MAX_ADDRESSES])
        self.dialer.wake()

    def learn_addresses(self, peer_id: str, texts: list[str], *, source: str) -> None:
        """Like `learn`, from address strings: direct "host:port" and relayed ones (peer/nat/addresses.py)."""
        if peer_id == self.peer_id:
            return
        texts = list(texts)[:MAX_ADDRESSES + MAX_RELAYED]
        direct = [a for a in (parse_address(t) for t in texts) if a is not None]
        relayed = [r for r in (parse_relayed(t) for t in texts) if r is not None and r.relay_id != peer_id]
        if source in SECOND_HAND and not self.private_addresses:
            relayed = [r for r in relayed if is_public_address(r.host)]
        if direct:
            self.learn(peer_id, direct, source=source)
        if not relayed:
            return
        info = self._entry(peer_id, source, f"through relay {', '.join(ident.short_id(r.relay_id) for r in relayed)}")
        if info is not None and info.add_relayed(relayed):
            self.dialer.wake()

    def _entry(self, peer_id: str, source: str, where: str) -> PeerInfo | None:
        """The peer's entry, made (and logged) on first news of it; None while the table is full."""
        info = self.peers.get(peer_id)
        if info is None:
            if len(self.peers) >= MAX_PEERS:
                log.debug("peer table full; ignoring %s", ident.short_id(peer_id))
                return None
            info = self.peers[peer_id] = PeerInfo(peer_id=peer_id, source=source)
            # a partial view's entries come and go every shuffle: worth a line only when debugging
            log.log(logging.DEBUG if source == "view" else logging.INFO, "discovered %s via %s %s",
                    ident.short_id(peer_id), source, where)
        return info

    def advertised_addresses(self) -> list[str]:
        """Where peers can reach us, best first: direct "host:port" ones, then relayed ones."""
        port = self._listen_port()
        nat = self._nat()
        verified = [h for n in nat for h in n.verified_hosts()]
        relayed = [a for n in nat for a in n.relayed_addresses()]
        hosts = list(dict.fromkeys(self.advertise_hosts + verified
                                   + (self.bound_hosts + self.observed_hosts if self.advertise_observed() else [])))
        return [format_hostport(h, port) for h in hosts][:MAX_ADDRESSES] + relayed[:MAX_RELAYED]

    def own_record(self) -> PeerRecord:
        """Our signed, expiring peer record, as peer exchange forwards it."""
        now = time.time()
        addresses = self.advertised_addresses()
        rec = PeerRecord(peer_id=self.peer_id, public_key=ident.public_key_bytes(self.transport.identity),
                         swarm=self.swarm, addresses=addresses,
                         issued=now, expires=now + self.cfg.peer_record_ttl, signature=b"")
        sig = ident.sign(self.transport.identity, peer_record_signing_bytes(rec))
        return PeerRecord(**{**{f: getattr(rec, f) for f in rec.__dataclass_fields__}, "signature": sig})

    def valid_record(self, rec: PeerRecord) -> str | None:
        """None if the record is authentic, current and ours; else why not."""
        if ident.peer_id_from_public_bytes(rec.public_key) != rec.peer_id:
            return "peer ID does not match its public key"
        if not ident.verify(rec.public_key, rec.signature, peer_record_signing_bytes(rec)):
            return "bad signature"
        now = time.time()
        # a record lives no longer than our own TTL, whatever expiry it claims
        if min(rec.expires, rec.issued + self.cfg.peer_record_ttl) < now or rec.issued > now + 300:
            return "expired or from the future"
        if rec.swarm != self.swarm:
            return f"other swarm {rec.swarm!r}"
        return None

    # ---- the loops ----------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.views.run)
            task_status.started()
            await self.dialer.run()

    def _start_session(self, session: Session) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self.own_session, session)

    def adopt(self, session: Session) -> None:
        """Own a session made elsewhere (a relay circuit, a punched connection) like one we dialed."""
        if self._nursery is None or self._leaving:
            session.stream.socket.close()  # not started yet: nothing else holds it
            return
        self._start_session(session)

    # ---- owning a session ---------------------------------------------------------------------------
    def _preferred(self, a: Session, b: Session) -> Session:
        """Of two sessions with one peer, the one both ends keep: a direct one over a relayed one (both
        ends know which runs through a relay), else the one initiated by the smaller peer ID."""
        if (a.path == "relayed") != (b.path == "relayed"):
            return b if a.path == "relayed" else a
        smaller = min(self.peer_id, a.peer_id)

        def initiator_id(s: Session) -> str:
            return self.peer_id if s.initiator else s.peer_id

        return a if initiator_id(a) == smaller else b

    async def own_session(self, session: Session) -> None:
        """Run one session to its end: reader, heartbeat, dispatcher. Returns when it is closed."""
        pid = session.peer_id
        if pid == self.peer_id:
            await session.aclose("connected to ourselves")
            return
        if isinstance(session.remote_app, dict) and session.remote_app.get("probe"):
            # a dial-back or `peer doctor` checking that we answer: the handshake was the whole answer
            await session.aclose("probe answered")
            return
        info = self.peers.get(pid)
        if info is None:
            source = "relay" if session.path == "relayed" else "inbound" if not session.initiator else "join"
            info = self.peers[pid] = PeerInfo(peer_id=pid, source=source)
        self._learn_from_handshake(info, session)
        if info.session is not None and not info.session.closed.is_set():
            keep = self._preferred(info.session, session)
            if keep is info.session:
                await session.aclose("duplicate session")
                return
            replaced = info.session.path == "relayed" and session.path != "relayed"
            why = "replaced by a direct session" if replaced else "duplicate session"
            if replaced and self._nursery is not None:  # what is in flight on it (a request, its reply) still arrives
                self._nursery.start_soon(self._close_after, info.session, REPLACED_DRAIN_S, why)
            else:
                await info.session.aclose(why)
        info.session = session
        session.send_timeout = self.cfg.dead_after  # a peer that takes no frame for this long is as dead as a silent one
        info.state = "connected"
        info.failures = 0
        info.dead_reason = ""
        info.last_seen = info.connected_since = time.time()
        info.first_connected = info.first_connected or info.last_seen
        log.info("connected to %s at %s:%d (%s, %s%s)", session.short, session.remote_addr[0], session.remote_addr[1],
                 "outbound" if session.initiator else "inbound", session.cipher,
                 f", through relay {ident.short_id(session.via)}" if session.via else
                 ", hole punched" if session.path == "punched" else "")
        self._notify(pid, session)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._heartbeat, session, info)
                n.start_soon(self._dispatch, session)
                n.start_soon(self.views.greet, session)
                await session.run()
                n.cancel_scope.cancel()
        finally:
            # its bytes count toward the pair whether it ended alone or was replaced (by a direct session)
            info.bytes_in_closed += session.stats.bytes_in
            info.bytes_out_closed += session.stats.bytes_out
            info.bytes_by_path[session.path] = (info.bytes_by_path.get(session.path, 0)
                                                + session.stats.bytes_in + session.stats.bytes_out)
            if info.session is session:
                info.session = None
                info.ended_at = trio.current_time()
                info.state = "dead"
                info.dead_reason = session.close_reason
                info.next_attempt = trio.current_time() + self.dialer.backoff(0)
                log.info("peer %s is dead: %s", session.short, session.close_reason)
                self._notify(pid, None)
                self.dialer.wake()

    @staticmethod
    async def _close_after(session: Session, seconds: float, reason: str) -> None:
        await trio.sleep(seconds)
        await session.aclose(reason)

    def _learn_from_handshake(self, info: PeerInfo, session: Session) -> None:
        app = session.remote_app if isinstance(session.remote_app, dict) else {}
        if session.path != "direct":
            return  # a circuit's or a punched connection's addresses are the relay's or a NAT's one-off port
        port = app.get("port")
        if isinstance(port, int) and 0 < port < 65536:
            info.add_addresses([(session.remote_addr[0], port)])
            info.firsthand.add((session.remote_addr[0], port))  # the address it connected from: its own
        observed = app.get("observed")
        if session.initiator and isinstance(observed, str):
            self.vote_observed(observed, reporter_ip=session.remote_addr[0], reporter=session.peer_id)
        dialed = parse_address(app.get("dialed", "")) if not session.initiator else None
        if dialed is not None:  # it reached us at this address: ours as seen from where it stands
            self.vote_observed(dialed[0], reporter_ip=session.remote_addr[0], reporter=session.peer_id)

    def vote_observed(self, observed: str, *, reporter_ip: str, reporter: str) -> None:
        """A peer we dialed says it sees us at `observed`. We advertise it once OBSERVED_QUORUM peers at
        distinct IPs agree (configured `advertise` addresses still come first)."""
        try:
            observed = str(ipaddress.ip_address(observed))
        except ValueError:
            return
        votes = self._observed_votes.get(observed)
        if votes is None:
            if len(self._observed_votes) >= MAX_OBSERVED_CANDIDATES:
                self._observed_votes.pop(next(iter(self._observed_votes)))
            votes = self._observed_votes[observed] = {}
        if reporter_ip not in votes and len(votes) < 4 * OBSERVED_QUORUM:
            votes[reporter_ip] = reporter
        if (observed not in self.observed_hosts and len(votes) >= OBSERVED_QUORUM
                and len(set(votes.values())) >= OBSERVED_QUORUM):
            self.observed_hosts = (self.observed_hosts + [observed])[-4:]
            log.info("advertising %s: seen by %d peers at distinct addresses", observed, len(votes))

    async def _dispatch(self, session: Session) -> None:
        async for env in session.incoming:
            await self.router.dispatch(session, env)

    async def _heartbeat(self, session: Session, info: PeerInfo) -> None:
        """Ping on a fixed interval a session that answered none of our requests within it; no answer for
        `dead_after` closes the session (the peer is dead).

        Answers, not received bytes: a peer that keeps sending but never reads our pings (or never answers
        them) once counted as alive and stalled everything we sent it. Any reply proves what a pong does (it
        read our request and answered), so a session busy with averaging or pipeline calls is not pinged: at
        a swarm's scale pings were most of a peer's control traffic (docs/benchmarks.md, 2026-11-27). Its RTT
        then keeps its last ping's figure, refreshed every RTT_REFRESH_S."""
        dead_after = self.cfg.dead_after
        last_pong = last_ping = trio.current_time()
        while True:
            await trio.sleep(self.cfg.heartbeat_interval)
            t0 = trio.current_time()
            last_pong = max(last_pong, session.stats.last_answered)
            if (t0 - last_pong < self.cfg.heartbeat_interval and info.rtt is not None
                    and t0 - last_ping < RTT_REFRESH_S):
                info.last_seen = time.time()
                continue
            last_ping = t0
            wait = last_pong + dead_after - t0
            if wait > 0:
                try:
                    await session.request(Ping(sent=time.time()), timeout=wait)
                except trio.TooSlowError:
                    pass
                except SessionClosed:
                    return
                else:
                    last_pong = trio.current_time()
                    rtt = last_pong - t0
                    info.rtt = rtt if info.rtt is None else 0.8 * info.rtt + 0.2 * rtt
                    info.last_seen = time.time()
            silent = trio.current_time() - last_pong
            if silent >= dead_after:
                reason = f"no heartbeat reply for {silent:.1f}s (dead_after={dead_after}s)"
                log.warning("closing session with %s: %s", session.short, reason)
                await session.aclose(reason)
                return

    async def _on_ping(self, session: Session, env) -> None:
        await session.reply(env, Pong(echo=env.message.sent))

    async def _on_goodbye(self, session: Session, env) -> None:
        await session.aclose(f"peer said goodbye: {env.message.reason}")

    # ---- peer records (the full view's peer exchange, peer/membership/view_mode.py) --------------------
    def take_record(self, rec: PeerRecord) -> None:
        """A peer's signed record, checked (`valid_record`): its latest word on where it is."""
        if rec.peer_id == self.peer_id:
            return
        info = self.peers.get(rec.peer_id)
        newer = info is not None and (info.record is None or info.record.issued < rec.issued)
        if newer:  # forget addresses it stopped advertising (not first-hand ones)
            listed = set(rec.addresses)
            info.addresses = [a for a in info.addresses if a in info.firsthand or format_hostport(*a) in listed]
            info.relayed = [r for r in info.relayed if str(r) in listed]
        self.learn_addresses(rec.peer_id, rec.addresses, source="pex")
        info = self.peers.get(rec.peer_id)
        if info is not None and (info.record is None or info.record.issued < rec.issued):
            info.record = rec

    async def say_goodbye(self, reason: str) -> None:
        """Tell every peer we are leaving (best effort, bounded), so they don't wait for a timeout."""
        await self.views.leave()  # partial views first pair our neighbours up, so their degrees stay
        with trio.move_on_after(1.0):
            await send_to_each(list(self.connected().values()), Goodbye(reason=reason))

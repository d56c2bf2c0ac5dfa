"""The daemon's driver of partial views: one `Views` (peer/membership/views.py) run with real sessions.

Under `[membership] views = "partial"` membership owns a `ViewDriver`. It carries out what the rules
return: a `Send` goes as its message over the authenticated session with that peer, and without one the
message waits (`outbox`, bounded) while the dialer reaches the entry's addresses (the dialer's limits and
backoff: peer/membership/dialing.py; it dials nobody else); `EdgeUp`/`EdgeDown` go to the services that
follow them (`FollowsViewEdges`, peer/services.py: the topology service sets the gossip neighbours the
averaging engine reads from them); `NeedContact`
joins again through a `--join` address, an mDNS peer or one of the peer cache (`CACHE_CONTACTS`). Another
service that needs a session with a peer the views never brought (a stage server our pipeline picked) asks
`reach_session` (peer/membership/reach.py): the same dialer dials it, a bounded few at once. Sessions are kept
with the active view, with peers a message waits for, and with whom the other services say they need
(`KeepsSessions`: relays we hold reservations with, peers a stage call is out between); any other session
idle (no message but heartbeats) for `SESSION_IDLE_S` is closed, and a peer with neither a session nor a
message waiting is forgotten (mDNS, `--join` and a few cached peers stay), so what a daemon holds does not
grow with the swarm. It is membership's view mode under partial views (`ViewMode`,
peer/membership/view_mode.py), and uses membership's public surface, never its peer table or dialer. See
docs/design.md, "Partial views".

Hostile peers: a view message is decoded and bounded by its schema (protocol/schema/views.py) like any
message, then its sender checked by `view_messages.check`; one that breaks either closes its session with
the reason, and so does a session that sends view messages faster than `VIEW_BYTES_PER_S` (a token bucket
per session, the relay's, that counts each message's encoded bytes).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from peer.membership.gap_driver import GapDriver, estimator_state_bytes
from peer.membership.reach import Reach
from peer.membership.view_messages import BadMessage, check, framed_size
from peer.membership.views import EdgeDown, EdgeUp, NeedContact, Send, ViewConfig, Views
from peer.nat.addresses import format_hostport, parse_address
from peer.token_bucket import TokenBucket
from peer.session.transport import Session, SessionClosed
from peer.topology.local_gap import GapConfig, check_round
from protocol import identity as ident
from protocol.addresses import MAX_ENTRY_ADDRESSES
from protocol.bounds import MAX_ADDRESS_CHARS
from protocol.schema.views import VIEW_MESSAGES, Entry, GapRound, ViewMessage

if TYPE_CHECKING:
    from peer.membership.service import Membership

log = logging.getLogger("peertrain.membership")

SESSION_IDLE_S = 30.0
"""A session outside the active view is closed after this long without a message (heartbeats aside):
long enough for a view exchange's replies, a few averaging or pipeline calls and a shuffle's answer, short
enough that sessions made for one message do not pile up. The simulator uses the same figure
(peer/bench/scale_sim.py)."""
SEND_TIMEOUT = 5.0  # a view message not written within this (the peer does not read) is undelivered
MAX_QUEUED = 8  # view messages waiting for one peer's session (a swap sends it two at most)
MAX_OUTBOX_PEERS = 64
"""Peers with messages waiting for a session: a shuffle, a few edge requests and walks' answers at once;
one dial each (the dialer makes MAX_DIALS_IN_PROGRESS at a time)."""
VIEW_BYTES_PER_S = 4096
"""View-message bytes one session may send us per second, after a burst of the bucket's capacity (64 KiB).
An honest neighbour sends a few hundred bytes a minute at steady state and a few kB while joining; a peer
faster than this is flooding us with requests, and its session is closed."""
VIEW_BURST_BYTES = 64 * 1024  # what a session may send at once: the largest view message fits (tests/test_views.py)
DEAD_KEPT_S = 10.0
"""A peer whose session ended stays in the peer table this long, so `peer status` shows why it ended (a bad
message, a flood); then, with no session and no message waiting, it is forgotten."""
MAX_DEAD_KEPT = 64  # and at most this many such peers (the oldest go first): sessions can end fast
CACHE_CONTACTS = 16
CACHE_DIALS = 3
"""Peers of the peer cache dialed at once when we join through it: some of an earlier run's peers are gone, and
joining through one picked at random waited `retry_after` (30 s) after each dead pick; the first to answer gets
the join (`_on_session`)."""
"""Peers of the peer cache (peer/membership/store.py: sessions of an earlier run, most recent first) kept as
contacts to join through when no --join or mDNS peer is at hand; the rest are forgotten like any unused
peer. A few suffice: any live member of the swarm lets us in."""
ADDRESS_WAIT_S = 10.0
"""Longest a peer with no address to advertise (behind NAT, no relay reservation yet) waits to join: a
reservation takes a dial-back verdict and a request, about 2 s on loopback; seconds more on the internet."""
LINK_GRACE_S = 2.0
"""A neighbour's session that ends stays an edge this long: a session replaced by another (a hole punch
swapping the relayed session for a direct one) ends just before its successor comes up, and the edge
should survive the swap. A dead peer's edge goes down this much later, after `dead_after` (6 s) anyway."""
TICK_MAX = 1.0  # seconds between housekeeping rounds (outbox deadlines, idle sessions) at most
TICK_MIN = 0.05  # and at least (a burst of timers is handled in one round)


@dataclass
class Outgoing:
    """Messages for a peer we have no session with, until `deadline` (trio clock)."""

    deadline: float
    messages: list[ViewMessage] = field(default_factory=list)


class ViewDriver:
    """Runs `views` for membership `m` (see the module docstring): membership's `ViewMode` under partial views."""

    chooses_edges = True

    def __init__(self, m: Membership, cfg: ViewConfig, *, gap: GapConfig | None = None,
                 rng: random.Random | None = None, register: bool = True):
        self.m = m
        self.cfg = cfg
        rng = rng or random.Random()
        self.views = Views(self.my_entry(), cfg, rng, now=trio.current_time())
        # the local gap estimate the rewiring rule reads (None: not estimated; the rule then reads no gap)
        self.gap = None if gap is None else GapDriver(gap, self.views, rng, sessions=m.connected, send=self._write)
        self.outbox: dict[str, Outgoing] = {}
        # sessions other services ask for (a stage server our pipeline picked): one bounded lookup each
        self.reach = Reach(m, timeout=cfg.request_timeout)
        self.contact_wanted = True  # the dialer dials --join addresses while this holds
        self.sent_bytes = self.received_bytes = 0  # view messages, as framed on the wire
        self.sent_messages = self.received_messages = 0
        self.closed_sessions = 0  # idle sessions outside the active view that we closed
        self._lost: dict[str, float] = {}  # neighbours whose session ended: until when a successor may replace it
        self._buckets: dict[str, TokenBucket] = {}  # per session (one per peer), dropped when it ends
        self._nursery: trio.Nursery | None = None
        self.running = trio.Event()  # run() holds its nursery: actions can be carried out
        self._wake = trio.Event()
        self._next_local_contact = 0.0
        self._started = trio.current_time()
        self._deferred_join: str | None = None  # a contact to join through once we have an address (_join)
        self._cache_dials: set[str] = set()  # peer cache contacts being dialed: the first up gets our join
        if register:  # (False: an `AutoView` registered them, and hands them on once it has switched)
            for cls, handler in self.handlers().items():
                m.router.register(cls, handler)
        m.watch(self._on_session)

    @staticmethod
    def message_types() -> tuple[type, ...]:
        """The messages partial views send (and a full-view daemon ignores)."""
        return (*VIEW_MESSAGES, GapRound)

    def handlers(self) -> dict[type, Callable[[Session, Any], Awaitable[None]]]:
        """The router's handlers of the views' messages."""
        return {cls: self._on_gap_round if cls is GapRound else self._on_view_message for cls in self.message_types()}

    def take_over(self, contact: str | None, candidates: list[str]) -> None:
        """Start from what a full view knew (`[membership] views = "auto"` switching): `candidates` (peers we
        have sessions with) go to the passive view, and we join through `contact` if there is one."""
        for peer in candidates[:self.cfg.passive_size]:
            if peer != contact:
                self.views.learn(self._entry_of(peer))
        if contact is not None:
            self.contact_wanted = False
            self._join(contact, trio.current_time())
            self._wake.set()

    # ---- the view mode (ViewMode, peer/membership/view_mode.py) --------------------------------------
    async def greet(self, session: Session) -> None:
        pass  # partial views spread entries in their own messages, not records

    def wants_dial(self, peer_id: str) -> bool:
        return (peer_id in self.outbox or self.reach.wanted(peer_id)
                or (self.contact_wanted and peer_id in self._cache_dials))

    def wants_contact(self) -> bool:
        return self.contact_wanted

    def dial_addresses(self) -> list[str]:
        return list(self.my_entry().addresses)

    def can_reach(self, addresses: list[str]) -> bool:
        return bool(addresses)

    async def reach_session(self, peer_id: str, addresses: list[str], *,
                            on_reached: Callable[[], None] | None = None) -> Session | None:
        return await self.reach.session(peer_id, addresses, on_reached=on_reached)

    def reach_status(self) -> dict[str, Any] | None:
        return self.reach.status()

    def status_fields(self) -> dict[str, Any]:
        return {"views": self.status(), "view_mode": "partial"}

    # ---- queries ------------------------------------------------------------------------------------
    def my_entry(self) -> Entry:
        """Us as others' views hold us: direct addresses first, and up to RELAYED_IN_ENTRY relayed ones (a
        peer behind NAT advertises only those: its entry names its relays, and whoever dials it asks them)."""
        addrs = self.m.advertised_addresses()
        return Entry(self.m.peer_id, _entry_addresses([a for a in addrs if parse_address(a) is not None],
                                                      [a for a in addrs if parse_address(a) is None]))

    def _entry_of(self, peer: str) -> Entry:
        info = self.m.peer_info(peer)
        if info is None:
            return Entry(peer, ())
        return Entry(peer, _entry_addresses([format_hostport(h, p) for h, p in info.addresses],
                                            [str(r) for r in info.relayed]))

    def status(self) -> dict:
        v = self.views
        # what the rules hold, serialized: the views' and the gap estimator's (as the simulator counts it)
        state = v.state_bytes() + (0 if self.gap is None else estimator_state_bytes(self.gap.estimator))
        return {"active": sorted(v.active), "degree": v.degree, "passive": len(v.passive), "pending": len(v.pending),
                "outbox": len(self.outbox), "state_bytes": state, "sent_bytes": self.sent_bytes,
                "received_bytes": self.received_bytes, "sent_messages": self.sent_messages,
                "received_messages": self.received_messages, "idle_sessions_closed": self.closed_sessions,
                "moves": dict(v.moves), "contact_wanted": self.contact_wanted, "reach": self.reach.status(),
                "gap": None if self.gap is None else self.gap.status()}

    # ---- the loop -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Tick the views at their `next_tick` (and at least every TICK_MAX), until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.running.set()
            if self.gap is not None:
                nursery.start_soon(self.gap.run)
            while True:
                now = trio.current_time()
                try:
                    self.views.me = self.my_entry()  # our addresses change (observed, relayed)
                    self._apply(self.views.tick(now))
                    self._housekeeping(now)
                except Exception:  # a bug here must not end the daemon: the next round tries again
                    log.exception("partial views: a round failed; retrying")
                delay = min(max(self.views.next_tick() - now, TICK_MIN), TICK_MAX)
                self._wake = trio.Event()
                with trio.move_on_after(delay):
                    await self._wake.wait()

    async def leave(self) -> None:
        """We are leaving: pair our neighbours up (`Views.leave`) over the sessions we have (bounded)."""
        sends = [a for a in self.views.leave(trio.current_time()) if isinstance(a, Send)]
        sessions = self.m.connected()
        with trio.move_on_after(1.0):
            for a in sends:
                s = sessions.get(a.to.peer_id)
                if s is not None:
                    await self._write(s, a.msg)

    # ---- carrying out actions -----------------------------------------------------------------------
    def _apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, Send):
                self._send(a.to, a.msg)
            elif isinstance(a, EdgeUp):
                log.info("partial view: %s is a neighbour; degree %d", ident.short_id(a.peer), self.views.degree)
                self._tell(a.peer, True, "partial view")
            elif isinstance(a, EdgeDown):
                log.info("partial view: %s is no neighbour (%s); degree %d", ident.short_id(a.peer), a.reason,
                         self.views.degree)
                self._tell(a.peer, False, a.reason)
            elif isinstance(a, NeedContact):
                self._need_contact(a.reason)

    def _tell(self, peer: str, up: bool, reason: str) -> None:
        self.m.view_edge(peer, up, reason, self.views.neighbour_degrees().get(peer, 0) if up else 0)

    def _send(self, to: Entry, msg: ViewMessage) -> None:
        peer = to.peer_id
        if peer == self.m.peer_id or self._nursery is None:
            return
        session = self.m.connected().get(peer)
        if session is not None and peer not in self.outbox:
            self._nursery.start_soon(self._deliver, session, [msg])
            return
        out = self.outbox.get(peer)
        if out is None:
            if len(self.outbox) >= MAX_OUTBOX_PEERS:
                log.debug("partial views: outbox full; a %s for %s is dropped", msg.TYPE, ident.short_id(peer))
                return  # the rules time out what they wait for
            out = self.outbox[peer] = Outgoing(deadline=trio.current_time() + self.cfg.request_timeout)
            self.m.learn_addresses(peer, list(to.addresses), source="view")
        if len(out.messages) < MAX_QUEUED:
            out.messages.append(msg)
        if session is not None:
            self._flush(peer, session)
        else:
            self.m.dial_soon()

    def _flush(self, peer: str, session: Session) -> None:
        out = self.outbox.pop(peer, None)
        if out is not None and out.messages and self._nursery is not None:
            self._nursery.start_soon(self._deliver, session, out.messages)

    async def _deliver(self, session: Session, messages: list[ViewMessage]) -> None:
        """Write `messages` in order; a peer that does not take them is unreachable for the views."""
        ok = False
        with trio.move_on_after(SEND_TIMEOUT):
            try:
                for msg in messages:
                    await self._write(session, msg)
                ok = True
            except SessionClosed:
                pass
        if not ok:
            self._apply(self.views.unreachable(session.peer_id, trio.current_time()))
            self._wake.set()

    async def write(self, session: Session, msg: ViewMessage | GapRound) -> None:
        """Send one view message outside the views' own rounds (AutoView greets a full-view newcomer), counted."""
        await self._write(session, msg)

    async def _write(self, session: Session, msg: ViewMessage | GapRound) -> None:
        size = await session.send_message(msg)
        self.sent_messages += 1
        self.sent_bytes += framed_size(size)

    def _join(self, contact: str, now: float) -> None:
        """Join through `contact`, once our entry names an address to reach us at: a peer behind NAT has none
        until a relay holds a reservation for it, and the entry its Join spreads is what the others keep (one
        without addresses left peers unable to link with it until a retry). At most ADDRESS_WAIT_S after the
        start: a peer nobody can dial still joins, over the sessions it makes."""
        self.views.me = self.my_entry()
        if not self.views.me.addresses and now < self._started + ADDRESS_WAIT_S:
            self._deferred_join = contact
            return
        self._deferred_join = None
        self._apply(self.views.join(self._entry_of(contact), now))

    def _need_contact(self, reason: str) -> None:
        """Join again: through a --join peer we have a session with, else dial the --join addresses (the
        join goes out when a session comes up: `_on_session`), else through an mDNS peer."""
        log.info("partial views need a contact: %s", reason)
        sessions = self.m.connected()
        for peer in self.m.bootstrap_ids():
            if peer in sessions:
                self._join(peer, trio.current_time())
                return
        if self.m.has_bootstrap():
            self.contact_wanted = True
            self.m.retry_bootstrap()
            return
        self._local_contact(force=True)

    def _local_contact(self, *, force: bool = False) -> None:
        """Join through a peer mDNS found, else through one from the peer cache (our sessions of an earlier
        run: a restarted daemon without --join finds the swarm again through them)."""
        now = trio.current_time()
        if not force and now < self._next_local_contact:
            return
        known = self.m.known_peers()
        for source in ("mdns", "cache"):
            found = [p for p, i in known.items() if i.source == source and p not in self.views.active]
            if not found:
                continue
            self._next_local_contact = now + self.cfg.retry_after
            sessions = self.m.connected()
            live = [p for p in found if p in sessions]
            if source == "mdns" or live:
                self.contact_wanted = False
                # mDNS peers that start together all see much the same peers: joining through the same one
                # (the smallest ID) keeps them from splitting into groups that joined through different ones
                self._join(min(found) if source == "mdns" else random.choice(live), now)
                return
            # an earlier run's peers, some gone: dial a few (fewest failed dials, most recently seen first)
            # and join through the first that answers
            ranked = sorted(found, key=lambda p: (known[p].failures, -known[p].last_seen))
            self._cache_dials = set(ranked[:CACHE_DIALS])
            self.contact_wanted = True
            self.m.dial_soon()
            return

    # ---- events -------------------------------------------------------------------------------------
    def _on_session(self, peer: str, session: Session | None) -> None:
        """Membership's watcher: a session came up (flush what waits for it; join through a contact) or ended."""
        now = trio.current_time()
        self.reach.session_changed(peer, session)
        if session is None:
            self._buckets.pop(peer, None)
            if peer in self.views.active:  # lost, unless a successor comes up within LINK_GRACE_S (housekeeping)
                self._lost.setdefault(peer, now + LINK_GRACE_S)
            self._wake.set()
            return
        self._lost.pop(peer, None)
        self._flush(peer, session)
        if self.contact_wanted and session.initiator and (peer in self.m.bootstrap_ids() or peer in self._cache_dials):
            self.contact_wanted = False
            self._cache_dials.clear()
            self._join(peer, now)
            self._wake.set()

    async def _within_budget(self, session: Session, env) -> bool:
        """Take a message's encoded bytes from its session's budget; a session over it is closed (False)."""
        bucket = self._buckets.get(session.peer_id)
        if bucket is None:
            bucket = self._buckets[session.peer_id] = TokenBucket(VIEW_BYTES_PER_S, VIEW_BURST_BYTES,
                                                                  clock=trio.current_time)
        if bucket.try_take(env.size):
            return True
        reason = f"view messages faster than {VIEW_BYTES_PER_S} bytes/s"
        log.warning("closing session with %s: %s", session.short, reason)
        await session.aclose(reason)
        return False

    async def _bad(self, session: Session, e: ValueError) -> None:
        log.warning("closing session with %s: bad view message: %s", session.short, e)
        await session.aclose(f"bad view message: {e}")

    async def _on_view_message(self, session: Session, env) -> None:
        if not await self._within_budget(session, env):
            return
        msg, peer = env.message, session.peer_id
        try:
            check(msg, peer)
        except BadMessage as e:
            await self._bad(session, e)
            return
        self.received_messages += 1
        self.received_bytes += framed_size(env.size)
        self._apply(self.views.handle(peer, msg, trio.current_time()))
        self._wake.set()  # its timers may have moved closer

    async def _on_gap_round(self, session: Session, env) -> None:
        if not await self._within_budget(session, env) or self.gap is None:
            return  # not estimating: a neighbour that is gets no answer, and its rounds leave us out
        try:
            check_round(env.message, self.gap.cfg)
        except ValueError as e:
            await self._bad(session, e)
            return
        self.gap.receive(session.peer_id, env.message)

    # ---- housekeeping -------------------------------------------------------------------------------
    def _housekeeping(self, now: float) -> None:
        if self._deferred_join is not None:
            self._join(self._deferred_join, now)
        sessions = self.m.connected()
        for peer, deadline in list(self._lost.items()):
            if peer in sessions or peer not in self.views.active:
                del self._lost[peer]
            elif deadline <= now:
                del self._lost[peer]
                self._apply(self.views.link_down(peer, now))
        for peer, out in list(self.outbox.items()):
            if out.deadline <= now and self.outbox.get(peer) is out:
                del self.outbox[peer]
                self._apply(self.views.unreachable(peer, now))
        for peer in self.views.active:
            est = self.m.link_estimate(peer)
            if est is not None:
                self.views.set_link(peer, est)
        self._close_idle(now)
        self._forget_unused()
        if self.contact_wanted and not self.m.has_bootstrap():
            self._local_contact()
        # what mDNS finds is a passive candidate (Views.learn): one a round, so a LAN of hundreds does not
        # flush what the shuffles brought
        unseen = [p for p, i in self.m.known_peers().items()
                  if i.source == "mdns" and p not in self.views.active and p not in self.views.passive]
        if unseen:
            self.views.learn(self._entry_of(random.choice(unseen)))

    def _needed(self, peer: str) -> bool:
        return peer in self.views.active or peer in self.outbox or self.m.keeps_session(peer)

    def _close_idle(self, now: float) -> None:
        if self._nursery is None:
            return
        for peer, s in self.m.connected().items():
            if self._needed(peer) or now - max(s.stats.last_useful, s.opened_at) < SESSION_IDLE_S:
                continue
            self.closed_sessions += 1
            self._nursery.start_soon(s.aclose, f"not in the partial view, and idle for {SESSION_IDLE_S:.0f} s")

    def _forget_unused(self) -> None:
        """Forget peers with no session (for DEAD_KEPT_S), no dial in flight and no message waiting (what a
        peer learned from the views is in the views); mDNS and --join peers stay (contacts to join again)."""
        boot = set(self.m.bootstrap_ids())
        known = self.m.known_peers()
        cached = [peer for peer, info in known.items() if info.source == "cache"]
        boot.update(cached[:CACHE_CONTACTS])
        now = trio.current_time()
        unused = [(info.ended_at, peer) for peer, info in known.items()
                  if info.session is None and not info.dialing and peer not in self.outbox and peer not in boot
                  and info.source != "mdns" and not self.reach.wanted(peer)]
        unused.sort()
        for i, (ended, peer) in enumerate(unused):
            if now - ended >= DEAD_KEPT_S or len(unused) - i > MAX_DEAD_KEPT:
                self.m.forget(peer)


RELAYED_IN_ENTRY = 2  # a peer holds `[nat] relays` (2) reservations: both, so one relay's loss leaves a way in


def _entry_addresses(direct: list[str], relayed: list[str]) -> tuple[str, ...]:
    """At most MAX_ENTRY_ADDRESSES: the direct ones, leaving room for up to RELAYED_IN_ENTRY relayed ones."""
    direct = [a for a in direct if len(a) <= MAX_ADDRESS_CHARS]  # an entry refuses longer ones (its schema)
    relayed = [a for a in relayed if len(a) <= MAX_ADDRESS_CHARS]
    room = MAX_ENTRY_ADDRESSES - min(len(relayed), RELAYED_IN_ENTRY)
    return tuple(direct[:room] + relayed[:MAX_ENTRY_ADDRESSES - len(direct[:room])])


def gap_config(cfg) -> GapConfig | None:
    """The gap estimate's timing from a daemon's config (None: `[membership] gap_every` is 0, not estimated)."""
    m = cfg.membership
    if m.gap_every == 0:
        return None
    return GapConfig(round_interval=m.gap_round, epoch_interval=m.gap_every)


def view_config(cfg) -> ViewConfig:
    """The views' bounds from a daemon's config: the active view is the gossip graph (`[topology]`'s
    degrees); a request waits for a dial (`handshake_timeout`) plus a round trip."""
    t, m = cfg.topology, cfg.membership
    return ViewConfig(target_degree=t.target_degree, min_degree=t.min_degree, max_degree=t.max_degree,
                      request_timeout=max(ViewConfig.request_timeout, m.handshake_timeout + 3.0))


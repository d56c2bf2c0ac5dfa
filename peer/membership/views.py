"""Partial views: who my gossip neighbours are, and whom else I know, bounded whatever the swarm's size.

Each peer keeps an *active view* (its gossip neighbours: the edges of the mixing graph, with a session
each, `target_degree` of them and never more than `max_degree`) and a *passive view* (`passive_size`
peers it could link to, refreshed by shuffles with random passive peers), as in HyParView (Leitão,
Pereira and Rodrigues, DSN 2007) and Cyclon (Voulgaris et al., 2005). What is ours: edges change only by
moves that keep degrees as they are, so the graph stays a random regular one (an expander as good as
any), and the rewiring rule (peer/topology/local_rewire.py) picks which edges to move for bandwidth and
mixing. See docs/design.md, "Partial views".

How edges change (messages in protocol/schema/views.py):

  * join -- a newcomer n asks a contact, which answers with a sample of its views and sends
    ceil(target / 2) random walks; each walk's last peer c introduces itself (`WalkEnd`), and n asks it
    for a *split* (`SwapRequest` without `drop`): c gives up one edge c-d, links to n and hands d over
    (`Disconnect(handoff=n)`), and d links to n. n ends with `target` edges and nobody else's degree
    changed (Law and Siu's construction of random regular graphs by splitting random edges, 2003).
  * swap -- the rewiring rule wants to give up my edge a-b: I ask a random passive peer c for one of its
    edges (`SwapRequest(drop=b)`); c leaves d for me, I leave b, and b and d, each told of the other
    (`Disconnect(handoff=...)`), link to each other. Degrees are unchanged.
  * repair -- a peer below `target_degree` asks for edges: first peers it was handed, then its lost
    neighbour's other neighbours (they lost an edge too: pairs of them, by sorted ID, link up), then, two
    edges short, the passive view for a split. A request is accepted below the target; above it only
    when the asker is below `min_degree` (urgent) or names a lost neighbour we share, up to `max_degree`.
    One edge short, a peer sends a `Seek` walk, which finds a peer short too (or one above the target,
    which hands it an edge); a peer above the target hands an edge to a short neighbour, or sheds one.
  * leave -- a leaving peer pairs up its neighbours (`Disconnect(handoff=...)`), so their degrees stay.

Sans-I/O: the daemon (peer/membership/view_driver.py) and the simulator (peer/bench/scale_sim.py) drive a
`Views` with events -- `handle` a message from an authenticated peer, `link_down` (the session to a
neighbour ended), `unreachable` (a peer could not be reached), `tick` at `next_tick` -- and carry out
the actions each returns: `Send` a message (dialing the entry's addresses if there is no session),
`EdgeUp` / `EdgeDown` (start or stop averaging with that peer, keep or release its session),
`NeedContact` (join again through a bootstrap address). The driver tells it what links measure
(`set_link`) and what the gap estimator read (`gap`). It reads no clock and does no I/O: `now` comes with every call (seconds, any
monotonic origin).

Hostile peers: every message is bounded by its schema (protocol/schema/views.py) when it is decoded, and
`view_messages.check` refuses one whose entry is not its sender, before it is handled; what a peer can
make a `Views` hold is bounded (views, leads, pending requests, backoffs, seekers); an unsolicited reply
changes nothing; a split is granted at most once per `split_cooldown`. What a `Views` cannot stop on its
own, the daemon must: a peer sending requests at a high rate (per-session rate limits). Keys are free, so an
eclipse (HyParView's weakness too) is bounded by what keys cannot make cheaply: an edge handed on or dropped
above the target is the youngest (`_trim`), a full passive view evicts from the prefix holding the most
(peer/membership/passive_view.py), and sends that only a forwarded message vouches for are rate-bounded (`_vouched_send`).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Union

from peer.membership.passive_view import PassiveView
from peer.token_bucket import TokenBucket
from peer.topology.graph import LinkEstimate
from peer.topology.local_gap import GapReading
from peer.topology.local_rewire import LocalRewireConfig, NeighbourFacts, plan_local_move, slower_half
from protocol.schema.views import (MAX_ENTRIES, MAX_WALK, Disconnect, Entry, Join, JoinReply, JoinWalk, NeighbourReply,
                                   NeighbourRequest, Seek, Shuffle, ShuffleReply, Status, SwapReply, SwapRequest,
                                   ViewMessage, WalkEnd, encoded_size)


@dataclass(frozen=True, kw_only=True)
class ViewConfig:
    """Bounds and timers of the views. The degrees are `[topology]`'s (the active view is the gossip graph)."""

    target_degree: int = 4
    min_degree: int = 2
    max_degree: int = 8
    passive_size: int = 30
    """Passive entries: HyParView's figure at 10^4 peers (it keeps 30 to rebuild after 80% fail at once)."""
    walk_length: int = 6
    """Hops of a join walk and of a shuffle: HyParView's ARWL. A random walk on an expander of 10^4 nodes
    forgets its start in a few hops, so a walk's end is a near-uniform sample of the swarm."""
    passive_walk: int = 3
    """Where a join walk's TTL equals this, the peer it reaches puts the newcomer in its passive view
    (HyParView's PRWL): newcomers spread into passive views and are found by repairs and swaps."""
    shuffle_interval: float = 30.0
    """Mean seconds between a peer's shuffles (each peer also answers one, on average, as often). HyParView
    and Cyclon shuffle every few seconds in small swarms; a shuffle here is two messages of ~0.6 kB and
    often a dial, so every 30 s is ~0.4 kbit/s of a peer's 2 kbit/s control budget, and a passive view of
    30 is still renewed within a few minutes."""
    shuffle_active: int = 3  # entries of my active view a shuffle carries (HyParView's ka)
    shuffle_passive: int = 4  # and of my passive view (kp)
    join_sample: int = 8  # entries a contact sends a newcomer
    request_timeout: float = 8.0
    """Seconds an edge request (or an expected handoff) waits for its answer: a dial (handshake_timeout,
    5 s) plus a round trip."""
    retry_after: float = 30.0
    """A peer that refused an edge, or could not be reached, is not asked again for this long."""
    retry_interval: float = 2.0
    """Below the target and out of candidates: look again this often (shuffles and walks bring new ones)."""
    seek_interval: float = 10.0
    """One edge short (and at min_degree or above): a `Seek` walk this often, instead of asking random
    passive peers. A random peer is almost always at the target and refuses, and each try costs a dial; a
    walk goes over sessions we have and looks at ~5 peers a hop (each peer knows its neighbours' degrees)."""
    status_delay: float = 2.0
    """Seconds to gather edge changes into one `Status` (a swap changes two edges in a row)."""
    status_interval: float = 300.0
    """A `Status` is sent to every neighbour at least this often, even unchanged (a lost one is refreshed)."""
    split_cooldown: float = 5.0
    """Seconds between two splits or swaps granted to others: a peer asked for edges faster than this
    (hostile, or a join storm through one region) gives no more away."""
    max_leads: int = 64  # peers to ask first (handoffs, lost neighbours' neighbours, walk ends), oldest forgotten
    rewire: LocalRewireConfig = field(default_factory=LocalRewireConfig)

    def __post_init__(self) -> None:
        if not 1 <= self.min_degree <= self.target_degree <= self.max_degree <= MAX_ENTRIES:
            raise ValueError("need 1 <= min_degree <= target_degree <= max_degree <= "
                             f"{MAX_ENTRIES}, got {self.min_degree}, {self.target_degree}, {self.max_degree}")
        if not 1 <= self.passive_size <= 1024:
            raise ValueError(f"passive_size must be in 1..1024, got {self.passive_size}")
        if not 0 <= self.passive_walk <= self.walk_length <= MAX_WALK:
            raise ValueError(f"need 0 <= passive_walk <= walk_length <= {MAX_WALK}, got {self.passive_walk}, "
                             f"{self.walk_length}")
        if self.shuffle_active + self.shuffle_passive + 1 > MAX_ENTRIES or self.join_sample > MAX_ENTRIES:
            raise ValueError(f"a shuffle or join sample carries at most {MAX_ENTRIES} entries")
        for name in ("shuffle_interval", "request_timeout", "retry_after", "retry_interval", "seek_interval",
                     "status_delay", "status_interval"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if not (math.isfinite(self.split_cooldown) and self.split_cooldown >= 0):
            raise ValueError(f"split_cooldown must be >= 0 s, got {self.split_cooldown!r}")
        if self.max_leads < 1:
            raise ValueError(f"max_leads must be >= 1, got {self.max_leads}")


MAX_SEEKERS = 4
"""Seekers whose walks passed here that a peer remembers (for twice seek_interval): a later seeker's walk
that passes here is sent on to one of them. Two walks of ~6 peers each then meet where their paths
cross (a birthday bound), not only when one walk lands next to the other seeker."""
LOCAL_LEADS = ("orphan", "short")
"""Leads found nearby: a lost neighbour's other neighbours, and a peer one edge short met by a seek walk
(which walks only the graph around me). An edge to one is marked `local`, and the rewiring rule mixes it
away at the next chance. Why: after many peers fail at once, a region cut off from the rest repairs
itself with such edges alone and closes into an island that no repair leaves again (it happened in
`tests/test_scale_sim.py`'s concurrent churn: 93-95% of the peers in one component after 90 s); a mix swaps
the local edge for one to a random passive peer, nearly always outside the island."""
PAIRING_TRIES = 16  # random orders a leaving peer tries to pair its (at most max_degree) neighbours without clashes
FORWARDED_DIALS = 8
"""Messages a peer sends, in a burst, to entries only a forwarded message vouched for (a shuffle's origin at a
walk's end, a join walk's newcomer, a seeker met on a walk): each may be a dial to addresses a stranger chose,
and one forged message at the end of a walk aimed our dial anywhere. Refilled at FORWARDED_DIAL_S."""
FORWARDED_DIAL_S = 5.0
"""Seconds per token of FORWARDED_DIALS: 12 such messages a minute. An honest peer answers a shuffle about
every `shuffle_interval` (30 s) and ends a few walks when peers join; past the bound, the rest are not sent,
which the rules already survive (a shuffle unanswered, a walk that ends nowhere)."""


# ---- actions ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Send:
    """Send `msg` to `to` (over its session; without one, dial its addresses first)."""

    to: Entry
    msg: ViewMessage


@dataclass(frozen=True, slots=True)
class EdgeUp:
    """`peer` is now a gossip neighbour: keep its session, average with it, measure the link."""

    peer: str


@dataclass(frozen=True, slots=True)
class EdgeDown:
    """`peer` is no longer a gossip neighbour (its session may go, unless something else needs it)."""

    peer: str
    reason: str


@dataclass(frozen=True, slots=True)
class NeedContact:
    """I am below the target and know nobody left to ask (no passive entry and no lead; or below min_degree,
    every passive entry refused me lately): join again through a contact from outside the views (`--join`
    addresses, mDNS, the peer cache). At most once per `retry_after`."""

    reason: str


Action = Union[Send, EdgeUp, EdgeDown, NeedContact]


@dataclass(slots=True)
class Neighbour:
    """One active-view entry: what I know of that neighbour."""

    entry: Entry
    degree: int
    since: float
    neighbours: tuple[Entry, ...] = ()  # from its last Status: whom to link with if it fails
    fastest_bps: float | None = None  # its fastest link (its Status)
    link: LinkEstimate | None = None  # our link, as measured (set_link)
    local: bool = False  # made by a local repair (lost neighbour's neighbours): the first to mix away


@dataclass(slots=True)
class Pending:
    """An edge request of mine awaiting its answer."""

    kind: str  # "neighbour" or "swap" (a split when drop is None)
    entry: Entry
    deadline: float
    gain: int  # edges it should bring me
    drop: Entry | None = None
    local: bool = False
    move: str = ""  # the rewiring move it carries out ("speed", "mix"), if any


class Views:
    """One peer's active and passive views, and the rules that change them (see the module docstring)."""

    def __init__(self, me: Entry, cfg: ViewConfig, rng: random.Random, now: float = 0.0):
        self.me = me
        self.cfg = cfg
        self.rng = rng
        self.active: dict[str, Neighbour] = {}
        self.passive = PassiveView(cfg.passive_size, rng)  # whom else I know (peer/membership/passive_view.py)
        self.pending: dict[str, Pending] = {}
        self.expected: dict[str, float] = {}  # peers handed to me that will ask: until when I hold a slot
        # peers to ask first: why, and for a lost neighbour's neighbour, whom we both lost
        self.leads: OrderedDict[str, tuple[Entry, str, str | None]] = OrderedDict()
        self.backoff: dict[str, float] = {}  # peers not to ask until then
        self.seekers: OrderedDict[str, tuple[Entry, float]] = OrderedDict()  # walks that passed: MAX_SEEKERS
        self.gap: GapReading | None = None  # the estimator's last reading (set_gap)
        self.left = False
        self._out: list[Action] = []
        self._shuffle_sent: tuple[Entry, ...] = ()
        self._shuffle_until = -math.inf  # a ShuffleReply is taken only while one of ours is out
        self._shuffle_target: str | None = None  # from whom (None: a walk's end, whoever it is)
        self._next_shuffle = now + rng.uniform(0.5, 1.5) * cfg.shuffle_interval
        self._next_rewire = now + rng.uniform(0.5, 1.5) * cfg.rewire.interval
        self._status_due = math.inf  # when the next Status goes out
        self._next_retry = now
        self._split_ready = now
        self._next_seek = now  # one edge short: when the next Seek walk may go
        self._over_since = math.inf  # above the target since then
        self._next_contact = now + cfg.request_timeout  # when NeedContact may be said again
        self._contacts: dict[str, float] = {}  # contacts I asked to join through: until when their reply is taken
        self.moves: dict[str, int] = {}  # rewiring swaps I started that were accepted, by kind
        self._forwarded = TokenBucket(1 / FORWARDED_DIAL_S, FORWARDED_DIALS, now=now)  # sends only forwards vouched for
        self.forwarded_refused = 0  # such sends not made (the bound): counted for status and tests

    # ---- queries --------------------------------------------------------------------------------------
    @property
    def degree(self) -> int:
        return len(self.active)

    def _effective(self) -> int:
        """Edges I have or am about to get: how many more to ask for."""
        return len(self.active) + sum(p.gain for p in self.pending.values()) + len(self.expected)

    def _room(self) -> bool:
        """Whether I take a peer's edge request: below the target, counting a split in flight as one edge (its
        second, the handed-over neighbour, may ask before the split's answer has told me who it is)."""
        held = len(self.active) + sum(min(p.gain, 1) for p in self.pending.values()) + len(self.expected)
        return held < self.cfg.target_degree

    def neighbour_degrees(self) -> dict[str, int]:
        """My neighbours' degrees, as they told me: my row of the mixing matrix (mixing.local_weights)."""
        return {p: n.degree for p, n in self.active.items()}

    def next_tick(self) -> float:
        """When `tick` next has something to do (the driver may call it earlier; never needs to later)."""
        t = min(self._next_shuffle, self._next_rewire, self._status_due,
                min((p.deadline for p in self.pending.values()), default=math.inf),
                min(self.expected.values(), default=math.inf))
        if len(self.active) != self.cfg.target_degree:  # repairs to make, or an edge to shed
            t = min(t, self._next_retry)
        return math.inf if self.left else t

    def state_bytes(self) -> int:
        """Bytes of everything this peer holds for its views, serialized: entries, neighbours' lists, links,
        requests in flight, leads and backoffs. What the simulator reports as a peer's state."""
        state = [
            self.me,
            [[n.entry, n.degree, n.since, list(n.neighbours), n.fastest_bps,
              None if n.link is None else [n.link.bandwidth_bps, n.link.rtt_s, n.link.log_se], n.local]
             for n in self.active.values()],
            list(self.passive.values()),
            [[p.kind, p.entry, p.deadline, p.gain, p.drop, p.local] for p in self.pending.values()],
            self.expected, [list(lead) for lead in self.leads.values()], self.backoff, list(self.seekers.values()),
            list(self._shuffle_sent),
            None if self.gap is None else [self.gap.epoch, self.gap.gap, self.gap.reference, self.gap.degree],
            self._contacts,
            [self._shuffle_until, self._next_seek, self._over_since, self._next_contact, self._next_shuffle,
             self._next_rewire, self._status_due, self._next_retry, self._split_ready], self.moves,
        ]
        return encoded_size(state)

    # ---- events ---------------------------------------------------------------------------------------
    def join(self, contact: Entry, now: float) -> list[Action]:
        """Ask `contact` to bring me in (a `--join` address, mDNS, the peer cache)."""
        self._out = []
        if contact.peer_id != self.me.peer_id:
            self._to_passive(contact)
            self._contacts[contact.peer_id] = now + self.cfg.request_timeout
            while len(self._contacts) > self.cfg.max_leads:
                del self._contacts[next(iter(self._contacts))]
            self._send(contact, Join(self.me))
            # the walks' ends are better-spread candidates than the contact's sample: give them a moment
            self._next_retry = max(self._next_retry, now + self.cfg.retry_interval)
        return self._take()

    def learn(self, entry: Entry) -> None:
        """A peer found outside the views' messages (mDNS on the local link): a candidate in the passive view,
        so shuffles and mixes can reach it. Without it, peers that joined through different mDNS contacts at
        once could settle into cliques at the target degree that never hear of each other."""
        self._to_passive(entry)

    def leave(self, now: float) -> list[Action]:
        """I am leaving: pair my neighbours up so that each keeps its degree, and forget everything."""
        self._out = []
        peers = self._pairing()
        for i in range(0, len(peers), 2):
            a = self.active[peers[i]].entry
            b = self.active[peers[i + 1]].entry if i + 1 < len(peers) else None
            self._send(a, Disconnect(b))
            if b is not None:
                self._send(b, Disconnect(a))
        for p in peers:
            self._out.append(EdgeDown(p, "leaving"))
        self.active.clear()
        self.pending.clear()
        self.expected.clear()
        self.left = True
        return self._take()

    def _pairing(self) -> list[str]:
        """My neighbours in an order whose consecutive pairs are not linked yet (as their Status lists say),
        as far as a few random orders find one: each pair links when I leave."""
        peers = sorted(self.active)
        linked = {p: {e.peer_id for e in n.neighbours} for p, n in self.active.items()}

        def clashes(order: list[str]) -> int:
            return sum(1 for i in range(0, len(order) - 1, 2) if order[i + 1] in linked[order[i]])

        best = peers
        for _ in range(PAIRING_TRIES):
            if clashes(best) == 0:
                break
            order = self.rng.sample(peers, len(peers))
            if clashes(order) < clashes(best):
                best = order
        return best

    def set_link(self, peer: str, link: LinkEstimate) -> None:
        """What our link to neighbour `peer` measures (averaging transfers, probes)."""
        n = self.active.get(peer)
        if n is not None:
            n.link = link

    def set_gap(self, reading: GapReading | None) -> None:
        """The gap estimator's reading at an epoch's end (peer/membership/gap_driver.py): what the local
        rewiring rule reads (None: no reading this epoch)."""
        self.gap = reading

    def link_down(self, peer: str, now: float) -> list[Action]:
        """The session to `peer` ended or went silent: if it was a neighbour, the edge is gone, and its other
        neighbours (who lost an edge too) are the first to ask."""
        self._out = []
        self._forget(peer, now)
        n = self.active.pop(peer, None)
        if n is not None:
            self._out.append(EdgeDown(peer, "session lost"))
            self._mark_status(now)
            self._orphans(n, now)
        self._repair(now)
        return self._take()

    def unreachable(self, peer: str, now: float) -> list[Action]:
        """A message to `peer` could not be delivered (no session and the dial failed)."""
        if peer in self.active:
            return self.link_down(peer, now)
        self._out = []
        self._forget(peer, now)
        self._repair(now)
        return self._take()

    def tick(self, now: float) -> list[Action]:
        """Timers: expire requests, shuffle, send a due Status, rewire, trim, repair."""
        self._out = []
        if self.left:
            return []
        for peer, until in list(self._contacts.items()):
            if until <= now:
                del self._contacts[peer]
        for peer, p in list(self.pending.items()):
            if p.deadline <= now:
                del self.pending[peer]
                self._back_off(peer, now)
                if peer not in self.active:  # in case it accepted after all: it drops the edge again
                    self._send(p.entry, Disconnect(None))
        for peer, until in list(self.expected.items()):
            if until <= now:
                del self.expected[peer]
        self.backoff = {p: t for p, t in self.backoff.items() if t > now}
        if now >= self._next_shuffle:
            self._shuffle(now)
        if now >= self._next_rewire:
            self._next_rewire = now + self.rng.uniform(0.5, 1.5) * self.cfg.rewire.interval
            self._rewire(now)
        self._trim(now)
        if now >= self._status_due:
            self._send_status(now)
        if now >= self._next_retry:
            self._next_retry = now + self.cfg.retry_interval
        self._repair(now)
        stranded = not self.passive or (self.degree < self.cfg.min_degree
                                        and all(self.backoff.get(p, -math.inf) > now for p in self.passive))
        if (self.degree < self.cfg.target_degree and stranded and not self.leads and not self.pending
                and not self._contacts and now >= self._next_contact):
            self._next_contact = now + self.cfg.retry_after
            self._out.append(NeedContact(f"{self.degree} of {self.cfg.target_degree} neighbours and nobody left to ask"))
        return self._take()

    def handle(self, sender: str, msg: ViewMessage, now: float) -> list[Action]:
        """A message from `sender` (authenticated by its session, checked by `view_messages.check`)."""
        self._out = []
        if self.left or sender == self.me.peer_id:
            return []
        handler = getattr(self, "_on_" + type(msg).__name__, None)
        if handler is None:  # `check` refuses what is not a view message: this is the driver's bug
            raise TypeError(f"not a view message: {type(msg).__name__}")
        handler(sender, msg, now)
        return self._take()

    # ---- handlers -------------------------------------------------------------------------------------
    def _on_Join(self, sender: str, msg: Join, now: float) -> None:
        sample = self._sample(self.cfg.join_sample, exclude={sender})
        self._send(msg.entry, JoinReply(tuple(sample)))
        others = [p for p in self.active if p != sender]
        if not others:  # I am all the swarm it can see
            self._send(msg.entry, WalkEnd(self.me))
        else:
            for _ in range(-(-self.cfg.target_degree // 2)):
                self._send(self.active[self.rng.choice(others)].entry, JoinWalk(msg.entry, self.cfg.walk_length))
        self._to_passive(msg.entry)

    def _on_JoinReply(self, sender: str, msg: JoinReply, now: float) -> None:
        if self._contacts.pop(sender, -math.inf) < now:
            return  # not an answer to a join of mine (or a late one)
        for e in msg.entries:
            self._to_passive(e)

    def _on_JoinWalk(self, sender: str, msg: JoinWalk, now: float) -> None:
        joiner = msg.joiner
        if joiner.peer_id == self.me.peer_id:
            return
        if msg.ttl == self.cfg.passive_walk:
            self._to_passive(joiner)
        nxt = [p for p in self.active if p != sender and p != joiner.peer_id]
        if msg.ttl > 0 and nxt:
            self._send(self.active[self.rng.choice(nxt)].entry, JoinWalk(joiner, min(msg.ttl, self.cfg.walk_length) - 1))
        elif joiner.peer_id not in self.active and (joiner.peer_id == sender or self._vouched_send(now)):
            self._send(joiner, WalkEnd(self.me))

    def _on_WalkEnd(self, sender: str, msg: WalkEnd, now: float) -> None:
        if self._effective() >= self.cfg.target_degree:
            return  # no longer looking
        self._lead(msg.entry, "walk")
        self._repair(now)

    def _on_Seek(self, sender: str, msg: Seek, now: float) -> None:
        origin = msg.origin
        if origin.peer_id == self.me.peer_id:
            return
        if origin.peer_id not in self.active:
            if self._room():  # short too: the two of us link up
                self._lead(origin, "short", first=True)
                self.backoff.pop(origin.peer_id, None)
                self._repair(now)
                return
            spare = list(self.active)  # the sender too: it loses our edge and gains one to the seeker
            if self.degree > self.cfg.target_degree and not self.pending and spare:
                # an edge to spare: hand one neighbour over to the seeker (both of us end at the target); the
                # youngest, as `_trim` does: a seek's origin is a forwarded word, and a key that put us over the
                # target with an urgent request and then sent a seek would otherwise have an honest edge handed off
                n = self.active.pop(self._youngest(spare))
                self._out.append(EdgeDown(n.entry.peer_id, "handed over to a peer one edge short"))
                self._mark_status(now)
                self._send(n.entry, Disconnect(origin))
                self._to_passive(n.entry)
                return
        if msg.ttl == 0:
            return  # the walk ends here (or it was sent here from a rendezvous: never on from it)
        # a rendezvous: another seeker's walk passed here lately; it is short too, so the two link up
        for p, (e, until) in list(self.seekers.items()):
            if until <= now or p == origin.peer_id:
                continue
            del self.seekers[p]
            if self._vouched_send(now):
                self._send(e, Seek(origin, 0))
            return
        self.seekers.pop(origin.peer_id, None)
        self.seekers[origin.peer_id] = (origin, now + 2 * self.cfg.seek_interval)
        while len(self.seekers) > MAX_SEEKERS:
            del self.seekers[next(iter(self.seekers))]
        nxt = [p for p in self.active if p != sender and p != origin.peer_id]
        if nxt:  # on, preferring a neighbour whose degree is off the target
            odd = [p for p in nxt if self.active[p].degree != self.cfg.target_degree]
            self._send(self.active[self.rng.choice(odd or nxt)].entry,
                       Seek(origin, min(msg.ttl, self.cfg.walk_length) - 1))

    def _on_NeighbourRequest(self, sender: str, msg: NeighbourRequest, now: float) -> None:
        n = self.active.get(sender)
        if n is not None:
            n.degree = msg.degree
            self._send(msg.entry, NeighbourReply(True, self.degree))
            return
        mutual = sender in self.pending and self.pending[sender].kind == "neighbour"  # we asked each other: one edge
        # `lost`: we both had that peer as a neighbour, and it failed; I may not have noticed yet (the
        # asker's pairing counts on me): take the edge, even if that puts me one above the target for now
        ok = ((mutual or sender in self.expected or self._room()
               or ((msg.urgent or msg.lost in self.active) and self._effective() < self.cfg.max_degree))
              and self.degree < self.cfg.max_degree)
        if ok:
            lead = self.leads.get(sender)
            local = self.pending.pop(sender).local if mutual else (lead is not None and lead[1] in LOCAL_LEADS)
            self.expected.pop(sender, None)
            self._add(msg.entry, msg.degree + 1, now, local=local)  # its degree once it has our edge
        self._send(msg.entry, NeighbourReply(ok, self.degree))

    def _on_NeighbourReply(self, sender: str, msg: NeighbourReply, now: float) -> None:
        p = self.pending.get(sender)
        if p is None or p.kind != "neighbour":
            if msg.accepted and sender not in self.active:
                self._send(Entry(sender, self._addresses(sender)), Disconnect(None))  # an answer we no longer wait for
            return
        del self.pending[sender]
        if msg.accepted:
            if sender not in self.active:
                if self.degree >= self.cfg.max_degree:
                    self._send(p.entry, Disconnect(None))
                else:
                    self._add(p.entry, msg.degree, now, local=p.local)
        else:
            self._back_off(sender, now)
        self._repair(now)

    def _on_SwapRequest(self, sender: str, msg: SwapRequest, now: float) -> None:
        if (sender in self.active or sender in self.pending
                or (msg.drop is not None and msg.drop.peer_id == self.me.peer_id)):
            self._send(msg.entry, SwapReply(False, self.degree, None))
            return
        if self._room() and self.degree < self.cfg.max_degree:
            self._add(msg.entry, msg.degree + (msg.drop is None), now)  # I have room: a plain edge
            self._send(msg.entry, SwapReply(True, self.degree, None))
            return
        drop = None if msg.drop is None else msg.drop.peer_id
        choices = [p for p in slower_half(self._facts(), self.cfg.rewire) if p != drop]
        if now < self._split_ready or self.degree < 2 or not choices:
            self._send(msg.entry, SwapReply(False, self.degree, None))
            return
        self._split_ready = now + self.cfg.split_cooldown
        partner = self.active.pop(self.rng.choice(choices))
        self._out.append(EdgeDown(partner.entry.peer_id, "handed over in a swap"))
        self._send(partner.entry, Disconnect(msg.drop if msg.drop is not None else msg.entry))
        self._to_passive(partner.entry)
        self._add(msg.entry, msg.degree + 2 * (msg.drop is None), now)  # a split brings it two edges, a swap none
        self._send(msg.entry, SwapReply(True, self.degree, partner.entry))

    def _on_SwapReply(self, sender: str, msg: SwapReply, now: float) -> None:
        p = self.pending.get(sender)
        if p is None or p.kind != "swap":
            if msg.accepted and sender not in self.active:
                self._send(Entry(sender, self._addresses(sender)), Disconnect(None))
            return
        del self.pending[sender]
        if not msg.accepted:
            if p.drop is None and self.degree < self.cfg.min_degree and self.degree < self.cfg.max_degree:
                # no split to spare (it gave one away moments ago): below min_degree, any edge will do
                self.pending[sender] = Pending("neighbour", p.entry, now + self.cfg.request_timeout, 1)
                self._send(p.entry, NeighbourRequest(self.me, self.degree, True))
                return
            self._back_off(sender, now)
            self._repair(now)
            return
        if sender not in self.active:
            if self.degree >= self.cfg.max_degree and (p.drop is None or p.drop.peer_id not in self.active):
                self._send(p.entry, Disconnect(None))  # no room (and no edge of mine goes for it)
                return
            self._add(p.entry, msg.degree, now)
        if p.drop is not None:
            self.moves[p.move] = self.moves.get(p.move, 0) + 1
            gone = self.active.pop(p.drop.peer_id, None)
            if gone is not None:
                self._out.append(EdgeDown(p.drop.peer_id, "swapped away"))
                self._send(gone.entry, Disconnect(msg.partner))
                self._to_passive(gone.entry)
        elif msg.partner is not None and msg.partner.peer_id not in self.active and msg.partner.peer_id != self.me.peer_id:
            self._expect(msg.partner.peer_id, now)
        self._repair(now)

    def _on_Disconnect(self, sender: str, msg: Disconnect, now: float) -> None:
        n = self.active.pop(sender, None)
        if n is not None:
            self._out.append(EdgeDown(sender, "dropped by them"))
            self._mark_status(now)
            self._to_passive(n.entry)
        h = msg.handoff
        if n is not None and h is not None and h.peer_id != self.me.peer_id and h.peer_id not in self.active:
            self._lead(h, "handoff", first=True)
            self.backoff.pop(h.peer_id, None)
        self._repair(now)

    def _on_Shuffle(self, sender: str, msg: Shuffle, now: float) -> None:
        origin = msg.origin
        if origin.peer_id == self.me.peer_id:
            return
        nxt = [p for p in self.active if p != sender and p != origin.peer_id]
        if msg.ttl > 0 and nxt:
            self._send(self.active[self.rng.choice(nxt)].entry,
                       Shuffle(origin, min(msg.ttl, self.cfg.walk_length) - 1, msg.entries, msg.degree))
            return
        if origin.peer_id != sender and not self._vouched_send(now):
            return  # the walk's origin is a forwarded message's word: no answer past the bound
        reply = self._sample(min(len(msg.entries) + 1, MAX_ENTRIES), exclude={origin.peer_id}, passive_first=True)
        self._send(origin, ShuffleReply(tuple(reply), self.degree))
        self._integrate((origin, *msg.entries), sent=reply)
        self._short_met(origin, msg.degree, now)

    def _on_ShuffleReply(self, sender: str, msg: ShuffleReply, now: float) -> None:
        if now > self._shuffle_until or self._shuffle_target not in (None, sender):
            return  # unsolicited: nothing of ours is out to this peer
        self._shuffle_until = -math.inf
        self._integrate(msg.entries, sent=self._shuffle_sent)
        self._shuffle_sent = ()
        e = self.passive.get(sender)
        if e is not None:
            self._short_met(e, msg.degree, now)

    def _on_Status(self, sender: str, msg: Status, now: float) -> None:
        """A neighbour's degree, neighbours and fastest link. It also heals an edge one end lost track of (a
        Disconnect or a reply lost with a session that closed under it): a Status comes after every edge
        change and every `status_interval`, and on one session after whatever that peer said before it."""
        n = self.active.get(sender)
        lists_me = any(e.peer_id == self.me.peer_id for e in msg.neighbours)
        if n is None:
            if lists_me and sender not in self.pending:  # it counts an edge to us that we do not have
                self._send(Entry(sender, self._addresses(sender)), Disconnect(None))
            return  # else a Status that crossed our edge's end
        if not lists_me:  # we count an edge it does not: its Disconnect never reached us
            del self.active[sender]
            self._out.append(EdgeDown(sender, "not in their view"))
            self._mark_status(now)
            self._to_passive(n.entry)
            self._repair(now)
            return
        n.degree = msg.degree
        n.neighbours = msg.neighbours[: self.cfg.max_degree * 2]
        n.fastest_bps = msg.fastest_bps

    # ---- rules ----------------------------------------------------------------------------------------
    def _repair(self, now: float) -> None:
        """Below the target: ask candidates for edges, one request per missing edge (two for a split)."""
        need = self.cfg.target_degree - self._effective()
        while need > 0 and len(self.pending) < self.cfg.target_degree:
            found = self._candidate(now, passive=need >= 2 or self.degree < self.cfg.min_degree)
            if found is None:
                if need == 1 and self.active and now >= self._next_seek:
                    self._next_seek = now + self.cfg.seek_interval
                    if self._short_neighbour() is not None and (found := self._candidate(now, passive=True)):
                        # a neighbour is one short too (a swap between two neighbours leaves that): a split
                        # takes me one above the target, and `_trim` hands the extra edge to that neighbour
                        self.pending[found[0].peer_id] = Pending("swap", found[0], now + self.cfg.request_timeout, 2)
                        self._send(found[0], SwapRequest(self.me, self.degree, None))
                    else:
                        self._send(self.active[self.rng.choice(list(self.active))].entry,
                                   Seek(self.me, self.cfg.walk_length))
                return
            entry, why, lost = found
            urgent = self.degree < self.cfg.min_degree
            if need >= 2 and why in ("walk", "passive"):
                self.pending[entry.peer_id] = Pending("swap", entry, now + self.cfg.request_timeout, 2)
                self._send(entry, SwapRequest(self.me, self.degree, None))
                need -= 2
            else:
                self.pending[entry.peer_id] = Pending("neighbour", entry, now + self.cfg.request_timeout, 1,
                                                      local=why in LOCAL_LEADS)
                self._send(entry, NeighbourRequest(self.me, self.degree, urgent, lost))
                need -= 1

    def _candidate(self, now: float, *, passive: bool) -> tuple[Entry, str, str | None] | None:
        """The next peer to ask for an edge: a lead, else (if `passive`) a random passive entry not backing
        off. One edge short and at min_degree or above, `_repair` asks no passive entry for a plain edge: a
        random peer is almost always at the target and refuses, and each try costs a dial."""
        def askable(p: str) -> bool:
            return (p != self.me.peer_id and p not in self.active and p not in self.pending
                    and p not in self.expected and self.backoff.get(p, -math.inf) <= now)
        while self.leads:
            peer, lead = self.leads.popitem(last=False)
            if askable(peer):
                return lead
        if not passive:
            return None
        pool = [p for p in self.passive if askable(p)]
        if not pool:
            return None
        return self.passive[self.rng.choice(pool)], "passive", None

    def _orphans(self, lost: Neighbour, now: float) -> None:
        """`lost` failed: its other neighbours lost an edge too. Pair up with one of them (by sorted ID, so
        each pair agrees who asks) and keep the rest as leads."""
        others = {e.peer_id: e for e in lost.neighbours if e.peer_id != lost.entry.peer_id}
        if self.me.peer_id in others:
            ids = sorted(others)
            i = ids.index(self.me.peer_id)
            if i % 2 == 0 and i + 1 < len(ids):
                self._lead(others[ids[i + 1]], "orphan", first=True, lost=lost.entry.peer_id)
            elif i % 2 == 1 and ids[i - 1] not in self.active:
                self._expect(ids[i - 1], now)
        for p, e in others.items():
            if p != self.me.peer_id and p not in self.active and p not in self.expected and p not in self.leads:
                self._lead(e, "orphan", lost=lost.entry.peer_id)

    def _short_neighbour(self) -> str | None:
        """A neighbour one edge short like me, with the larger ID (so only one of a pair acts), or None."""
        return min((p for p, n in self.active.items()
                    if n.degree < self.cfg.target_degree and p > self.me.peer_id), default=None)

    def _trim(self, now: float) -> None:
        """Above the target (urgent requests let peers in, a split can overshoot): hand my youngest edge (the one
        that put me over) to an older neighbour that is short and not linked to it (both of us end at the
        target), else drop an edge to a neighbour above the target too, the youngest of them. With neither,
        after `seek_interval` above the target, drop my youngest edge anyway: that neighbour, one short, seeks
        and finds a peer above the target (there is one: the degrees' sum is even), which hands it an edge.
        Why the youngest: an urgent request and a claimed shortage are a peer's word. When any edge could be
        handed over, each fresh key that asked urgently and then said it was short took one of my honest edges:
        16 keys took all four within a minute (tests/test_views.py). Now they only ever hand each other on."""
        if self.degree <= self.cfg.target_degree:
            self._over_since = math.inf
            return
        self._over_since = min(self._over_since, now)
        if self.pending:
            return
        y = self._youngest(list(self.active))
        for b in sorted(p for p, n in self.active.items() if n.degree < self.cfg.target_degree and p != y):
            if y not in {e.peer_id for e in self.active[b].neighbours}:
                n = self.active.pop(y)
                self._out.append(EdgeDown(n.entry.peer_id, "handed over to a neighbour one edge short"))
                self._mark_status(now)
                self._send(n.entry, Disconnect(self.active[b].entry))
                self._to_passive(n.entry)
                return
        over = sorted(p for p, n in self.active.items() if n.degree > self.cfg.target_degree)
        if not over and now - self._over_since >= self.cfg.seek_interval:
            over = [y]
            self._over_since = now
        if over:
            peer = self._youngest(over)
            n = self.active.pop(peer)
            self._out.append(EdgeDown(peer, "trimmed: both above the target degree"))
            self._mark_status(now)
            self._send(n.entry, Disconnect(None))
            self._to_passive(n.entry)

    def _youngest(self, peers: list[str]) -> str:
        """Of these neighbours, the one whose edge is the most recent (ties: a random one of them)."""
        last = max(self.active[p].since for p in peers)
        return self.rng.choice(sorted(p for p in peers if self.active[p].since == last))

    def _rewire(self, now: float) -> None:
        """One move of the local rewiring rule: a swap of my edge for a random passive peer's."""
        if self.pending or self.degree < self.cfg.target_degree:
            return
        move = plan_local_move(self._facts(), self.gap, self.cfg.rewire, self.rng, min_degree=self.cfg.min_degree)
        if move is None:
            return
        found = self._candidate_for_swap(now)
        if found is None:
            return
        drop = self.active[move.drop].entry
        self.pending[found.peer_id] = Pending("swap", found, now + self.cfg.request_timeout, 0, drop=drop,
                                              move=move.kind)
        self._send(found, SwapRequest(self.me, self.degree, drop))

    def _candidate_for_swap(self, now: float) -> Entry | None:
        pool = [p for p in self.passive if p not in self.active and p not in self.pending
                and self.backoff.get(p, -math.inf) <= now]
        return self.passive[self.rng.choice(pool)] if pool else None

    def _shuffle(self, now: float) -> None:
        """Swap a sample of my views with a random passive peer's, directly (Cyclon): two messages, and a
        passive entry that has died is found out (`unreachable`) and dropped. With no passive entry yet,
        the sample walks from a neighbour instead (HyParView), and whoever it ends at answers."""
        self._next_shuffle = now + self.rng.uniform(0.5, 1.5) * self.cfg.shuffle_interval
        if self.passive:
            target, ttl = self.passive[self.rng.choice(list(self.passive))], 0
        elif self.active:
            target, ttl = self.active[self.rng.choice(list(self.active))].entry, self.cfg.walk_length
        else:
            return
        mine = [n.entry for p, n in self.active.items() if p != target.peer_id]
        sent = self.rng.sample([e for p, e in self.passive.items() if p != target.peer_id],
                               min(self.cfg.shuffle_passive, max(len(self.passive) - 1, 0)))
        entries = self.rng.sample(mine, min(self.cfg.shuffle_active, len(mine))) + sent
        self._shuffle_sent = tuple(sent)
        self._shuffle_until = now + self.cfg.request_timeout * (ttl + 1)
        self._shuffle_target = target.peer_id if ttl == 0 else None  # a walk's end is anyone's guess
        self._send(target, Shuffle(self.me, ttl, tuple(entries), self.degree))

    def _send_status(self, now: float) -> None:
        self._status_due = now + self.cfg.status_interval
        fastest = max((n.link.bandwidth_bps for n in self.active.values()
                       if n.link is not None and n.link.bandwidth_bps is not None), default=None)
        msg = Status(self.degree, tuple(n.entry for n in self.active.values()), fastest)
        for n in self.active.values():
            self._send(n.entry, msg)

    def _short_met(self, entry: Entry, degree: int, now: float) -> None:
        """A shuffle met a peer that is short of edges, as I am: it is the first to ask (a peer one edge short
        probes the passive view slowly, and two such peers rarely find each other otherwise)."""
        if degree < self.cfg.target_degree and self._room():
            self._lead(entry, "short", first=True)
            self.backoff.pop(entry.peer_id, None)
            self._repair(now)

    # ---- bookkeeping ----------------------------------------------------------------------------------
    def _facts(self) -> dict[str, NeighbourFacts]:
        return {p: NeighbourFacts(n.degree, n.link, n.fastest_bps, n.local) for p, n in self.active.items()}

    def _add(self, entry: Entry, degree: int, now: float, *, local: bool = False) -> None:
        peer = entry.peer_id
        if peer in self.active:
            return
        self.active[peer] = Neighbour(entry, degree, now, local=local)
        if local:  # mix it away soon: repairs found it nearby, and nearby repairs can close off an island
            self._next_rewire = min(self._next_rewire, now + self.rng.uniform(1.0, 2.0) * self.cfg.retry_interval)
        self.pending.pop(peer, None)  # whatever it answers now is about an edge we have
        self.passive.pop(peer, None)
        self.leads.pop(peer, None)
        self.expected.pop(peer, None)
        self._out.append(EdgeUp(peer))
        self._mark_status(now)

    def _mark_status(self, now: float) -> None:
        self._status_due = min(self._status_due, now + self.cfg.status_delay)

    def _forget(self, peer: str, now: float) -> None:
        """`peer` is gone or unreachable: out of the passive view and leads; an edge request to it failed."""
        self.passive.pop(peer, None)
        self.leads.pop(peer, None)
        self.expected.pop(peer, None)
        if self.pending.pop(peer, None) is not None:
            self._back_off(peer, now)

    def _back_off(self, peer: str, now: float) -> None:
        """Do not ask `peer` again for `retry_after` (at most passive_size + max_leads such peers: the oldest go)."""
        self.backoff.pop(peer, None)
        self.backoff[peer] = now + self.cfg.retry_after
        while len(self.backoff) > self.cfg.passive_size + self.cfg.max_leads:
            del self.backoff[next(iter(self.backoff))]

    def _expect(self, peer: str, now: float) -> None:
        """`peer` was handed to me and will ask: hold a slot for it (at most max_degree: the oldest go)."""
        self.expected.pop(peer, None)
        self.expected[peer] = now + self.cfg.request_timeout
        while len(self.expected) > self.cfg.max_degree:
            del self.expected[next(iter(self.expected))]

    def _lead(self, entry: Entry, why: str, *, first: bool = False, lost: str | None = None) -> None:
        if entry.peer_id == self.me.peer_id or entry.peer_id in self.active:
            return
        self.leads[entry.peer_id] = (entry, why, lost)
        self.leads.move_to_end(entry.peer_id, last=not first)
        while len(self.leads) > self.cfg.max_leads:
            self.leads.popitem(last=True)

    def _to_passive(self, entry: Entry) -> None:
        if entry.peer_id != self.me.peer_id and entry.peer_id not in self.active:
            self.passive.add(entry)

    def _integrate(self, entries, *, sent) -> None:
        """Shuffled entries into the passive view (passive_view.py says which make room), but ourselves and our
        neighbours."""
        self.passive.integrate([e for e in entries if e.peer_id != self.me.peer_id and e.peer_id not in self.active],
                               sent=list(sent))

    def _vouched_send(self, now: float) -> bool:
        """Take a token for a send to an entry only a forwarded message vouched for (FORWARDED_DIALS); False,
        counted, when none is left."""
        if self._forwarded.try_take(1, now):
            return True
        self.forwarded_refused += 1
        return False

    def _sample(self, k: int, *, exclude: set[str], passive_first: bool = False) -> list[Entry]:
        passive = [e for p, e in self.passive.items() if p not in exclude]
        active = [n.entry for p, n in self.active.items() if p not in exclude]
        if passive_first:
            got = self.rng.sample(passive, min(k, len(passive)))
            return got + self.rng.sample(active, min(k - len(got), len(active)))
        pool = passive + active
        return self.rng.sample(pool, min(k, len(pool)))

    def _addresses(self, peer: str) -> tuple[str, ...]:
        e = self.passive.get(peer)
        return e.addresses if e is not None else ()

    def _send(self, to: Entry, msg: ViewMessage) -> None:
        self._out.append(Send(to, msg))

    def _take(self) -> list[Action]:
        out, self._out = self._out, []
        return out

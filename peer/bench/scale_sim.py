"""A discrete-event simulator of a swarm's membership: N peers, each running THE rules a daemon runs
(`peer.membership.views.Views`, `peer.topology.local_gap.GapEstimator`), over simulated links.

What is simulated, and what is not:
  * time: a heap of timed events; every rule call gets the simulated `now`. A peer's timers are one
    event at its `Views.next_tick()`.
  * links: each peer is a host with an access bandwidth (log-normal around `median_mbit`) and a place in
    a unit square (RTT grows with distance, `rtt_min` to `rtt_max`); a pair's bandwidth is the smaller
    of its two hosts', divided by `slow_factor` for a fraction `slow_pairs` of pairs (a congested path:
    the slowness rewiring can route around). A message takes half the RTT, plus a full RTT to dial
    when the pair has no session (sessions are kept with the active view).
  * failures: a crashed peer's neighbours learn it after `detect_s` (`[membership] dead_after`); a
    message to a dead or unknown peer fails after `dial_timeout` (`handshake_timeout`). A peer that
    knows nobody left to ask (`NeedContact`) joins again through a random live peer, as a daemon would
    through its bootstrap addresses.
  * measurements: a new edge's link is known after its first exchange (a shard over that link), as the
    daemon learns it from averaging transfers; no probe traffic is simulated.
  * bytes: every message is priced by `view_messages.wire_size` (the envelope and sealed frame a daemon
    would send), and a dial by the bytes of a real handshake (`handshake_bytes`). A session outside the
    active view stays open `SESSION_IDLE_S` after its last message. Heartbeats on sessions and averaging
    tensors are not control traffic of the views and are not counted.

It runs on one core: ~10^6 messages a simulated 10 minutes at 10^4 peers.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from peer.membership.view_messages import BadMessage, check, wire_size
from peer.membership.views import EdgeUp, NeedContact, Send, ViewConfig, Views
from peer.topology.graph import LinkEstimate
from peer.topology.local_gap import GapConfig, GapEstimator
from protocol.schema.views import Entry


SESSION_IDLE_S = 30.0  # a session made for a view message (not an edge) is closed after this long unused


def handshake_bytes() -> tuple[int, int]:
    """Bytes the dialer and the dialed peer send in one real handshake (protocol/handshake.py), with the app
    payload a daemon sends (peer/session/connect.py)."""
    from protocol.handshake import Handshake
    from protocol.identity import generate_identity

    init = Handshake(initiator=True, identity=generate_identity(), swarm="peertrain",
                     app_payload={"port": 7100, "ver": "0.0.0", "time": 1.7e9, "dialed": "198.51.100.17:7100"})
    resp = Handshake(initiator=False, identity=generate_identity(), swarm="peertrain",
                     app_payload={"port": 7100, "ver": "0.0.0", "time": 1.7e9, "observed": "198.51.100.18",
                                  "observed_port": 7100})
    sent = [0, 0]
    msg = init.data_to_send()
    for step in range(3):
        sent[step % 2] += len(msg)
        receiver = resp if step % 2 == 0 else init
        receiver.receive_data(msg)
        msg = receiver.data_to_send()
    return sent[0], sent[1]


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    seed: int = 0
    median_mbit: float = 100.0  # a host's access bandwidth, median (both directions)
    bandwidth_sigma: float = 0.5  # log-normal spread of it: 90% of hosts within 0.44x..2.3x the median
    slow_pairs: float = 0.2  # pairs whose path is slow
    slow_factor: float = 20.0  # how much slower
    rtt_min: float = 0.005  # RTT of two hosts in the same place
    rtt_max: float = 0.25  # RTT across the square's diagonal
    detect_s: float = 6.0  # [membership] dead_after: a crashed neighbour is noticed this much later
    dial_timeout: float = 5.0  # [membership] handshake_timeout: a message to a dead peer fails this much later
    shard_bytes: int = 16 << 20  # what one averaging exchange moves each way (the topology service's)
    dual_stack: bool = True
    """Each host advertises an IPv4 and an IPv6 address, as a dual-stack host does; off: one IPv4 address, as
    daemons on loopback do (`peer bench scale --real` compares with those)."""


class LinkModel:
    """Hosts' bandwidth and place, and the pairs' slow paths (a hash of the pair: no N^2 table)."""

    def __init__(self, cfg: SimConfig, rng: np.random.Generator):
        self.cfg = cfg
        self._rng = rng
        self.up: list[float] = []
        self.x: list[float] = []
        self.y: list[float] = []
        self._slow_cut = int(cfg.slow_pairs * (1 << 32))
        self._salt = int(rng.integers(1 << 31))

    def add_host(self) -> int:
        self.up.append(self.cfg.median_mbit * 1e6 * math.exp(self.cfg.bandwidth_sigma * float(self._rng.standard_normal())))
        self.x.append(float(self._rng.random()))
        self.y.append(float(self._rng.random()))
        return len(self.up) - 1

    def slow(self, a: int, b: int) -> bool:
        lo, hi = (a, b) if a < b else (b, a)
        h = (lo * 0x9E3779B1 + hi * 0x85EBCA77 + self._salt) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h ^= h >> 12
        h = (h * 0x297A2D39) & 0xFFFFFFFF
        h ^= h >> 15
        return h < self._slow_cut

    def bandwidth(self, a: int, b: int) -> float:
        bw = min(self.up[a], self.up[b])
        return bw / self.cfg.slow_factor if self.slow(a, b) else bw

    def rtt(self, a: int, b: int) -> float:
        d = math.hypot(self.x[a] - self.x[b], self.y[a] - self.y[b]) / math.sqrt(2.0)
        return self.cfg.rtt_min + (self.cfg.rtt_max - self.cfg.rtt_min) * d

    def exchange_time(self, a: int, b: int) -> float:
        """Seconds one averaging exchange takes over a-b: a shard each way, one round trip."""
        return self.cfg.shard_bytes * 8 / self.bandwidth(a, b) + self.rtt(a, b)


@dataclass(slots=True, eq=False)
class SimPeer:
    pid: str
    host: int
    entry: Entry
    views: Views
    gap: GapEstimator
    alive: bool = True
    view_bytes: int = 0  # control bytes sent: view messages
    gap_bytes: int = 0  # and gap rounds
    tick_at: float = math.inf
    joined_at: float | None = None  # when it asked to join (None: a founder, or not measured)
    connected_at: float | None = None  # when it first reached min_degree
    first_exchange_at: float | None = None  # when its first averaging exchange would have finished


@dataclass
class Counters:
    messages: int = 0
    dials: int = 0
    bad: int = 0  # messages a rule's check refused (a bug of ours: the simulated peers are honest)
    unreachable: int = 0
    rejoins: int = 0  # NeedContact answered with a random live peer (a daemon: its bootstrap addresses)
    by_type: dict[str, int] = field(default_factory=dict)  # bytes by message type


class Simulator:
    """The event loop, the peers and their links. Drives `Views` and `GapEstimator` objects, nothing else."""

    def __init__(self, view_cfg: ViewConfig, gap_cfg: GapConfig, cfg: SimConfig):
        self.view_cfg = view_cfg
        self.gap_cfg = gap_cfg
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.links = LinkModel(cfg, np.random.default_rng(cfg.seed))
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self.peers: dict[str, SimPeer] = {}
        self.alive: list[SimPeer] = []
        self._alive_index: dict[str, int] = {}
        self.counters = Counters()
        self._gap_sizes: dict[tuple, int] = {}
        self._sessions: dict[tuple[str, str], float] = {}  # sessions outside the active views: until when
        self._dial_bytes = handshake_bytes()

    # ---- the event loop -------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run_until(self, t_end: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= t_end:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            fn(*args)
        self.now = t_end

    # ---- peers ----------------------------------------------------------------------------------------
    def spawn(self) -> SimPeer:
        host = self.links.add_host()
        pid = f"{self.rng.getrandbits(100):020x}"[:20]  # a peer ID's length (20 characters)
        addresses = (f"198.51.{host // 250 % 250}.{host % 250 + 1}:7100", f"[2001:db8::{host:x}]:7100")
        addresses = addresses if self.cfg.dual_stack else addresses[:1]
        entry = Entry(pid, addresses)
        rng = random.Random(self.rng.getrandbits(64))
        p = SimPeer(pid, host, entry, Views(entry, self.view_cfg, rng, self.now), GapEstimator(self.gap_cfg, rng))
        self.peers[pid] = p
        self._alive_index[pid] = len(self.alive)
        self.alive.append(p)
        self._schedule_tick(p)
        return p

    def join(self, p: SimPeer, contact: SimPeer | None, *, measure: bool = True) -> None:
        if measure:
            p.joined_at = self.now
        if contact is not None:
            self._apply(p, p.views.join(contact.entry, self.now))

    def random_alive(self, exclude: SimPeer | None = None) -> SimPeer | None:
        if not self.alive or (len(self.alive) == 1 and self.alive[0] is exclude):
            return None
        while True:
            p = self.alive[self.rng.randrange(len(self.alive))]
            if p is not exclude:
                return p

    def _unlist(self, p: SimPeer) -> None:
        i = self._alive_index.pop(p.pid)
        last = self.alive.pop()
        if last is not p:
            self.alive[i] = last
            self._alive_index[last.pid] = i

    def crash(self, p: SimPeer) -> None:
        """`p` dies without a word; its neighbours notice after detect_s."""
        if not p.alive:
            return
        p.alive = False
        self._unlist(p)
        for q in list(p.views.active):
            other = self.peers.get(q)
            if other is not None and other.alive:
                self.at(self.now + self.cfg.detect_s * self.rng.uniform(0.8, 1.2), self._link_down, other, p.pid)

    def leave(self, p: SimPeer) -> None:
        """`p` leaves gracefully: its goodbyes go out, then it is gone."""
        if not p.alive:
            return
        self._apply(p, p.views.leave(self.now))
        p.alive = False
        self._unlist(p)

    # ---- driving the rules ----------------------------------------------------------------------------
    def _apply(self, p: SimPeer, actions) -> None:
        for a in actions:
            if type(a) is Send:
                self._send(p, a.to, a.msg)
            elif type(a) is EdgeUp:
                other = self.peers.get(a.peer)
                if other is not None:
                    t = self.links.exchange_time(p.host, other.host)
                    self.at(self.now + t, self._measured, p, other, t)
            elif type(a) is NeedContact:  # as a daemon's bootstrap address would: a random live peer
                contact = self.random_alive(exclude=p)
                if contact is not None:
                    self.counters.rejoins += 1
                    self._apply(p, p.views.join(contact.entry, self.now))
        self._schedule_tick(p)

    def _measured(self, p: SimPeer, other: SimPeer, t: float) -> None:
        """The first exchange over a new edge finished: the link is measured, and `p` has averaged."""
        if not p.alive or other.pid not in p.views.active:
            return
        p.views.set_link(other.pid, LinkEstimate(bandwidth_bps=self.links.bandwidth(p.host, other.host),
                                                 rtt_s=self.links.rtt(p.host, other.host)))
        if p.first_exchange_at is None:
            p.first_exchange_at = self.now

    def _send(self, src: SimPeer, to: Entry, msg) -> None:
        size = wire_size(msg)
        src.view_bytes += size
        c = self.counters
        c.messages += 1
        name = type(msg).TYPE
        c.by_type[name] = c.by_type.get(name, 0) + size
        dst = self.peers.get(to.peer_id)
        if dst is None or not dst.alive:
            self.at(self.now + self.cfg.dial_timeout, self._unreachable, src, to.peer_id)
            return
        rtt = self.links.rtt(src.host, dst.host)
        delay = rtt / 2
        if not self._has_session(src, dst):  # dial first: a handshake (1.5 RTT)
            delay += rtt * 1.5
            c.dials += 1
            src.view_bytes += self._dial_bytes[0]
            dst.view_bytes += self._dial_bytes[1]
            c.by_type["handshake"] = c.by_type.get("handshake", 0) + sum(self._dial_bytes)
        self.at(self.now + delay, self._deliver, src, dst, msg)

    def _has_session(self, a: SimPeer, b: SimPeer) -> bool:
        """Whether a and b have a session now (an edge, or a recent message); either way it is kept a while."""
        if b.pid in a.views.active or a.pid in b.views.active:
            return True
        key = (a.pid, b.pid) if a.pid < b.pid else (b.pid, a.pid)
        until = self._sessions.get(key)
        self._sessions[key] = self.now + SESSION_IDLE_S
        if len(self._sessions) > 64 * (len(self.alive) + 16):
            self._sessions = {k: t for k, t in self._sessions.items() if t > self.now}
        return until is not None and until > self.now

    def _deliver(self, src: SimPeer, dst: SimPeer, msg) -> None:
        if not dst.alive:
            if src.alive:
                self.at(self.now + self.cfg.dial_timeout, self._unreachable, src, dst.pid)
            return
        try:
            check(msg, src.pid)
        except BadMessage:
            self.counters.bad += 1
            return
        self._apply(dst, dst.views.handle(src.pid, msg, self.now))
        self._note_connected(dst)

    def _unreachable(self, p: SimPeer, peer: str) -> None:
        if p.alive:
            self.counters.unreachable += 1
            self._apply(p, p.views.unreachable(peer, self.now))

    def _link_down(self, p: SimPeer, peer: str) -> None:
        if p.alive:
            self._apply(p, p.views.link_down(peer, self.now))

    def _note_connected(self, p: SimPeer) -> None:
        if p.connected_at is None and p.views.degree >= self.view_cfg.min_degree:
            p.connected_at = self.now

    def _schedule_tick(self, p: SimPeer) -> None:
        if not p.alive:
            return
        t = max(p.views.next_tick(), self.now + 1e-3)
        if t < p.tick_at:
            p.tick_at = t
            self.at(t, self._tick, p, t)

    def _tick(self, p: SimPeer, t: float) -> None:
        if not p.alive or t != p.tick_at:
            return  # superseded by an earlier one
        p.tick_at = math.inf
        self._apply(p, p.views.tick(self.now))
        self._note_connected(p)

    # ---- the gap estimate: rounds driven for every peer at once -----------------------------------------
    def gap_epoch(self, epoch: int) -> None:
        """Start an epoch now: every live peer begins; rounds end every round_interval."""
        for p in self.alive:
            p.gap.begin(epoch)
        for r in range(self.gap_cfg.rounds):
            self.at(self.now + (r + 1) * self.gap_cfg.round_interval, self._gap_round)

    def _gap_round(self) -> None:
        """One round: each peer's values to its neighbours (arriving within the round: RTTs are shorter),
        then every peer advances; after the last one, each peer's reading goes to its views."""
        peers = [p for p in self.alive if p.gap.running]
        for p in peers:
            msg = p.gap.message(p.views.degree)
            if msg is None:
                continue
            key = (msg.degree, msg.slope is None)
            size = self._gap_sizes.get(key)
            if size is None:
                size = self._gap_sizes[key] = wire_size(msg)
            for q in p.views.active:
                other = self.peers.get(q)
                if other is not None and other.alive:
                    other.gap.receive(p.pid, msg)
                    p.gap_bytes += size
        for p in peers:
            p.gap.advance(p.views.active)
            if not p.gap.running:
                p.views.set_gap(p.gap.reading)

    # ---- the graph --------------------------------------------------------------------------------------
    def graph(self) -> tuple[list[SimPeer], np.ndarray, int]:
        """(live peers, their edges as index pairs, edges one end lists and the other does not)."""
        peers = list(self.alive)
        index = {p.pid: i for i, p in enumerate(peers)}
        pairs = []
        one_sided = 0
        for i, p in enumerate(peers):
            for q in p.views.active:
                j = index.get(q)
                if j is None:
                    one_sided += 1  # an edge to a dead peer not yet noticed
                elif p.pid not in peers[j].views.active:
                    one_sided += 1
                elif i < j:
                    pairs.append((i, j))
        return peers, np.array(pairs, dtype=np.int64).reshape(-1, 2), one_sided


def components(n: int, pairs: np.ndarray) -> list[int]:
    """Sizes of the connected components of nodes 0..n-1, largest first (union-find)."""
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a, b in pairs.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
    sizes: dict[int, int] = {}
    for a in range(n):
        r = find(a)
        sizes[r] = sizes.get(r, 0) + 1
    return sorted(sizes.values(), reverse=True)


def consensus_time(n: int, pairs: np.ndarray, exchange_time: Callable[[int, int], float], *, seed: int = 0,
                   tol: float = 1e-3, max_s: float = 3600.0, weight: float = 1.0 / 3.0,
                   slots: int = 3) -> tuple[float | None, float]:
    """Seconds until simulated gossip averaging on this graph brings the spread (RMS) of the peers' values
    down by `tol` (None: not within max_s), and the rate it fell at (e-folds per second).

    AD-PSGD as the daemon runs it: each peer starts one exchange at a time with a random neighbour; a peer
    takes part in at most `slots` exchanges at once (the pairwise weight 1/3 leaves room for three,
    docs/design.md, "Which weight"), and a full neighbour makes it try another after a short wait. Both
    sides snapshot their values at the start and apply `weight` x (other snapshot - own) at the end, so
    the sum is kept. An exchange takes the link's time, slowed by the number of exchanges either end
    has in progress when it starts (they share the host's bandwidth). The same model on another graph
    over the same links is the yardstick."""
    rng = random.Random(seed)
    nbrs: list[list[int]] = [[] for _ in range(n)]
    for a, b in pairs.tolist():
        nbrs[a].append(b)
        nbrs[b].append(a)
    x = np.random.default_rng(seed).standard_normal(n)
    x -= x.mean()
    xs = x.tolist()
    spread0 = math.sqrt(sum(v * v for v in xs) / n)
    load = [0] * n
    heap: list[tuple[float, int, int, int, int, float, float]] = []
    seq = 0
    for i in range(n):
        if nbrs[i]:
            heap.append((rng.uniform(0, 0.5), seq, 0, i, -1, 0.0, 0.0))  # a try of peer i
            seq += 1
    heapq.heapify(heap)
    sq = sum(v * v for v in xs)  # kept up to date; the mean stays 0 (exchanges keep the sum)
    next_check = 1.0
    trace: list[tuple[float, float]] = []
    while heap:
        now, _, kind, i, j, xi0, xj0 = heapq.heappop(heap)
        while now > next_check:
            spread = math.sqrt(max(sq, 0.0) / n) / spread0
            trace.append((next_check, spread))
            next_check += 1.0
        if trace and (trace[-1][1] <= tol or now > max_s):
            break
        if kind == 0:  # each peer has one event out at a time: a try, or the end of the exchange it started
            j = nbrs[i][rng.randrange(len(nbrs[i]))]
            if load[i] >= slots or load[j] >= slots:
                seq += 1
                heapq.heappush(heap, (now + rng.uniform(0.05, 0.15), seq, 0, i, -1, 0.0, 0.0))
                continue
            load[i] += 1
            load[j] += 1
            seq += 1
            t = exchange_time(i, j) * max(load[i], load[j])
            heapq.heappush(heap, (now + t, seq, 1, i, j, xs[i], xs[j]))
        else:
            d = weight * (xj0 - xi0)
            a, b = xs[i], xs[j]
            sq -= a * a + b * b
            a, b = a + d, b - d
            xs[i], xs[j] = a, b
            sq += a * a + b * b
            load[i] -= 1
            load[j] -= 1
            seq += 1
            heapq.heappush(heap, (now, seq, 0, i, -1, 0.0, 0.0))
    reached = next((t for t, s in trace if s <= tol), None)
    pts = [(t, math.log(s)) for t, s in trace if 0 < s < 0.5]
    rate = 0.0
    if len(pts) >= 2:
        ts, ls = zip(*pts)
        rate = -float(np.polyfit(ts, ls, 1)[0])
    return reached, rate

"""The config's sections, one frozen dataclass each, and `Config`, which holds them: every key declared once,
here, with its default, doc and range (peer/config/keys.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from peer.config.checks import validate_semantics
from peer.config.keys import _f
from peer.membership.auto_switch import AUTO_SWITCH_PEERS
from peer.membership.peers import MAX_PEERS
from peer.topology.local_gap import GapConfig
from protocol.limits import DEFAULT_CHUNK_SIZE, DEFAULT_LIMITS, KiB, MiB
from protocol.schema.topology import MAX_RECORD_NEIGHBOURS

# Largest frame the 32-bit length field can carry with any AEAD tag added (protocol.frames), in KiB: < 4 GiB.
_MAX_FRAME_KIB = (1 << 32) // KiB - 1
# Seconds: the longest interval or timeout a key takes (an hour; a day for how long a peer may stay silent):
# longer is never useful and an infinite one disables the guard it sets.
_HOUR, _DAY = 3600.0, 86400.0
# Shortest interval: 10 ms; below it a loop spins.
_TICK = 0.01


@dataclass(frozen=True)
class DaemonSection:
    swarm: str = _f("default", "Swarm name; daemons connect only within their swarm.")
    listen: str = _f("0.0.0.0:7100", "HOST:PORT to accept peers on; port 0 picks a free port (logged, and shown in `peer status`).")
    join: list[str] = _f([], "Bootstrap addresses HOST:PORT to dial at start (works with mDNS off).")
    log_format: str = _f("text", "'text' for readable lines, 'json' for one JSON object per line.")
    log_level: str = _f("info", "debug, info, warning or error.")


@dataclass(frozen=True)
class SecuritySection:
    swarm_key_file: str = _f("", "File with a pre-shared swarm key; peers without it cannot complete a handshake. Relative to the config file.")
    allow_peers: list[str] = _f([], "If non-empty, only these peer IDs (as `peer id` prints them) may connect.")
    ciphers: list[str] = _f(["auto"], "Session ciphers by preference: aes-256-ocb, aes-256-gcm, chacha20-poly1305, or 'auto' (the fastest, measured at start).")


@dataclass(frozen=True)
class DiscoverySection:
    mdns: bool = _f(True, "Announce and browse `_peertrain._tcp.local.` with mDNS on the local link.")
    interfaces: list[str] = _f([], "IPs of the interfaces mDNS uses (empty: all); ['127.0.0.1'] for daemons on one host.")
    advertise: list[str] = _f([], "IPs to announce to peers (empty: the interface addresses).")
    private_addresses: bool = _f(False, "Dial loopback, link-local and private addresses (and host names) that "
                                 "other peers told us (peer exchange, peer cache); mDNS, --join and connecting "
                                 "peers' own addresses are always used. On for a LAN or one host.")


@dataclass(frozen=True)
class MembershipSection:
    heartbeat_interval: float = _f(1.0, "Seconds between pings on each session (also measures RTT).", lo=_TICK, hi=_HOUR, unit="s")
    dead_after: float = _f(6.0, "A peer silent this many seconds (> heartbeat_interval) is dead; its session is closed.",
                            lo=_TICK, hi=_DAY, unit="s")
    handshake_timeout: float = _f(5.0, "Seconds a handshake may take before the connection is dropped (slowloris guard).",
                                   lo=0.1, hi=120.0, unit="s")
    identity_bits: int = _f(0, "Work every identity key must carry (leading zero bits of a hash of it), checked "
                            "at the handshake: keys then cost about 2^bits tries to make (20: ~1 min of a core "
                            "once per peer, 12 h for a thousand Sybil keys). A new home's key is made so; an "
                            "older, weaker key is refused at start, with the fix. 0: off.", lo=0, hi=32)
    max_connections: int = _f(64, "Most sessions this daemon keeps open at once.", lo=1, hi=65536)
    max_connections_per_ip: int = _f(16, "Most sessions from one remote IP address.", lo=1, hi=65536)
    reconnect_min: float = _f(0.5, "First reconnect delay in seconds; doubles with jitter on each failure.",
                               lo=_TICK, hi=_HOUR, unit="s")
    reconnect_max: float = _f(30.0, "Longest reconnect delay in seconds (at least reconnect_min).", lo=_TICK, hi=_DAY, unit="s")
    pex_interval: float = _f(5.0, "Seconds between peer-exchange (signed peer record) messages.",
                              lo=_TICK, hi=_HOUR, unit="s")
    peer_record_ttl: float = _f(600.0, "Seconds a signed peer record stays valid.", lo=1.0, hi=30 * _DAY, unit="s")
    # "auto" by default: the full view while the swarm is small (it mixes best there, every peer known), partial
    # views past AUTO_SWITCH_PEERS, where they were measured to win (docs/design.md, "Auto views")
    views: str = _f("auto", "'full': know, dial and keep a session with every peer (up to max_connections), flood "
                    "peer records, rewire on the whole graph. 'partial': HyParView-style partial views: sessions with "
                    "[topology] target_degree gossip neighbours and whom a message needs now, a bounded passive view. "
                    "'auto': full until auto_peers peers are known (or a peer sends a partial-view message), then "
                    "partial, once.")
    auto_peers: int = _f(AUTO_SWITCH_PEERS, "With views = 'auto': the swarm size (us and the peers we know) at which "
                         "the daemon switches to partial views.", lo=2, hi=MAX_PEERS)
    # The estimator's own defaults (peer/topology/local_gap.py, GapConfig, where they are argued).
    gap_every: float = _f(GapConfig.epoch_interval, "With views = 'partial': seconds between estimates of the "
                          "spectral gap, made with the gossip neighbours (each costs 60 rounds of small messages); "
                          "0 turns them off (local rewiring then reads no gap).", lo=0.0, hi=_DAY, unit="s")
    gap_round: float = _f(GapConfig.round_interval, "Seconds per round of the gap estimate: a round's message must "
                          "reach every neighbour within a quarter of it; hosts' clocks must agree that closely.",
                          lo=_TICK, hi=60.0, unit="s")


@dataclass(frozen=True)
class LimitsSection:
    # The defaults are protocol.limits.WireLimits' (where they are defined, with why), in this section's units
    # (the frame's rounded up to whole KiB: 4 MiB + 64 B is 4097 KiB).
    max_frame_kib: int = _f(-(-DEFAULT_LIMITS.max_frame_bytes // KiB), "Largest sealed frame accepted, in KiB.",
                        lo=64, hi=_MAX_FRAME_KIB)
    max_message_kib: int = _f(DEFAULT_LIMITS.max_message_bytes // KiB, "Largest control message accepted, in KiB (at most max_frame_kib).",
                          lo=16, hi=_MAX_FRAME_KIB)
    max_tensor_mib: int = _f(DEFAULT_LIMITS.max_tensor_bytes // MiB, "Largest tensor a peer may send us, in MiB (at most max_inflight_tensor_mib).",
                         lo=1, hi=1 << 20)
    max_inflight_tensor_mib: int = _f(DEFAULT_LIMITS.max_inflight_tensor_bytes // MiB,
                                      "Tensor MiB one session may have in flight.",
                                      lo=1, hi=1 << 20)
    max_queued_messages: int = _f(DEFAULT_LIMITS.max_queued_messages,
                                  "Messages buffered per session before reading pauses (backpressure).",
                                  lo=1, hi=1 << 20)


@dataclass(frozen=True)
class TopologySection:
    kind: str = _f("rewired", "Gossip graph: rewired (adaptive), ring, exponential, random_regular, full or "
                   "two_cliques (two complete halves joined by one edge: a hard case for robust averaging).")
    target_degree: int = _f(4, "Neighbours each peer aims for (min_degree to max_degree).", lo=1, hi=MAX_RECORD_NEIGHBOURS)
    min_degree: int = _f(2, "A peer never drops an edge that leaves it or a neighbour below this (except a relink "
                            "between two slow-linked peers, which re-adds a well-linked peer at once).", lo=1, hi=MAX_RECORD_NEIGHBOURS)
    max_degree: int = _f(8, "A peer refuses edges above this degree (a topology record lists at most 64 neighbours).", lo=1, hi=MAX_RECORD_NEIGHBOURS)
    gap_floor: float = _f(0.05, "Rewiring never lets the spectral gap of the local view fall below this.",
                           lo=0.0, hi=1.0, hi_open=True)
    confidence: float = _f(1.5, "Rewiring judges the link it would replace at its best and the new one at its worst by "
                                "this many standard errors of their bandwidth estimates (a speed-up within the noise "
                                "is none); raise it on noisy hosts.",
                           lo=0.0, hi=10.0, unit="standard errors")
    rewire_interval: float = _f(4.0, "Mean seconds between rewiring attempts (randomized).", lo=_TICK, hi=_HOUR, unit="s")
    record_interval: float = _f(2.0, "Seconds between topology-record broadcasts.", lo=_TICK, hi=_HOUR, unit="s")
    seed: int = _f(0, "Seed for fixed random topologies.", lo=0, hi=(1 << 32) - 1)


@dataclass(frozen=True)
class GossipSection:
    exchange_timeout: float = _f(30.0, "Deadline for one averaging exchange; a slow or dead neighbour is skipped.",
                                 lo=0.1, hi=_HOUR, unit="s")
    max_concurrent_exchanges: int = _f(4, "Most averaging exchanges this peer serves at once.", lo=1, hi=1024)
    codec: str = _f("raw", "Tensor codec for averaging: raw, float16 or q8.")
    # (the default is protocol.limits.DEFAULT_CHUNK_SIZE, defined there with why)
    chunk_kib: int = _f(DEFAULT_CHUNK_SIZE // KiB, "Tensor chunk (one frame) in KiB, at most max_frame_kib.",
                         lo=1, hi=_MAX_FRAME_KIB)
    max_update_ratio: float = _f(8.0, "Ceiling of the clip radius, times our model's norm (the whole bound while we "
                                 "have no other partner to compare with); a download must be within this times "
                                 "the smaller norm (independently initialised models differ by about 1.4x their "
                                 "norm).", lo=1.0, hi=1e6)
    # 1/4: with the default degree 4 one lying neighbour in four; with 4 to 7 other partners the farthest is set aside
    byzantine_share: float = _f(0.25, "Share of our averaging partners assumed to lie: the clip radius comes from "
                                "the others' distances once this share of the farthest is set aside.",
                                lo=0.0, hi=0.5, hi_open=True)


@dataclass(frozen=True)
class PipelineSection:
    """Bounds on the swarm pipeline's calls (peer/pipeline/): what a driver waits for and what a server holds."""

    max_queue: int = _f(16, "Stage calls this daemon holds at once (received, queued or computing), from all "
                        "drivers; more are refused as busy (the driver tries another peer of the stage). A quarter is kept "
                        "for backward and loss calls, which are also computed first.",
                        lo=1, hi=4096)
    max_queue_per_peer: int = _f(8, "Stage calls one driver may have at this daemon at once (a quarter kept "
                                 "for its backward and loss calls).", lo=1, hi=4096)
    call_timeout: float = _f(10.0, "Base deadline of one stage call; a call's deadline adds 4x its expected "
                             "queue, compute and transfer time (measured), up to max_call_timeout.",
                             lo=0.1, hi=_HOUR, unit="s")
    max_call_timeout: float = _f(120.0, "Longest deadline one stage call may get, however slow the peer.",
                                 lo=0.1, hi=_HOUR, unit="s")
    max_retries: int = _f(4, "Times one stage call is re-sent to another peer of the stage before its microbatch "
                          "fails.", lo=0, hi=64)
    stage_wait: float = _f(120.0, "Longest a driver waits for a stage with no live peer before failing the "
                           "microbatch (the wait shows in `peer status`).", lo=0.1, hi=_DAY, unit="s")
    first_ban: float = _f(2.0, "Seconds a driver avoids a peer after a failed call; doubles with each further "
                          "failure in a row, up to max_ban.", lo=0.0, hi=_HOUR, unit="s")
    max_ban: float = _f(120.0, "Longest a driver avoids a failing peer.", lo=0.0, hi=_DAY, unit="s")
    # verify_fraction: 1 call in 20 checked costs ~5% more compute (a third peer on a mismatch) and still meets a
    # liar serving a third of a stage's calls every ~15 microbatches of each driver (peer bench pipeline --liar)
    verify_fraction: float = _f(0.05, "Share of its stage calls a driver re-executes at another peer of the stage "
                                "to compare the answers; a peer whose answers disagree with two others is struck, "
                                "and banned from this daemon's calls and stage after 3 strikes (0: no checks).",
                                lo=0.0, hi=1.0)
    max_state_uploads: int = _f(2, "Stage states (weights and optimizer state) this daemon sends at once to peers "
                                "taking a stage over; each writes a snapshot of the stage to a file in the home and streams it from there.",
                                lo=1, hi=64)
    state_timeout: float = _f(120.0, "Longest one stage-state transfer may take (a stage of 100 MB at ~10 MB/s, "
                              "with room); a slower one is abandoned and the mover asks another holder.",
                              lo=1.0, hi=_DAY, unit="s")
    memory_mib: int = _f(0, "Memory (MiB) this daemon's pipeline stage may use, process included; the cut, placement "
                         "and moves keep every stage within it. 0: the memory cgroup's limit, else the available "
                         "memory at start, less 10% (on a GPU: its free memory, less 10%).", lo=0, hi=1 << 30)
    device: str = _f("auto", "Where this daemon's pipeline stage computes: 'auto' (the first CUDA GPU torch sees, "
                     "else the CPU), 'cpu', 'cuda' or 'cuda:N'.")


@dataclass(frozen=True)
class NatSection:
    """Being reachable from the internet (peer/nat/): dial-back, relays we use, hole punching."""

    reachability: str = _f("auto", "'auto': ask peers to dial our advertised addresses back and conclude public, "
                           "nat or unknown; 'public' or 'private' to skip asking (you know the port is open, or not).")
    dialback_peers: int = _f(3, "Peers (at distinct IPs) asked to dial us back each round; two agreeing decide.",
                             lo=1, hi=16)
    recheck_interval: float = _f(300.0, "Seconds between reachability checks once decided (sooner while unknown).",
                                 lo=1.0, hi=_DAY, unit="s")
    use_relays: bool = _f(True, "When not publicly reachable, keep reservations with public peers that relay, "
                          "and advertise the relayed addresses in our signed peer record.")
    relays: int = _f(2, "Relay reservations to hold (two: losing one relay does not cut us off).", lo=1, hi=8)
    hole_punching: bool = _f(True, "Over a relayed session, try a simultaneous TCP open for a direct one.")


@dataclass(frozen=True)
class RelaySection:
    """Relaying for peers behind NAT, offered only while we are publicly reachable: a relay is a service
    strangers in the swarm use, so everything it holds is capped here."""

    enabled: bool = _f(True, "Offer relaying while this daemon is publicly reachable.")
    max_reservations: int = _f(64, "Peers that may hold a reservation with us at once.", lo=0, hi=65536)
    max_circuits: int = _f(64, "Relayed connections at once, in total.", lo=0, hi=65536)
    max_circuits_per_peer: int = _f(8, "Relayed connections at once from one peer, and to one peer (a peer behind "
                                    "a NAT that cannot be punched needs one per peer it talks to, spread over its "
                                    "relays).", lo=1, hi=1024)
    max_circuit_mib: int = _f(1024, "Bytes one relayed connection may carry (both directions), in MiB; then it is "
                              "closed and its peers reconnect.", lo=1, hi=1 << 30)
    max_circuit_seconds: float = _f(3600.0, "Longest a relayed connection stays open.", lo=1.0, hi=_DAY, unit="s")
    max_bandwidth_mib_s: float = _f(25.0, "Bytes per second, in MiB, all relayed connections together may use "
                                    "(shared fairly by taking turns).", lo=0.01, hi=1 << 20, unit="MiB/s")


@dataclass(frozen=True)
class AttachSection:
    enabled: bool = _f(True, "Let training processes of this host's user attach to this daemon (peertrain.attach) "
                       "through the control socket (mode 0600).")
    max_clients: int = _f(16, "Processes attached at once (a torchrun job attaches once, from its rank 0).",
                          lo=1, hi=1024)
    max_shared_mib: int = _f(16384, "Tensors all attached processes may share, in MiB (the daemon keeps snapshot "
                             "buffers of that size for the exchanges).", lo=1, hi=1 << 24)


@dataclass(frozen=True)
class MetricsSection:
    """Prometheus metrics over HTTP (peer/metrics/): off unless an address is given."""

    listen: str = _f("", "HOST:PORT serving Prometheus metrics at GET /metrics; empty: off. Port 0 picks a free "
                     "port (logged, and shown in `peer status` as metrics.listen). It tells whoever reaches it "
                     "about this daemon and its peers: keep it on 127.0.0.1 or a private network.")


@dataclass(frozen=True)
class DashboardSection:
    """A read-only web page of this daemon's status (peer/dashboard/): off unless an address is given."""

    listen: str = _f("", "HOST:PORT serving the dashboard (a page at / and its JSON feed at /api/status); empty: "
                     "off. Port 0 picks a free port (shown in `peer status` as dashboard.listen). On an address "
                     "other than loopback it needs `token`; else reach it through an SSH tunnel.")
    token: str = _f("", "Secret a client must send (`Authorization: Bearer TOKEN`, or `?token=TOKEN` in the page's "
                    "URL) to see the dashboard; required when `listen` is not a loopback address (at least "
                    "16 characters, e.g. 24 random bytes in base64).")


@dataclass(frozen=True)
class TrainerSection:
    name: str = _f("", "Trainer module the daemon hosts (e.g. trainers.gossip_sgd); empty: no training.")
    options: dict = _f({}, "Trainer options (see the trainer's docs).")


@dataclass(frozen=True)
class Config:
    daemon: DaemonSection = field(default_factory=DaemonSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    discovery: DiscoverySection = field(default_factory=DiscoverySection)
    membership: MembershipSection = field(default_factory=MembershipSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    topology: TopologySection = field(default_factory=TopologySection)
    gossip: GossipSection = field(default_factory=GossipSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    nat: NatSection = field(default_factory=NatSection)
    relay: RelaySection = field(default_factory=RelaySection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    dashboard: DashboardSection = field(default_factory=DashboardSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    attach: AttachSection = field(default_factory=AttachSection)
    source: str = field(default="", compare=False)  # file it came from, for messages

    def replace(self, **sections: dict[str, Any]) -> "Config":
        """A copy with some fields of some sections changed: cfg.replace(daemon={'swarm': 'x'})."""
        changes = {name: dataclasses.replace(getattr(self, name), **vals) for name, vals in sections.items()}
        new = dataclasses.replace(self, **changes)
        validate_semantics(new)
        return new

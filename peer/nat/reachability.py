"""Are we reachable from the internet? Ask several peers to dial our advertised addresses back.

Asking side: every round we send our candidate addresses (configured `advertise` and the addresses
peers observe for us, with our listen port) to up to `[nat] dialback_peers` connected peers at distinct
IPs. Each asked IP has one vote, from its last answer: it got through if it reached us at any address it
tested (one that failed, say an advertised address we no longer hold, does not hide one that worked), else
it could not. Two peers at distinct IPs that got through make us "public"; two that could not, and none
that could, "nat"; anything else stays "unknown". The last answer from each IP, every address of it, is the
evidence `peer status` and `peer doctor` show.

Answering side (an attack surface: a request names addresses for us to dial): we only dial addresses at
the IP we see the asker at (so nobody can aim our dials at a third party), one request per peer at a
time and none sooner than MIN_INTERVAL after its last, at most MAX_DIALBACKS dials daemon-wide, each
bounded by the handshake timeout. A dial-back is a full handshake expecting the asker's peer ID, marked
as a probe so the asker closes it at once instead of replacing its session with us.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from typing import Callable

import trio

from peer.config import NatSection
from peer.nat.addresses import format_hostport, ip_literal, parse_address
from peer.session.connect import dial
from peer.session.transport import SessionClosed
from protocol.identity import short_id
from protocol.refusal import Code, Refusal
from protocol.schema import DialBackReply, DialBackRequest, DialBackResult
from protocol.schema.nat import MAX_DIALBACK_ADDRESSES

log = logging.getLogger("peertrain.nat")

QUORUM = 2
"""Peers at distinct IPs that must agree before we call ourselves public (or behind NAT). While fewer
than that can be asked (a newcomer behind NAT knows only its bootstrap host), the one answer decides,
and is checked again every WEAK_RECHECK seconds: it is the only view of the outside there is, and
waiting for a second one would leave a peer behind NAT without relays, unreachable, for good."""
WEAK_RECHECK = 30.0
MAX_DIALBACKS = 4
"""Dial-backs in progress at once, for all askers together: each holds a socket and a handshake for up to
`handshake_timeout`; 4 answers a few joining peers at once while bounding what askers can make us do."""
MIN_INTERVAL = 10.0  # seconds between two dial-back requests we serve for one peer
UNKNOWN_RETRY = 5.0  # seconds between rounds while we do not know yet
MAX_EVIDENCE = 16  # answers kept (one per asked IP, the oldest forgotten), each of at most MAX_DIALBACK_ADDRESSES results


def local_ip(session) -> str | None:
    try:
        return ip_literal(session.stream.socket.getsockname()[0])
    except OSError:
        return None


def seen_by(session) -> str | None:
    """Our IP as the session's peer sees it: what it reported (`observed`, when we dialed it), the address
    it dialed (when it dialed us), or our own end of the connection."""
    app = session.remote_app if isinstance(session.remote_app, dict) else {}
    if session.initiator:
        return ip_literal(str(app.get("observed", "")))
    dialed = parse_address(str(app.get("dialed", "")))
    if dialed is not None and ip_literal(dialed[0]):
        return ip_literal(dialed[0])
    return local_ip(session)


@dataclass
class Evidence:
    """What one asked peer found when it dialed one address of ours."""

    peer_id: str
    ip: str  # where the asked peer is, as we see it (one vote per IP)
    address: str
    ok: bool
    reason: str
    at: float  # trio clock


def vote(answer: list[Evidence]) -> Evidence:
    """An asked IP's one vote from its answer's results: one that got through if any did (we are reachable
    there, whatever another address of ours did), else its last failure."""
    return next((e for e in answer if e.ok), answer[-1])


class Reachability:
    def __init__(self, cfg: NatSection, *, membership, transport, router, listen_port: Callable[[], int],
                 seen_hosts: Callable[[], list[str]] = lambda: []):
        self.cfg = cfg
        self.membership = membership
        self.transport = transport
        self._probe = dataclasses.replace(transport, app_payload={**transport.app_payload, "probe": True})
        self.listen_port = listen_port
        self.seen_hosts = seen_hosts  # our IPs as single peers reported them: worth testing, not yet advertising
        self.weak = False  # decided on fewer than QUORUM answers
        forced = {"public": "public", "private": "nat"}.get(cfg.reachability)
        self.verdict = forced or "unknown"
        self.reason = f"set by [nat] reachability = {cfg.reachability!r}" if forced else "not checked yet"
        self.evidence: dict[str, list[Evidence]] = {}  # asked peer's IP -> its last answer's results (tested ones)
        self._serving: set[str] = set()
        self._served_at: dict[str, float] = {}
        self._dials = 0
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        router.register(DialBackRequest, self._on_request)

    def candidates(self) -> list[str]:
        m, port = self.membership, self.listen_port()
        hosts = list(dict.fromkeys(m.advertise_hosts + m.bound_hosts + m.observed_hosts + self.seen_hosts()))
        return [format_hostport(h, port) for h in hosts if ip_literal(h)][:MAX_DIALBACK_ADDRESSES]

    def verified_hosts(self) -> list[str]:
        """Hosts of ours that peers dialed back while we are public: proven, so worth advertising."""
        if self.verdict != "public":
            return []
        return list(dict.fromkeys(e.address.rpartition(":")[0].strip("[]") for e in self.results() if e.ok))

    def results(self) -> list[Evidence]:
        """Every result of the answers kept, oldest answer first."""
        return [e for answer in self.evidence.values() for e in answer]

    def status(self) -> dict:
        now = trio.current_time()
        return {"reachability": self.verdict, "reason": self.reason,
                "evidence": [{"peer_id": e.peer_id, "address": e.address, "ok": e.ok, "reason": e.reason,
                              "age_s": round(now - e.at, 1)} for e in self.results()]}

    # ---- asking -------------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            if self.cfg.reachability != "auto":
                await trio.sleep_forever()
            while True:
                await self._round()
                wait = (UNKNOWN_RETRY if self.verdict == "unknown" else
                        min(WEAK_RECHECK, self.cfg.recheck_interval) if self.weak else self.cfg.recheck_interval)
                with trio.move_on_after(wait * random.uniform(0.8, 1.2)):
                    await self._changed.wait()
                self._changed = trio.Event()

    def addresses_changed(self) -> None:
        self._changed.set()

    async def _round(self) -> None:
        """Ask peers at distinct IPs. When some see us at an address other than our own end of the
        connection (a NAT translates between us), only those are asked: they are the outside, and a peer
        on our LAN, which sees our private address, would only prove that the LAN reaches us (two such
        answers once made a peer behind NAT call itself public). When all see our own address (a public
        host, or a swarm on one LAN), any may answer."""
        by_ip: dict[str, object] = {}
        for s in self.membership.connected().values():
            if s.path == "direct":
                by_ip.setdefault(s.remote_addr[0], s)
        plans = [(s, a) for s in by_ip.values() if (a := self.addresses_for(s))]
        outside = [(s, a) for s, a in plans if seen_by(s) != local_ip(s)]
        plans = outside or plans
        if not plans:
            self.reason = ("no connected peer to ask yet" if not by_ip else
                           "no address to test yet (no peers have reported where they see us)")
            return
        async with trio.open_nursery() as nursery:
            for s, addresses in random.sample(plans, min(self.cfg.dialback_peers, len(plans))):
                nursery.start_soon(self._ask, s, addresses)
        self._decide(needed=min(QUORUM, len(plans)))

    def addresses_for(self, session) -> list[str]:
        """What `session`'s peer should dial: where it sees us (it may dial nothing else of ours), and
        the addresses we were told to advertise, with our listen port."""
        seen = seen_by(session)
        hosts = dict.fromkeys(([seen] if seen else []) + [h for h in self.membership.advertise_hosts if ip_literal(h)])
        return [format_hostport(h, self.listen_port()) for h in hosts][:MAX_DIALBACK_ADDRESSES]

    async def _ask(self, session, addresses: list[str]) -> None:
        timeout = self.transport.handshake_timeout * len(addresses) * 2 + 5.0
        try:
            reply = (await session.request(DialBackRequest(addresses=addresses), timeout=timeout)).message
        except (SessionClosed, trio.TooSlowError):
            return
        if not isinstance(reply, DialBackReply):
            return
        ip, now = session.remote_addr[0], trio.current_time()
        tested = {r.address: r for r in reply.results if r.address in addresses and r.refusal() is None}
        if not tested:  # it dialed nothing (it refused, see `refusal`): no evidence either way
            return
        self.evidence.pop(ip, None)  # its last answer is its vote: it replaces the one before, moved to the end
        self.evidence[ip] = [Evidence(session.peer_id, ip, r.address, r.ok, r.reason, now) for r in tested.values()]
        if len(self.evidence) > MAX_EVIDENCE:
            self.evidence.pop(next(iter(self.evidence)))

    def _decide(self, needed: int) -> None:
        horizon = trio.current_time() - 3 * self.cfg.recheck_interval
        recent = [vote(answer) for answer in self.evidence.values() if answer[-1].at >= horizon]
        good = [e for e in recent if e.ok]
        bad = [e for e in recent if not e.ok]
        before = self.verdict
        self.weak = needed < QUORUM
        only = f" (the only peer we can ask; {QUORUM} at distinct IPs would be surer)" if self.weak else ""
        if needed and len(good) >= needed:
            self.verdict = "public"
            self.reason = f"{len(good)} of {len(recent)} peers dialed us back at {good[-1].address}{only}"
        elif needed and len(bad) >= needed and not good:
            self.verdict = "nat"
            self.reason = f"{len(bad)} of {len(recent)} peers could not dial {bad[-1].address} ({bad[-1].reason}){only}"
        elif (before == "nat" and bad and not good) or (before == "public" and good and not bad):
            self.reason = f"{self.reason.split(' (keeping')[0]} (keeping it: {len(recent)} answers, none against)"
        else:  # answers disagree, or too few: a verdict flips only on evidence against it
            self.verdict = "unknown"
            self.reason = (f"{len(good)} peers got through and {len(bad)} did not; "
                           f"{QUORUM} peers at distinct IPs must agree")
        if self.verdict != before:
            log.info("reachability: %s (%s)", self.verdict, self.reason)

    # ---- answering ----------------------------------------------------------------------------------
    async def _on_request(self, session, env) -> None:
        addresses = env.message.addresses
        now = trio.current_time()
        why = None
        if session.path != "direct":
            why = Refusal(Code.WRONG_PATH, "ask over a direct session")
        elif session.peer_id in self._serving or now - self._served_at.get(session.peer_id, -1e9) < MIN_INTERVAL:
            why = Refusal(Code.TOO_SOON, f"at most one request per {MIN_INTERVAL:g} s")
        elif self._dials >= MAX_DIALBACKS or self._nursery is None:
            why = Refusal(Code.BUSY, f"busy ({MAX_DIALBACKS} dial-backs at once)")
        if why is not None:
            await session.reply(env, DialBackReply(results=[DialBackResult.not_tried(a, why) for a in addresses]))
            return
        self._serving.add(session.peer_id)
        self._served_at[session.peer_id] = now
        if len(self._served_at) > 4096:  # forget the oldest: bounded by what peers can make us remember
            self._served_at.pop(next(iter(self._served_at)))
        self._dials += 1
        self._nursery.start_soon(self._answer, session, env)

    async def _answer(self, session, env) -> None:
        results = []
        try:
            seen = ip_literal(session.remote_addr[0])
            for a in env.message.addresses:
                hp = parse_address(a)
                if hp is None or ip_literal(hp[0]) != seen:
                    results.append(DialBackResult.not_tried(a, Refusal(Code.BAD_INPUT,
                                                                       f"not your address (we see you at {seen})")))
                    continue
                results.append(await self._dial_back(session.peer_id, a, *hp))
            await session.reply(env, DialBackReply(results=results))
        except SessionClosed:
            pass
        finally:
            self._dials -= 1
            self._serving.discard(session.peer_id)

    async def _dial_back(self, peer_id: str, address: str, host: str, port: int) -> DialBackResult:
        timeout = self.transport.handshake_timeout
        try:
            probe = await dial(host, port, self._probe, expected_peer_id=peer_id, connect_timeout=timeout)
        except trio.TooSlowError:
            return DialBackResult(address, False, f"no answer within {timeout:g} s")
        except Exception as exc:  # OSError, HandshakeError: the address does not lead to that peer
            return DialBackResult(address, False, f"{type(exc).__name__}: {exc}"[:200])
        await probe.stream.aclose()  # the handshake was the whole test; nothing else runs on it
        log.debug("dialed %s back at %s", short_id(peer_id), address)
        return DialBackResult(address, True, "")

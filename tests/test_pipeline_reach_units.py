"""Stage servers reached by their announcement under partial views (issue 30): the bounds of the addresses an
announcement carries (refused at decode, with the reason), the lookup's bounds (peer/membership/reach.py: how
many at once, its deadline, a dialer that gave up), and how the pipeline uses it (its stage map, a driver's
call, the sessions it keeps). Process-free; tests/test_pipeline_partial_views.py runs it in real daemons."""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgpack
import pytest
import trio
import trio.testing
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from peer.averaging.bans import BanList
from peer.config import PipelineSection
from peer.membership.peers import PeerInfo
from peer.membership.reach import MAX_REACHING, Reach, ReachBusy, Unreachable
from peer.membership.view_mode import FullView
from peer.pipeline.driver import Driver, _CallFailed
from peer.pipeline.server import StageServer
from peer.pipeline.service import PipelineService
from peer.topology.records import signed_record
from peertrain.pipeline import PipelineKey, StagePeer
from protocol import identity as ident
from protocol.addresses import MAX_ENTRY_ADDRESSES
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.refusal import Code, Refused
from protocol.schema import DEFAULT_REGISTRY, TopologyRecords
from protocol.schema.pipeline import MAX_SAMPLES_PER_S, MAX_STEP, StageAnnouncement
from protocol.bounds import MAX_ADDRESS_CHARS
from protocol.schema.training import MAX_FIGURE_LOSS, TrainingFigures
from protocol.schema.topology import (MAX_GROUP_CHARS, MAX_RECORD_GROUPS, MAX_RECORD_LINKS, MAX_RECORD_NEIGHBOURS, LinkReport, TopologyRecord,
                                      topology_record_signing_bytes)

KEY = PipelineKey("p", (1,))
RELAY = "r" * 20  # a relay's peer ID


def wire_records(stage: dict) -> bytes:
    rec = {"peer_id": "p" * 20, "public_key": b"k" * 32, "version": 1, "issued": 1.0, "neighbours": [], "links": [],
           "signature": b"s" * 64, "stage": stage}
    return msgpack.packb({"t": "topo_records", "v": 1, "r": 0, "q": 0, "b": {"records": [rec]}}, use_bin_type=True)


def stage_body(addresses) -> dict:
    return {"pipeline": "p", "stage": 0, "stages": 2, "cuts": [1], "addresses": addresses}


# ---- the announcement's addresses ---------------------------------------------------------------------------

def test_an_announcement_carries_direct_and_relayed_addresses():
    ok = ["127.0.0.1:4000", "[::1]:5", f"10.0.0.1:7/relay/{RELAY}", "example.org:65535"]
    env = DEFAULT_REGISTRY.decode(wire_records(stage_body(ok)), DEFAULT_LIMITS)
    assert env.message.records[0].stage.addresses == ok
    assert StageAnnouncement("p", 0, 2, cuts=[1]).addresses == []  # none said: an older peer's announcement


@pytest.mark.parametrize("addresses, why", [
    ([f"127.0.0.1:{1000 + i}" for i in range(MAX_ENTRY_ADDRESSES + 1)], f"at most {MAX_ENTRY_ADDRESSES}"),
    (["h" * (MAX_ADDRESS_CHARS - 4) + ":4000"], f"1..{MAX_ADDRESS_CHARS} characters"),
    ([""], f"1..{MAX_ADDRESS_CHARS} characters"),
    (["no-port"], "neither host:port"),
    (["127.0.0.1:0"], "neither host:port"),
    (["127.0.0.1:65536"], "neither host:port"),
    (["127.0.0.1:-1"], "neither host:port"),
    ([":4000"], "neither host:port"),
    (["user@127.0.0.1:4000"], "neither host:port"),
    (["127.0.0.1:4000/relay/"], "neither host:port"),
    ([f"127.0.0.1:4000/relay/{'r' * 65}"], "neither host:port"),
    (["127.0.0.1:4000/relay/a/b"], "neither host:port"),
    (["127.0.0.1:4000/elsewhere/x"], "neither host:port"),
    ("127.0.0.1:4000", "expected list"),
    ([4000], "expected str"),
    ([None], "expected str"),
])
def test_hostile_addresses_are_refused_at_decode_with_the_reason(addresses, why):
    with pytest.raises(ProtocolError, match="stage") as e:
        DEFAULT_REGISTRY.decode(wire_records(stage_body(addresses)), DEFAULT_LIMITS)
    assert why in str(e.value), str(e.value)


def test_the_addresses_are_signed_and_a_record_without_them_signs_as_before():
    key = Ed25519PrivateKey.generate()
    me = ident.peer_id_from_public_bytes(ident.public_key_bytes(key))
    bare = StageAnnouncement("p", 0, 2, cuts=[1])
    rec = signed_record(key, me, version=1, neighbours=[], links={}, stage=bare, groups=[])
    assert b"addresses" not in topology_record_signing_bytes(rec)  # what an older peer signed and checks
    ann = StageAnnouncement("p", 0, 2, cuts=[1], addresses=["127.0.0.1:4000"])
    rec = signed_record(key, me, version=1, neighbours=[], links={}, stage=ann, groups=[])
    assert ident.verify(rec.public_key, rec.signature, topology_record_signing_bytes(rec))
    forged = TopologyRecord(**{f: getattr(rec, f) for f in rec.__dataclass_fields__} | {
        "stage": StageAnnouncement("p", 0, 2, cuts=[1], addresses=["6.6.6.6:4000"])})
    assert not ident.verify(forged.public_key, forged.signature, topology_record_signing_bytes(forged))


def test_a_largest_record_with_a_largest_announcement_is_small_enough_to_batch():
    ann = StageAnnouncement("p" * 64, 0, 2, cuts=[1],
                            addresses=["h" * (MAX_ADDRESS_CHARS - 6) + ":65535"] * MAX_ENTRY_ADDRESSES)
    rec = TopologyRecord(peer_id="p" * 20, public_key=b"k" * 32, version=2**63, issued=1e9,
                         neighbours=["n" * 64] * MAX_RECORD_NEIGHBOURS,
                         links=[LinkReport("l" * 64, 1e9, 1.0)] * MAX_RECORD_LINKS, signature=b"s" * 64, stage=ann,
                         groups=["g" * MAX_GROUP_CHARS] * MAX_RECORD_GROUPS,
                         training=TrainingFigures(MAX_STEP, MAX_FIGURE_LOSS, 1.0, MAX_SAMPLES_PER_S))
    assert len(DEFAULT_REGISTRY.encode(TopologyRecords(records=[rec]))) < 24 * 1024 < DEFAULT_LIMITS.max_message_bytes


# ---- the lookup (peer/membership/reach.py) ------------------------------------------------------------------

class FakeMembership:
    """What Reach reads of membership: the peer table, the sessions, learning addresses, waking the dialer."""

    def __init__(self):
        self.peer_id = "me"
        self.peers: dict[str, PeerInfo] = {}
        self.sessions: dict[str, object] = {}
        self.learned: list[tuple[str, list[str], str]] = []
        self.wakes = 0

    def dial_soon(self) -> None:
        self.wakes += 1

    def peer_info(self, peer_id: str) -> PeerInfo | None:
        return self.peers.get(peer_id)

    def connected(self) -> dict:
        return dict(self.sessions)

    def learn_addresses(self, peer_id: str, texts: list[str], *, source: str) -> None:
        self.learned.append((peer_id, list(texts), source))
        self.peers.setdefault(peer_id, PeerInfo(peer_id=peer_id, source=source))

    def connect(self, reach: Reach, peer_id: str) -> object:
        s = self.sessions[peer_id] = object()
        reach.session_changed(peer_id, s)
        return s


def run(fn) -> None:
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


def test_at_most_max_reaching_lookups_are_pending_and_a_peer_is_dialed_once():
    m = FakeMembership()
    reach = Reach(m, timeout=8.0)
    got: dict[str, object] = {}
    reached: list[str] = []

    async def look(peer: str) -> None:
        got[peer] = await reach.session(peer, ["127.0.0.1:4000"], on_reached=lambda: reached.append(peer))

    async def main() -> None:
        async with trio.open_nursery() as n:
            for i in range(MAX_REACHING):
                n.start_soon(look, f"s{i}")
            await trio.testing.wait_all_tasks_blocked()
            assert len(reach.pending) == MAX_REACHING and all(reach.wanted(f"s{i}") for i in range(MAX_REACHING))
            with pytest.raises(ReachBusy):
                await reach.session("one-more", ["127.0.0.1:4001"])
            assert reach.busy == 1 and not reach.wanted("one-more") and "one-more" not in m.peers
            n.start_soon(look, "s0")  # a second caller for a peer being reached: waits on the same dial
            await trio.testing.wait_all_tasks_blocked()
            assert len(reach.pending) == MAX_REACHING and [p for p, _, _ in m.learned].count("s0") == 1
            for i in range(MAX_REACHING):
                m.connect(reach, f"s{i}")
        assert set(got) == {f"s{i}" for i in range(MAX_REACHING)} and not reach.pending
        assert sorted(reached) == sorted(got)  # one lookup each, however many callers waited for it
        assert reach.status() == {"pending": 0, "reached": MAX_REACHING, "failed": 0, "busy": 1}
        assert ("s0", ["127.0.0.1:4000"], "view") in m.learned  # second-hand: the dialer's host backoff applies

    run(main)


def test_a_peer_not_reached_by_the_deadline_is_given_up_and_forgotten_by_the_lookup():
    m = FakeMembership()
    reach = Reach(m, timeout=8.0)

    async def main() -> None:
        t0 = trio.current_time()
        with pytest.raises(Unreachable, match="no session within 8 s"):
            await reach.session("slow", ["127.0.0.1:4000"])
        assert trio.current_time() - t0 == pytest.approx(8.0)
        assert not reach.wanted("slow") and reach.failed == 1

    run(main)


def test_a_lookup_ends_when_the_dialer_gave_up_and_is_not_made_while_it_backs_off():
    m = FakeMembership()
    reach = Reach(m, timeout=8.0)

    async def dial_and_fail() -> None:
        await trio.sleep(0.5)
        m.peers["down"].dialing = True
        await trio.sleep(1.0)
        info = m.peers["down"]
        info.dialing, info.failures, info.next_attempt = False, 1, trio.current_time() + 30.0

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(dial_and_fail)
            t0 = trio.current_time()
            with pytest.raises(Unreachable, match="every address failed"):
                await reach.session("down", ["127.0.0.1:4000"])
            assert trio.current_time() - t0 < 2.0
        with pytest.raises(Unreachable, match="backing off"):  # the dialer's backoff holds: not asked again
            await reach.session("down", ["127.0.0.1:4000"])
        assert len(m.learned) == 1 and reach.failed == 1

    run(main)


def test_a_peer_we_have_a_session_with_is_not_looked_up():
    m = FakeMembership()
    reach = Reach(m, timeout=8.0)

    async def main() -> None:
        s = m.connect(reach, "up")
        assert await reach.session("up", ["127.0.0.1:4000"]) is s
        assert not m.learned and reach.reached == 0

    run(main)


# ---- the pipeline's use of it -------------------------------------------------------------------------------

class PartialModeStub:
    """The partial views' answers the stage map reads (peer/membership/view_mode.py, ViewMode)."""

    def can_reach(self, addresses: list[str]) -> bool:
        return bool(addresses)


def service(*, partial: bool, connected: set[str], anns: dict[str, StageAnnouncement]) -> PipelineService:
    svc = object.__new__(PipelineService)  # the parts the stage map reads, without a daemon
    svc.me = "me"
    svc.server = SimpleNamespace(stage=None)
    svc.announcement = lambda: None  # ours: we serve none here
    svc.views = PartialModeStub() if partial else FullView(SimpleNamespace(
        router=SimpleNamespace(register=lambda *a: None), connected=lambda: {p: object() for p in connected}))
    svc.topology = SimpleNamespace(fresh_records=lambda: [SimpleNamespace(peer_id=p, stage=a) for p, a in anns.items()])
    svc.daemon = SimpleNamespace(membership=SimpleNamespace(connected=lambda: {p: object() for p in connected}))
    svc.drivers = {}
    svc.bans = BanList()
    return svc


ANNS = {"near": StageAnnouncement("p", 1, 2, cuts=[1], addresses=["127.0.0.1:1"]),
        "far": StageAnnouncement("p", 1, 2, cuts=[1], addresses=["127.0.0.1:2"]),
        "mute": StageAnnouncement("p", 1, 2, cuts=[1])}  # no address: only a session makes it live


def test_under_partial_views_the_stage_map_counts_servers_we_can_dial():
    svc = service(partial=True, connected={"near"}, anns=ANNS)
    assert [p.peer_id for p in svc.stage_map(KEY)[1]] == ["far", "near"]
    svc.server = SimpleNamespace(stage=SimpleNamespace(key=KEY, stage=1))

    async def partners() -> set[str]:
        return svc.stage_partners()
    assert trio.run(partners) == {"near"}  # a stage's averaging stays with the peers we have a session with


def test_under_full_views_the_stage_map_is_the_connected_servers_as_before():
    svc = service(partial=False, connected={"near"}, anns=ANNS)
    assert [p.peer_id for p in svc.stage_map(KEY)[1]] == ["near"]
    assert trio.run(svc.reach, "far") is None  # no lookup: the driver fails the call as before ("no session")


class Unreached:
    """A service whose lookups fail the way `exc` says."""

    def __init__(self, exc: Exception):
        self.cfg, self.me, self.exc = PipelineSection(), "me", exc

    def session_of(self, pid):
        return None

    async def reach(self, pid):
        raise self.exc


def call_once(exc: Exception):
    driver = Driver(Unreached(exc), KEY, reply_shapes=lambda *a: [], rng=random.Random(0))
    peer = StagePeer("far", 1, 0.0, 0)
    return trio.run(driver._call_once, "far", peer, None, 1, "forward", [])


def test_a_driver_treats_a_full_lookup_as_busy_and_an_unreached_server_as_failing():
    with pytest.raises(Refused) as e:  # TRY_LATER: avoided briefly, no attempt used
        call_once(ReachBusy("4 peers are being reached already"))
    assert e.value.code == Code.BUSY
    with pytest.raises(_CallFailed, match="not reached: no session within 8 s"):  # avoided for a growing while
        call_once(Unreachable("no session within 8 s"))


def test_the_sessions_kept_are_those_a_call_is_out_on_either_way():
    svc = service(partial=True, connected=set(), anns={})
    svc.server = StageServer(PipelineSection())
    driver = Driver(SimpleNamespace(cfg=PipelineSection(), me="me"), KEY, reply_shapes=lambda *a: [])
    svc.drivers = {"p": driver}
    b = driver.balancers[1]
    assert b.choose([StagePeer("far", 1, 0.0, 0)], 8, 0.0) == "far"
    assert svc.keeps_session("far") and not svc.keeps_session("near")
    b.done("far", 8, 0.1, 0.1)
    assert not svc.keeps_session("far")  # no call out: the view driver closes it once idle, as any session
    svc.server.per_peer["caller"] += 1  # a call of `caller` held at our stage, however long its compute
    assert svc.keeps_session("caller")
    svc.server.per_peer["caller"] -= 1
    assert not svc.keeps_session("caller")

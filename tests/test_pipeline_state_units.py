"""Pipeline units for issue 17: stage moves, copies and state transfers on the wire, who may fetch a stage's
state, the copies a daemon keeps (on disk by default: peer/pipeline/copies.py), serving them, and what our
announcement says of them (tests/test_pipeline_units.py has the balancer, directory, server and call messages)."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trio

from peer.config import PipelineSection, TopologySection
from peer.home import Home
from peer.membership.view_mode import FullView
from peer.pipeline.server import ServedStage, StageServer
from peer.pipeline.service import PipelineService
from peer.pipeline.copies import COPY_SUFFIX, KeptCopy, copy_file, snapshot_file
from peer.pipeline.state_transfer import StageStates
from peertrain.pipeline import CopyUnreadable, PipelineKey
from protocol.schema.pipeline import BlockProfile
from protocol import identity as ident
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.refusal import Code
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.gossip import TensorSpec
from protocol.schema.pipeline import (MAX_COPIES, MAX_STAGES, MAX_STATE_TENSORS, MAX_STEP, StageAnnouncement,
                                      StageCopy, StageStateReply, StageStateRequest)
from protocol.schema.session import ErrorReply
from protocol.schema.topology import TopologyRecord, topology_record_signing_bytes
from tests.test_pipeline_units import KEY, Handler, ann, record, roundtrip, tampered

# ---- wire: a stage's moves, copies and state transfers ------------------------------------------------------

def moving(**kw) -> StageAnnouncement:
    """Stage 1 of KEY, moving to stage 2, having left stage 0, keeping copies of stages 0 and 3."""
    d = dict(pipeline="shakespeare", stage=1, stages=4, cuts=[2, 5, 8], samples_per_s=3.5, queue=1, step=120,
             moving_to=2, moved_from=0, copies=[StageCopy(0, 100), StageCopy(3, 90)])
    return StageAnnouncement(**{**d, **kw})


def state_reply(**kw) -> StageStateReply:
    d = dict(tensors=[TensorSpec("m/0.weight", "float32", [4, 4]), TensorSpec("o/0.weight.exp_avg", "float32", [4, 4]),
                      TensorSpec("o/0.weight.step:num", "float32", [])], streams=[1, 3, 5], step=42, samples=336,
             live=False)
    return StageStateReply(**{**d, **kw})


def test_moves_copies_and_state_transfers_round_trip():
    rec = record(moving())
    assert roundtrip(rec) == rec and roundtrip(rec).stage.copies == [StageCopy(0, 100), StageCopy(3, 90)]
    full = moving(stages=6, cuts=[2, 5, 8, 9, 10], step=MAX_STEP, moving_to=5,
                  copies=[StageCopy(s, MAX_STEP) for s in (0, 2, 3, 4)][:MAX_COPIES])  # every field at its bound
    assert roundtrip(record(full)) == record(full)
    req = StageStateRequest("shakespeare", 3, [2, 5, 8])
    assert roundtrip(req) == req
    for r in (state_reply(), state_reply(tensors=[], streams=[], step=0, live=True)):
        assert roundtrip(r) == r


@pytest.mark.parametrize("field, value", [
    ("moving_to", 1),  # its own stage
    ("moving_to", 4),
    ("moving_to", -2),
    ("moved_from", 1),
    ("moved_from", 4),
    ("moved_from", -2),
    ("step", -1),
    ("step", MAX_STEP + 1),
    ("copies", [StageCopy(0, 1)] * (MAX_COPIES + 1)),
    ("copies", [StageCopy(4, 1)]),  # a stage the pipeline does not have
])
def test_a_move_or_copy_out_of_range_is_refused_by_the_sender_and_on_decode(field, value):
    with pytest.raises(ValueError):
        moving(**{field: value})
    wire = [{"stage": c.stage, "step": c.step} for c in value] if field == "copies" else value
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(record(moving()), ["stage", field], wire), DEFAULT_LIMITS)


@pytest.mark.parametrize("copy", [{"stage": -1, "step": 0}, {"stage": MAX_STAGES, "step": 0},
                                  {"stage": 0, "step": -1}, {"stage": 0, "step": MAX_STEP + 1},
                                  {"stage": 0}, {"stage": "0", "step": 0}])
def test_a_stage_copy_out_of_range_is_a_protocol_error(copy):
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(record(moving()), ["stage", "copies"], [copy]), DEFAULT_LIMITS)


@pytest.mark.parametrize("path, value", [
    (["pipeline"], ""),
    (["pipeline"], "x" * 65),
    (["stage"], -1),
    (["stage"], MAX_STAGES),
    (["cuts"], list(range(1, MAX_STAGES + 1))),
])
def test_a_stage_state_request_out_of_range_is_a_protocol_error(path, value):
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(StageStateRequest("shakespeare", 1, [2, 5, 8]), path, value), DEFAULT_LIMITS)


@pytest.mark.parametrize("path, value", [
    (["streams"], [1, 3]),  # one stream short of the specs
    (["step"], -1),
    (["step"], MAX_STEP + 1),
    (["samples"], -1),
    (["samples"], MAX_STEP + 1),
    (["live"], "yes"),
])
def test_a_stage_state_reply_out_of_range_is_a_protocol_error(path, value):
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(state_reply(), path, value), DEFAULT_LIMITS)


def test_a_stage_state_reply_is_bounded_in_tensors():
    specs = [TensorSpec(f"m/{i}", "float32", [1]) for i in range(MAX_STATE_TENSORS + 1)]
    with pytest.raises(ValueError, match="at most"):
        StageStateReply(tensors=specs, streams=list(range(len(specs))), step=0)
    StageStateReply(tensors=specs[:-1], streams=list(range(len(specs) - 1)), step=0)  # the bound itself is fine


@pytest.mark.parametrize("change", [dict(moving_to=3), dict(moving_to=-1), dict(moved_from=-1), dict(step=121),
                                    dict(copies=[StageCopy(0, 100)]),
                                    dict(copies=[StageCopy(0, 101), StageCopy(3, 90)]),
                                    dict(copies=[StageCopy(3, 90), StageCopy(0, 100)])])
def test_a_records_signature_covers_its_moves_and_copies(change):
    key = ident.generate_identity()
    rec = record(moving())
    signed = TopologyRecord(**{**{f: getattr(rec, f) for f in rec.__dataclass_fields__},
                               "public_key": ident.public_key_bytes(key)})
    sig = ident.sign(key, topology_record_signing_bytes(signed))
    assert ident.verify(signed.public_key, sig, topology_record_signing_bytes(signed))
    forged = TopologyRecord(**{**{f: getattr(signed, f) for f in signed.__dataclass_fields__},
                               "stage": moving(**change)})
    assert topology_record_signing_bytes(forged) != topology_record_signing_bytes(signed)
    assert not ident.verify(forged.public_key, sig, topology_record_signing_bytes(forged))


# ---- stage states: who may fetch, the copies kept ----------------------------------------------------------

OTHER_CUT = PipelineKey("shakespeare", (3, 5, 8))


class FakeService:
    """What StageStates reads of the pipeline service: who announces what, and the stage we serve."""

    def __init__(self, anns: dict[str, StageAnnouncement], serving: ServedStage | None):
        self._anns = anns
        self.server = SimpleNamespace(stage=serving)

    def announcements(self) -> dict[str, StageAnnouncement]:
        return self._anns


@pytest.fixture
def copies_dir(tmp_path) -> Path:
    return tmp_path / "stage-copies"


@pytest.fixture
def states(copies_dir) -> StageStates:
    anns = {"member": ann(0), "member2": ann(3), "recut": ann(0, cuts=(3, 5, 8)), "stranger": ann(0, name="other")}
    return StageStates(FakeService(anns, ServedStage(KEY, 1, 16, Handler())), PipelineSection(max_state_uploads=2),
                       copies_dir)


def state_request(stage: int, key: PipelineKey = KEY) -> StageStateRequest:
    return StageStateRequest(key.name, stage, list(key.cuts))


def named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A small stage state as export_state gives it: weights, optimizer moments, a step count, other dtypes."""
    g = torch.Generator().manual_seed(seed)
    return [("m/0.weight", torch.randn(4, 4, generator=g)), ("m/0.bias", torch.randn(4, generator=g).to(torch.bfloat16)),
            ("o/0.weight/exp_avg", torch.randn(4, 4, generator=g)), ("o/0.weight/step", torch.tensor(float(seed + 3))),
            ("m/tok", torch.randint(0, 1 << 40, (3,), generator=g, dtype=torch.int64))]


def keep(states: StageStates, key: PipelineKey, stage: int, step: int = 7, *, in_memory: bool = False,
         tensors=None) -> KeptCopy:
    return trio.run(partial(states.keep, key, stage, named(step) if tensors is None else tensors, step, step * 8,
                            in_memory=in_memory))


def drop(states: StageStates, key: PipelineKey, stage: int) -> None:
    trio.run(states.drop, key, stage)


def files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


def assert_bit_exact(got, want) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (n, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device.type == "cpu", n
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), n


def test_the_served_stage_and_a_kept_copy_go_to_a_member(states):
    assert states.refusal(state_request(1), "member") is None  # the stage we serve, live
    assert states.refusal(state_request(3), "member").code is Code.NO_STATE
    keep(states, KEY, 3)
    assert states.refusal(state_request(3), "member2") is None  # a copy we keep


@pytest.mark.parametrize("peer_id", ["nobody", "recut", "stranger"])
def test_only_a_peer_announcing_a_stage_of_the_same_pipeline_and_cut_may_fetch(states, peer_id):
    refused = states.refusal(state_request(1), peer_id)
    assert refused.code is Code.NOT_A_MEMBER and "same cut" in refused.reason


def test_a_member_asking_for_a_state_we_do_not_hold_gets_no_state(states, tmp_path):
    keep(states, OTHER_CUT, 2)  # a copy of stage 2, of another cut
    refused = states.refusal(state_request(2), "member")
    assert refused.code is Code.NO_STATE and "stage 2" in refused.reason
    # a recut peer asking for the other cut's stage 1: we serve stage 1, but of KEY's cut
    recut = StageStates(FakeService({"recut": ann(0, cuts=(3, 5, 8))}, ServedStage(KEY, 1, 16, Handler())),
                        PipelineSection(), tmp_path / "recut")
    assert recut.refusal(state_request(1, OTHER_CUT), "recut").code is Code.NO_STATE
    assert StageStates(FakeService({"member": ann(0)}, None), PipelineSection(), tmp_path / "none").refusal(
        state_request(1), "member").code is Code.NO_STATE  # serving nothing, keeping nothing


def test_uploads_are_capped_per_daemon_and_one_per_peer(states):
    states.uploads, states.per_peer["member"] = 1, 1
    refused = states.refusal(state_request(1), "member")
    assert refused.code is Code.BUSY and "one stage state per peer" in refused.reason
    assert states.refusal(state_request(1), "member2") is None  # one each
    states.uploads, states.per_peer["member2"] = 2, 1
    refused = states.refusal(state_request(1), "member2")
    assert refused.code is Code.BUSY and "the most this peer sends at once" in refused.reason
    del states.per_peer["member"], states.per_peer["member2"]
    assert states.refusal(state_request(1), "member").code is Code.BUSY  # the daemon's cap, whoever asks
    states.uploads = 1
    assert states.refusal(state_request(1), "member") is None


def test_a_refused_request_is_answered_with_its_code_and_counted(states):
    import trio

    replies = []

    class Session:
        peer_id = "stranger"

        async def reply(self, env, msg):
            replies.append(msg)

    async def main():
        async with trio.open_nursery() as n:
            await states.on_request(Session(), SimpleNamespace(message=state_request(1)), n)

    trio.run(main)
    [err] = replies
    assert isinstance(err, ErrorReply) and err.refusal().code is Code.NOT_A_MEMBER
    assert states.stats.refused == {"not_a_member": 1} and states.uploads == 0 and not states.per_peer
    assert states.status()["refused"] == {"not_a_member": 1}


@pytest.mark.parametrize("in_memory", [False, True])
def test_keep_replaces_a_stages_copy_and_evicts_the_oldest_past_max_copies(states, copies_dir, in_memory):
    def on_disk() -> set[str]:
        return {p.name for p in (c.path for c in states.copies.values()) if p is not None}

    for s in range(4):
        keep(states, KEY, s, in_memory=in_memory)
    keep(states, KEY, 2, step=9, in_memory=in_memory)  # a fresher copy of stage 2 replaces the old one
    assert len(states.copies) == 4 and states.copies[(KEY, 2)].step == 9
    keep(states, OTHER_CUT, 0, in_memory=in_memory)  # a fifth: the oldest (KEY's stage 0, kept first) goes
    assert len(states.copies) == MAX_COPIES and (KEY, 0) not in states.copies and (OTHER_CUT, 0) in states.copies
    keep(states, OTHER_CUT, 1, in_memory=in_memory)
    assert set(states.copies) == {(KEY, 2), (KEY, 3), (OTHER_CUT, 0), (OTHER_CUT, 1)}  # then stage 1 (kept second)
    assert set(files(copies_dir)) == on_disk() and len(on_disk()) == (0 if in_memory else 4)  # evicted: file gone
    drop(states, KEY, 3)
    drop(states, KEY, 3)  # dropping what is not kept is fine
    assert set(states.copies) == {(KEY, 2), (OTHER_CUT, 0), (OTHER_CUT, 1)}
    assert set(files(copies_dir)) == on_disk() and copy_file(copies_dir, KEY, 3).name not in on_disk()


def test_announced_copies_leave_out_the_served_stage_and_other_pipelines(states):
    keep(states, KEY, 3, step=5)
    keep(states, KEY, 0, step=MAX_STEP + 10, tensors=named())
    keep(states, KEY, 1)
    keep(states, OTHER_CUT, 2)
    assert states.announced(KEY, serving=1) == [StageCopy(0, MAX_STEP), StageCopy(3, 5)]  # by stage, step bounded
    assert states.announced(OTHER_CUT, serving=0) == [StageCopy(2, 7)]
    assert states.announced(PipelineKey("other", (2, 5, 8)), serving=0) == []
    assert sorted(c["stage"] for c in states.status()["copies"]) == [0, 1, 2, 3]


class StepsHandler(Handler):
    steps = 120

    def samples_per_s(self):
        return 4.0


def test_our_announcement_carries_step_move_and_copies_and_drops_a_stale_move(copies_dir):
    svc = object.__new__(PipelineService)  # the parts announcement() reads, without a daemon
    svc.views = FullView(SimpleNamespace(router=SimpleNamespace(register=lambda *a: None)))  # no addresses announced
    svc.server = StageServer(PipelineSection())
    svc.server.stage = ServedStage(KEY, 1, 16, StepsHandler())
    svc.states = StageStates(svc, PipelineSection(), copies_dir)
    keep(svc.states, KEY, 0, step=100)
    keep(svc.states, KEY, 1, step=50, in_memory=True)  # the stage we serve again: not announced as a copy
    svc.moving_to, svc.seating = 2, SimpleNamespace(cooling_from=0)
    svc.profiles, svc.memory_mib, svc.stage_room_mib = [BlockProfile(3, 0.01, 1024, 4096)], 900, 500
    a = svc.announcement()
    assert (a.profiles, a.memory_mib, a.stage_room_mib) == (svc.profiles, 900, 500) and a.memory_used_mib > 0
    assert (a.stage, a.step, a.moving_to, a.moved_from, a.samples_per_s) == (1, 120, 2, 0, 4.0)
    assert a.copies == [StageCopy(0, 100)]
    svc.moving_to, svc.seating.cooling_from = 1, 7  # stale: we serve stage 1 now; no stage 7 in this pipeline
    a = svc.announcement()
    assert (a.moving_to, a.moved_from) == (-1, -1)
    assert roundtrip(record(a)) == record(a)


# ---- copies on disk (peer/pipeline/copies.py) ------------------------------------------------------------

def test_a_copy_is_kept_on_disk_by_default_and_loads_back_bit_exact(states, copies_dir):
    want = named(5)
    copy = keep(states, KEY, 3, step=5, tensors=want)
    assert copy.on_disk and copy.held is None and copy.path == copy_file(copies_dir, KEY, 3)
    assert files(copies_dir) == [copy.path.name] and copy.path.name.endswith(COPY_SUFFIX)
    assert copy.path.stat().st_mode & 0o777 == 0o600  # like a checkpoint: the home's owner only
    assert copy.nbytes == sum(t.numel() * t.element_size() for _, t in want)
    assert copy.specs == [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in want]
    tensors, step, samples = copy.load()
    assert (step, samples) == (5, 40)
    assert_bit_exact(tensors, want)
    assert all(a is not b for (_, a), (_, b) in zip(tensors, want))  # fresh tensors, not the caller's
    [row] = states.status()["copies"]
    assert row["where"] == "disk" and row["mb"] == round(copy.nbytes / 1e6, 2) and row["stage"] == 3


def test_a_copy_in_memory_holds_the_tensors_given_and_writes_nothing(states, copies_dir):
    want = named(2)
    copy = keep(states, KEY, 3, step=2, tensors=want, in_memory=True)
    assert not copy.on_disk and files(copies_dir) == []
    tensors, step, samples = copy.load()
    assert (step, samples) == (2, 16) and all(a is b for (_, a), (_, b) in zip(tensors, want))
    assert states.status()["copies"][0]["where"] == "memory"


def test_a_pipeline_name_of_any_characters_makes_one_file_per_cut_and_stage(copies_dir):
    odd = PipelineKey("../../etc/x y\u00e9", (2, 5, 8))
    paths = {copy_file(copies_dir, k, s) for k in (KEY, OTHER_CUT, odd) for s in range(4)}
    assert len(paths) == 12 and all(p.parent == copies_dir and "/" not in p.name for p in paths)


def test_a_newer_copy_of_a_stage_replaces_its_file_atomically(states, copies_dir, monkeypatch):
    old = keep(states, KEY, 3, step=5)
    new = keep(states, KEY, 3, step=9)  # the same file, replaced by rename: never a torn one
    assert new.path == old.path and files(copies_dir) == [new.path.name] and states.copies[(KEY, 3)] is new
    tensors, step, _ = new.load()
    assert step == 9
    assert_bit_exact(tensors, named(9))
    assert old.load()[1] == 9  # a reader still holding the old record reads the file as it is now, and says so

    def full_disk(obj, f):  # half a file written, then the disk is full
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        keep(states, KEY, 3, step=11)
    assert files(copies_dir) == [new.path.name] and states.copies[(KEY, 3)] is new  # no temp file left behind
    tensors, step, _ = new.load()
    assert step == 9
    assert_bit_exact(tensors, named(9))  # the copy kept before is whole


def test_a_copy_in_memory_replacing_one_on_disk_removes_its_file_and_back(states, copies_dir):
    keep(states, KEY, 3)
    keep(states, KEY, 3, in_memory=True)
    assert files(copies_dir) == []
    keep(states, KEY, 3)
    assert files(copies_dir) == [copy_file(copies_dir, KEY, 3).name]
    drop(states, KEY, 3)
    assert files(copies_dir) == [] and not states.copies


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.unlink(), "its file is gone"),
    (lambda p: p.write_bytes(b"not a zip file at all"), "not a file torch.save wrote"),
    (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "not a file torch.save wrote"),  # torn
    (lambda p: p.write_bytes(p.read_bytes().replace(b"PK\x01\x02", b"PK\x01\x03", 1)), "cannot read checkpoint"),
    (lambda p: torch.save({"format": 1, "pipeline": KEY.name, "cuts": list(KEY.cuts), "stage": 2, "step": 1,
                           "samples": 1, "names": [], "tensors": []}, p), "the file holds stage 2"),
    (lambda p: torch.save({"format": 1, "pipeline": KEY.name, "cuts": list(KEY.cuts), "stage": 3, "step": 1,
                           "samples": 1, "names": [n for n, _ in named()], "tensors": [t.double() for _, t in named()]},
                          p), "does not hold the tensors kept"),
    (lambda p: torch.save({"format": 1, "pipeline": KEY.name, "cuts": list(KEY.cuts), "stage": 3, "step": -4,
                           "samples": 1, "names": [], "tensors": []}, p), "its step is -4"),
    (lambda p: torch.save([1, 2], p), "not a stage copy"),
    (lambda p: torch.save({"format": 1, "x": SimpleNamespace()}, p), "loading it could run code"),
])
def test_a_missing_or_bad_file_is_a_clear_error_and_the_copy_is_forgotten(states, copies_dir, damage, reason):
    copy = keep(states, KEY, 3)
    damage(copy.path)
    with pytest.raises(CopyUnreadable, match=reason) as err:
        copy.load()
    assert str(copy.path) in str(err.value) and "stage 3" in str(err.value) and copy.unreadable == str(err.value)
    assert states.announced(KEY, serving=1) == []  # no longer offered to the swarm
    assert states.get(KEY, 3) is None and not states.copies and states.status()["copies_unreadable"] == 1
    drop(states, KEY, 0)  # the next keep or drop removes what is left of its file
    assert files(copies_dir) == []


def test_files_an_earlier_run_left_are_removed_at_start(copies_dir, tmp_path):
    copies_dir.mkdir(parents=True)
    for name in ("shakespeare-0123-stage1" + COPY_SUFFIX, ".x.copy.pt.abc.tmp"):  # a copy, a crash's temp file
        (copies_dir / name).write_bytes(b"old")
    (copies_dir / "sub").mkdir()
    StageStates(FakeService({}, None), PipelineSection(), copies_dir)
    assert files(copies_dir) == ["sub"]
    StageStates(FakeService({}, None), PipelineSection(), tmp_path / "never-made")  # no folder yet: fine


class ServeSession:
    """What `_serve` uses of a session: it records the reply and the tensors sent."""

    peer_id, short = "member2", "member2"

    def __init__(self):
        self.replies, self.sent, self._next = [], [], 1

    async def reply(self, env, msg):
        self.replies.append(msg)

    def new_stream_id(self) -> int:
        self._next += 2
        return self._next

    async def send_tensor(self, name, array, *, codec, stream):
        self.sent.append((name, array))

    async def call_off(self, streams, reason):
        pass


def serve(states: StageStates, stage: int) -> ServeSession:
    session = ServeSession()

    async def main():
        async with trio.open_nursery() as n:
            await states.on_request(session, SimpleNamespace(message=state_request(stage)), n)

    trio.run(main)
    assert states.uploads == 0 and not states.per_peer  # every ending gives its slot back
    return session


def test_a_copy_on_disk_is_served_from_its_file(states):
    keep(states, KEY, 3, step=6)
    session = serve(states, 3)
    [reply] = session.replies
    assert isinstance(reply, StageStateReply) and (reply.step, reply.samples, reply.live) == (6, 48, False)
    assert [(s.name, s.dtype, list(s.shape)) for s in reply.tensors] == \
        [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named(6)]
    assert_bit_exact(session.sent, named(6))
    assert states.stats.served == 1


class LiveHandler(Handler):
    """The stage we serve: hands its tensors themselves to `write_state`'s writer, as StageWorker does."""

    def __init__(self, tensors, step):
        self.tensors, self.step, self.writes = tensors, step, 0

    def write_state(self, write):
        self.writes += 1
        write(self.tensors, self.step, self.step * 8)


def test_the_served_stage_is_sent_from_a_snapshot_file_that_goes_when_the_transfer_ends(states, copies_dir):
    """No copy of a live stage's state in memory beside it (copies.py): it is written to a file under the stage's
    lock and sent from the file's pages; the file is removed once sent."""
    live = LiveHandler(named(9), 9)
    states.service.server.stage = ServedStage(KEY, 1, 16, live)
    seen_files: list[list[str]] = []

    class Watching(ServeSession):
        async def send_tensor(self, name, array, *, codec, stream):
            seen_files.append(files(copies_dir))
            await super().send_tensor(name, array, codec=codec, stream=stream)

    session = Watching()

    async def main():
        async with trio.open_nursery() as n:
            await states.on_request(session, SimpleNamespace(message=state_request(1)), n)

    trio.run(main)
    [reply] = session.replies
    assert isinstance(reply, StageStateReply) and (reply.step, reply.samples, reply.live) == (9, 72, True)
    assert live.writes == 1 and states.stats.served == 1 and states.uploads == 0
    assert_bit_exact(session.sent, named(9))
    mine = {t.data_ptr() for _, t in live.tensors}
    assert not any(t.data_ptr() in mine for _, t in session.sent)  # what went out is the file's, not the stage's
    assert all(f == [snapshot_file(copies_dir, 0).name] for f in seen_files) and seen_files  # sent from the file
    assert files(copies_dir) == []  # and the file is gone
    serve(states, 1)
    assert live.writes == 2 and files(copies_dir) == []  # each transfer its own snapshot


def test_a_copy_whose_file_is_bad_is_refused_with_a_reason_not_a_crash(states, caplog):
    copy = keep(states, KEY, 3)
    copy.path.write_bytes(b"garbage")
    session = serve(states, 3)
    [err] = session.replies
    assert isinstance(err, ErrorReply) and err.refusal().code is Code.NO_STATE
    assert "copy of stage 3 cannot be read" in err.refusal().reason and str(copy.path) not in err.refusal().reason
    assert any(str(copy.path) in r.getMessage() for r in caplog.records)  # the path is in our log, not the reply
    assert states.stats.served == 0 and states.get(KEY, 3) is None
    assert states.refusal(state_request(3), "member2").code is Code.NO_STATE  # asked again: we keep none now


def test_the_pipeline_service_keeps_copies_in_its_homes_folder_and_empties_it_at_start(tmp_path):
    home = Home(tmp_path / "home")
    home.stage_copies.mkdir(parents=True)
    (home.stage_copies / f"left-by-an-earlier-run{COPY_SUFFIX}").write_bytes(b"old")
    daemon = SimpleNamespace(config=SimpleNamespace(pipeline=PipelineSection(), topology=TopologySection()),
                             peer_id="me", home=home,
                             router=SimpleNamespace(register=lambda *a: None),
                             membership=SimpleNamespace(views=None))
    svc = PipelineService(daemon, SimpleNamespace(announce_soon=lambda: None))
    assert files(home.stage_copies) == []
    trio.run(partial(svc.keep_copy, KEY, 2, named(3), 3, 24))
    copy = svc.copy_of(KEY, 2)
    assert copy.on_disk and copy.path.parent == home.stage_copies and copy.step == 3
    assert_bit_exact(copy.load()[0], named(3))
    trio.run(partial(svc.keep_copy, KEY, 1, named(4), 4, 32, in_memory=True))
    assert not svc.copy_of(KEY, 1).on_disk and files(home.stage_copies) == [copy.path.name]
    trio.run(svc.drop_copy, KEY, 2)
    assert svc.copy_of(KEY, 2) is None and files(home.stage_copies) == []


# ---- a peer joining a stage starts from the freshest state a peer holds (trainers/pipeline/seat.py) ----------

class _JoinSwarm:
    """What `StageSeat.join_stage` asks of the swarm: the stage's sources, our own copy (none), one fetch."""

    def __init__(self, sources):
        self._sources, self.fetched, self.lines, self.ready = sources, [], [], False

    def state_sources(self, key, stage):
        return self._sources

    def stage_copy(self, key, stage):
        return None

    def fetch_stage_state(self, key, stage, peer_id, check):
        from peertrain.pipeline import FetchedState
        self.fetched.append(peer_id)
        return FetchedState(tensors={}, step=self._sources[0].step, samples=0, live=False, source=peer_id, nbytes=0,
                            seconds=0.0)

    def log(self, fmt, *args):
        self.lines.append(fmt % args)

    def should_stop(self):
        return False

    def stage_ready(self):
        self.ready = True


@pytest.mark.parametrize("live", [True, False])
def test_a_joiner_starts_from_the_freshest_state_live_or_a_copy(live):
    """A restarted peer placed on a stage whose last peer was killed must load the freshest copy, not serve its
    untrained blocks (it did: only live peers were asked)."""
    from peertrain.pipeline import StateSource
    from trainers.pipeline.seat import StageSeat

    swarm = _JoinSwarm([StateSource("holder", 59, live)])
    worker = SimpleNamespace(steps=0, check_state_specs=None)
    worker.import_state = lambda tensors, step, samples: setattr(worker, "steps", step)
    seat = StageSeat.__new__(StageSeat)  # only what join_stage touches
    seat.swarm, seat.worker, seat.stage, seat.key = swarm, worker, 0, PipelineKey("p", (1,))
    seat._share = lambda: None
    seat.tell_daemon = lambda: None
    seat.join_stage()
    assert swarm.fetched == ["holder"] and worker.steps == 59 and swarm.ready
    assert any("joined stage 0 at its step 59" in line for line in swarm.lines)

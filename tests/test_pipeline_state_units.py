"""Pipeline units for issue 17: stage moves, copies and state transfers on the wire, who may fetch a stage's
state, the copies a daemon keeps, and what our announcement says of them (tests/test_pipeline_units.py has the
balancer, directory, server and call messages)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from peer.config import PipelineSection
from peer.pipeline.directory import PipelineKey
from peer.pipeline.server import ServedStage, StageServer
from peer.pipeline.service import PipelineService
from protocol.schema.pipeline import BlockProfile
from peer.pipeline.state import KeptCopy, StageStates
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
def states() -> StageStates:
    anns = {"member": ann(0), "member2": ann(3), "recut": ann(0, cuts=(3, 5, 8)), "stranger": ann(0, name="other")}
    return StageStates(FakeService(anns, ServedStage(KEY, 1, 16, Handler())), PipelineSection(max_state_uploads=2))


def state_request(stage: int, key: PipelineKey = KEY) -> StageStateRequest:
    return StageStateRequest(key.name, stage, list(key.cuts))


def kept(key: PipelineKey, stage: int, at: float, step: int = 7) -> KeptCopy:
    return KeptCopy(key, stage, [("m/0.weight", None)], step, step * 8, kept_at=at)


def test_the_served_stage_and_a_kept_copy_go_to_a_member(states):
    assert states.refusal(state_request(1), "member") is None  # the stage we serve, live
    assert states.refusal(state_request(3), "member").code is Code.NO_STATE
    states.keep(kept(KEY, 3, 1.0))
    assert states.refusal(state_request(3), "member2") is None  # a copy we keep


@pytest.mark.parametrize("peer_id", ["nobody", "recut", "stranger"])
def test_only_a_peer_announcing_a_stage_of_the_same_pipeline_and_cut_may_fetch(states, peer_id):
    refused = states.refusal(state_request(1), peer_id)
    assert refused.code is Code.NOT_A_MEMBER and "same cut" in refused.reason


def test_a_member_asking_for_a_state_we_do_not_hold_gets_no_state(states):
    states.keep(kept(OTHER_CUT, 2, 1.0))  # a copy of stage 2, of another cut
    refused = states.refusal(state_request(2), "member")
    assert refused.code is Code.NO_STATE and "stage 2" in refused.reason
    # a recut peer asking for the other cut's stage 1: we serve stage 1, but of KEY's cut
    recut = StageStates(FakeService({"recut": ann(0, cuts=(3, 5, 8))}, ServedStage(KEY, 1, 16, Handler())),
                        PipelineSection())
    assert recut.refusal(state_request(1, OTHER_CUT), "recut").code is Code.NO_STATE
    assert StageStates(FakeService({"member": ann(0)}, None), PipelineSection()).refusal(
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


def test_keep_replaces_a_stages_copy_and_evicts_the_oldest_past_max_copies(states):
    for s in range(4):
        states.keep(kept(KEY, s, float(s)))
    states.keep(kept(KEY, 2, 10.0, step=9))  # a fresher copy of stage 2 replaces the old one
    assert len(states.copies) == 4 and states.copies[(KEY, 2)].step == 9
    states.keep(kept(OTHER_CUT, 0, 11.0))  # a fifth: the oldest (KEY's stage 0, kept at 0) goes
    assert len(states.copies) == MAX_COPIES and (KEY, 0) not in states.copies and (OTHER_CUT, 0) in states.copies
    states.keep(kept(OTHER_CUT, 1, 12.0))
    assert set(states.copies) == {(KEY, 2), (KEY, 3), (OTHER_CUT, 0), (OTHER_CUT, 1)}  # then stage 1 (kept at 1)
    states.drop(KEY, 3)
    states.drop(KEY, 3)  # dropping what is not kept is fine
    assert set(states.copies) == {(KEY, 2), (OTHER_CUT, 0), (OTHER_CUT, 1)}


def test_announced_copies_leave_out_the_served_stage_and_other_pipelines(states):
    states.keep(kept(KEY, 3, 1.0, step=5))
    states.keep(kept(KEY, 0, 2.0, step=MAX_STEP + 10))
    states.keep(kept(KEY, 1, 3.0))
    states.keep(kept(OTHER_CUT, 2, 4.0))
    assert states.announced(KEY, serving=1) == [StageCopy(0, MAX_STEP), StageCopy(3, 5)]  # by stage, step bounded
    assert states.announced(OTHER_CUT, serving=0) == [StageCopy(2, 7)]
    assert states.announced(PipelineKey("other", (2, 5, 8)), serving=0) == []
    assert sorted(c["stage"] for c in states.status()["copies"]) == [0, 1, 2, 3]


class StepsHandler(Handler):
    steps = 120

    def samples_per_s(self):
        return 4.0


def test_our_announcement_carries_step_move_and_copies_and_drops_a_stale_move():
    svc = object.__new__(PipelineService)  # the parts announcement() reads, without a daemon
    svc.server = StageServer(PipelineSection())
    svc.server.stage = ServedStage(KEY, 1, 16, StepsHandler())
    svc.states = StageStates(svc, PipelineSection())
    svc.states.keep(kept(KEY, 0, 1.0, step=100))
    svc.states.keep(kept(KEY, 1, 2.0, step=50))  # the stage we serve again: not announced as a copy
    svc.moving_to, svc.moved_from = 2, 0
    svc.profiles, svc.memory_mib, svc.stage_room_mib = [BlockProfile(3, 0.01, 1024, 4096)], 900, 500
    a = svc.announcement()
    assert (a.profiles, a.memory_mib, a.stage_room_mib) == (svc.profiles, 900, 500) and a.memory_used_mib > 0
    assert (a.stage, a.step, a.moving_to, a.moved_from, a.samples_per_s) == (1, 120, 2, 0, 4.0)
    assert a.copies == [StageCopy(0, 100)]
    svc.moving_to, svc.moved_from = 1, 7  # stale: we serve stage 1 now; no stage 7 in this pipeline
    a = svc.announcement()
    assert (a.moving_to, a.moved_from) == (-1, -1)
    assert roundtrip(record(a)) == record(a)

"""The swarm pipeline's parts without daemons: the balancer under a simulated clock, the stage directory, a
stage server's refusals, the pipeline messages' range checks on the wire, and a stage state's holder: who
it serves, the copies it keeps and announces."""

from __future__ import annotations

import heapq
import random
from types import SimpleNamespace

import msgpack
import pytest

from peer.config import PipelineSection
from peer.pipeline.balancer import DEFAULT_SECONDS_PER_SAMPLE, Balancer
from peer.pipeline.directory import PipelineKey, StagePeer, bottleneck, capacity, stage_map
from peer.pipeline.server import ServedStage, StageServer
from peer.pipeline.service import PipelineService
from peer.pipeline.state import KeptCopy, StageStates
from protocol import identity as ident
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.gossip import TensorSpec
from protocol.schema.pipeline import (MAX_COPIES, MAX_QUEUE, MAX_SAMPLES_PER_S, MAX_STAGE_TENSORS, MAX_STAGES,
                                      MAX_STATE_TENSORS, MAX_STEP, StageAnnouncement, StageCall, StageCopy, StageReply,
                                      StageStateReply, StageStateRequest)
from protocol.schema.session import ErrorReply
from protocol.schema.topology import TopologyRecord, topology_record_signing_bytes

BATCH = 8


def peer(pid: str, stage: int = 0, rate: float = 0.0, queue: int = 0) -> StagePeer:
    return StagePeer(pid, stage, rate, queue)


# ---- balancer -------------------------------------------------------------------------------------------

def simulate(service_s_per_sample: dict[str, float], *, in_flight: int, calls: int, seed: int = 0) -> dict[str, int]:
    """A driver keeping `in_flight` calls out to peers that serve one call at a time (FIFO) in the given
    seconds per sample; the calls each peer finished. Time is simulated: the balancer sees only its clock."""
    bal = Balancer(first_ban=2.0, max_ban=120.0, rng=random.Random(seed))
    peers = [peer(p) for p in service_s_per_sample]
    free_at = dict.fromkeys(service_s_per_sample, 0.0)  # when each peer finishes what it holds
    events: list[tuple[float, int, str, float]] = []  # (end, n, peer, sent at)
    now, n, done = 0.0, 0, {p: 0 for p in service_s_per_sample}

    def send() -> None:
        nonlocal n
        pid = bal.choose(peers, BATCH, now)
        end = max(now, free_at[pid]) + service_s_per_sample[pid] * BATCH
        free_at[pid] = end
        n += 1
        heapq.heappush(events, (end, n, pid, now))

    for _ in range(in_flight):
        send()
    while sum(done.values()) < calls:
        now, _, pid, sent = heapq.heappop(events)
        bal.done(pid, BATCH, now - sent, now)
        done[pid] += 1
        send()
    return done


def test_a_peer_four_times_slower_gets_a_quarter_of_the_calls():
    got = simulate({"fast": 0.01, "slow": 0.04}, in_flight=8, calls=2000)
    share = got["slow"] / got["fast"]
    assert 0.15 <= share <= 0.35, got


def test_equal_peers_share_equally_and_a_lone_driver_keeps_off_a_peer_that_would_not_help():
    got = simulate({"a": 0.01, "b": 0.01, "c": 0.01}, in_flight=9, calls=3000)
    assert max(got.values()) - min(got.values()) <= 0.1 * 1000, got
    # One call out at a time: the fast peer finishes each first, so the slow one is not used after its trial.
    got = simulate({"fast": 0.01, "slow": 0.04}, in_flight=1, calls=500)
    assert got["slow"] <= 3, got


def test_failures_in_a_row_double_the_avoidance_up_to_max_ban_and_one_success_forgives():
    bal = Balancer(first_ban=2.0, max_ban=10.0)
    peers = [peer("a")]
    now = 0.0
    for ban in (2.0, 4.0, 8.0, 10.0, 10.0):
        assert bal.choose(peers, BATCH, now) == "a"
        bal.done("a", BATCH, 0.1, now, failure="deadline")
        assert bal.avoided("a", now) and "deadline" in bal.avoided("a", now)
        assert bal.choose(peers, BATCH, now + ban - 0.01) is None  # avoided for exactly `ban`
        assert bal.avoided("a", now + ban) is None
        now += ban
    assert bal.choose(peers, BATCH, now) == "a"
    bal.done("a", BATCH, 0.1, now)  # forgiven
    assert bal.choose(peers, BATCH, now) == "a"
    bal.done("a", BATCH, 0.1, now, failure="refused")
    assert bal.avoided("a", now + 1.99) and bal.avoided("a", now + 2.0) is None  # back to first_ban


def test_calls_failing_together_count_as_one_failure():
    """A dead peer fails every call it held at once: that is one failure, not one per call."""
    bal = Balancer(first_ban=2.0, max_ban=120.0)
    peers = [peer("a")]
    for _ in range(6):
        bal.choose(peers, BATCH, 0.0)
    for _ in range(6):  # all sent at 0, all fail at 1
        bal.done("a", BATCH, 1.0, 1.0, failure="session ended")
    assert bal.avoided("a", 2.99) and bal.avoided("a", 3.0) is None
    # A call sent after that failure fails too: now it is a second failure in a row.
    bal.choose(peers, BATCH, 3.0)
    bal.done("a", BATCH, 0.5, 3.5, failure="session ended")
    assert bal.avoided("a", 7.49) and bal.avoided("a", 7.5) is None


def test_a_busy_peer_is_avoided_briefly_and_not_counted_as_failing():
    bal = Balancer(first_ban=2.0, max_ban=120.0)
    peers = [peer("a")]
    for i in range(10):
        assert bal.choose(peers, BATCH, float(i)) == "a"
        bal.done("a", BATCH, 0.01, float(i), failure="refused (busy)", busy=True)
        assert bal.avoided("a", i + 0.5) is None  # about one call's time (unmeasured: a default guess)
    assert bal.peers["a"].failures_in_row == 0
    assert bal.choose(peers, BATCH, 10.0) == "a"
    bal.done("a", BATCH, 0.01, 10.0, failure="deadline")
    assert bal.avoided("a", 11.99) and bal.avoided("a", 12.0) is None  # a real failure starts at first_ban


def test_a_new_peer_is_tried_early_and_excluded_or_avoided_peers_are_not_chosen():
    bal = Balancer(first_ban=2.0, max_ban=120.0, rng=random.Random(1))
    old = [peer("a"), peer("b")]
    now = 0.0
    for _ in range(6):  # a and b are measured and hold work
        pid = bal.choose(old, BATCH, now)
        bal.done(pid, BATCH, 0.08, now + 0.08)
    for _ in range(4):
        bal.choose(old, BATCH, now)
    assert bal.choose([*old, peer("new")], BATCH, now) == "new"  # assumed as fast as the fastest, and idle
    assert bal.choose(old, BATCH, now, exclude={"a", "b"}) is None
    bal.done("a", BATCH, 0.1, now, failure="x")
    assert bal.choose(old, BATCH, now, exclude={"b"}) is None
    assert bal.choose(old, BATCH, now) == "b"


def test_speeds_come_from_measurements_then_announcements_then_a_default():
    bal = Balancer(first_ban=2.0, max_ban=120.0)
    assert bal.expected_seconds("x", None, BATCH) == pytest.approx(DEFAULT_SECONDS_PER_SAMPLE * BATCH)
    assert bal.expected_seconds("x", peer("x", rate=100.0), BATCH) == pytest.approx(BATCH / 100.0)
    bal.choose([peer("x")], BATCH, 0.0)
    bal.done("x", BATCH, 0.4, 0.4)
    assert bal.expected_seconds("x", peer("x", rate=100.0), BATCH) == pytest.approx(0.4)
    # A call queued behind our previous one there is timed from when that one ended: 0.4 s, not 0.7 s.
    bal.choose([peer("x")], BATCH, 0.0)
    bal.done("x", BATCH, 0.7, 0.8)
    assert bal.expected_seconds("x", None, BATCH) == pytest.approx(0.4)
    [row] = bal.report(1.0)
    assert row["peer_id"] == "x" and row["calls"] == 2 and row["outstanding"] == 0 and row["avoided"] is None


# ---- directory ------------------------------------------------------------------------------------------

KEY = PipelineKey("shakespeare", (2, 5, 8))


def ann(stage: int, *, name: str = "shakespeare", cuts=(2, 5, 8), rate: float = 0.0, queue: int = 0):
    return StageAnnouncement(name, stage, len(cuts) + 1, samples_per_s=rate, queue=queue, cuts=list(cuts))


def test_stage_map_keeps_live_peers_of_this_pipeline_and_cut_only():
    anns = {"me": ann(0, rate=5.0), "b": ann(1, rate=3.0, queue=2), "a": ann(1), "dead": ann(2),
            "other": ann(3, name="other"), "recut": ann(3, cuts=(1, 5, 8)), "c": ann(3)}
    smap = stage_map(KEY, anns, live={"a", "b", "other", "recut", "c"}, me="me")
    assert {s: [p.peer_id for p in ps] for s, ps in smap.items()} == {0: ["me"], 1: ["a", "b"], 2: [], 3: ["c"]}
    assert smap[0][0].me and not smap[1][0].me
    assert smap[1][1] == StagePeer("b", 1, 3.0, 2)
    assert KEY.stages == 4 and PipelineKey.of(anns["recut"]) != KEY


def test_capacity_and_bottleneck():
    assert capacity([peer("a", rate=2.0), peer("b", rate=3.0)]) == 5.0
    assert capacity([peer("a"), peer("b", rate=3.0)], unmeasured=7.0) == 10.0
    assert bottleneck({}) is None
    stages = {0: [peer("a", rate=10.0)], 1: [peer("b", rate=4.0), peer("c", rate=4.0)], 2: [peer("d", rate=5.0)]}
    assert bottleneck(stages) == 2
    assert bottleneck({**stages, 3: []}) == 3  # an empty stage first
    assert bottleneck({0: [peer("a")], 1: [peer("b")]}) == 0  # nothing measured: ties go to the first


# ---- server refusals ------------------------------------------------------------------------------------

class Handler:
    """Stage 1 of KEY: takes a (batch, 4) float32 forward and (batch, 4) x2 backward."""

    def kinds(self):
        return ("forward", "backward")

    def input_specs(self, kind, batch):
        h = ("h", "float32", [batch, 4])
        return [h] if kind == "forward" else [h, ("grad_out", "float32", [batch, 4])]


def call(**kw) -> StageCall:
    batch = kw.pop("batch", BATCH)
    shapes = kw.pop("shapes", [[batch, 4]])
    d = dict(pipeline="shakespeare", stage=1, kind="forward", batch=batch, seed=1, cuts=[2, 5, 8],
             tensors=[TensorSpec(f"in{i}", kw.pop("dtype", "float32"), s) for i, s in enumerate(shapes)],
             streams=list(range(len(shapes))))
    return StageCall(**{**d, **kw})


@pytest.fixture
def server() -> StageServer:
    s = StageServer(PipelineSection(max_queue=4, max_queue_per_peer=2))
    s.stage = ServedStage(KEY, 1, max_batch=16, handler=Handler())
    return s


def test_a_well_formed_call_is_taken(server):
    assert server.refusal(call(), "p") is None
    assert server.refusal(call(kind="backward", shapes=[[BATCH, 4], [BATCH, 4]]), "p") is None
    assert server.refusal(call(batch=16, shapes=[[16, 4]]), "p") is None


@pytest.mark.parametrize("bad, code", [
    (dict(pipeline="other"), "wrong_pipeline"),
    (dict(cuts=[2, 5, 9]), "wrong_cut"),
    (dict(cuts=[]), "wrong_cut"),
    (dict(stage=2), "wrong_stage"),
    (dict(kind="loss"), "wrong_kind"),
    (dict(batch=17, shapes=[[17, 4]]), "too_big"),
    (dict(codec="zstd"), "bad_codec"),
    (dict(shapes=[[BATCH, 5]]), "wrong_specs"),
    (dict(shapes=[[BATCH - 1, 4]]), "wrong_specs"),  # shapes that contradict the batch
    (dict(dtype="float16"), "wrong_specs"),
    (dict(kind="backward"), "wrong_specs"),  # backward without its output gradient
])
def test_a_call_the_stage_cannot_take_is_refused_with_its_code(server, bad, code):
    refused = server.refusal(call(**bad), "p")
    assert refused is not None and refused[0] == code, refused
    assert refused[1]  # a reason for the driver's log


def test_a_full_server_and_a_driver_over_its_share_are_busy(server):
    server.per_peer["greedy"] = 2
    code, reason = server.refusal(call(), "greedy")
    assert code == "busy" and "max_queue_per_peer" in reason
    assert server.refusal(call(), "modest") is None  # the bound is per driver
    server.stats.queue = 4
    code, reason = server.refusal(call(), "modest")
    assert code == "busy" and "max_queue" in reason


def test_a_peer_serving_nothing_refuses_everything():
    s = StageServer(PipelineSection())
    assert s.refusal(call(), "p")[0] == "not_serving"


# ---- wire: range checks on decode -------------------------------------------------------------------------

def roundtrip(msg):
    return DEFAULT_REGISTRY.decode(DEFAULT_REGISTRY.encode(msg), DEFAULT_LIMITS).message


def tampered(msg, path: list, value) -> bytes:
    """`msg` encoded, with the body field at `path` replaced by `value` (bypassing the sender's checks)."""
    env = msgpack.unpackb(DEFAULT_REGISTRY.encode(msg), raw=False)
    node = env["b"]
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return msgpack.packb(env, use_bin_type=True)


def record(stage: StageAnnouncement | None) -> TopologyRecord:
    return TopologyRecord(peer_id="a" * 20, public_key=b"k" * 32, version=1, issued=1.0, neighbours=[], links=[],
                          signature=b"", stage=stage)


def test_pipeline_messages_round_trip():
    c = call(kind="backward", shapes=[[BATCH, 4], [BATCH, 4]], microbatch=7, codec="q8")
    assert roundtrip(c) == c
    r = StageReply(tensors=[TensorSpec("out0", "float32", [BATCH, 4])], streams=[3], loss=2.5, compute_s=0.01)
    assert roundtrip(r) == r
    rec = record(ann(2, rate=12.5, queue=3))
    assert roundtrip(rec) == rec
    assert roundtrip(record(None)).stage is None


@pytest.mark.parametrize("path, value", [
    (["pipeline"], ""),
    (["pipeline"], "x" * 65),
    (["stage"], -1),
    (["stage"], MAX_STAGES),
    (["kind"], "train"),
    (["batch"], 0),
    (["cuts"], list(range(1, MAX_STAGES + 1))),
    (["streams"], []),
    (["tensors"], [{"name": f"t{i}", "dtype": "float32", "shape": [1]} for i in range(MAX_STAGE_TENSORS + 1)]),
])
def test_a_stage_call_out_of_range_is_a_protocol_error(path, value):
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(call(), path, value), DEFAULT_LIMITS)


@pytest.mark.parametrize("path, value", [
    (["compute_s"], -1.0),
    (["streams"], [1]),
    (["loss"], "nan"),
])
def test_a_stage_reply_out_of_range_is_a_protocol_error(path, value):
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(StageReply(tensors=[], streams=[]), path, value), DEFAULT_LIMITS)


@pytest.mark.parametrize("field, value", [
    ("pipeline", ""),
    ("stage", 4),
    ("stage", -1),
    ("stages", 0),
    ("stages", MAX_STAGES + 1),
    ("samples_per_s", -1.0),
    ("samples_per_s", MAX_SAMPLES_PER_S * 2),
    ("queue", -1),
    ("queue", MAX_QUEUE + 1),
    ("cuts", [2, 5]),  # one cut short of 4 stages
    ("cuts", [5, 2, 8]),  # not increasing
    ("cuts", [0, 5, 8]),  # a stage with no block
])
def test_a_stage_announcement_out_of_range_is_a_protocol_error(field, value):
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(record(ann(1)), ["stage", field], value), DEFAULT_LIMITS)
    with pytest.raises(ValueError):  # and the sender's own check says the same
        StageAnnouncement(**{**dict(pipeline="p", stage=1, stages=4, cuts=[2, 5, 8]), field: value})


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
    assert states.refusal(state_request(3), "member")[0] == "no_state"
    states.keep(kept(KEY, 3, 1.0))
    assert states.refusal(state_request(3), "member2") is None  # a copy we keep


@pytest.mark.parametrize("peer_id", ["nobody", "recut", "stranger"])
def test_only_a_peer_announcing_a_stage_of_the_same_pipeline_and_cut_may_fetch(states, peer_id):
    code, reason = states.refusal(state_request(1), peer_id)
    assert code == "not_a_member" and "same cut" in reason


def test_a_member_asking_for_a_state_we_do_not_hold_gets_no_state(states):
    states.keep(kept(OTHER_CUT, 2, 1.0))  # a copy of stage 2, of another cut
    code, reason = states.refusal(state_request(2), "member")
    assert code == "no_state" and "stage 2" in reason
    # a recut peer asking for the other cut's stage 1: we serve stage 1, but of KEY's cut
    recut = StageStates(FakeService({"recut": ann(0, cuts=(3, 5, 8))}, ServedStage(KEY, 1, 16, Handler())),
                        PipelineSection())
    assert recut.refusal(state_request(1, OTHER_CUT), "recut")[0] == "no_state"
    assert StageStates(FakeService({"member": ann(0)}, None), PipelineSection()).refusal(
        state_request(1), "member")[0] == "no_state"  # serving nothing, keeping nothing


def test_uploads_are_capped_per_daemon_and_one_per_peer(states):
    states.uploads, states.per_peer["member"] = 1, 1
    code, reason = states.refusal(state_request(1), "member")
    assert code == "busy" and "one stage state per peer" in reason
    assert states.refusal(state_request(1), "member2") is None  # one each
    states.uploads, states.per_peer["member2"] = 2, 1
    code, reason = states.refusal(state_request(1), "member2")
    assert code == "busy" and "the most this peer sends at once" in reason
    del states.per_peer["member"], states.per_peer["member2"]
    assert states.refusal(state_request(1), "member")[0] == "busy"  # the daemon's cap, whoever asks
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
    assert isinstance(err, ErrorReply) and err.code == "not_a_member"
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
    a = svc.announcement()
    assert (a.stage, a.step, a.moving_to, a.moved_from, a.samples_per_s) == (1, 120, 2, 0, 4.0)
    assert a.copies == [StageCopy(0, 100)]
    svc.moving_to, svc.moved_from = 1, 7  # stale: we serve stage 1 now; no stage 7 in this pipeline
    a = svc.announcement()
    assert (a.moving_to, a.moved_from) == (-1, -1)
    assert roundtrip(record(a)) == record(a)

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
from peer.pipeline.directory import bottleneck, capacity, stage_map
from peer.pipeline.server import ServedStage, StageServer
from peertrain.pipeline import PipelineKey, StagePeer
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.refusal import ASKERS_FAULT, Code, Refusal, Refused
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.gossip import TensorSpec
from protocol.schema.pipeline import (MAX_QUEUE, MAX_SAMPLES_PER_S, MAX_STAGE_TENSORS, MAX_STAGES, StageAnnouncement,
                                      StageCall, StageReply)
from protocol.schema.topology import TopologyRecord

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
    (dict(pipeline="other"), Code.WRONG_PIPELINE),
    (dict(cuts=[2, 5, 9]), Code.WRONG_CUT),
    (dict(cuts=[]), Code.WRONG_CUT),
    (dict(stage=2), Code.WRONG_STAGE),
    (dict(kind="loss"), Code.WRONG_KIND),
    (dict(batch=17, shapes=[[17, 4]]), Code.TOO_BIG),
    (dict(codec="zstd"), Code.BAD_CODEC),
    (dict(shapes=[[BATCH, 5]]), Code.WRONG_SPECS),
    (dict(shapes=[[BATCH - 1, 4]]), Code.WRONG_SPECS),  # shapes that contradict the batch
    (dict(dtype="float16"), Code.WRONG_SPECS),
    (dict(kind="backward"), Code.WRONG_SPECS),  # backward without its output gradient
])
def test_a_call_the_stage_cannot_take_is_refused_with_its_code(server, bad, code):
    refused = server.refusal(call(**bad), "p")
    assert refused is not None and refused.code is code, refused
    assert refused.reason  # a reason for the driver's log


def test_a_full_server_and_a_driver_over_its_share_are_busy(server):
    server.per_peer["greedy"] = 2
    refused = server.refusal(call(), "greedy")
    assert refused.code is Code.BUSY and "max_queue_per_peer" in refused.reason
    assert server.refusal(call(), "modest") is None  # the bound is per driver
    server.stats.queue = 4
    refused = server.refusal(call(), "modest")
    assert refused.code is Code.BUSY and "max_queue" in refused.reason


def test_a_peer_serving_nothing_refuses_everything():
    s = StageServer(PipelineSection())
    assert s.refusal(call(), "p").code is Code.NOT_SERVING


# ---- driver: a refusal is handled by its code ---------------------------------------------------------------

def drive(script: list, *, max_retries: int = 1) -> tuple:
    """One microbatch through a one-stage pipeline of five peers whose calls end as `script` says, in turn
    (an exception to raise, or None: the call succeeds); its outcome and the driver's stats."""
    import trio
    import trio.testing

    from peer.pipeline.driver import Driver
    from peertrain.pipeline import Microbatch

    key = PipelineKey("one", ())
    peers = [StagePeer(f"peer{i}", 0, 10.0, 0) for i in range(5)]
    service = SimpleNamespace(cfg=PipelineSection(max_retries=max_retries, verify_fraction=0.0), me="me",
                              stage_map=lambda k: {0: peers})
    driver = Driver(service, key, reply_shapes=lambda *a: [])
    calls = list(script)

    async def call_once(pid, peer, mb, stage, kind, tensors):
        step = calls.pop(0)
        if step is not None:
            raise step
        return 0.5, [], 0, 0.0

    driver._call_once = call_once
    mb = Microbatch(1, SimpleNamespace(shape=(4,)), None, seed=1)
    outcome = trio.run(driver.run, mb, clock=trio.testing.MockClock(autojump_threshold=0))
    return outcome, driver.stats, calls


def refused(code: Code) -> Refused:
    return Refused(Refusal(code, f"said {code.value}"))


def test_busy_and_stale_refusals_use_no_attempt_and_other_failures_do():
    from peer.pipeline.driver import _CallFailed

    outcome, stats, left = drive([refused(Code.BUSY), refused(Code.MOVED), refused(Code.WRONG_STAGE),
                                  _CallFailed("no answer within its deadline"), None])
    assert outcome.ok and outcome.loss == 0.5 and not left
    assert stats.busy == 1 and outcome.resent == 3  # busy is re-sent as a new try, not a re-send
    outcome, stats, left = drive([_CallFailed("session ended"), refused(Code.UNKNOWN), None])
    assert not outcome.ok and "2 calls failed" in outcome.reason and left == [None]


@pytest.mark.parametrize("code", sorted(ASKERS_FAULT))
def test_a_refusal_blaming_us_is_tried_elsewhere_and_the_refuser_struck_when_another_serves_it(code):
    """One server alone cannot fail a microbatch by blaming the driver: the call goes to another peer of the
    stage, and once that one serves it the refuser is struck (issue 39)."""
    outcome, stats, left = drive([refused(code), None])
    assert outcome.ok and outcome.resent == 1 and not left and stats.failed == 0
    assert sum(stats.struck.values()) == 1


@pytest.mark.parametrize("code", sorted(ASKERS_FAULT))
def test_a_refusal_two_peers_agree_on_fails_the_microbatch_and_strikes_nobody(code):
    from peer.pipeline.driver import ASKERS_FAULT_AGREE

    outcome, stats, left = drive([refused(code)] * ASKERS_FAULT_AGREE + [None], max_retries=4)
    assert not outcome.ok and f"refused ({code.value})" in outcome.reason and left == [None]
    assert outcome.resent == ASKERS_FAULT_AGREE - 1 and stats.failed == 1 and not stats.struck


def test_a_late_or_malformed_reply_is_struck_once_another_peer_serves_the_call():
    from peer.pipeline.driver import _CallFailed

    outcome, stats, left = drive([_CallFailed("no answer", fault=True), _CallFailed("bad reply", fault=True),
                                  _CallFailed("session ended"), None], max_retries=4)
    assert outcome.ok and not left and sum(stats.struck.values()) == 2  # not the ended session's (not its doing)


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

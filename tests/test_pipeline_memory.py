"""Only your stage in memory, pure (docs/design.md, "Profiles are shared" and "Memory is a budget"): the memory
model of a stage and the swarm's cap, the cut under that cap (and the smallest cap named when none fits), the
per-block costs planned from shared profiles (medians, same-kind blocks, estimates), placement, takeover and
rebalancing keeping to peers whose room holds the stage, the wire bounds and signature of the profiles and
memory a stage record carries, and the daemon's own budget (configured, cgroup, available)."""

from __future__ import annotations

import functools
import itertools
import math
import random
import re

import msgpack
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from peer.pipeline import memory_budget as peer_memory
from peer.pipeline.kept import MAX_KEPT
from peer.pipeline.memory_budget import AUTO_MARGIN as HOST_MARGIN, UNLIMITED, Budget, budget, rss_bytes
from peertrain.pipeline import PipelineKey, StagePeer
from protocol import identity as ident
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS
from protocol.schema import DEFAULT_REGISTRY
from protocol.schema.pipeline import (MAX_BLOCK_BYTES, MAX_BLOCK_SECONDS, MAX_BLOCKS, MAX_COPIES, MAX_MEMORY_MIB,
                                      MAX_PROFILED_BLOCKS, MAX_STAGES, BlockProfile, StageAnnouncement, StageCopy)
from protocol.schema.topology import TopologyRecord, TopologyRecords, topology_record_signing_bytes
from tests.test_pipeline_rebalance import smap_of
from tests.test_pipeline_units import roundtrip, tampered
from trainers.pipeline import memory, profiles
from trainers.pipeline.blocks import char_transformer_pipeline, from_factory
from trainers.pipeline.partition import BlockCost, DoesNotFit, plan_stages
from peer.pipeline.placement import better_stage, initial_stage
from peer.pipeline.stage_moves import plan_move, takeover_order
from trainers.pipeline.shapes import trace
from protocol.limits import MiB


# ---- trainers/pipeline/memory.py: a stage's bytes, the swarm's cap ------------------------------------------

def test_state_bytes_counts_parameters_gradient_and_the_optimizers_slots():
    assert memory.state_bytes(100, "adam") == 100 * (2 + 2)
    assert memory.state_bytes(100, "sgd") == 100 * (2 + 1)
    assert memory.state_bytes(100, "lion?") == memory.state_bytes(100, "adam")  # unknown: planned as Adam
    assert memory.state_bytes(0, "adam") == 0


def overhead(params: list[int], outs: list[int], lo: int, hi: int) -> int:
    """The kept calls' inputs, the step's temporaries, the allocator's slack and the process's growth of a stage
    of blocks [lo, hi)."""
    kept = MAX_KEPT * ((outs[lo - 1] if lo else outs[lo]) + outs[hi - 1])
    return kept + memory.STEP_TEMPORARIES * max(params[lo:hi]) + int(memory.ALLOCATOR_SLACK * sum(params[lo:hi])) \
        + memory.PROCESS_GROWTH


def test_stage_bytes_sums_only_the_stages_blocks():
    params, outs = [10, 20, 30, 40], [1, 2, 3, 4]
    # blocks [1, 3): 50 parameter bytes, 5 output bytes
    want = 50 * (2 + 1) + memory.ACTIVATION_FACTOR * 5 + overhead(params, outs, 1, 3)
    assert memory.stage_bytes(params, outs, 1, 3, "sgd") == want  # no copy of the gradient per call kept
    whole = memory.stage_bytes(params, outs, 0, 4, "adam")
    assert whole == 100 * 4 + memory.ACTIVATION_FACTOR * 10 + overhead(params, outs, 0, 4)
    assert memory.stage_bytes(params, outs, 2, 2, "adam") == 0  # no block, no bytes


def test_the_room_keeps_a_stages_averaging_before_any_gradient_copy_and_only_where_it_holds_both():
    """Two peers of a 134 MB stage once held 256 MiB beyond their plan (an exchange's two copies, idle receive
    buffers) and one was OOM-killed: the room beside a stage now keeps `sharing_bytes` first, where it holds it."""
    import types

    import torch

    from trainers.swarm_pipeline import _memory

    params, outs = [64 * MiB, 64 * MiB], [MiB, MiB]
    traced = types.SimpleNamespace(param_bytes=params, out_bytes=lambda i, mb: outs[i])
    need = memory.stage_bytes(params, outs, 0, 2, "adam")
    share = memory.sharing_bytes(128 * MiB)
    assert share == memory.AVERAGING_COPIES * 128 * MiB + memory.RECEIVE_POOL_IDLE

    def mem_for(room_bytes: int):
        budget = rss_bytes() + room_bytes  # the room is the budget less what the process holds now
        swarm = types.SimpleNamespace(stage_memory=lambda: (budget, "[pipeline] memory_mib"), log=lambda *a: None)
        o = types.SimpleNamespace(microbatch=8, optimizer="adam")
        return _memory(swarm, o, traced, torch.device("cpu"))

    roomy = mem_for(need + share + 3 * 128 * MiB + 64 * MiB)  # the process may grow a little meanwhile: 64 MiB slack
    assert roomy.sharing(0, 2) == share
    assert roomy.max_held(0, 2) in (2, 3)  # the copies come after the averaging's share
    tight = mem_for(need + share // 2)  # holds the stage, not its averaging (its seat says so when it builds):
    assert tight.sharing(0, 2) == 0 and tight.max_held(0, 2) in (0, 1)  # nothing kept for it; copies use the rest


def test_cap_for_stages_is_the_stages_th_largest_room():
    rooms = [5 * MiB, 1 * MiB, 3 * MiB, 0, 4 * MiB]  # 0: a peer that announced none
    assert memory.cap_for_stages(rooms, 1) == 5 * MiB
    assert memory.cap_for_stages(rooms, 2) == 4 * MiB
    assert memory.cap_for_stages(rooms, 3) == 3 * MiB  # at least 3 peers can each hold any stage
    assert memory.cap_for_stages(rooms, 4) == 1 * MiB
    # fewer peers known than stages: the smallest of theirs
    assert memory.cap_for_stages(rooms, 9) == 1 * MiB
    assert memory.cap_for_stages([7 * MiB], 3) == 7 * MiB
    # nobody announced a budget: no constraint
    assert memory.cap_for_stages([], 2) is None
    assert memory.cap_for_stages([0, 0], 1) is None


def test_the_caps_rooms_are_those_of_placed_peers_never_bare_claims():
    """The cheapest attack on the cut's cap: records claiming 1 PiB of room, one per free key. Only peers that serve
    a stage of the pipeline at a measured speed count, so those claims leave the cap at what real peers hold."""
    def ann(room_mib: int, speed: float, pipeline: str = "p") -> StageAnnouncement:
        return StageAnnouncement(pipeline=pipeline, stage=0, stages=2, cuts=[1], samples_per_s=speed,
                                 stage_room_mib=room_mib)
    ours = 2000 * MiB
    sybils = [ann(MAX_MEMORY_MIB, 0.0) for _ in range(8)]  # claimed, never served a call
    assert memory.cap_for_stages([ours] + [MAX_MEMORY_MIB * MiB] * 8, 4) == MAX_MEMORY_MIB * MiB  # every claim: gone
    assert memory.cap_for_stages([ours] + memory.placed_rooms(sybils, "p"), 4) == ours
    placed = [ann(3000, 12.5), ann(1500, 3.0), ann(9000, 4.0, pipeline="other")]
    assert sorted(memory.placed_rooms(placed + sybils, "p")) == [1500 * MiB, 3000 * MiB]


def test_fits_and_mib():
    assert memory.fits(10, 0, 1 << 40)  # an unknown budget holds anything
    assert memory.fits(60, 100, 40) and not memory.fits(61, 100, 40)
    assert memory.mib(0) == 0 and memory.mib(1) == 1 and memory.mib(MiB) == 1 and memory.mib(MiB + 1) == 2


# ---- partition.plan_stages under a memory cap -----------------------------------------------------------

def costs_of(seconds, params, outs=None) -> list[BlockCost]:
    outs = outs or [0] * len(seconds)
    return [BlockCost(f"{i}:b", s, o, p) for i, (s, p, o) in enumerate(zip(seconds, params, outs))]


def by_params(costs: list[BlockCost]):
    """A memory model: a stage takes its blocks' parameter bytes (easy to reason about)."""
    return lambda lo, hi: sum(c.param_bytes for c in costs[lo:hi])


# Four equal blocks, the last one four times as large: the fastest 2-stage cut (2 + 2 blocks) puts 50 MiB in
# its second stage; cutting after block 3 costs a slower stage (3 blocks) but needs at most 40 MiB.
SMALL = costs_of([1.0, 1.0, 1.0, 1.0], [10 * MiB, 10 * MiB, 10 * MiB, 40 * MiB])


def test_the_fastest_cut_is_refused_when_a_stage_exceeds_the_cap_and_the_next_best_fitting_cut_is_chosen():
    free = plan_stages(SMALL, 2)
    assert free.bounds == [(0, 2), (2, 4)]
    capped = plan_stages(SMALL, 2, memory=by_params(SMALL), memory_cap=45 * MiB)
    assert capped.bounds == [(0, 3), (3, 4)]
    assert capped.stage_seconds == [3.0, 1.0] and capped.bottleneck == 0
    # a cap every stage of the fastest cut fits changes nothing
    assert plan_stages(SMALL, 2, memory=by_params(SMALL), memory_cap=50 * MiB).bounds == free.bounds


def test_an_impossible_cap_names_the_smallest_cap_that_would_do():
    mem = by_params(SMALL)
    # the cuts after block 1, 2, 3 need at most 60, 50, 40 MiB: 40 MiB is the least that would do
    with pytest.raises(DoesNotFit) as err:
        plan_stages(SMALL, 2, memory=mem, memory_cap=39 * MiB)
    msg = str(err.value)
    assert re.search(r"needs (\d+) MiB", msg).group(1) == "40", msg
    assert "at most 39 MiB" in msg and "4 blocks" in msg and "2 stages" in msg
    assert isinstance(err.value, ValueError)  # callers that catch a bad plan catch this too
    assert plan_stages(SMALL, 2, memory=mem, memory_cap=40 * MiB).bounds == [(0, 3), (3, 4)]  # the named cap does
    with pytest.raises(DoesNotFit):
        plan_stages(SMALL, 2, memory=mem, memory_cap=40 * MiB - 1)
    # more stages need less: 4 stages of one block each fit 40 MiB
    assert plan_stages(SMALL, 4, memory=mem, memory_cap=40 * MiB).bounds == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_no_memory_model_or_no_cap_plans_as_before():
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(2, 7)
        costs = costs_of([rng.uniform(0.1, 2.0) for _ in range(n)], [rng.randint(1, 50) * MiB for _ in range(n)],
                         [rng.randint(0, 10_000_000) for _ in range(n)])
        stages = rng.randint(1, n)
        plain = plan_stages(costs, stages)
        assert plan_stages(costs, stages, memory=by_params(costs)) == plain  # a model without a cap
        assert plan_stages(costs, stages, memory_cap=1) == plain  # a cap without a model


def _bottleneck(costs: list[BlockCost], bounds, link: float) -> float:
    return max(max(math.fsum(c.seconds for c in costs[lo:hi]),
                   2 * costs[lo - 1].out_bytes / link if lo else 0.0) for lo, hi in bounds)


def test_the_capped_plan_is_the_fastest_cut_that_fits_by_brute_force():
    rng = random.Random(11)
    link = 125e6
    for _ in range(60):
        n = rng.randint(2, 7)
        costs = costs_of([rng.uniform(0.1, 2.0) for _ in range(n)], [rng.randint(1, 50) * MiB for _ in range(n)],
                         [rng.randint(0, 50_000_000) for _ in range(n)])
        stages = rng.randint(1, n)
        mem = by_params(costs)
        cap = rng.randint(10, 150) * MiB
        cuts = [[(a, b) for a, b in zip((0, *c), (*c, n))] for c in itertools.combinations(range(1, n), stages - 1)]
        fitting = [b for b in cuts if all(mem(lo, hi) <= cap for lo, hi in b)]
        if not fitting:
            with pytest.raises(DoesNotFit) as err:
                plan_stages(costs, stages, memory=mem, memory_cap=cap)
            least = min(max(mem(lo, hi) for lo, hi in b) for b in cuts)
            assert f"needs {-(-least // MiB)} MiB" in str(err.value)
            continue
        plan = plan_stages(costs, stages, memory=mem, memory_cap=cap, link_bytes_per_s=link)
        assert all(mem(lo, hi) <= cap for lo, hi in plan.bounds)
        assert _bottleneck(costs, plan.bounds, link) == pytest.approx(min(_bottleneck(costs, b, link) for b in fitting))


def test_the_memory_model_of_trainers_pipeline_memory_drives_the_cut():
    costs = SMALL
    params, outs = [c.param_bytes for c in costs], [1 * MiB] * len(costs)
    mem = functools.partial(memory.stage_bytes, params, outs, optimizer="adam")
    # 2 + 2 blocks: the second stage holds 50 MiB of parameters, 4x in state, 16 MiB of outputs
    need = mem(2, 4)
    assert need == 50 * MiB * 4 + memory.ACTIVATION_FACTOR * 2 * MiB + overhead(params, outs, 2, 4)
    plan = plan_stages(costs, 2, memory=lambda lo, hi: mem(lo, hi), memory_cap=need - 1)
    assert plan.bounds == [(0, 3), (3, 4)]


# ---- profiles.swarm_costs: medians, same kind, estimates ------------------------------------------------------

def mlp_blocks():
    """A factory (for from_factory): an input layer, three identical layers, an output layer, as builders."""
    blocks = [functools.partial(nn.Linear, 8, 16)] + [functools.partial(nn.Linear, 16, 16) for _ in range(3)] \
        + [functools.partial(nn.Linear, 16, 4)]
    return blocks, F.mse_loss


BATCH = 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mlp():
    model = from_factory(f"{__name__}:mlp_blocks")
    return model, trace(model, torch.zeros(BATCH, 8), torch.zeros(BATCH, 4))


def prof(block: int, seconds: float, *, out_bytes: int = 0, param_bytes: int = 0) -> BlockProfile:
    return BlockProfile(block, seconds, out_bytes, param_bytes)


@pytest.fixture
def no_probe(monkeypatch):
    """The device probe must not run (every cost has a measured source)."""
    def refuse(device):
        raise AssertionError("the device probe ran although blocks were measured")
    monkeypatch.setattr(profiles, "probe_seconds_per_operation", refuse)


def test_a_block_measured_by_several_peers_takes_the_median_and_a_liar_does_not_move_it(mlp, no_probe):
    model, traced = mlp
    measured = [prof(i, 0.01 * (i + 1)) for i in range(5)]
    measured += [prof(1, 0.018), prof(1, 0.022), prof(1, MAX_BLOCK_SECONDS)]  # block 1: 0.02 twice more, a liar
    costs, how = profiles.swarm_costs(model, traced, BATCH, measured, device=CPU)
    assert costs[1].seconds == pytest.approx(0.021)  # the median of 0.018, 0.02, 0.022, 3600: (0.02 + 0.022) / 2
    costs2, _ = profiles.swarm_costs(model, traced, BATCH, measured + [prof(1, 0.019)], device=CPU)
    assert costs2[1].seconds == pytest.approx(0.02)  # an odd count: the middle one
    assert [c.seconds for c in costs] == pytest.approx([0.01, 0.021, 0.03, 0.04, 0.05])
    assert how == {"measured": 5, "same_kind": 0, "estimated": 0}


def test_bytes_come_from_the_shapes_never_from_peers(mlp, no_probe):
    model, traced = mlp
    measured = [prof(i, 0.01, out_bytes=MAX_BLOCK_BYTES, param_bytes=MAX_BLOCK_BYTES) for i in range(5)]
    costs, _ = profiles.swarm_costs(model, traced, BATCH, measured, device=CPU)
    assert [c.out_bytes for c in costs] == [traced.out_bytes(i, BATCH) for i in range(5)] == [128, 128, 128, 128, 32]
    assert [c.param_bytes for c in costs] == traced.param_bytes == [(8 * 16 + 16) * 4] + [(16 * 16 + 16) * 4] * 3 \
        + [(16 * 4 + 4) * 4]


def test_an_unmeasured_block_takes_the_cost_of_a_measured_block_of_its_signature(mlp, no_probe):
    model, traced = mlp
    base = [prof(0, 0.01), prof(4, 0.05)]
    costs, how = profiles.swarm_costs(model, traced, BATCH, base + [prof(2, 0.03)], device=CPU)
    assert [c.seconds for c in costs] == pytest.approx([0.01, 0.03, 0.03, 0.03, 0.05])
    assert how == {"measured": 3, "same_kind": 2, "estimated": 0}
    # two of the kind measured: the unmeasured one takes their median
    costs, how = profiles.swarm_costs(model, traced, BATCH, base + [prof(1, 0.02), prof(2, 0.04)], device=CPU)
    assert costs[3].seconds == pytest.approx(0.03)
    assert how == {"measured": 4, "same_kind": 1, "estimated": 0}
    assert [c.name for c in costs] == ["0:Linear", "1:Linear", "2:Linear", "3:Linear", "4:Linear"]


def test_an_unmeasured_block_of_another_kind_is_estimated_at_the_measured_rate(mlp, no_probe):
    model, traced = mlp
    ops = [profiles.operations(traced, i, BATCH) for i in range(5)]
    assert ops[0] < ops[1] == ops[2] == ops[3] and ops[4] < ops[1]
    costs, how = profiles.swarm_costs(model, traced, BATCH, [prof(1, 0.03)], device=CPU)
    rate = 0.03 / ops[1]
    assert [c.seconds for c in costs] == pytest.approx([rate * ops[0], 0.03, 0.03, 0.03, rate * ops[4]])
    assert how == {"measured": 1, "same_kind": 2, "estimated": 2}
    # two kinds at different rates: the estimate takes the median rate (blocks 1-3 at one rate, block 4 at another)
    costs, _ = profiles.swarm_costs(model, traced, BATCH, [prof(1, 0.03), prof(2, 0.03), prof(4, 1.0)],
                                    device=CPU)
    assert costs[0].seconds == pytest.approx(rate * ops[0])


def test_with_nothing_measured_the_device_probes_rate_is_used(mlp, monkeypatch):
    model, traced = mlp
    calls = []

    def probe(device):
        calls.append(device)
        return 1e-6

    monkeypatch.setattr(profiles, "probe_seconds_per_operation", probe)
    costs, how = profiles.swarm_costs(model, traced, BATCH, [], device=CPU)
    assert calls == [CPU]  # once, on the device asked for
    assert [c.seconds for c in costs] == pytest.approx([1e-6 * profiles.operations(traced, i, BATCH) for i in range(5)])
    assert how == {"measured": 0, "same_kind": 0, "estimated": 5}


def test_profiles_of_blocks_out_of_range_are_ignored(mlp, monkeypatch):
    model, traced = mlp
    monkeypatch.setattr(profiles, "probe_seconds_per_operation", lambda device: 1e-6)
    # block 5 and beyond do not exist in this 5-block model (a record of another model, or a lie)
    noise = [prof(5, 9.0), prof(MAX_BLOCKS - 1, 9.0)]
    costs, how = profiles.swarm_costs(model, traced, BATCH, noise, device=CPU)
    assert how == {"measured": 0, "same_kind": 0, "estimated": 5}
    assert all(c.seconds < 1.0 for c in costs)
    costs, how = profiles.swarm_costs(model, traced, BATCH, noise + [prof(4, 0.5)], device=CPU)
    assert how["measured"] == 1 and costs[4].seconds == 0.5


def test_a_transformers_identical_layers_share_one_measurement(monkeypatch):
    model = char_transformer_pipeline(16, d_model=16, n_layers=3, n_heads=2, block=8, dropout=0.0)
    x = torch.zeros(BATCH, 8, dtype=torch.long)
    traced = trace(model, x, x)
    monkeypatch.setattr(profiles, "probe_seconds_per_operation", lambda device: pytest.fail("probe ran"))
    costs, how = profiles.swarm_costs(model, traced, BATCH, [prof(2, 0.004)], device=CPU)
    assert [c.seconds for c in costs[1:4]] == pytest.approx([0.004] * 3)
    assert how == {"measured": 1, "same_kind": 2, "estimated": 2}  # the embedding and the head: estimated
    assert [c.name.split(":")[1] for c in costs] == ["TokenEmbedding", "Block", "Block", "Block", "LMHead"]
    # the costs are a plan's input as they are
    assert plan_stages(costs, 2).bounds[0][0] == 0


def test_announced_profiles_are_within_the_schemas_bounds():
    costs = [BlockCost("0:x", 0.0, 1, 2), BlockCost("1:x", 1e9, 3, 4)] \
        + [BlockCost(f"{i}:x", 0.1, 0, 0) for i in range(2, MAX_PROFILED_BLOCKS + 10)]
    out = profiles.announced_profiles(costs, 7)
    assert len(out) == MAX_PROFILED_BLOCKS
    assert out[0] == BlockProfile(7, 1e-9, 1, 2) and out[1] == BlockProfile(8, MAX_BLOCK_SECONDS, 3, 4)


# ---- placement: only stages this peer can hold ---------------------------------------------------------------

KEY3 = PipelineKey("p", (2, 4))


def sp(pid: str, stage: int, rate: float = 0.0, me: bool = False) -> StagePeer:
    return StagePeer(pid, stage, rate, 0, me=me)


def test_a_numbered_peer_whose_stage_does_not_fit_takes_another_it_can_hold():
    empty = {0: [], 1: [], 2: []}
    assert initial_stage(KEY3, empty, 1, random.Random(0)) == 1  # without `fits`: as before
    assert initial_stage(KEY3, empty, 1, random.Random(0), fits=[True, True, True]) == 1
    got = {initial_stage(KEY3, empty, 1, random.Random(seed), fits=[True, False, True]) for seed in range(20)}
    assert got == {0, 2}  # an empty stage it can hold, at random
    # a numbered peer past the stages: its numbered stage if it fits, else the least capacity it can hold
    busy = {0: [sp("a", 0, 10.0)], 1: [sp("b", 1, 1.0)], 2: [sp("c", 2, 5.0)]}
    seconds = [1.0, 1.0, 3.0]
    assert initial_stage(KEY3, busy, 3, random.Random(0), seconds) == 2
    assert initial_stage(KEY3, busy, 3, random.Random(0), seconds, fits=[True, True, False]) == 1


def test_an_unnumbered_peer_takes_the_slowest_stage_it_can_hold_never_an_empty_one_it_cannot():
    smap = {0: [], 1: [sp("a", 1, 10.0)], 2: [sp("b", 2, 2.0)]}
    for seed in range(10):
        assert initial_stage(KEY3, smap, None, random.Random(seed)) == 0  # the empty stage first
        assert initial_stage(KEY3, smap, None, random.Random(seed), fits=[False, True, True]) == 2
        assert initial_stage(KEY3, smap, None, random.Random(seed), fits=[False, True, False]) == 1
    # we count in no stage's capacity (`me`): a stage held only by us is empty to us
    mine = {0: [sp("me", 0, 9.0, me=True)], 1: [sp("a", 1, 10.0)], 2: [sp("b", 2, 2.0)]}
    assert initial_stage(KEY3, mine, None, random.Random(0), fits=[True, True, True]) == 0
    assert initial_stage(KEY3, mine, None, random.Random(0), fits=[False, True, True]) == 2


def test_a_peer_that_can_hold_no_stage_is_refused_a_place():
    with pytest.raises(ValueError, match="holds no stage"):
        initial_stage(KEY3, {0: [], 1: [], 2: []}, 0, random.Random(0), fits=[False, False, False])
    with pytest.raises(ValueError, match="holds no stage"):
        initial_stage(KEY3, {0: [], 1: [], 2: []}, None, random.Random(0), fits=[False] * 3)


def test_better_stage_goes_only_to_an_empty_stage_it_can_hold():
    smap = {0: [sp("a", 0), sp("b", 0, me=True)], 1: [], 2: []}
    assert better_stage(smap, 0, "b") == 1
    assert better_stage(smap, 0, "b", fits=[True, True, True]) == 1
    assert better_stage(smap, 0, "b", fits=[True, False, True]) == 2
    assert better_stage(smap, 0, "b", fits=[True, False, False]) is None
    assert better_stage(smap, 0, "a", fits=[True, True, True]) is None  # not the largest ID of its stage


# ---- rebalance: never a move to a stage the mover cannot hold --------------------------------------------------

COST3 = [1.0, 1.0, 1.0]
CROWDED = smap_of(3, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0), ("d", 1, 10.0), ("e", 1, 10.0),
                  ("f", 2, 2.5))


def refusing(*pairs: tuple[str, int]):
    banned = set(pairs)
    return lambda pid, stage: (pid, stage) not in banned


def test_plan_move_skips_a_peer_that_cannot_hold_the_bottleneck_stage():
    free = plan_move(CROWDED, COST3, min_gain=0.1)
    assert (free.peer_id, free.from_stage, free.to_stage) == ("a", 0, 2)
    assert plan_move(CROWDED, COST3, min_gain=0.1, fits=lambda p, s: True) == free
    other = plan_move(CROWDED, COST3, min_gain=0.1, fits=refusing(("a", 2)))
    assert other is not None and other.peer_id != "a" and other.to_stage == 2
    nobody = refusing(*((p, 2) for p in "abcde"))
    assert plan_move(CROWDED, COST3, min_gain=0.1, fits=nobody) is None


def test_takeover_order_leaves_out_peers_that_cannot_hold_the_empty_stage():
    smap = smap_of(3, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 1, 10.0), ("d", 1, 10.0))
    free = [m.peer_id for m in takeover_order(smap, COST3, 2, {})]
    assert sorted(free) == ["a", "b", "c", "d"]
    order = takeover_order(smap, COST3, 2, {"a": 5}, fits=refusing(("a", 2), ("d", 2)))
    assert [m.peer_id for m in order] == [p for p in free if p not in ("a", "d")]  # a's fresh copy does not help it
    assert takeover_order(smap, COST3, 2, {}, fits=lambda p, s: False) == []


def test_random_stage_maps_never_get_a_move_the_fits_callback_refuses():
    rng = random.Random(5)
    planned = taken = 0
    for _ in range(300):
        stages = rng.randint(2, 4)
        peers = [(f"p{i:02d}", rng.randrange(stages), rng.choice([0.0, rng.uniform(0.5, 20.0)]))
                 for i in range(rng.randint(stages, 9))]
        smap = smap_of(stages, *peers)
        cost = [rng.uniform(0.5, 2.0) for _ in range(stages)]
        table = {(pid, s): rng.random() < 0.6 for pid, *_ in peers for s in range(stages)}
        fits = lambda pid, s: table[(pid, s)]  # noqa: E731
        if all(smap.values()):
            move = plan_move(smap, cost, min_gain=0.05, fits=fits)
            if move is not None:
                planned += 1
                assert fits(move.peer_id, move.to_stage), move
        for empty in [s for s, ps in smap.items() if not ps]:
            for m in takeover_order(smap, cost, empty, {}, fits=fits):
                taken += 1
                assert m.to_stage == empty and fits(m.peer_id, empty), m
    assert planned > 10 and taken > 10  # the property was exercised


# ---- protocol: profiles and memory in a stage record ----------------------------------------------------------

@pytest.mark.parametrize("change", [
    dict(seconds=-1.0), dict(seconds=0.0), dict(seconds=float("nan")), dict(seconds=float("inf")),
    dict(seconds=MAX_BLOCK_SECONDS * 1.01),
    dict(out_bytes=-1), dict(out_bytes=MAX_BLOCK_BYTES + 1), dict(param_bytes=-1), dict(param_bytes=MAX_BLOCK_BYTES + 1),
    dict(block=-1), dict(block=MAX_BLOCKS),
])
def test_a_block_profile_out_of_range_is_refused(change):
    fine = dict(block=3, seconds=0.5, out_bytes=10, param_bytes=20)
    BlockProfile(**fine)
    BlockProfile(**{**fine, "seconds": MAX_BLOCK_SECONDS, "out_bytes": MAX_BLOCK_BYTES, "block": MAX_BLOCKS - 1})
    with pytest.raises(ValueError):
        BlockProfile(**{**fine, **change})


def ann(**kw) -> StageAnnouncement:
    return StageAnnouncement(**{**dict(pipeline="p", stage=1, stages=4, cuts=[2, 5, 8], samples_per_s=3.5, step=9,
                                       copies=[StageCopy(0, 7)]), **kw})


PROFILED = dict(profiles=[BlockProfile(2, 0.25, 4096, 1 << 20), BlockProfile(3, 0.125, 4096, 1 << 20)],
                memory_mib=4096, stage_room_mib=3500, memory_used_mib=900)


def test_a_stage_announcement_bounds_its_profiles_and_memory():
    many = [BlockProfile(i, 0.1, 0, 0) for i in range(MAX_PROFILED_BLOCKS + 1)]
    ann(profiles=many[:-1])  # the bound itself is fine
    with pytest.raises(ValueError, match="block profiles"):
        ann(profiles=many)
    for name in ("memory_mib", "stage_room_mib", "memory_used_mib"):
        ann(**{name: MAX_MEMORY_MIB})
        for bad in (-1, MAX_MEMORY_MIB + 1):
            with pytest.raises(ValueError, match=name):
                ann(**{name: bad})


def record(stage: StageAnnouncement | None, key=None) -> TopologyRecord:
    """A record of `stage`, signed by `key` (a fresh identity if None)."""
    key = key or ident.generate_identity()
    pub = ident.public_key_bytes(key)
    rec = TopologyRecord(peer_id=ident.peer_id_from_public_bytes(pub), public_key=pub, version=3, issued=1.5,
                         neighbours=["n" * 20], links=[], signature=b"", stage=stage)
    sig = ident.sign(key, topology_record_signing_bytes(rec))
    return TopologyRecord(**{**{f: getattr(rec, f) for f in rec.__dataclass_fields__}, "signature": sig})


def verifies(rec: TopologyRecord) -> bool:
    return ident.verify(rec.public_key, rec.signature, topology_record_signing_bytes(rec))


def test_a_record_with_profiles_and_memory_round_trips_and_its_signature_verifies():
    rec = record(ann(**PROFILED))
    back = roundtrip(rec)
    assert back == rec and back.stage.profiles == PROFILED["profiles"] and back.stage.stage_room_mib == 3500
    assert verifies(back)
    batch = roundtrip(TopologyRecords(records=[rec]))
    assert verifies(batch.records[0])


def test_a_record_without_profiles_or_memory_signs_exactly_as_before():
    key = ident.generate_identity()
    rec = record(ann(), key)
    a = rec.stage
    # the signing list as it was before profiles and memory existed
    before = msgpack.packb(["peertrain/topology_record/v1", rec.peer_id, bytes(rec.public_key), 3, 1.5, ["n" * 20], [],
                            [a.pipeline, a.stage, a.stages, 3.5, a.queue, [2, 5, 8], 9, -1, -1, [[0, 7]]]],
                           use_bin_type=True)
    assert topology_record_signing_bytes(rec) == before
    assert verifies(roundtrip(rec))
    # each addition changes what is signed
    for extra in (dict(profiles=PROFILED["profiles"]), dict(memory_mib=1), dict(stage_room_mib=1),
                  dict(memory_used_mib=1)):
        assert topology_record_signing_bytes(record(ann(**extra), key)) != before


@pytest.mark.parametrize("path, value", [
    (["stage", "profiles", 0, "seconds"], 0.5),  # claims block 2 is slower (or, below, faster) than measured
    (["stage", "profiles", 1, "seconds"], 0.001),
    (["stage", "profiles", 0, "block"], 7),
    (["stage", "profiles", 1, "out_bytes"], 1),
    (["stage", "memory_mib"], 1 << 20),
    (["stage", "stage_room_mib"], 1 << 20),
    (["stage", "memory_used_mib"], 0),
])
def test_a_tampered_profile_or_memory_figure_fails_verification(path, value):
    rec = record(ann(**PROFILED))
    forged = DEFAULT_REGISTRY.decode(tampered(rec, path, value), DEFAULT_LIMITS).message
    assert forged != rec and not verifies(forged)


def test_dropping_the_profiles_fails_verification_too():
    rec = record(ann(**PROFILED))
    assert not verifies(DEFAULT_REGISTRY.decode(tampered(rec, ["stage", "profiles"], []), DEFAULT_LIMITS).message)


@pytest.mark.parametrize("path, value", [
    (["stage", "profiles", 0, "seconds"], -1.0),
    (["stage", "profiles", 0, "seconds"], MAX_BLOCK_SECONDS * 2),
    (["stage", "profiles", 0, "block"], -1),
    (["stage", "profiles", 0, "param_bytes"], MAX_BLOCK_BYTES + 1),
    (["stage", "profiles"], [{"block": i, "seconds": 0.1, "out_bytes": 0, "param_bytes": 0}
                             for i in range(MAX_PROFILED_BLOCKS + 1)]),
    (["stage", "memory_mib"], -1),
    (["stage", "stage_room_mib"], MAX_MEMORY_MIB + 1),
])
def test_profiles_or_memory_out_of_range_are_a_protocol_error_at_decode(path, value):
    with pytest.raises(ProtocolError):
        DEFAULT_REGISTRY.decode(tampered(record(ann(**PROFILED)), path, value), DEFAULT_LIMITS)


def test_a_largest_stage_record_is_small_enough_to_batch():
    """A stage with every list at its bound still leaves a record far under the message limit."""
    stages = MAX_STAGES
    big = StageAnnouncement("p" * 64, 1, stages, samples_per_s=1e9, queue=1 << 20, cuts=list(range(1, stages)),
                            step=1 << 53, moving_to=2, moved_from=3, copies=[StageCopy(0, 1 << 53)] * MAX_COPIES,
                            profiles=[BlockProfile(MAX_BLOCKS - 1, MAX_BLOCK_SECONDS / 3, MAX_BLOCK_BYTES,
                                                   MAX_BLOCK_BYTES)] * MAX_PROFILED_BLOCKS,
                            memory_mib=MAX_MEMORY_MIB, stage_room_mib=MAX_MEMORY_MIB, memory_used_mib=MAX_MEMORY_MIB)
    size = len(DEFAULT_REGISTRY.encode(TopologyRecords(records=[record(big)])))
    assert size < 64 * 1024 < DEFAULT_LIMITS.max_message_bytes


# ---- peer/pipeline/memory_budget.py: the daemon's budget ---------------------------------------------------------------

def test_a_configured_budget_wins(monkeypatch):
    monkeypatch.setattr(peer_memory, "_cgroup_limit", lambda: pytest.fail("the cgroup was read"))
    assert budget(512) == Budget(512 * MiB, "[pipeline] memory_mib")


def test_a_cgroup_limit_is_used_less_the_margin(monkeypatch):
    monkeypatch.setattr(peer_memory, "_cgroup_limit", lambda: (1000 * MiB, "the memory cgroup's limit (x)"))
    monkeypatch.setattr(peer_memory, "_available", lambda: pytest.fail("the host's memory was read"))
    got = budget(0)
    assert got.bytes == int(1000 * MiB * (1 - HOST_MARGIN)) and got.bytes < 1000 * MiB
    assert "cgroup" in got.source and "less 10%" in got.source


def test_without_a_cgroup_limit_the_available_memory_plus_ours_less_the_margin(monkeypatch):
    monkeypatch.setattr(peer_memory, "_cgroup_limit", lambda: None)
    monkeypatch.setattr(peer_memory, "_available", lambda: 2000 * MiB)
    monkeypatch.setattr(peer_memory, "rss_bytes", lambda pid="self": 100 * MiB)
    got = budget(0)
    assert got.bytes == int(2100 * MiB * (1 - HOST_MARGIN)) and "available" in got.source
    monkeypatch.setattr(peer_memory, "_available", lambda: None)
    assert budget(0).bytes == 0  # nothing readable: no constraint


def fake_cgroups(tmp_path, proc: str, files: dict[str, str]):
    """A /proc/self/cgroup with `proc` and a cgroup tree with `files` (relative path -> content)."""
    (tmp_path / "cgroup").write_text(proc)
    root = tmp_path / "fs"
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(content)
    return tmp_path / "cgroup", root


def test_cgroup_v2_memory_max_is_read_and_max_means_none(tmp_path):
    proc, root = fake_cgroups(tmp_path, "0::/user.slice/job\n", {"user.slice/job/memory.max": "1073741824\n"})
    limit, source = peer_memory._cgroup_limit(proc, root)
    assert limit == 1 << 30 and "memory.max" in source
    (root / "user.slice/job/memory.max").write_text("max\n")
    assert peer_memory._cgroup_limit(proc, root) is None


def test_cgroup_v2_under_a_hybrid_hierarchy_is_read_from_unified(tmp_path):
    proc, root = fake_cgroups(tmp_path, "1:name=systemd:/x\n0::/x\n", {"unified/x/memory.max": "536870912"})
    assert peer_memory._cgroup_limit(proc, root)[0] == 512 * MiB


def test_cgroup_v1_limit_is_read_and_its_unlimited_huge_value_ignored(tmp_path):
    lines = "5:cpu,cpuacct:/docker/abc\n4:blkio,memory:/docker/abc\n"
    proc, root = fake_cgroups(tmp_path, lines, {"memory/docker/abc/memory.limit_in_bytes": "268435456\n"})
    limit, source = peer_memory._cgroup_limit(proc, root)
    assert limit == 256 * MiB and "memory.limit_in_bytes" in source
    # v1's "no limit" is a page-rounded 2**63 - 1
    (root / "memory/docker/abc/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert 9223372036854771712 > UNLIMITED
    assert peer_memory._cgroup_limit(proc, root) is None


def test_cgroup_limit_is_none_without_a_readable_file(tmp_path):
    assert peer_memory._cgroup_limit(tmp_path / "missing", tmp_path) is None
    proc, root = fake_cgroups(tmp_path, "0::/a\ngarbage\n3:cpu:/a\n", {})  # no memory.max anywhere
    assert peer_memory._cgroup_limit(proc, root) is None
    proc, root = fake_cgroups(tmp_path, "0::/a\n", {"a/memory.max": "lots"})
    assert peer_memory._cgroup_limit(proc, root) is None


def test_rss_and_mib():
    assert rss_bytes() > 10 * MiB  # this interpreter with torch loaded
    assert rss_bytes("no-such-pid") == 0
    assert peer_memory.mib(0) == 0 and peer_memory.mib(1) == 1 and peer_memory.mib(MiB) == 1
    assert peer_memory.mib(MiB + 1) == 2  # rounded up: a use is never shown smaller than it is

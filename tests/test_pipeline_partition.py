"""Stage planning: the dynamic program against brute force, the link term, errors, and profiling."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from trainers.pipeline.blocks import char_transformer_pipeline
from trainers.pipeline.partition import BlockCost, StagePlan, format_plan, plan_stages, profile_blocks


def _costs(rng: random.Random, n: int) -> list[BlockCost]:
    return [BlockCost(f"b{i}", rng.uniform(0.001, 0.1), rng.randrange(0, 40_000_000), rng.randrange(0, 10**6))
            for i in range(n)]


def _brute(costs: list[BlockCost], stages: int, link: float) -> tuple[float, int]:
    """(best bottleneck, fewest cut bytes among plans with that bottleneck) over every contiguous cut."""
    n = len(costs)
    plans = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = list(zip((0, *cuts), (*cuts, n)))
        times = [max(math.fsum(c.seconds for c in costs[lo:hi]),
                     2 * costs[lo - 1].out_bytes / link if lo else 0.0) for lo, hi in bounds]
        plans.append((max(times), sum(costs[c - 1].out_bytes for c in cuts)))
    best = min(t for t, _ in plans)
    return best, min(b for t, b in plans if t == best)


def _bottleneck_time(plan: StagePlan, costs: list[BlockCost], link: float) -> float:
    return max(max(plan.stage_seconds[s], 2 * plan.cut_bytes[s - 1] / link if s else 0.0)
               for s in range(len(plan.bounds)))


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for n in range(1, 9):
        costs = _costs(rng, n)
        for stages in range(1, min(4, n) + 1):
            for link in (1e12, 125e6, 1e9):  # link time negligible, dominant, comparable
                plan = plan_stages(costs, stages, link_bytes_per_s=link)
                assert len(plan.bounds) == stages and plan.bounds[0][0] == 0 and plan.bounds[-1][1] == n
                assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(plan.bounds, plan.bounds[1:]))
                best, fewest = _brute(costs, stages, link)
                assert _bottleneck_time(plan, costs, link) == best
                assert sum(plan.cut_bytes) == fewest
                assert [plan.stage_of_block(i) for i in range(n)] == [
                    s for s, (lo, hi) in enumerate(plan.bounds) for _ in range(lo, hi)]


def test_ties_prefer_fewer_bytes() -> None:
    # Cutting after a gives stages (1, 2) s, after b (2, 1) s: the same bottleneck; b's cut sends
    # 10 bytes instead of 100, so it wins.
    costs = [BlockCost("a", 1.0, 100, 0), BlockCost("b", 1.0, 10, 0), BlockCost("c", 0.5, 1000, 0),
             BlockCost("d", 0.5, 0, 0)]
    plan = plan_stages(costs, 2, link_bytes_per_s=1e12)
    assert plan.bounds == [(0, 2), (2, 4)] and plan.cut_bytes == [10]
    costs = [BlockCost("a", 1.0, 100, 0), BlockCost("b", 0.0, 10, 0), BlockCost("c", 1.0, 0, 0)]
    plan = plan_stages(costs, 2, link_bytes_per_s=1e12)  # cut after a or after b: both bottleneck 1.0
    assert plan.bounds == [(0, 2), (2, 3)] and plan.cut_bytes == [10]


def test_a_huge_cut_is_avoided() -> None:
    costs = [BlockCost(f"b{i}", 1.0, 10, 0) for i in range(4)]
    assert plan_stages(costs, 2).bounds == [(0, 2), (2, 4)]
    huge = list(costs)
    huge[1] = BlockCost("b1", 1.0, 10**9, 0)  # 2 GB over 125 MB/s = 16 s across the balanced cut
    plan = plan_stages(huge, 2)
    assert plan.bounds != [(0, 2), (2, 4)] and 10**9 not in plan.cut_bytes
    assert plan.bottleneck == (0 if plan.bounds[0][1] == 3 else 1)


def test_errors() -> None:
    costs = [BlockCost("a", 1.0, 1, 1), BlockCost("b", 1.0, 1, 1)]
    for bad in (dict(stages=0), dict(stages=3), dict(stages=1, link_bytes_per_s=0.0),
                dict(stages=1, link_bytes_per_s=-1.0), dict(stages=1, link_bytes_per_s=math.nan)):
        with pytest.raises(ValueError):
            plan_stages(costs, **bad)  # type: ignore[arg-type]
    for c in (BlockCost("x", math.inf, 1, 1), BlockCost("x", math.nan, 1, 1), BlockCost("x", -1.0, 1, 1),
              BlockCost("x", 1.0, -1, 1)):
        with pytest.raises(ValueError, match="block 1 \\(x\\)"):
            plan_stages([costs[0], c], 1)
    with pytest.raises(ValueError, match="outside"):
        plan_stages(costs, 2).stage_of_block(2)


def test_profile_and_format() -> None:
    model = char_transformer_pipeline(20, d_model=32, n_layers=2, n_heads=4, block=16, seed=0)
    x = torch.randint(0, 20, (4, 16))
    y = torch.randint(0, 20, (4, 16))
    before = {k: v.clone() for k, v in model.sequential().state_dict().items()}
    rng = torch.get_rng_state()
    costs = profile_blocks(model, x, y, repeats=2)
    assert [c.name for c in costs] == ["0:TokenEmbedding", "1:Block", "2:Block", "3:LMHead"]
    assert all(c.seconds > 0 for c in costs)
    assert [c.out_bytes for c in costs] == [4 * 16 * 32 * 4] * 3 + [4 * 16 * 20 * 4]
    assert costs[0].param_bytes == (20 + 16) * 32 * 4
    assert all(p.grad is None for p in model.sequential().parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.sequential().state_dict().items())
    plan = plan_stages(costs, 2)
    table = format_plan(plan, costs)
    assert "bottleneck" in table and "0:TokenEmbedding" in table and len(table.splitlines()) == 3


def test_a_profile_is_measured_once_per_home_and_model(tmp_path):
    """cached_profile measures at first, reads the file after; another key, or a damaged file, measures again."""
    from trainers.pipeline import partition

    model = char_transformer_pipeline(10, d_model=8, n_layers=1, n_heads=2, block=4, dropout=0.0, seed=0)
    x, y = torch.randint(0, 10, (2, 4)), torch.randint(0, 10, (2, 4))
    calls = []

    def measure():
        calls.append(1)
        return partition.profile_blocks(model, x, y, repeats=1)

    path = tmp_path / "sub" / "profile.json"
    first = partition.cached_profile(path, {"d": 8}, measure, len(model))
    again = partition.cached_profile(path, {"d": 8}, measure, len(model))
    assert len(calls) == 1 and again == first
    partition.cached_profile(path, {"d": 16}, measure, len(model))
    assert len(calls) == 2
    path.write_text("{not json")
    assert partition.cached_profile(path, {"d": 16}, measure, len(model)) and len(calls) == 3

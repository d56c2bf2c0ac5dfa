"""The rebalancing rules of peer/pipeline/stage_moves.py, pure: which peer moves to the bottleneck stage (and
when none does), that no two peers leave one stage at once (also in a seeded simulation of many peers deciding
on shared and stale views), who takes over an empty stage, and where a stage's state is fetched from."""

from __future__ import annotations

import random

import pytest

from peertrain.pipeline import StagePeer, StateSource
from protocol.schema.pipeline import StageAnnouncement, StageCopy
from peer.pipeline.stage_moves import (empty_stages, may_switch, plan_move, predicted_throughput, settling,
                                         state_sources, takeover_order)


def smap_of(stages: int, *peers: tuple) -> dict[int, list[StagePeer]]:
    """A stage map from (peer_id, stage, samples_per_s[, moving_to[, moved_from]]) tuples, sorted like
    peer/pipeline/directory.py's stage_map sorts it."""
    out: dict[int, list[StagePeer]] = {s: [] for s in range(stages)}
    for pid, stage, rate, *rest in peers:
        moving_to = rest[0] if rest else -1
        moved_from = rest[1] if len(rest) > 1 else -1
        out[stage].append(StagePeer(pid, stage, rate, 0, moving_to=moving_to, moved_from=moved_from))
    for ps in out.values():
        ps.sort(key=lambda p: p.peer_id)
    return out


# ---- predicted_throughput and settling ------------------------------------------------------------------

def test_predicted_throughput_is_the_slowest_stages_capacity():
    smap = smap_of(3, ("a", 0, 10.0), ("b", 0, 5.0), ("c", 1, 4.0), ("d", 2, 20.0))
    assert predicted_throughput(smap, [1.0, 1.0, 1.0]) == pytest.approx(4.0)
    assert predicted_throughput(smap_of(2, ("a", 0, 10.0)), [1.0, 1.0]) == 0.0  # an empty stage: nothing flows


def test_predicted_throughput_counts_an_unmeasured_peer_with_the_typical_speed():
    # measured speed factors 4 and 8: the unmeasured peer counts as 6
    smap = smap_of(2, ("a", 0, 0.0), ("b", 1, 4.0), ("c", 1, 8.0))
    assert predicted_throughput(smap, [1.0, 1.0]) == pytest.approx(6.0)
    # nothing measured at all: every peer counts as 1 sample/s at a stage of cost 1
    assert predicted_throughput(smap_of(2, ("a", 0, 0.0), ("b", 1, 0.0)), [1.0, 1.0]) == pytest.approx(1.0)
    # the typical speed is a speed factor: 2 seconds a sample at stage 1 make it half as many samples/s there
    assert predicted_throughput(smap_of(2, ("a", 0, 4.0), ("b", 1, 0.0)), [1.0, 2.0]) == pytest.approx(2.0)


def test_predicted_throughput_converts_a_peers_speed_by_the_stage_costs():
    # a does 6 samples/s of stage 0 (cost 1): speed factor 6; b does 1 sample/s of stage 1 (cost 3): factor 3
    smap = smap_of(2, ("a", 0, 6.0), ("b", 1, 1.0))
    assert predicted_throughput(smap, [1.0, 3.0]) == pytest.approx(1.0)
    # a announcing a move to stage 1 counts there (6 / 3 = 2 samples/s), leaving stage 0 empty
    moving = smap_of(2, ("a", 0, 6.0, 1), ("b", 1, 1.0), ("c", 0, 6.0))
    assert predicted_throughput(moving, [1.0, 3.0]) == pytest.approx(3.0)  # stage 0: c 6; stage 1: 1 + 2


def test_settling_while_a_peer_moves_or_lately_moved():
    assert not settling(smap_of(2, ("a", 0, 1.0), ("b", 1, 1.0)))
    assert settling(smap_of(2, ("a", 0, 1.0, 1), ("b", 1, 1.0)))
    assert settling(smap_of(2, ("a", 0, 1.0, -1, 1), ("b", 1, 1.0)))
    assert not settling(smap_of(2))


# ---- plan_move ------------------------------------------------------------------------------------------

COST3 = [1.0, 1.0, 1.0]


def test_a_peer_of_the_stage_with_the_most_spare_capacity_moves_to_a_four_times_slower_lone_peers_stage():
    smap = smap_of(3, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0), ("d", 1, 10.0), ("e", 1, 10.0),
                   ("f", 2, 2.5))
    plan = plan_move(smap, COST3, min_gain=0.1)
    assert plan is not None
    assert (plan.peer_id, plan.from_stage, plan.to_stage) == ("a", 0, 2)
    assert plan.before == pytest.approx(2.5) and plan.after == pytest.approx(12.5)
    assert "stage 2 is the bottleneck" in plan.reason and "stage 0" in plan.reason


def test_the_chosen_peer_gives_the_best_predicted_throughput():
    smap = smap_of(3, ("a", 0, 5.0), ("b", 0, 20.0), ("c", 0, 10.0), ("d", 1, 20.0), ("f", 2, 2.5))
    plan = plan_move(smap, COST3, min_gain=0.1)
    # b: stage 0 keeps 15, stage 2 gets 22.5 -> 15; c -> 12.5 (stage 2); a -> 7.5 (stage 2)
    assert plan.peer_id == "b" and plan.after == pytest.approx(15.0)


def test_the_best_move_is_weighed_with_the_stage_costs():
    # stage 1 costs twice stage 0: a peer at 8 samples/s on stage 0 does 4 on stage 1
    smap = smap_of(2, ("a", 0, 8.0), ("b", 0, 8.0), ("c", 1, 1.0))
    plan = plan_move(smap, [1.0, 2.0], min_gain=0.1)
    assert (plan.peer_id, plan.to_stage) == ("a", 1)
    assert plan.before == pytest.approx(1.0) and plan.after == pytest.approx(5.0)  # min(8, 1 + 4)


def test_ties_go_to_the_smallest_peer_id():
    smap = smap_of(2, ("zz", 0, 10.0), ("mm", 0, 10.0), ("aa", 0, 10.0), ("qq", 1, 1.0))
    assert plan_move(smap, [1.0, 1.0], min_gain=0.0).peer_id == "aa"


def test_no_move_below_min_gain():
    smap = smap_of(2, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 1, 9.0))
    plan = plan_move(smap, [1.0, 1.0], min_gain=0.1)  # 9 -> 10: +11%
    assert plan is not None and plan.after == pytest.approx(10.0)
    assert plan_move(smap, [1.0, 1.0], min_gain=0.12) is None
    # a balanced pipeline: no move helps at all, even with no hysteresis
    assert plan_move(smap_of(2, ("a", 0, 5.0), ("b", 0, 5.0), ("c", 1, 10.0)), [1.0, 1.0], min_gain=0.0) is None


def test_two_stages_about_as_slow_are_both_filled():
    """Four spare peers on stage 0, stages 1 and 2 each one slow peer (2.5 and 2.6 samples/s): moving one
    spare peer to stage 1 only raises the pipeline to stage 2's 2.6 (+4%), so the pipeline stays at 2.5 while
    40 samples/s of stage 0 idle. The rule: a move that lifts the bottleneck stage (and leaves its source) above
    today's throughput by min_gain, without lowering the minimum, is made (the sorted capacities rise, so moves
    cannot cycle); the next round fills stage 2."""
    smap = smap_of(3, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0), ("d", 0, 10.0), ("e", 1, 2.5),
                   ("f", 2, 2.6))
    plan = plan_move(smap, COST3, min_gain=0.1)
    assert plan is not None and plan.to_stage == 1 and plan.from_stage == 0, plan


def test_never_from_a_stage_with_one_peer():
    assert plan_move(smap_of(2, ("a", 0, 100.0), ("b", 1, 1.0)), [1.0, 1.0], min_gain=0.0) is None
    # stage 0's lone fast peer has the most spare capacity, but only stage 1 keeps a peer after a move
    smap = smap_of(3, ("a", 0, 100.0), ("b", 1, 10.0), ("c", 1, 10.0), ("d", 2, 1.0))
    plan = plan_move(smap, COST3, min_gain=0.1)
    assert (plan.peer_id, plan.from_stage) == ("b", 1)


def test_no_move_with_a_stage_empty():
    """An empty stage is takeover_order's case, not a rebalancing one."""
    assert plan_move(smap_of(3, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 1, 1.0)), COST3, min_gain=0.0) is None


def test_not_out_of_a_stage_a_peer_left_lately():
    base = [("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0), ("d", 1, 10.0), ("f", 2, 2.5)]
    # e serves stage 1 and left stage 0 lately: stage 0 cools down, the mover comes from stage 1
    smap = smap_of(3, *base, ("e", 1, 10.0, -1, 0))
    plan = plan_move(smap, COST3, min_gain=0.1)
    assert (plan.peer_id, plan.from_stage, plan.to_stage) == ("d", 1, 2)
    # both stages with spare peers cool down: nobody moves
    smap = smap_of(3, *base, ("e", 1, 10.0, -1, 0), ("g", 2, 1.0, -1, 1))
    assert plan_move(smap, COST3, min_gain=0.1) is None


def test_not_out_of_a_stage_a_peer_is_leaving_and_never_the_moving_peer_again():
    # c is leaving stage 0 for stage 1: stage 0 gives nobody else; c counts in stage 1 but is not a
    # candidate there (it does not serve stage 1 yet, and it is busy with its move)
    smap = smap_of(3, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0, 1), ("d", 1, 10.0), ("e", 1, 10.0),
                   ("f", 2, 2.5))
    plan = plan_move(smap, COST3, min_gain=0.1)
    assert plan is not None and (plan.peer_id, plan.from_stage, plan.to_stage) == ("d", 1, 2)
    # stage 1 counts c as good as there, so d may be named; may_switch keeps d until c serves stage 1
    smap = smap_of(3, ("a", 0, 10.0), ("c", 0, 10.0, 1), ("d", 1, 10.0), ("f", 2, 2.5))
    plan = plan_move(smap, COST3, min_gain=0.0)
    assert plan is not None and (plan.peer_id, plan.from_stage) == ("d", 1)
    assert "would have no peer left" in may_switch(smap, "d", 1)
    # with stage 1 cooling too (b left it lately), nobody at all moves: the mover is never named again
    smap = smap_of(3, ("a", 0, 10.0), ("c", 0, 10.0, 1), ("d", 1, 10.0), ("b", 2, 1.5, -1, 1), ("f", 2, 1.0))
    assert plan_move(smap, COST3, min_gain=0.0) is None


def test_a_peer_announcing_a_move_counts_in_its_target_so_a_second_peer_is_not_sent_to_the_same_gap():
    base = [("b", 0, 10.0), ("c", 0, 10.0), ("d", 1, 10.0), ("e", 1, 10.0), ("g", 1, 10.0), ("f", 2, 2.5),
            ("h", 3, 8.0)]
    first = plan_move(smap_of(4, ("a", 0, 10.0), *base), [1.0] * 4, min_gain=0.1)
    assert (first.peer_id, first.from_stage, first.to_stage) == ("a", 0, 2)
    # a claims that gap: stage 3 is the bottleneck now, and the next move fills it, from stage 1 (stage 0
    # cools down while a leaves it)
    smap = smap_of(4, ("a", 0, 10.0, 2), *base)
    assert predicted_throughput(smap, [1.0] * 4) == pytest.approx(8.0)
    plan = plan_move(smap, [1.0] * 4, min_gain=0.1)
    assert (plan.peer_id, plan.from_stage, plan.to_stage) == ("d", 1, 3)
    # with only one gap, claimed: no second peer goes there (were a counted in stage 0, d would: 2.5 -> 10)
    smap = smap_of(3, ("a", 0, 10.0, 2), ("b", 0, 10.0), ("c", 0, 10.0), ("d", 1, 10.0), ("e", 1, 10.0),
                   ("f", 2, 2.5))
    assert plan_move(smap, COST3, min_gain=0.1) is None


def test_an_unmeasured_peer_counts_with_the_typical_speed():
    # measured factors 12, 12, 3: typical 9. b (unmeasured) moving to stage 2 gives min(12, 12, 3 + 9) = 12;
    # a moving leaves stage 0 with b's 9. Were b counted as 0, nobody could leave stage 0 at all.
    smap = smap_of(3, ("a", 0, 12.0), ("b", 0, 0.0), ("c", 1, 12.0), ("d", 2, 3.0))
    plan = plan_move(smap, COST3, min_gain=0.1)
    assert plan.before == pytest.approx(3.0)
    assert plan.peer_id == "b" and plan.after == pytest.approx(12.0)
    # were the unmeasured peer counted as 0, stage 0 would be the bottleneck and nobody would move
    assert predicted_throughput(smap_of(2, ("a", 0, 0.0), ("b", 1, 5.0)), [1.0, 1.0]) == pytest.approx(5.0)


@pytest.mark.parametrize("cost", [[1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, -1.0, 1.0], []])
def test_a_bad_cost_list_raises(cost):
    smap = smap_of(3, ("a", 0, 1.0), ("b", 1, 1.0), ("c", 2, 1.0))
    with pytest.raises(ValueError, match="stage costs"):
        plan_move(smap, cost, min_gain=0.1)


# ---- may_switch: no two peers leave one stage at once ----------------------------------------------------

def test_of_two_peers_leaving_one_stage_only_the_smaller_id_goes():
    smap = smap_of(3, ("a", 0, 1.0, 1), ("b", 0, 1.0, 2), ("c", 0, 1.0), ("d", 1, 1.0), ("e", 2, 1.0))
    assert may_switch(smap, "a", 0) is None
    why = may_switch(smap, "b", 0)
    assert why is not None and "a is leaving stage 0" in why and "smaller peer ID" in why


def test_a_stage_left_with_no_peer_that_stays_refuses_every_leaver():
    smap = smap_of(3, ("a", 0, 1.0, 1), ("b", 0, 1.0, 2), ("d", 1, 1.0), ("e", 2, 1.0))
    for me in ("a", "b"):
        assert "stage 0 would have no peer left" in may_switch(smap, me, 0)
    assert "would have no peer left" in may_switch(smap_of(2, ("a", 0, 1.0, 1), ("b", 1, 1.0)), "a", 0)
    # one peer that stays is enough for one leaver
    assert may_switch(smap_of(2, ("a", 0, 1.0, 1), ("b", 0, 1.0), ("c", 1, 1.0)), "a", 0) is None


def test_a_peer_moving_into_a_stage_does_not_let_its_lone_peer_leave():
    """c's move into stage 1 is announced, not made: b is still stage 1's only server."""
    smap = smap_of(3, ("a", 0, 1.0), ("c", 0, 1.0, 1), ("b", 1, 1.0, 2), ("d", 2, 1.0))
    assert "would have no peer left" in may_switch(smap, "b", 1)


class Sim:
    """Peers with speed factors deciding moves from the stage map: every step each peer not moving runs
    plan_move on the view it holds (today's, or with `stale` chance the previous step's: records travel), the
    peer a plan names claims (announces moving_to) and downloads for 0-2 more steps, then asks may_switch on
    today's view, all such peers at once. A switch leaves `moved_from` announced for `cool` steps, and the
    mover's rate is unmeasured for a step."""

    def __init__(self, rng: random.Random, peers: int, stages: int, *, stale: float, cool: int = 3):
        self.rng, self.stale, self.cool = rng, stale, cool
        self.cost = [rng.uniform(0.5, 2.0) for _ in range(stages)]
        ids = [f"{rng.getrandbits(32):08x}" for _ in range(peers)]
        self.speed = {pid: rng.uniform(1.0, 20.0) for pid in ids}
        placed = list(range(stages)) + [rng.randrange(stages) for _ in range(peers - stages)]
        rng.shuffle(placed)
        self.stage = dict(zip(ids, placed))
        self.moving_to = dict.fromkeys(ids, -1)
        self.moved_from = dict.fromkeys(ids, -1)
        self.cool_until = dict.fromkeys(ids, 0)
        self.switch_at: dict[str, int] = {}
        self.unmeasured: set[str] = set()
        self.claims = self.switches = self.refusals = 0

    def view(self) -> dict[int, list[StagePeer]]:
        out: dict[int, list[StagePeer]] = {s: [] for s in range(len(self.cost))}
        for pid, s in self.stage.items():
            rate = 0.0 if pid in self.unmeasured else self.speed[pid] / self.cost[s]
            out[s].append(StagePeer(pid, s, rate, 0, moving_to=self.moving_to[pid], moved_from=self.moved_from[pid]))
        for ps in out.values():
            ps.sort(key=lambda p: p.peer_id)
        return out

    def step(self, t: int, previous: dict | None) -> tuple[dict, int]:
        if self.rng.random() < 0.3:  # a peer slows down or speeds up: the bottleneck moves
            self.speed[self.rng.choice(sorted(self.speed))] = self.rng.uniform(1.0, 20.0)
        self.unmeasured.clear()
        today = self.view()
        claims = 0
        for pid in sorted(self.stage):
            if self.moving_to[pid] >= 0:
                continue
            seen = previous if previous is not None and self.rng.random() < self.stale else today
            plan = plan_move(seen, self.cost, min_gain=0.05)
            if plan is None or plan.peer_id != pid or plan.to_stage == self.stage[pid]:
                continue
            self.moving_to[pid] = plan.to_stage
            self.switch_at[pid] = t + self.rng.randint(0, 2)
            claims += 1
        self.claims += claims
        claimed = self.view()  # every claim is seen before anyone switches (the mover's settle time)
        due = sorted(pid for pid, at in self.switch_at.items() if at <= t)
        verdicts = {pid: may_switch(claimed, pid, self.stage[pid]) for pid in due}  # all at once, same view
        left = {s: 0 for s in range(len(self.cost))}
        for pid in due:
            del self.switch_at[pid]
            if verdicts[pid] is None:
                old = self.stage[pid]
                left[old] += 1
                self.stage[pid], self.moved_from[pid], self.cool_until[pid] = self.moving_to[pid], old, t + self.cool
                self.unmeasured.add(pid)
                self.switches += 1
            else:
                self.refusals += 1
            self.moving_to[pid] = -1
        for pid, until in self.cool_until.items():
            if self.moved_from[pid] >= 0 and t >= until:
                self.moved_from[pid] = -1
        served = set(self.stage.values())
        assert served == set(range(len(self.cost))), f"step {t}: a stage went empty ({self.stage})"
        assert max(left.values()) <= 1, f"step {t}: two peers left one stage at once ({left})"
        return today, claims


@pytest.mark.parametrize("stale", [0.0, 0.5])
def test_simulated_peers_never_empty_a_stage_nor_leave_one_two_at_a_time(stale):
    rng = random.Random(17)
    totals = {"claims": 0, "switches": 0, "refusals": 0}
    for _ in range(120):
        stages = rng.randint(2, 5)
        sim = Sim(rng, peers=rng.randint(stages, 12), stages=stages, stale=stale)
        previous = None
        for t in range(40):
            previous, claims = sim.step(t, previous)
            if stale == 0.0:
                assert claims <= 1  # one shared view, one plan: at most one peer claims a move per step
        totals["claims"] += sim.claims
        totals["switches"] += sim.switches
        totals["refusals"] += sim.refusals
    assert totals["switches"] > 100, totals  # the simulation did move peers around
    if stale:
        assert totals["refusals"] > 0, totals  # and stale views made claims may_switch had to turn down


# ---- empty stages and who takes them over ----------------------------------------------------------------

def test_empty_stages_count_a_peer_moving_there_as_there():
    assert empty_stages(smap_of(3, ("a", 0, 1.0), ("b", 2, 1.0))) == [1]
    assert empty_stages(smap_of(3, ("a", 0, 1.0), ("c", 0, 1.0, 1), ("b", 2, 1.0))) == []
    assert empty_stages(smap_of(3, ("a", 0, 1.0))) == [1, 2]
    # a lone peer announcing a move away counts where it goes: its own stage reads as empty
    assert empty_stages(smap_of(2, ("a", 0, 1.0, 1), ("b", 1, 1.0))) == [0]


def test_takeover_order_puts_the_freshest_copy_holder_first_then_throughput_then_id():
    # stage 2 is empty; stage 3's lone peer h never goes
    smap = smap_of(4, ("a", 0, 10.0), ("b", 0, 30.0), ("c", 0, 20.0), ("d", 1, 20.0), ("e", 1, 20.0),
                   ("h", 3, 20.0))
    order = takeover_order(smap, [1.0] * 4, 2, {"e": 50, "a": 40})
    assert [m.peer_id for m in order][0] == "e"  # holds the freshest copy: first, whatever its throughput
    assert "freshest copy (step 50)" in order[0].reason and all("freshest" not in m.reason for m in order[1:])
    # the rest by the throughput with them moved (h's stage 3 has 20): a -> 10 on stage 2; b, c, d -> 20: ties
    # by ID
    assert [m.peer_id for m in order] == ["e", "b", "c", "d", "a"]
    assert all(m.to_stage == 2 and "stage 2 has no peer" in m.reason for m in order)
    assert "h" not in [m.peer_id for m in order]
    assert [m.peer_id for m in takeover_order(smap, [1.0] * 4, 2, {})] == ["b", "c", "d", "e", "a"]


def test_a_peer_whose_stage_has_one_peer_is_never_a_taker_even_with_the_freshest_copy():
    smap = smap_of(3, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 1, 50.0))
    order = takeover_order(smap, [1.0] * 3, 2, {"c": 99})
    assert [m.peer_id for m in order] == ["a", "b"]
    assert takeover_order(smap_of(3, ("a", 0, 1.0), ("c", 1, 1.0)), [1.0] * 3, 2, {"a": 1}) == []


def test_a_moving_peer_is_not_a_taker():
    # c is moving to stage 1; stage 3 is empty. c counts in stage 1 but serves stage 0 still, busy moving.
    smap = smap_of(4, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 0, 10.0, 1), ("d", 1, 10.0), ("e", 2, 10.0))
    order = takeover_order(smap, [1.0] * 4, 3, {"c": 7})
    assert "c" not in [m.peer_id for m in order]
    assert [m.peer_id for m in order] == ["a", "b", "d"]


def test_a_copy_held_outside_the_stage_map_does_not_hide_the_freshest_live_holder():
    """Seating passes every announced copy of the stage (any pipeline, dead peers too): only copies of
    peers on this stage map can make a taker."""
    smap = smap_of(3, ("a", 0, 10.0), ("b", 0, 10.0), ("c", 1, 10.0))
    order = takeover_order(smap, [1.0] * 3, 2, {"b": 40, "gone": 90})
    assert order[0].peer_id == "b" and "freshest copy (step 40)" in order[0].reason


# ---- state sources ---------------------------------------------------------------------------------------

def _ann(stage: int, step: int, *, name: str = "p", copies=()) -> StageAnnouncement:
    return StageAnnouncement(name, stage, 4, cuts=[1, 2, 3], step=step, copies=[StageCopy(s, st) for s, st in copies])


def test_state_sources_freshest_first_live_before_a_copy_of_the_same_step():
    anns = {
        "a": _ann(1, 10),  # serves stage 1 at step 10
        "b": _ann(0, 5, copies=[(1, 12), (2, 30)]),  # keeps a copy of stage 1 at step 12
        "c": _ann(1, 12),  # serves stage 1 at step 12
        "d": _ann(3, 1, copies=[(1, 11)]),
        "e": _ann(2, 30),  # serves another stage
        "me": _ann(1, 99),  # we never fetch from ourselves
        "dead": _ann(1, 100),
        "other": _ann(1, 100, name="q"),  # another pipeline's stage 1
    }
    live = {"a", "b", "c", "d", "e", "me", "other"}
    got = state_sources(anns, live, lambda a: a.pipeline == "p", 1, "me")
    assert got == [StateSource("c", 12, True), StateSource("b", 12, False), StateSource("d", 11, False), StateSource("a", 10, True)]
    assert state_sources(anns, live, lambda a: a.pipeline == "p", 2, "me") == [StateSource("e", 30, True),
                                                                               StateSource("b", 30, False)]
    assert state_sources(anns, set(), lambda a: True, 1, "me") == []


def test_state_sources_at_equal_step_and_kind_go_by_peer_id():
    anns = {"z": _ann(1, 3), "y": _ann(1, 3), "x": _ann(0, 0, copies=[(1, 3)])}
    got = state_sources(anns, {"x", "y", "z"}, lambda a: True, 1, "me")
    assert [(s.peer_id, s.live) for s in got] == [("y", True), ("z", True), ("x", False)]


def test_a_move_that_only_shuffles_which_stage_is_slowest_is_not_made():
    """Stage 1 (20.3/s) is the bottleneck and stage 2 has two peers of 25/s: moving one to stage 1 lifts the
    pipeline only to stage 0's 20.5 (+1%), and no second move gets past stage 3's 20.6: nothing is worth a move.
    With stage 3 at 30/s, the same first move and one more (stage 1's slow peer to stage 0) reach 25/s (+23%)."""
    cost = [1.0, 1.0, 1.0, 1.0]
    shuffle = smap_of(4, ("a", 0, 20.5), ("b", 1, 20.3), ("c", 2, 25.0), ("d", 2, 25.0), ("e", 3, 20.6))
    assert plan_move(shuffle, cost, min_gain=0.1) is None
    two_step = smap_of(4, ("a", 0, 20.5), ("b", 1, 20.3), ("c", 2, 25.0), ("d", 2, 25.0), ("e", 3, 30.0))
    plan = plan_move(two_step, cost, min_gain=0.1)
    assert plan is not None and (plan.from_stage, plan.to_stage) == (2, 1), plan
    assert plan.after == pytest.approx(20.5) and "with one more move" in plan.reason, plan

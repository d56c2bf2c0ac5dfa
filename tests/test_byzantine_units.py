"""The attack library without processes: the crafted models (peer/testing/byzantine_craft.py), the liar's options
(peer/testing/byzantine_trainer.py), the harness's registry (peer/testing/byzantine.py) and the bench's figures
(peer/bench/byzantine.py). The attacks against real daemons: tests/test_byzantine.py and the bench."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from peer.bench.byzantine import _figures, _fractions
from peer.testing.byzantine import ATTACKS, SwarmPlan
from peer.testing import byzantine_craft as craft
from peer.testing.byzantine_trainer import NAME, ByzantineOptions, check, flipped_digits
from trainers.datasets import load_digits
from trainers.gossip_sgd import GossipSGDOptions
from trainers.options import parse_options


def _models(n: int, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)] for i in range(n)}


def _flat(model: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in model])


def test_mean_and_spread_are_coordinate_wise() -> None:
    ms = _models(4)
    stack = torch.stack([_flat(m) for m in ms.values()])
    assert torch.allclose(_flat(craft.mean(list(ms.values()))), stack.mean(0))
    assert torch.allclose(_flat(craft.std(list(ms.values()))), stack.std(0))
    one = [list(ms.values())[0]]
    assert all(float(t.abs().sum()) == 0.0 for t in craft.std(one))  # one model: no spread seen yet
    with pytest.raises(ValueError):
        craft.mean([])


def test_sign_flip_scaled_and_ipm_are_multiples_of_the_honest_mean() -> None:
    ms = _models(3)
    mu = _flat(craft.mean(list(ms.values())))
    assert torch.allclose(_flat(craft.craft("sign_flip", ms)), -mu)
    assert torch.allclose(_flat(craft.craft("scaled", ms, scale=-4.0)), -4 * mu)
    assert torch.allclose(_flat(craft.craft("ipm", ms, epsilon=0.1)), -0.1 * mu)
    assert torch.allclose(_flat(craft.craft("ipm", ms, epsilon=10.0)), -10 * mu)


def test_alie_stays_within_z_deviations_of_the_mean_in_every_coordinate() -> None:
    ms = _models(6)
    mu, sigma = (_flat(x) for x in (craft.mean(list(ms.values())), craft.std(list(ms.values()))))
    for z in (0.0, 0.5, 1.0):
        x = _flat(craft.craft("alie", ms, z=z))
        assert torch.all((x - mu).abs() <= z * sigma + 1e-6)
        assert torch.allclose(x, mu - z * sigma)


def test_dissensus_pushes_the_victim_away_from_its_neighbours_mean() -> None:
    ms = _models(4)
    v = _flat(ms["p0"])
    m = torch.stack([_flat(ms[p]) for p in ("p1", "p2", "p3")]).mean(0)
    x = _flat(craft.craft("dissensus", ms, epsilon=1.5, victim="p0"))
    assert torch.allclose(x, v - 1.5 * (m - v), atol=1e-6)
    # on the far side of the victim from the mean, 1.5 times the victim's own distance from it
    assert math.isclose(float((x - v).norm()), 1.5 * float((m - v).norm()), rel_tol=1e-5)
    assert float((x - m).norm()) > float((v - m).norm())
    alone = _flat(craft.craft("dissensus", {"p0": ms["p0"]}, epsilon=1.5, victim="p0"))
    assert torch.allclose(alone, v)  # no neighbour seen: nothing to push from
    with pytest.raises(ValueError, match="victim"):
        craft.craft("dissensus", ms, epsilon=1.5, victim="nobody")
    with pytest.raises(ValueError, match="unknown attack"):
        craft.craft("gradient_ascent", ms)


def test_drift_sits_a_fixed_multiple_of_the_honest_spread_out_along_one_direction_colluders_share() -> None:
    ms = _models(4)
    mu = _flat(craft.mean(list(ms.values())))
    widest = max(float((_flat(ms[a]) - _flat(ms[b])).norm()) for a in ms for b in ms if a < b)
    x = _flat(craft.craft("drift", ms, epsilon=6.0, seed=40))
    assert math.isclose(float((x - mu).norm()), 6.0 * widest, rel_tol=1e-5)
    other = _flat(craft.craft("drift", _models(4, seed=1), epsilon=6.0, seed=40))  # an ally, other neighbours
    mu1 = _flat(craft.mean(list(_models(4, seed=1).values())))
    cos = float(torch.nn.functional.cosine_similarity(x - mu, other - mu1, dim=0))
    assert cos > 0.999  # the same direction: the colluders push one way
    lone = {"p0": ms["p0"]}
    assert torch.allclose(_flat(craft.craft("drift", lone, epsilon=6.0)), _flat(ms["p0"]))  # no spread seen yet


def test_baruch_z_follows_their_rule() -> None:
    # s = floor(n/2 + 1) - f supporters; z = Φ⁻¹((n - s) / n), not below 0
    assert craft.baruch_z(8, 1) == 0.0  # s = 4: (8 - 4) / 8 = 0.5
    assert math.isclose(craft.baruch_z(8, 2), 0.3186, abs_tol=1e-3)  # s = 3: 5/8
    assert math.isclose(craft.baruch_z(16, 4), 0.4888, abs_tol=1e-3)  # s = 5: 11/16
    assert math.isclose(craft.baruch_z(50, 24), 1.7507, abs_tol=1e-3)  # s = 2: 48/50 (their paper's scale)
    for n, f in ((1, 0), (8, 8), (8, -1)):
        with pytest.raises(ValueError):
            craft.baruch_z(n, f)


@pytest.mark.parametrize("key,value", [
    ("attack", "gradient_ascent"), ("epsilon", float("nan")), ("epsilon", -1.0), ("interval", -0.1),
    ("learn_every", 0.0), ("z", -2.0), ("z", float("inf")), ("scale", float("nan")), ("sleep_exchanges", -1),
    ("byzantine", -1), ("mode", "allreduce"), ("allies", ["x"] * 65), ("allies", [""]),
])
def test_liar_options_out_of_range_are_refused_naming_the_key(key, value) -> None:
    o = dataclasses.replace(ByzantineOptions(), **{key: value})
    with pytest.raises(ValueError, match=rf"\[trainer.options\] {key}:"):
        check(o)


def test_every_attack_of_the_registry_parses_as_its_trainer_takes_it() -> None:
    """The harness names options the trainers must accept: a typo there would fail only in a daemon."""
    for a in ATTACKS.values():
        if a.honest_trainer:
            parse_options(GossipSGDOptions, a.options, trainer="trainers.gossip_sgd")
        else:
            check(parse_options(ByzantineOptions, a.options, trainer=NAME))
    detectable = {a.name for a in ATTACKS.values() if a.detectable}
    assert detectable == {"sign_flip", "scaled", "ipm_10", "sleeper"}  # the issue's; the others are bounded


def test_flipped_digits_flip_training_labels_only() -> None:
    train, test = flipped_digits()
    true_train, true_test = load_digits(as_images=True)
    assert torch.equal(train.y, 9 - true_train.y) and torch.equal(train.x, true_train.x)
    assert torch.equal(test.y, true_test.y)


def test_swarm_plan_and_fractions_are_checked() -> None:
    topo = {"kind": "rewired"}
    with pytest.raises(ValueError):
        SwarmPlan(honest=1, liars=1, attack="sign_flip", topology=topo, honest_options={})
    with pytest.raises(ValueError):
        SwarmPlan(honest=4, liars=1, attack=None, topology=topo, honest_options={})
    with pytest.raises(ValueError):
        SwarmPlan(honest=4, liars=1, attack="nope", topology=topo, honest_options={})
    assert _fractions("1/8,1/4", 8) == [("1/8", 1), ("1/4", 2)]
    assert _fractions("1/16", 8) == [("1/16", 1)]  # at least one liar
    for bad in ("0", "1", "7/8"):
        with pytest.raises(ValueError):
            _fractions(bad, 8)


def _run(accs: list[float], *, bans: dict | None = None, fp: int = 0, metric: str = "accuracy") -> dict:
    liars = bans or {}
    return {"peers": [{"state": "done", metric: a} for a in accs], "wall_s": 1.0, "liars": [],
            "watch": {"liars": liars, "honest_banned": fp, "false_positives": []}}


def test_figures_compare_worst_and_mean_with_the_no_attack_run() -> None:
    ref = _run([0.97, 0.96, 0.98])
    liar = {"x": {"honest_partners": 3, "banned_by": 2, "exchanges_until_ban_max": 4, "exchanges_until_ban_mean": 3.5,
                  "seconds_until_first_ban": 2.0, "woke_after_s": 1.0, "exchanges_with_honest": 9, "ban_reason": "far"}}
    f = _figures(_run([0.95, 0.10, 0.97], bans=liar), ref, "sign_flip", "accuracy")
    assert f["worst"] == 0.1 and f["worst_drop"] == 86.0 and f["liars_banned"] == 1 and f["exchanges_until_ban"] == 4
    failed = _run([0.97, 0.96])
    failed["peers"].append({"state": "failed: FloatingPointError: loss became nan", "accuracy": 0.9})
    g = _figures(failed, ref, None, "accuracy")
    assert g["worst"] == 0.0 and g["failed_peers"] == 1  # a diverged peer counts as 0
    lm = _figures(_run([2.5, 2.6], metric="test_loss"), _run([2.4, 2.45], metric="test_loss"), None, "test_loss")
    assert lm["worst_drop"] == 0.15  # a loss: how much higher than without attack
    ref["watch"]["radius_max"] = {"to_honest": 2.0, "to_liars": 0.0}
    pushed = _run([0.95, 0.9, 0.97], bans=liar)
    pushed["watch"]["radius_max"] = {"to_honest": 9.0, "to_liars": 12.0}
    r = _figures(pushed, ref, "drift", "accuracy")
    assert r["radius_max_to_honest"] == 9.0 and r["radius_ratio_vs_none"] == 4.5  # the ratchet, among real daemons


class _Group:
    def __init__(self, model: list[torch.Tensor]):
        import threading

        self.lock, self.step = threading.Lock(), 0
        self.tensors = {f"p{i}": t.clone() for i, t in enumerate(model)}


class _Swarm:
    """What the liar asks of its daemon: neighbours, downloads (recording what we held meanwhile), exchanges."""

    def __init__(self, models: dict, group: _Group):
        self.models, self.group, self.step = models, group, 10
        self.held_while_fetching: list[torch.Tensor] = []
        self.counts = {"initiated": 0, "served": 0}
        self.results: dict = {}

    def neighbours(self) -> list[str]:
        return sorted(self.models)

    def fetch_params(self, group: str, peer_id: str):
        self.held_while_fetching.append(_flat(list(self.group.tensors.values())))
        return [t.clone() for t in self.models[peer_id]], self.step

    def exchanges(self) -> dict:
        return dict(self.counts)

    def average_with(self, group: str, peer_id: str):
        from peertrain.swarm import ExchangeResult

        return self.results.get(peer_id) or ExchangeResult(peer_id, True)


def _liar(**options):
    from peer.testing.byzantine_trainer import Liar

    models = _models(3)
    initial = [torch.zeros(3, 4), torch.zeros(5)]
    group = _Group(initial)
    swarm = _Swarm({**models, "ally": [torch.full((3, 4), 1e6), torch.full((5,), 1e6)]}, group)
    o = dataclasses.replace(ByzantineOptions(), allies=["ally"], **options)
    check(o)
    return Liar(swarm, o, group, list(group.tensors), initial), swarm, models


def test_liar_learns_holding_the_honest_mean_and_never_from_allies() -> None:
    liar, swarm, models = _liar(attack="sign_flip")
    liar.learn()
    assert sorted(liar.honest) == sorted(models)  # not the ally
    assert all(float(h.abs().sum()) == 0.0 for h in swarm.held_while_fetching)  # the initial model, not a lie
    mu = _flat(craft.mean(list(models.values())))
    liar.write(liar.crafted(attacking=True))
    assert torch.allclose(_flat(list(liar.group.tensors.values())), -mu) and liar.group.step == 10
    swarm.held_while_fetching.clear()
    liar.learn()
    assert all(torch.allclose(h, mu) for h in swarm.held_while_fetching)  # the honest mean learnt, while fetching


def test_sleeper_holds_the_honest_mean_until_its_exchanges_are_spent() -> None:
    liar, swarm, models = _liar(attack="sign_flip", sleep_exchanges=5)
    liar.learn()
    mu = _flat(craft.mean(list(models.values())))
    assert liar.sleeping() and torch.allclose(_flat(liar.crafted(not liar.sleeping())), mu)
    swarm.counts = {"initiated": 2, "served": 3}
    assert not liar.sleeping() and torch.allclose(_flat(liar.crafted(not liar.sleeping())), -mu)


def test_liar_paces_itself_as_an_honest_peer_and_leaves_refusing_peers_alone() -> None:
    from peertrain.swarm import ExchangeResult
    from protocol.refusal import Code

    liar, swarm, models = _liar(attack="sign_flip", steps_per_exchange=2)
    liar.learn()
    assert not liar.training()  # one download: no pace yet
    swarm.step = 30
    liar.pace[0] = (liar.pace[0][0] - 2.0, 10)  # 20 steps in the 2 s before this download
    liar.learn()
    assert liar.training() and math.isclose(liar.interval(), 2 * 2.0 / 20, rel_tol=0.05)
    swarm.results["p1"] = ExchangeResult("p1", False, "banned for 60s", code=Code.BANNED)
    liar.exchange("p1")
    assert liar.counts["refused_banned"] == 1
    assert all(liar.pick() in ("p0", "p2") for _ in range(50))  # not p1 (it banned us), never the ally


def test_dissensus_liar_keeps_one_learnt_victim() -> None:
    liar, swarm, models = _liar(attack="dissensus")
    liar.learn()
    mu = _flat(craft.mean(list(models.values())))  # before it picks a victim (the honest peers not yet training)
    assert torch.allclose(_flat(liar.crafted(True)), mu)  # it holds the honest mean (it crashed here in CI)
    victim = liar.pick()
    assert victim == "p0" and all(liar.pick() == victim for _ in range(5))
    x = _flat(liar.crafted(True))
    v, m = _flat(models["p0"]), torch.stack([_flat(models[p]) for p in ("p1", "p2")]).mean(0)
    assert torch.allclose(x, v - 1.5 * (m - v), atol=1e-5)  # its default ε

"""Local steps with an outer optimizer, gossiped (peertrain/outer.py, gossip_sgd mode = "local"): the outer
step's arithmetic, error feedback keeping the swarm's sum, download-only state, and real daemons training a
small char transformer: pulled together and no worse than the same peers training alone, 8-bit as well as
float32, and a peer killed mid-round or joining late never holding the others up."""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import numpy as np
import pytest
import torch

import peertrain
from peer.averaging.shared import SharedTensors
from peer.control import call
from peer.testing.process import wait_for
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config, unique_swarm
from tests.daemons import trainer_steps
from tests.test_torch_data import LoneSwarm
from trainers import gossip_sgd

# A char transformer small enough for tests: 200 steps take ~2 s in one process here.
TINY = {"model": "char_transformer", "model_options": {"d_model": 64, "n_layers": 2, "n_heads": 4, "block": 32},
        "batch_size": 16, "lr": 3e-3, "optimizer": "adam", "threads": 1, "checkpoint_every": 0}
STEPS = 200  # per peer; 4 peers see as many samples as one process does in STEPS steps of 4x the batch


class Recorder(LoneSwarm):
    """A peer alone: shares are kept, averaging does nothing (the outer step's own arithmetic is tested)."""

    def share(self, name, tensors, *, lock=None, partners=None, codec=None, error_feedback=False, averaged=True):
        group = SharedTensors(name, tensors, lock=lock, codec=codec, error_feedback=error_feedback, averaged=averaged)
        self.groups = getattr(self, "groups", {})
        self.groups[name] = group
        return group

    def average(self, group, *, mode="one"):
        return []


# ---- the outer step ---------------------------------------------------------------------------------


def test_outer_step_is_nesterov_on_the_pseudo_gradient_and_restarts_the_round():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    w0 = model.weight.detach().clone()
    swarm = Recorder()
    opt = peertrain.LocalStepsOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, inner_steps=2,
                                        outer_lr=0.5, outer_momentum=0.9, background=False)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if opt.local_step == 1:
            theta_before_last = model.weight.detach().clone()
            grad = model.weight.grad.clone()
        opt.step()
    theta_h = theta_before_last - 0.1 * grad  # where the inner steps took it
    delta = w0 - theta_h  # the pseudo-gradient
    m = delta  # first round: momentum = delta
    expected = w0 - 0.5 * (delta + 0.9 * m)  # Nesterov
    assert torch.allclose(opt.slow["p0"], expected, atol=1e-6)
    assert torch.equal(model.weight.detach(), opt.slow["p0"]) and torch.equal(opt.start["p0"], opt.slow["p0"])
    assert opt.rounds == 1 and torch.allclose(opt.momentum["p0"], m)
    assert swarm.groups["model.outer"].averaged is False  # the momentum is only served to joiners

    state = opt.state_dict()
    other = peertrain.LocalStepsOptimizer(torch.optim.SGD(torch.nn.Linear(3, 1, bias=False).parameters(), lr=0.1),
                                          Recorder(), inner_steps=2)
    other.load_state_dict(state)
    assert torch.equal(other.slow["p0"], opt.slow["p0"]) and other.rounds == 1 and other.local_step == 2


def test_a_checkpoint_may_stream_the_live_outer_state_while_it_is_held_still():
    """`state_dict(copy=False)` hands the live outer tensors (no 3 copies of the model), for a writer holding
    `locked()`; what it writes loads back as the copied state does."""
    import io

    model = torch.nn.Linear(3, 1, bias=False)
    opt = peertrain.LocalStepsOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), Recorder(), inner_steps=2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()
    copied = opt.state_dict()
    assert copied["outer"]["slow"]["p0"].data_ptr() != opt.slow["p0"].data_ptr()
    buf = io.BytesIO()
    with opt.locked():
        assert opt.shared.lock.locked() and opt.outer_state.lock.locked()  # the daemon's exchanges wait, or owe
        live = opt.state_dict(copy=False)
        assert all(live["outer"][part]["p0"].data_ptr() == getattr(opt, part)["p0"].data_ptr()
                   for part in ("slow", "momentum", "start"))
        torch.save(live, buf)
    assert not opt.shared.lock.locked()
    other = peertrain.LocalStepsOptimizer(torch.optim.SGD(torch.nn.Linear(3, 1, bias=False).parameters(), lr=0.1),
                                          Recorder(), inner_steps=2)
    other.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    for part in ("slow", "momentum", "start"):
        assert torch.equal(getattr(other, part)["p0"], copied["outer"][part]["p0"])


@pytest.mark.parametrize("bad, says", [(dict(inner_steps=0), "inner_steps"), (dict(outer_lr=float("nan")), "outer_lr"),
                                       (dict(outer_momentum=1.0), "outer_momentum"), (dict(mode="ring"), "mode")])
def test_bad_outer_settings_are_named(bad, says):
    with pytest.raises(ValueError, match=says):
        peertrain.LocalStepsOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), Recorder(), **bad)


def test_the_outer_step_follows_the_models_recipe_unless_set():
    """DiLoCo's outer Nesterov (0.7, 0.9) scales a round's move by up to 7: over the digits models' inner SGD
    with momentum 0.9 it diverged (digits_cnn alone fell to 10%), so their recipe averages the rounds plainly."""
    from trainers.gossip_sgd import GossipSGDOptions, _recipe

    def outer(**o):
        hp = _recipe(GossipSGDOptions(**o), 4)
        return hp["outer_lr"], hp["outer_momentum"]
    assert outer(model="digits_cnn") == (1.0, 0.0)
    assert outer(model="char_transformer") == (0.7, 0.9)
    assert outer(model="digits_cnn", outer_lr=0.5, outer_momentum=0.9) == (0.5, 0.9)
    assert outer(model="digits_cnn", outer_momentum=0.0) == (1.0, 0.0)  # 0 is a momentum, not "the recipe's"
    assert outer(model="", model_factory="m:f", lr=0.1, batch_size=8, max_steps=10) == (0.7, 0.9)


def test_error_feedback_carries_the_rounding_and_keeps_the_pair_sum():
    """Two groups exchanging with q8 as the engine does: each sends q(x + r), both apply w (q_b - q_a) with
    opposite signs, so the sum is exact; each residual becomes what its send left out."""
    rng = np.random.default_rng(0)
    a = SharedTensors("g", {"x": rng.standard_normal(4096).astype(np.float32)}, codec="q8", error_feedback=True)
    b = SharedTensors("g", {"x": rng.standard_normal(4096).astype(np.float32)}, codec="q8", error_feedback=True)
    total0 = float(a.tensors["x"].astype(np.float64).sum() + b.tensors["x"].astype(np.float64).sum())
    for _ in range(20):
        own_a, own_b = a.snapshot(), b.snapshot()
        ca, cb = a.add_residual(own_a, "q8"), b.add_residual(own_b, "q8")
        assert ca and cb and not a.add_residual(a.snapshot(), "q8")  # one exchange at a time holds it
        sent_a, sent_b = a.as_sent(own_a, "q8"), b.as_sent(own_b, "q8")
        a.apply(1 / 3, sent_b, sent_a)
        b.apply(1 / 3, sent_a, sent_b)
        a.keep_residual(own_a, sent_a)
        b.keep_residual(own_b, sent_b)
        assert np.allclose(a._residual[0], own_a[0] - sent_a[0])
    total = float(a.tensors["x"].astype(np.float64).sum() + b.tensors["x"].astype(np.float64).sum())
    assert abs(total - total0) < 1e-3 * max(1.0, abs(total0))
    assert np.abs(a.tensors["x"] - b.tensors["x"]).max() < 0.05  # they converged, to within the rounding
    # an exchange that did not commit leaves the residual as it was
    before = a._residual[0].copy()
    own = a.snapshot()
    assert a.add_residual(own, "q8")
    a.keep_residual(own, None)
    assert np.array_equal(a._residual[0], before) and not a._residual_busy


# ---- real daemons -----------------------------------------------------------------------------------


def _swarm_options(**extra) -> dict:
    return {**TINY, "mode": "local", "inner_steps": 20, "max_steps": STEPS, "eval_every": STEPS, "world": 4, **extra}


def _run_four(tmp_path, name: str, **extra) -> list[dict]:
    """Four daemons train in local mode to STEPS; each one's final trainer status."""
    with LocalSwarm(tmp_path / name) as swarm:
        cfg = swarm_config(swarm=unique_swarm("loc"), trainer="trainers.gossip_sgd", options=_swarm_options(**extra),
                           topology={"kind": "full", "target_degree": 3, "min_degree": 3})
        swarm.start_nodes(4, cfg)
        swarm.wait(lambda sts: all(s and s.get("trainer", {}).get("state") == "done" for s in sts), timeout=240,
                   what="four local-mode peers to finish", interval=0.25,
                   progress=trainer_steps)
        return [s["trainer"] | {"bytes_out": sum(p["bytes_out"] for p in s["peers"])} for s in swarm.statuses()]


def _alone() -> tuple[list[dict], list[dict[str, np.ndarray]]]:
    """The same four peers (shards, steps, options) each training alone, in this process: no averaging.
    Each one's final trainer figures and outer weights."""
    peers = [Recorder(rank, 4) for rank in range(4)]
    figures = [gossip_sgd.run(p, {**_swarm_options(), "join_wait": 0.0}) for p in peers]
    return figures, [{k: np.asarray(t, dtype=np.float64) for k, t in p.groups["model"].tensors.items()} for p in peers]


def outer_weights(daemon) -> dict[str, np.ndarray]:
    """A daemon's outer weights (group "model") as they are now, read through its control socket."""
    values = call(daemon.home, "group_stats", {"values": True})["model"]["values"]
    return {str(i): np.frombuffer(v, dtype=np.float32).astype(np.float64) for i, v in enumerate(values)}


def farthest_apart(weights: list[dict[str, np.ndarray]]) -> float:
    """The largest `_relative_distance` between two of `weights`."""
    return max(_relative_distance(a, b) for a, b in itertools.permutations(weights, 2))


def _relative_distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """||b - a|| / ||a|| over all tensors: what a peer's `consensus_distance` reports at an exchange."""
    diff = sum(float(((b[k] - a[k]) ** 2).sum()) for k in a)
    return (diff / sum(float((a[k] ** 2).sum()) for k in a)) ** 0.5


@pytest.mark.slow
def test_four_peers_in_local_mode_train_together_no_worse_than_alone_and_8_bit_matches_float32(tmp_path):
    alone, alone_weights = _alone()
    raw = _run_four(tmp_path, "raw", outer_codec="raw")
    q8 = _run_four(tmp_path, "q8", outer_codec="q8", outer_error_feedback=True)
    for run in (raw, q8):
        assert all(t["rounds"] == STEPS // 20 for t in run), run
    mean_alone = statistics.mean(t["test_loss"] for t in alone)
    mean_raw = statistics.mean(t["test_loss"] for t in raw)
    mean_q8 = statistics.mean(t["test_loss"] for t in q8)
    # Averaging pulls the replicas together: alone, the four drift to 0.40-0.41 of their norm apart by step
    # 200; averaged, each peer's last exchange measured 0.065-0.075 (4 runs). Half the closest alone pair
    # leaves that 3x room and fails at once if no exchange lands (a peer with none reports None).
    apart = min(_relative_distance(a, b) for a, b in itertools.permutations(alone_weights, 2))
    for run in (raw, q8):
        assert all(t["consensus_distance"] is not None and t["consensus_distance"] < 0.5 * apart for t in run), \
            ([t["consensus_distance"] for t in run], apart)
    # ... and costs no quality against the same peers alone. It does not beat them yet at 200 steps: measured
    # 0.996-1.008 of alone's loss (5 runs; alone ~2.415). Exchanges land one round stale (background) and
    # without a barrier, which takes the gain a synchronous mean would give (four in-process peers, an exact
    # mean each round: 0.963 of alone; pairwise: 0.973; pairwise one round stale: 0.996-1.012). 2% is 2.5x the
    # worst of the daemons' runs; an averaging that hurts fails.
    assert mean_raw <= 1.02 * mean_alone, (mean_raw, mean_alone)
    assert abs(mean_q8 - mean_raw) <= 0.03 * mean_raw, (mean_q8, mean_raw)  # measured within 0.3%
    assert sum(t["bytes_out"] for t in q8) < 0.5 * sum(t["bytes_out"] for t in raw)


@pytest.mark.slow
def test_four_peers_push_sparse_updates_to_each_other_and_their_replicas_stay_together(tmp_path):
    """outer_codec "sparse": every round's update, 64 of every 4096 values, goes to every partner, and every
    peer adds every push it takes (peer/averaging/pushes.py). With no dense exchange at all (resync every 25
    rounds of 10), once the last pushes have landed the replicas hold the same weights; on a few percent of
    the bytes, with no honest push clipped."""
    with LocalSwarm(tmp_path / "sparse") as swarm:
        cfg = swarm_config(swarm=unique_swarm("spr"), trainer="trainers.gossip_sgd",
                           options=_swarm_options(outer_codec="sparse"),
                           topology={"kind": "full", "target_degree": 3, "min_degree": 3})
        daemons = swarm.start_nodes(4, cfg)
        swarm.wait(lambda sts: all(s and s.get("trainer", {}).get("state") == "done" for s in sts), timeout=240,
                   what="four sparse local-mode peers to finish", interval=0.25, progress=trainer_steps)

        def pushes_ended(sts) -> bool:  # each round's push went to the 3 others: taken, refused or failed
            return all(sum(s["gossip"]["pushes"][k] for k in ("sent", "not_taken", "failed"))
                       >= 3 * (s["trainer"].get("rounds_pushed") or 0) for s in sts)

        swarm.wait(pushes_ended, timeout=60, what="the last pushes to end")
        sts = swarm.statuses()
        weights = [outer_weights(d) for d in daemons]
    for s in sts:
        t, pushes = s["trainer"], s["gossip"]["pushes"]
        assert t["rounds"] == STEPS // 20 and t["rounds_pushed"] >= STEPS // 20 - 4, t
        assert pushes["taken"] >= 12 and pushes["clipped"] == 0, pushes  # measured: 19-25 taken of 30
        assert pushes["opposed"] == 0 and not s["gossip"]["bans"], pushes  # honest rounds point alike
        print("pushes' cosines with ours:", pushes.get("cosine"))
        model_bytes = s["gossip"]["groups"]["model"]["bytes"]
        assert s["gossip"]["bytes_sent"] < model_bytes * t["rounds"] / 10, (s["gossip"]["bytes_sent"], model_bytes)
        # it trains: from ~4.2 at the start; measured 2.55-2.70 alone (raw pairwise: 2.38-2.43), and 3.29 once in
        # the parallel CI tier (cause not found yet: the rounds' pushes slow there, and a lost one is not resent)
        assert t["test_loss"] < 3.6, t
    lost = sum(s["gossip"]["pushes"]["not_taken"] + s["gossip"]["pushes"]["failed"] for s in sts)
    apart = farthest_apart(weights)
    # Alone, the four drift 0.40-0.41 of their norm apart by step 200 (the test above); pairwise averaging keeps
    # them at 0.065-0.075. Here only a push lost for good leaves two apart (measured: none lost, 3e-8 apart).
    assert apart < (1e-5 if lost == 0 else 0.05), (apart, lost)


@pytest.mark.slow
def test_a_peer_killed_mid_round_and_one_joining_late_hold_no_one_up(tmp_path):
    opts = _swarm_options(world=3, max_steps=100_000, eval_every=10_000, inner_steps=10, step_delay=0.005)
    with LocalSwarm(tmp_path / "churn") as swarm:
        cfg = swarm_config(swarm=unique_swarm("chn"), trainer="trainers.gossip_sgd", options=opts,
                           membership={"dead_after": 2.0, "heartbeat_interval": 0.3})
        a, b, c = swarm.start_nodes(3, cfg)

        def steps(d) -> int:
            return int(((d.try_status() or {}).get("trainer") or {}).get("step") or 0)

        wait_for(lambda: all(((d.try_status() or {}).get("trainer") or {}).get("rounds", 0) >= 3 for d in (a, b, c)),
                 timeout=120, what="three rounds on every peer")
        c.kill()  # mid-round: it had started exchanges it will never finish
        t_kill, before = time.monotonic(), [steps(d) for d in (a, b)]
        late = swarm.start("late", config=cfg, env=rank_env(2, 3))
        # the survivors never wait: within the failure-detection time they keep stepping
        wait_for(lambda: all(steps(d) >= s + 100 for d, s in zip((a, b), before)), timeout=30,
                 what="the survivors to keep stepping after the kill")
        assert time.monotonic() - t_kill < 30
        joined = late.wait_until(lambda s: (s.get("trainer") or {}).get("joined_at_step"), timeout=90,
                                 what="the late peer to download the outer weights and momentum")
        assert joined > 0
        assert "refused parameters" not in late.log_path.read_text()  # the momentum came too
        wait_for(lambda: steps(late) >= 50 and all(steps(d) >= s + 300 for d, s in zip((a, b), before)), timeout=90,
                 what="everyone to train on after the join")
        for d in (a, b, late):
            assert not str(d.status()["trainer"]["state"]).startswith("failed")


@pytest.mark.slow
def test_an_attached_process_uses_local_steps_with_8_bit_exchanges(tmp_path):
    """The wrapper works from a user's own loop too: groups shared with a codec and download-only state."""
    with LocalSwarm(tmp_path / "att") as swarm:
        swarm.start_nodes(2, swarm_config(swarm=unique_swarm("lat"), mdns=True))
        swarm.wait_connected()
        results: list = [None, None]

        def train(i: int) -> None:
            torch.manual_seed(i)
            model = torch.nn.Linear(16, 4)
            with peertrain.attach(swarm.daemons[i].home) as s:
                opt = peertrain.LocalStepsOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), s, inner_steps=5,
                                                    codec="q8", background=False)
                s.wait_for_peers(1, group="model", timeout=30)
                x, y = torch.randn(64, 16), torch.randn(64, 4)
                for _ in range(30):
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                results[i] = (opt.rounds, s.exchanges(), [g for g in swarm.daemons[i].status()["gossip"]["groups"]])

        threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r is not None for r in results), results
        for rounds, exchanges, groups in results:
            assert rounds == 6 and exchanges["initiated"] + exchanges["served"] > 0
            assert set(groups) == {"model", "model.outer"}

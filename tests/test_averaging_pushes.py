"""The sparse outer exchange, process-free: the receiver's gate on partners' pushes (peer/averaging/push_gate.py),
adding a push in place (SharedTensors.add_scaled), the wire message, and the local-steps wrapper's sparse round
(peertrain/outer.py, codec "sparse"): error feedback, its own share of its update, a push not started kept
in the feedback, and the handles that cannot push refused by name. Real daemons: tests/test_local_steps.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import peertrain
from peer.averaging import norms
from peer.averaging.bounds import OPPOSED_COSINE
from peer.averaging.push_gate import (ANGLE_MIN_PUSHES, PUSH_BURST, PUSH_NORM_BOUND, PUSH_RATE, PUSH_STRIKE_RATIO,
                                     PushGate)
from peer.averaging.shared import SharedTensors
from peer.averaging.sparse_updates import EF_DECAY, OUTER_LR, nonzero_entries
from peer.averaging.edge_copies import sparse_roundtrip
from protocol.limits import DEFAULT_LIMITS
from protocol.messages import Registry
from protocol.refusal import Code
from protocol.schema import MESSAGES
from protocol.schema.gossip import UpdatePush, UpdateTaken
from protocol.tensor_decoder import TensorDecoder
from tests.test_local_steps import Recorder


# ---- the gate -------------------------------------------------------------------------------------------


def test_no_push_is_taken_before_a_round_of_our_own_bounds_it():
    gate = PushGate()
    refused = gate.refusal("a", now=0.0)
    assert refused is not None and refused.code is Code.TOO_SOON and "round of our own" in refused.reason
    assert gate.scale(1.0) == 0.0
    gate.pushed(2.0, now=1.0)
    assert gate.refusal("a", now=1.0) is None


def test_a_push_past_a_few_of_our_own_is_scaled_down_to_the_bound_and_a_non_finite_one_to_nothing():
    gate = PushGate()
    gate.pushed(2.0, now=0.0)
    assert gate.scale(2.0 * PUSH_NORM_BOUND) == 1.0
    assert gate.scale(5.0 * PUSH_NORM_BOUND) == pytest.approx(0.4)
    assert gate.scale(2.0 * PUSH_STRIKE_RATIO * 1.01) == 0.0  # evidence: none of it
    assert gate.scale(float("inf")) == 0.0 and gate.scale(float("nan")) == 0.0
    gate.pushed(float("nan"), now=1.0)  # a round whose norm is not a number does not replace the yardstick
    assert gate.own_norm == 2.0


def test_a_push_far_past_our_own_is_evidence_against_its_sender():
    gate = PushGate()
    assert gate.evidence(1e9) is None  # no yardstick yet (and no push is taken then)
    gate.pushed(1.0, now=0.0)
    assert gate.evidence(10.0) is None and gate.evidence(PUSH_STRIKE_RATIO * 1.01) is not None
    assert gate.evidence(float("nan")) is not None


def test_a_push_pointing_away_from_our_own_is_not_added_and_a_sender_whose_pushes_keep_doing_so_is_struck():
    ours = np.zeros(8192, dtype=np.float32)
    ours[::64] = np.random.default_rng(0).normal(size=128)
    gate = PushGate()
    gate.pushed(float(np.linalg.norm(ours)), now=0.0, support=[nonzero_entries(ours)])
    noise = np.random.default_rng(1).normal(size=8192).astype(np.float32) * 0.01

    def judged(push, sender="p"):
        norm = float(np.linalg.norm(push))
        cosine = gate.cosine(norm, norms.dot_on_support([torch.from_numpy(push)], gate.own_support))
        return cosine, gate.scale(norm, cosine), gate.evidence(norm, cosine) or gate.turned_away(sender, cosine)

    cosine, scale, why = judged(ours + noise, "honest")  # an honest partner's: along ours
    assert cosine > 0.9 and scale == 1.0 and why is None
    for i in range(ANGLE_MIN_PUSHES):  # ours negated (or the swarm's mean, which holds ours): none of it added,
        cosine, scale, why = judged(-ours + noise, "liar")  # and struck once its latest say so together
        assert cosine < -0.9 and scale == 0.0
        assert (why is None) == (i < ANGLE_MIN_PUSHES - 1), (i, why)
    assert "pointing away" in why and "mean cosine" in why
    cosine, scale, why = judged(noise * 100)  # orthogonal: not seen by the angle (the norm bounds it)
    assert abs(cosine) < OPPOSED_COSINE and why is None and 0.0 < scale <= 1.0
    assert gate.evidence(1.0, float("nan")) is not None
    unjudged = PushGate()
    unjudged.pushed(1.0, now=0.0)  # a pusher that gave no support: no angle, the norm alone
    assert unjudged.cosine(1.0, -1.0) is None


def test_an_honest_sender_whose_pushes_now_and_then_point_away_is_never_struck():
    """Label-skewed peers' honest pushes (push_gate.py's docstring): single ones down to -0.235, means of 4 above
    -0.15; a sender alternating such pushes with ordinary ones is left out of the opposed ones, never struck."""
    gate = PushGate()
    gate.pushed(1.0, now=0.0, support=[(np.arange(4), np.ones(4, dtype=np.float32))])
    skewed = [-0.235, -0.19, -0.12, 0.05, -0.18, 0.02, -0.15, 0.03, 0.01, -0.2, -0.11, 0.04]
    assert all(gate.turned_away("skewed", c) is None for c in skewed)
    assert [gate.scale(1.0, c) for c in skewed[:4]] == [0.0, 0.0, 0.0, 1.0]  # the three past -0.1 are left out
    assert sum(gate.turned_away("late", c) is not None for c in (-0.25,) * 3) == 0  # too few to judge
    assert gate.turned_away("late", -0.25) is not None  # a fourth: the mean of 4 past -0.2


def test_a_sender_pushes_at_most_its_rate_per_round_of_ours_after_a_burst():
    gate = PushGate()
    gate.pushed(1.0, now=0.0)
    gate.pushed(1.0, now=10.0)  # our round: 10 s
    taken = [gate.refusal("liar", now=10.0 + 0.01 * i) is None for i in range(10)]
    assert sum(taken) == PUSH_BURST  # a burst, then refused
    later = sum(gate.refusal("liar", now=20.0 + 0.1 * i) is None for i in range(100))  # the next round, spread
    assert later <= PUSH_RATE + 1  # what the bucket refilled in 10 s, give or take one
    assert gate.refusal("honest", now=20.0) is None  # each sender has its own bucket


# ---- adding a push --------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_torch", [False, True])
def test_a_push_is_added_in_place_scaled(as_torch):
    x = np.arange(10, dtype=np.float32)
    t = torch.from_numpy(x.copy()) if as_torch else x.copy()
    g = SharedTensors("m", {"w": t})
    g.add_scaled(0.5, [np.full(10, 2.0, dtype=np.float32)])
    assert np.allclose(np.asarray(g.tensors["w"]), x + 1.0)


def test_a_push_the_lock_refuses_is_owed_and_added_at_the_next_snapshot():
    class Timid:
        def __enter__(self):
            raise TimeoutError("held")

        def __exit__(self, *exc):
            return False

    g = SharedTensors("m", {"w": np.zeros(4, dtype=np.float32)})
    g.lock = Timid()
    g.add_scaled(2.0, [np.ones(4, dtype=np.float32)])
    assert g.owing and np.array_equal(g.tensors["w"], np.zeros(4))
    g.lock = threading.Lock()
    assert np.array_equal(g.snapshot()[0], np.full(4, 2.0))


def test_the_push_messages_cross_the_wire():
    reg = Registry(MESSAGES)
    push = UpdatePush(group="model", streams=[3, 5], round=7)
    assert reg.decode(reg.encode(push, rid=1), DEFAULT_LIMITS).message == push
    assert reg.decode(reg.encode(UpdateTaken(scale=0.25), reply_to=1), DEFAULT_LIMITS).message.scale == 0.25


# ---- the wrapper's sparse round --------------------------------------------------------------------------


class Pusher(Recorder):
    """A peer among `n - 1` partners that records its pushes (`started` False: the previous push still runs)."""

    def __init__(self, n: int = 4, started: bool = True):
        super().__init__()
        self.n, self.started, self.pushes, self.averaged = n, started, [], []

    def share(self, name, tensors, *, codec=None, error_feedback=False, averaged=True, push_lr=None, **kw):
        group = super().share(name, tensors, codec=codec, error_feedback=error_feedback, averaged=averaged)
        group.push_lr = push_lr
        return group

    def push_update(self, group, encoded, *, norm, round=0, support=None):
        self.pushes.append([_decoded(e) for e in encoded])
        assert norm == pytest.approx(sum(float((q ** 2).sum()) for q in self.pushes[-1]) ** 0.5, rel=1e-5)
        for q, (idx, vals) in zip(self.pushes[-1], support):  # the angle's yardstick: the push's nonzero entries
            assert np.array_equal(idx, np.flatnonzero(q)) and np.array_equal(vals, q.reshape(-1)[idx])
        return self.n if self.started else None

    def average_in_background(self, group, *, mode="one"):
        self.averaged.append(group)
        return True

    def neighbours(self):
        return [f"p{i}" for i in range(self.n - 1)]


def _decoded(encoded) -> np.ndarray:
    decoder = TensorDecoder(encoded.header(0), DEFAULT_LIMITS)
    for chunk in encoded.chunks():
        decoder.write(chunk)
    return np.asarray(decoder.finish().array)


def _round(swarm, *, inner_steps=2, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 2, bias=False)
    w0 = model.weight.detach().clone()
    opt = peertrain.LocalStepsOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), swarm, inner_steps=inner_steps,
                                        codec="sparse", **kw)
    x, y = torch.randn(16, 4096), torch.randn(16, 2)
    for _ in range(inner_steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.wait_for_round()
    return opt, w0, model


def test_a_sparse_round_pushes_what_the_feedback_keeps_and_adds_its_own_share():
    swarm = Pusher(n=4)
    opt, w0, model = _round(swarm)
    assert opt.outer_lr == OUTER_LR and swarm.groups["model"].push_lr == OUTER_LR
    assert swarm.groups["model"].codec == "q8"  # the dense re-synchronisation's
    (q,), = swarm.pushes
    assert np.count_nonzero(q) <= 2 * 64  # 64 of every 4096 values a row
    update = opt.slow["p0"] - w0  # our own share, added by the worker
    assert torch.allclose(update, torch.from_numpy(q) * OUTER_LR / 4)
    error = opt.momentum["p0"].numpy()  # what the push left out, kept for later rounds
    assert np.count_nonzero(error) > 8000 and np.allclose(np.count_nonzero(q + error), 8192)
    # overlapped: the next round began at once, from the outer weights as they were (w0: the worker added our
    # update to them after) plus our own share of the whole update, dense (n from our 3 neighbours)
    assert torch.allclose(opt.start["p0"] - w0, torch.from_numpy(q + error) * OUTER_LR / 4, atol=1e-7)
    assert torch.equal(model.weight.detach(), opt.start["p0"])
    assert opt.pushed == 1 and opt.skipped == 0


def test_a_round_starts_ahead_by_our_own_share_of_the_last_update_which_the_outer_weights_take_sparse():
    swarm = Pusher(n=4)
    opt, w0, model = _round(swarm, inner_steps=1)
    before = opt.slow["p0"].clone()  # our first update in it, sparse
    with torch.no_grad():
        model.weight.add_(0.01)  # the second round's inner steps, by hand
    update = model.weight.detach() - opt.start["p0"]
    opt.outer_step()  # the round's end: the worker runs in the background
    # overlapped: the round started at once, from the outer weights as they were (the worker adds our update
    # to them later, as the partners' land), ahead by our own share of it, dense
    assert torch.allclose(opt.start["p0"], before + update * OUTER_LR / 4)
    assert torch.equal(model.weight.detach(), opt.start["p0"])
    opt.wait_for_round()
    (_,), (q2,) = swarm.pushes
    assert torch.allclose(opt.slow["p0"], before + torch.from_numpy(q2) * OUTER_LR / 4)  # the outer weights: sparse


def test_a_joiner_that_takes_a_partner_s_step_mid_round_trains_a_whole_first_round():
    class Joiner(Pusher):
        def download(self, group, *, min_step=1):
            return 16 if group == "model" else None  # a partner at step 16, inner_steps 20

    model = torch.nn.Linear(4096, 2, bias=False)
    opt = peertrain.LocalStepsOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), Joiner(), inner_steps=20,
                                        codec="sparse")
    assert opt.joined_at_step == 16 and opt.local_step == 16
    x, y = torch.randn(16, 4096), torch.randn(16, 2)
    for _ in range(19):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    # a round of 4 steps would push an update a fifth of its partners', which they would clip by ours
    assert opt.rounds == 0 and opt.local_step == 35
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.wait_for_round()
    assert opt.rounds == 1 and opt.pushed == 1 and opt.round_began == 36


def test_a_round_whose_push_does_not_start_keeps_all_of_its_update_in_the_feedback():
    sent = Pusher()
    sent_opt, _, _ = _round(sent)
    (q,), = sent.pushes
    update = q + sent_opt.momentum["p0"].numpy()  # the round's whole update: what went, and what was kept
    swarm = Pusher(started=False)
    opt, w0, model = _round(swarm)
    assert torch.equal(opt.slow["p0"], w0)  # nothing applied
    assert opt.skipped == 1 and opt.pushed == 0
    assert np.allclose(opt.momentum["p0"].numpy(), update, atol=1e-7)  # all of it owed to the next round


def test_the_outer_weights_are_averaged_densely_every_resync_rounds():
    swarm = Pusher()
    opt, _, _ = _round(swarm, inner_steps=1, resync_every=1)
    assert swarm.averaged == ["model"]
    swarm2 = Pusher()
    _round(swarm2, inner_steps=1, resync_every=0)
    assert swarm2.averaged == []


def test_a_handle_that_cannot_push_and_bad_sparse_settings_are_named():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="sparse.*q8"):
        peertrain.LocalStepsOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), Recorder(), codec="sparse")
    for bad, says in ((dict(decay=0.0), "decay"), (dict(resync_every=-1), "resync_every"),
                      (dict(decay=float("nan")), "decay")):
        with pytest.raises(ValueError, match=says):
            peertrain.LocalStepsOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), Pusher(), codec="sparse", **bad)


def test_the_feedback_decays_what_earlier_rounds_left_out():
    from peer.averaging.sparse_updates import send_with_feedback
    error = np.zeros(4096, dtype=np.float32)
    u = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    q1 = send_with_feedback(error, u)
    left = error.copy()
    q2 = send_with_feedback(error, np.zeros(4096, dtype=np.float32))
    assert np.allclose(q2 + error, EF_DECAY * left, atol=1e-6)
    assert np.array_equal(q1, sparse_roundtrip(u))


def test_a_round_that_ends_while_the_last_is_still_sent_keeps_training_and_settling_sends_it():
    release = threading.Event()

    class Slow(Pusher):
        def push_update(self, group, encoded, *, norm, round=0, support=None):
            release.wait(10)
            return super().push_update(group, encoded, norm=norm, round=round, support=support)

    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 2, bias=False)
    swarm = Slow()
    opt = peertrain.LocalStepsOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), swarm, inner_steps=1,
                                        codec="sparse")
    x, y = torch.randn(16, 4096), torch.randn(16, 2)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()  # its push hangs in the worker
    step()
    assert opt.rounds == 1 and opt.skipped == 1  # the second round's update waits in the model, not restarted
    assert not torch.equal(model.weight.detach(), opt.start["p0"])
    release.set()
    opt.settle(rounds=0)
    assert opt.pushed == 2 and len(swarm.pushes) == 2  # settling sent the kept round


def test_peer_status_shows_the_sparse_pushes():
    from rich.console import Console

    from peer.cli.status_view import render_status

    st = {"peer_id": "a" * 52, "swarm": "s", "protocol_version": 1, "version": "0", "listen": "127.0.0.1:1",
          "mdns": False, "ciphers": ["x"], "uptime_s": 1.0, "pid": 1, "home": "/h", "connected": 0, "peers": [],
          "gossip": {"pushes": {"sent": 27, "not_taken": 1, "failed": 0, "taken": 24, "clipped": 2, "opposed": 1,
                                      "refused": 5, "cosine": {"min": -0.5, "median": 0.31}}},
          "trainer": {"trainer": "trainers.gossip_sgd", "mode": "local", "step": 200, "state": "training",
                      "rounds": 10, "rounds_skipped": 1}}
    console = Console(record=True, width=160)
    console.print(render_status(st))
    out = console.export_text()
    assert "sparse pushes" in out and "sent 27" in out and "taken 24" in out and "clipped 2" in out
    assert "opposed 1" in out and "median 0.31" in out


def test_the_push_angle_measurement_runs_each_split_and_reports_what_the_gate_judges(capsys):
    """`python -m peer.testing.push_angle_sim` (docs/benchmarks.md, fourteenth session), at two rounds: every split
    gives each peer a shard (by label for `classes`), and a run reports the figures the angle rule was set from."""
    import json

    from peer.testing.push_angle_sim import main, run, shards

    labels = np.arange(100) % 10
    rng = np.random.default_rng(0)
    for split in ("iid", "classes", "dir:0.1"):
        parts = shards(labels, split, 4, rng)
        assert sorted(np.concatenate(parts).tolist()) == list(range(100)), split  # each sample once
    assert {int(labels[i]) % 4 for i in shards(labels, "classes", 4, rng)[1]} == {1}
    with pytest.raises(ValueError, match="unknown split"):
        shards(labels, "zipf", 4, rng)
    got = run("classes", peers=3, rounds=2, inner=2, seed=0)
    assert got["parameters"] == 19210 and got["opposed"].endswith("of 12") and got["negated_mean_cosine_median"] < 0
    assert got["mean_of_4_min"] is None  # two rounds: no window of 4 yet
    main(["--splits", "iid", "--peers", "2", "--rounds", "1", "--inner", "1", "--seeds", "1"])
    assert json.loads(capsys.readouterr().out)["split"] == "iid"

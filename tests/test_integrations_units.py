"""The framework integrations (peertrain/integrations/) in one process against a recording stand-in for the
Swarm: WrappingOptimizer.follow (our step from the inner optimizer's step hooks), SwarmOptions' checks,
unwrapping a framework's optimizer, FollowedTraining's begin/figures/publish/end, and the Hugging Face
Trainer's SwarmCallback on a real tiny Trainer (checkpoints and resuming included)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import peertrain
from peertrain import ExchangeResult
from peertrain.integrations.followed import FollowedTraining, SwarmOptions, innermost
from tests.test_local_steps import Recorder


class Swarm(Recorder):
    """A peer whose averaging calls are recorded, with two neighbours that answer every round (and move
    nothing: settling stops after its minimum of rounds); `ahead` is the step a partner would give a joiner."""

    def __init__(self, ahead: int | None = None) -> None:
        super().__init__()
        self.ahead = ahead
        self.calls: list[tuple] = []

    def average(self, group, *, mode="one"):
        self.calls.append(("average", group, mode))
        return [ExchangeResult(p, True) for p in (self.neighbours() if mode == "all" else self.neighbours()[:1])]

    def neighbours(self):
        return ["a", "b"]

    def average_in_background(self, group, mode="one"):
        self.calls.append(("background", group, mode))
        return True

    def download(self, group, *, min_step=1):
        self.calls.append(("download", group, min_step))
        return self.ahead if self.ahead is not None and self.ahead >= min_step else None

    def wait_for_peers(self, n=1, *, group=None, timeout=30.0):
        self.calls.append(("wait", n, group))
        return n

    def exchanges(self):
        return {"initiated": 2, "served": 3, "failed": 1, "last_error": "timeout"}

    def peers(self):
        return ["a", "b"]

    def named(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


class Probed(torch.optim.SGD):
    """SGD that notes, in each step, whether the lock `probe` is held (by whoever: this test has one thread)."""

    probe: threading.Lock | None = None
    seen: list[bool]

    def step(self, closure=None):
        self.seen = getattr(self, "seen", []) + [self.probe is not None and self.probe.locked()]
        return super().step(closure)


def model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1), torch.randn(8, 3), torch.randn(8, 1)


def train_inner(model, inner, x, y, steps: int) -> None:
    """What a framework does: step the inner optimizer itself."""
    for _ in range(steps):
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()


# ---- follow() ---------------------------------------------------------------------------------------


def test_following_adpsgd_counts_the_inner_steps_holds_the_lock_and_averages_every_n():
    model, x, y = model_and_data()
    inner, swarm = Probed(model.parameters(), lr=0.1), Swarm()
    opt = peertrain.GossipOptimizer(inner, swarm, average_every=2, join=False).follow()
    inner.probe = opt.shared.lock
    train_inner(model, inner, x, y, 5)
    assert opt.local_step == 5 and opt.shared.step == 5
    assert inner.seen == [True] * 5 and not opt.shared.lock.locked()  # held in each step, released after it
    assert swarm.named("background") == [("background", "model", "one")] * 2 and opt.averaged == 2
    assert opt.follow() is opt  # twice is once: one step still counts one
    train_inner(model, inner, x, y, 1)
    assert opt.local_step == 6
    with pytest.raises(RuntimeError, match="follows"):
        opt.step()
    opt.unfollow()
    train_inner(model, inner, x, y, 2)
    assert opt.local_step == 6 and len(inner.seen) == 8 and inner.seen[-2:] == [False, False]
    opt.step()  # stepping the wrapper works again, and counts
    assert opt.local_step == 7 and inner.seen[-1] is True


def test_following_an_optimizer_whose_step_calls_its_base_class_step_counts_each_step_once():
    """torch hooks each optimizer class's `step` once it is built: a subclass whose `step` calls `super().step()`
    (Probed here, and custom optimizers alike) runs the step hooks twice, nested, in every step."""
    model, x, y = model_and_data()
    torch.optim.SGD(model.parameters(), lr=0.1)  # SGD.step hooked, as any SGD built in this process does
    inner, swarm = Probed(model.parameters(), lr=0.1), Swarm()
    opt = peertrain.GossipOptimizer(inner, swarm, join=False).follow()
    inner.probe = opt.shared.lock
    train_inner(model, inner, x, y, 3)
    assert opt.local_step == 3 and len(swarm.named("background")) == 3
    assert inner.seen == [True] * 3 and not opt.shared.lock.locked()


def test_following_dpsgd_averages_with_all_after_each_step():
    model, x, y = model_and_data()
    inner, swarm = torch.optim.SGD(model.parameters(), lr=0.1), Swarm()
    opt = peertrain.GossipOptimizer(inner, swarm, mode="dpsgd", join=False).follow()
    train_inner(model, inner, x, y, 3)
    assert swarm.named("average") == [("average", "model", "all")] * 3 and opt.averaged == 3
    assert swarm.named("background") == []


def test_a_step_the_grad_scaler_skips_is_not_counted():
    model, x, y = model_and_data()
    inner, swarm = torch.optim.SGD(model.parameters(), lr=0.1), Swarm()
    opt = peertrain.GossipOptimizer(inner, swarm, join=False).follow()
    scaler = torch.amp.GradScaler("cpu")
    if not scaler.is_enabled():
        pytest.skip("this torch's GradScaler does not run on the CPU")
    before = model.weight.detach().clone()
    for poisoned in (False, True, False):
        inner.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if poisoned:
            model.weight.grad.fill_(float("inf"))
        scaler.step(inner)
        scaler.update()
    assert opt.local_step == 2 and len(swarm.named("background")) == 2
    assert not torch.equal(model.weight.detach(), before) and not opt.shared.lock.locked()


def test_following_local_steps_takes_an_outer_step_every_inner_steps():
    model, x, y = model_and_data()
    inner, swarm = torch.optim.SGD(model.parameters(), lr=0.1), Swarm()
    opt = peertrain.LocalStepsOptimizer(inner, swarm, inner_steps=3, join=False).follow()
    train_inner(model, inner, x, y, 7)
    assert opt.local_step == 7 and opt.rounds == 2
    assert swarm.named("background") == [("background", "model", "one")] * 2
    assert torch.equal(opt.start["p0"], opt.slow["p0"])  # the round restarted from the outer weights


# ---- SwarmOptions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, field", [(dict(mode="allreduce"), "mode"), (dict(average_every=0), "average_every"),
                                        (dict(peers=-1), "peers"), (dict(inner_steps=True), "inner_steps"),
                                        (dict(settle_rounds=1.5), "settle_rounds"), (dict(group=""), "group"),
                                        (dict(group=None), "group")])
def test_swarm_options_name_the_bad_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SwarmOptions(**bad)


def test_swarm_options_defaults_are_valid():
    o = SwarmOptions()
    assert (o.mode, o.average_every, o.peers) == ("adpsgd", 1, 0)
    SwarmOptions(mode="local", inner_steps=1, peers=0, settle_rounds=0, group="g")


# ---- innermost() ------------------------------------------------------------------------------------


def test_innermost_unwraps_accelerate_and_stops_at_our_wrapper():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model, _, _ = model_and_data()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        accelerated = Accelerator(cpu=True).prepare_optimizer(sgd)
        assert type(accelerated).__name__ == "AcceleratedOptimizer" and innermost(accelerated) is sgd
        ours = peertrain.GossipOptimizer(sgd, Swarm(), join=False)
        assert innermost(Accelerator(cpu=True).prepare_optimizer(ours)) is ours  # not its inner SGD
    finally:
        AcceleratorState._reset_state(True)  # the process-wide state an Accelerator sets up
    assert innermost(sgd) is sgd

    class Lightningish:  # LightningOptimizer's shape: the optimizer as `_optimizer`
        _optimizer = sgd
    assert innermost(Lightningish()) is sgd


@pytest.mark.parametrize("thing", [object(), None, "sgd"])
def test_innermost_refuses_what_is_no_optimizer(thing):
    with pytest.raises(TypeError, match="torch optimizer"):
        innermost(thing)


# ---- FollowedTraining ---------------------------------------------------------------------------------


def test_begin_wraps_follows_waits_and_joins_past_its_step():
    model, x, y = model_and_data()
    inner, swarm = torch.optim.SGD(model.parameters(), lr=0.1), Swarm()
    run = FollowedTraining(swarm, SwarmOptions(peers=2, group="g"))
    run.begin(inner, step=4)
    w = run.wrapper
    assert isinstance(w, peertrain.GossipOptimizer) and run.ours and w.group_name == "g" and w.local_step == 4
    assert swarm.calls == [("wait", 2, "g"), ("download", "g", 5)]
    run.begin(inner)  # once begun, again is nothing
    assert run.wrapper is w and len(swarm.calls) == 2
    train_inner(model, inner, x, y, 2)
    assert w.local_step == 6
    run.end()
    assert w._following is None
    train_inner(model, inner, x, y, 1)
    assert w.local_step == 6


def test_begin_without_peers_does_not_wait_and_a_partner_ahead_is_joined():
    model, _, _ = model_and_data()
    swarm = Swarm(ahead=9)
    run = FollowedTraining(swarm, SwarmOptions())
    run.begin(torch.optim.SGD(model.parameters(), lr=0.1))
    assert swarm.calls == [("download", "model", 1)]
    assert run.wrapper.local_step == 9 and run.figures()["swarm/joined_at_step"] == 9.0


def test_begin_resumes_our_state_and_joins_only_a_partner_past_it():
    model, x, y = model_and_data()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = FollowedTraining(Swarm(), SwarmOptions())
    first.begin(inner)
    train_inner(model, inner, x, y, 3)
    state = first.state_dict()
    assert state is not None and state["gossip"]["step"] == 3

    model2, _, _ = model_and_data(1)
    inner2, swarm = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9), Swarm(ahead=3)
    second = FollowedTraining(swarm, SwarmOptions())
    second.begin(inner2, step=3, state=state)
    assert swarm.named("download") == [("download", "model", 4)]  # a partner only at our own step is no news
    assert second.wrapper.local_step == 3 and second.wrapper.joined_at_step is None
    momentum = [o.state_dict()["state"][0]["momentum_buffer"] for o in (inner, inner2)]
    assert torch.equal(*momentum)  # the inner optimizer's state came back too


def test_begin_uses_a_wrapper_the_user_made_as_it_is():
    model, _, _ = model_and_data()
    swarm = Swarm()
    ours = peertrain.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, join=False)
    run = FollowedTraining(swarm, SwarmOptions(mode="local"))  # the user's wrapper wins over the mode
    run.begin(ours)
    assert run.wrapper is ours and not run.ours and ours._following is None
    run.end()
    assert len(swarm.named("average")) == 3


def test_figures_and_publish():
    swarm = Swarm()
    run = FollowedTraining(swarm, SwarmOptions())
    assert run.figures() == {"swarm/peers": 2.0, "swarm/exchanges": 5.0, "swarm/exchanges_failed": 1.0}
    assert run.state_dict() is None and run.should_stop() is False
    run.publish({"loss": 0.5, "step": 3, "lr": float("nan"), "grad": float("inf"), "flag": True, "name": "x",
                 "tensor": torch.tensor(1.0)})
    assert swarm.published == [{"loss": 0.5, "step": 3.0}]
    run.publish({"lr": float("-inf"), "note": "nothing numeric"})
    assert len(swarm.published) == 1  # nothing left: nothing sent
    run.end()  # never begun: nothing to settle
    assert swarm.calls == []


def test_end_settles_with_every_neighbour_and_unfollows():
    model, x, y = model_and_data()
    inner, swarm = torch.optim.SGD(model.parameters(), lr=0.1), Swarm()
    run = FollowedTraining(swarm, SwarmOptions(settle_rounds=2))
    run.begin(inner)
    train_inner(model, inner, x, y, 2)
    run.end()
    assert swarm.named("average") == [("average", "model", "all")] * 2
    assert run.wrapper._following is None


def test_end_of_local_steps_closes_the_partial_round():
    model, x, y = model_and_data()
    inner, swarm = torch.optim.SGD(model.parameters(), lr=0.1), Swarm()
    run = FollowedTraining(swarm, SwarmOptions(mode="local", inner_steps=3))
    run.begin(inner)
    w = run.wrapper
    assert isinstance(w, peertrain.LocalStepsOptimizer)
    train_inner(model, inner, x, y, 4)
    assert w.rounds == 1
    run.end()
    assert w.rounds == 2 and w._following is None  # the partial round's outer step
    assert swarm.named("average") == [("average", "model", "all")] * 3
    assert torch.equal(model.weight.detach(), w.slow["p0"])  # the model leaves with the settled outer weights

    model2, x2, y2 = model_and_data()
    inner2, swarm2 = torch.optim.SGD(model2.parameters(), lr=0.1), Swarm()
    run2 = FollowedTraining(swarm2, SwarmOptions(mode="local", inner_steps=3))
    run2.begin(inner2)
    train_inner(model2, inner2, x2, y2, 3)
    run2.end()
    assert run2.wrapper.rounds == 1  # a round just closed: no extra outer step


# ---- the Hugging Face Trainer -----------------------------------------------------------------------


def log_recorder():
    """A callback to put after ours: it keeps what every `report_to` logger would receive."""
    from transformers import TrainerCallback

    class Seen(TrainerCallback):
        def __init__(self):
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    return Seen()


def tiny_trainer(out: Path, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 32, (16, 8), generator=g)]
    args = TrainingArguments(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, use_cpu=True,
                             report_to=[], save_strategy="steps", save_steps=3, logging_steps=1, seed=seed,
                             disable_tqdm=True, dataloader_num_workers=0)
    return Trainer(model=model, args=args, train_dataset=data)


def test_hf_trainer_trains_in_the_swarm_saves_our_state_and_resumes_it(tmp_path, monkeypatch):
    from peertrain.integrations.hf import STATE_FILE, SwarmCallback, add_swarm
    from peertrain.checkpoints import load_checkpoint

    trainer, swarm = tiny_trainer(tmp_path), Swarm()
    seen = log_recorder()
    trainer.add_callback(seen)
    callback = add_swarm(trainer, swarm)
    assert trainer.callback_handler.callbacks[0] is callback and isinstance(callback, SwarmCallback)
    trainer.train()

    w = callback.training.wrapper
    assert isinstance(w, peertrain.GossipOptimizer) and callback.training.ours and w.local_step == 6
    assert swarm.named("background") == [("background", "model", "one")] * 6  # after each step
    assert swarm.named("average") == [("average", "model", "all")] * 3  # settled at the end
    assert w._following is None
    steps = [entry for entry in seen.logs if "loss" in entry]
    assert len(steps) == 6 and all(entry["swarm/peers"] == 2.0 for entry in steps)
    assert swarm.published and all("loss" in p and "step" in p for p in swarm.published[:6])
    for step in (3, 6):
        saved = load_checkpoint(tmp_path / f"checkpoint-{step}", STATE_FILE)
        assert saved is not None and saved["gossip"]["step"] == step

    loaded: list[dict] = []
    load = peertrain.GossipOptimizer.load_state_dict
    monkeypatch.setattr(peertrain.GossipOptimizer, "load_state_dict",
                        lambda self, state: (loaded.append(state), load(self, state))[1])
    again, swarm2 = tiny_trainer(tmp_path, seed=1), Swarm()
    resumed = add_swarm(again, swarm2)
    again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    w2 = resumed.training.wrapper
    assert [state["gossip"]["step"] for state in loaded] == [3]  # checkpoint-3's peertrain.pt
    assert swarm2.named("download") == [("download", "model", 4)]
    assert w2.local_step == 6 and len(swarm2.named("background")) == 3  # from step 3 on


def test_hf_callback_stops_the_trainer_when_the_swarm_stops(tmp_path):
    from peertrain.integrations.hf import add_swarm

    class Stopping(Swarm):
        def should_stop(self):
            return len(self.named("average")) >= 2

    trainer, swarm = tiny_trainer(tmp_path), Stopping()
    callback = add_swarm(trainer, swarm, mode="dpsgd", settle_rounds=1)
    trainer.train()
    assert trainer.state.global_step == 2 and callback.training.wrapper.local_step == 2
    assert len(swarm.named("average")) == 3  # a step each, and one settling round


def test_begin_again_after_end_follows_the_same_optimizer_again_and_refuses_another():
    """A second `trainer.train()` on one Trainer begins again on the same optimizer: it must gossip again, not
    train alone without a word; a new optimizer under the same training is refused (its group is shared)."""
    model, x, y = model_and_data()
    inner, swarm = torch.optim.SGD(model.parameters(), lr=0.1), Swarm()
    run = FollowedTraining(swarm, SwarmOptions())
    run.begin(inner)
    train_inner(model, inner, x, y, 2)
    run.end()
    run.begin(inner)
    train_inner(model, inner, x, y, 3)
    assert run.wrapper.local_step == 5 and len(swarm.named("background")) == 5
    run.end()
    with pytest.raises(RuntimeError, match="another optimizer"):
        run.begin(torch.optim.SGD(model.parameters(), lr=0.1))


def test_hf_trainer_trained_twice_gossips_both_times(tmp_path):
    from peertrain.integrations.hf import add_swarm

    trainer, swarm = tiny_trainer(tmp_path), Swarm()
    callback = add_swarm(trainer, swarm, settle_rounds=0)
    trainer.train()
    trainer.args.max_steps = 9
    trainer.train()  # not resumed: the Trainer counts from 0 again, the optimizer's steps go on (6 + 9)
    assert trainer.state.global_step == 9
    assert callback.training.wrapper.local_step == 15 and len(swarm.named("background")) == 15


def test_settle_goes_on_while_a_partner_moves_us_and_waits_out_a_round_that_ran_no_exchange():
    """settle(): a round in which no exchange ran (our own background round in flight) is tried again and
    not counted; rounds that still move us past SETTLED add rounds; partners gone end it."""
    model, x, y = model_and_data()

    class Moving(Swarm):
        """The first answer is empty (busy); then round r moves the tensors by 3·10^-r of their norm."""

        def __init__(self, opt_box):
            super().__init__()
            self.box, self.round = opt_box, 0

        def average(self, group, *, mode="one"):
            self.calls.append(("average", group, mode))
            self.round += 1
            if self.round == 1:
                return []
            with torch.no_grad():
                for t in self.box[0].shared.tensors.values():
                    t.mul_(1 + 3 * 10.0 ** -self.round)
            return [ExchangeResult("a", True)]

    box: list = []
    swarm = Moving(box)
    opt = peertrain.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, join=False)
    box.append(opt)
    assert opt.settle(3) == 4  # moves 3e-2, 3e-3, 3e-4 (past SETTLED, 1e-4: one more), 3e-5
    assert len(swarm.named("average")) == 5  # and the busy first try

    class Gone(Swarm):
        def average(self, group, *, mode="one"):
            self.calls.append(("average", group, mode))
            return []

        def neighbours(self):
            return []

    alone = Gone()
    opt2 = peertrain.GossipOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), alone, join=False)
    assert opt2.settle(3) == 0 and len(alone.named("average")) == 1
    with pytest.raises(ValueError, match="rounds"):
        opt2.settle(-1)


# ---- Lightning --------------------------------------------------------------------------------------


def tiny_lightning(root: Path, callback, steps: int):
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 3), torch.randn(32, 1)), batch_size=4)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        default_root_dir=str(root), enable_checkpointing=False)
    return trainer, Module(), data


def test_lightning_trains_in_the_swarm_checkpoints_our_state_and_resumes_it(tmp_path):
    from peertrain.integrations.followed import STATE_KEY
    from peertrain.integrations.lightning import SwarmCallback

    swarm = Swarm()
    callback = SwarmCallback(swarm)
    trainer, module, data = tiny_lightning(tmp_path, callback, steps=5)
    trainer.fit(module, data)
    w = callback.training.wrapper
    assert isinstance(w, peertrain.GossipOptimizer) and w.local_step == 5 and w._following is None
    assert swarm.named("background") == [("background", "model", "one")] * 5
    assert swarm.named("average") == [("average", "model", "all")] * 3  # settled at the end
    assert float(trainer.callback_metrics["swarm/peers"]) == 2.0  # reached Lightning's loggers
    assert swarm.published and all("step" in p for p in swarm.published)
    trainer.save_checkpoint(tmp_path / "five.ckpt")
    saved = torch.load(tmp_path / "five.ckpt", weights_only=False)
    assert saved[STATE_KEY]["gossip"]["step"] == 5

    swarm2 = Swarm()
    again = SwarmCallback(swarm2)
    trainer2, module2, data2 = tiny_lightning(tmp_path, again, steps=8)
    trainer2.fit(module2, data2, ckpt_path=tmp_path / "five.ckpt")
    assert again.training.wrapper.local_step == 8 and len(swarm2.named("background")) == 3  # from step 5 on
    assert swarm2.named("download") == [("download", "model", 6)]  # only a partner past our step


def test_lightning_stops_when_the_swarm_stops_and_refuses_two_optimizers(tmp_path):
    import lightning.pytorch as L

    from peertrain.integrations.lightning import SwarmCallback

    class Stopping(Swarm):
        def should_stop(self):
            return len(self.named("background")) >= 2

    callback = SwarmCallback(Stopping(), settle_rounds=0)
    trainer, module, data = tiny_lightning(tmp_path, callback, steps=50)
    trainer.fit(module, data)
    assert trainer.global_step == 2

    class Two(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)]

    trainer2, _, data2 = tiny_lightning(tmp_path, SwarmCallback(Swarm()), steps=2)
    with pytest.raises(ValueError, match="one optimizer"):
        trainer2.fit(Two(), data2)


def test_a_followed_step_that_raised_leaves_neither_the_lock_held_nor_the_next_steps_uncounted():
    """A framework that catches a step's error and goes on (an OOM retry): that step ran no post-hook; the
    next step releases the lock it left and counts as usual, instead of deadlocking or going silent."""
    model, x, y = model_and_data()

    class Failing(torch.optim.SGD):
        fail = True

        def step(self, closure=None):
            if Failing.fail:
                Failing.fail = False
                raise RuntimeError("out of memory (a test's)")
            return super().step(closure)

    inner, swarm = Failing(model.parameters(), lr=0.1), Swarm()
    opt = peertrain.GossipOptimizer(inner, swarm, join=False).follow()
    with pytest.raises(RuntimeError, match="out of memory"):
        train_inner(model, inner, x, y, 1)
    assert opt.local_step == 0
    train_inner(model, inner, x, y, 3)
    assert opt.local_step == 3 and len(swarm.named("background")) == 3
    assert opt.shared.lock.acquire(timeout=1)  # released after the last step
    opt.shared.lock.release()

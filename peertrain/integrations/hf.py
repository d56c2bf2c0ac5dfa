"""A Hugging Face `Trainer` that trains in a swarm: three added lines.

    swarm = peertrain.attach()                                            # or peertrain.start(...)
    trainer = Trainer(model=model, args=args, train_dataset=peertrain.shard(train_set, swarm), ...)
    peertrain.integrations.hf.add_swarm(trainer, swarm)                   # before trainer.train()

`add_swarm` puts a `SwarmCallback` first among the Trainer's callbacks (first, so the swarm's figures are in
the logs every `report_to` logger receives). The callback, on the Trainer's events:
  - train begin: wraps the Trainer's optimizer (under Accelerate's wrapper) in GossipOptimizer, or in
    LocalStepsOptimizer for `mode="local"`, following its steps; waits for `peers` partners; resumes our state
    from the checkpoint the Trainer resumed from, or joins late from a partner ahead of it;
  - log: publishes the Trainer's figures to the daemon (`peer status`) and adds "swarm/..." figures;
  - step end: stops training when the daemon stops;
  - save: writes our state (`peertrain.pt`) into the Trainer's checkpoint folder, atomically;
  - train end: averages with every neighbour a few times, so the peers end with models that agree.
A user who builds the optimizer can pass `optimizers=(peertrain.GossipOptimizer(...), None)` instead; the
callback then uses that one as it is. Options: peertrain/integrations/followed.py (SwarmOptions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from peertrain.checkpoints import load_checkpoint, save_checkpoint
from peertrain.integrations.followed import FollowedTraining, SwarmOptions
from peertrain.swarm import Swarm

STATE_FILE = "peertrain.pt"  # our part of a Trainer checkpoint folder, beside its optimizer.pt


class SwarmCallback(TrainerCallback):
    """The Trainer's events mapped onto FollowedTraining (see the module docstring)."""

    def __init__(self, swarm: Swarm, **options: Any):
        self.training = FollowedTraining(swarm, SwarmOptions(**options))

    @staticmethod
    def _folder(args: Any, step: int) -> Path:
        return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is None:
            raise RuntimeError("the Trainer gave its callbacks no optimizer at train begin")
        saved = load_checkpoint(self._folder(args, state.global_step), STATE_FILE) if state.global_step else None
        self.training.begin(optimizer, step=state.global_step, state=saved)

    def on_step_end(self, args, state, control, **kwargs):
        if self.training.should_stop():
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            self.training.publish({**logs, "step": state.global_step})
            logs.update(self.training.figures())

    def on_save(self, args, state, control, **kwargs):
        ours = self.training.state_dict()
        folder = self._folder(args, state.global_step)
        if ours is not None and folder.is_dir() and state.is_world_process_zero:
            save_checkpoint(folder, ours, STATE_FILE)

    def on_train_end(self, args, state, control, **kwargs):
        self.training.end()


def add_swarm(trainer: Any, swarm: Swarm, **options: Any) -> SwarmCallback:
    """Make `trainer` train in `swarm`: a SwarmCallback, first among its callbacks. Returns it."""
    callback = SwarmCallback(swarm, **options)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback

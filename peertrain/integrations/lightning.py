"""A PyTorch Lightning `Trainer` that trains in a swarm: two added lines and a callback.

    swarm = peertrain.attach()                                            # or peertrain.start(...)
    loader = DataLoader(peertrain.shard(train_set, swarm), batch_size=32, shuffle=True)
    trainer = L.Trainer(..., callbacks=[peertrain.integrations.lightning.SwarmCallback(swarm)])

The callback, on Lightning's hooks:
  - train start: wraps the module's optimizer (from `configure_optimizers`; one) in GossipOptimizer, or in
    LocalStepsOptimizer for `mode="local"`, following its steps; waits for `peers` partners; resumes our state
    from the checkpoint Lightning resumed from (`fit(ckpt_path=...)`), or joins late from a partner ahead;
  - each `log_every_n_steps` steps: logs "swarm/..." figures through the module (so every Lightning logger
    gets them) and publishes Lightning's logged figures to the daemon (`peer status`); stops training when the
    daemon stops;
  - checkpoint save/load: our state travels inside Lightning's checkpoint, under "peertrain";
  - train end: averages with every neighbour a few times, so the peers end with models that agree.
Options: peertrain/integrations/followed.py (SwarmOptions). This is the `lightning` package's callback (`import
lightning.pytorch as L`); the older `pytorch_lightning` package has its own Trainer classes, not these.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from peertrain.integrations.followed import STATE_KEY, FollowedTraining, SwarmOptions
from peertrain.swarm import Swarm


class SwarmCallback(Callback):
    """Lightning's hooks mapped onto FollowedTraining (see the module docstring)."""

    def __init__(self, swarm: Swarm, **options: Any):
        self.training = FollowedTraining(swarm, SwarmOptions(**options))
        self._resumed: dict | None = None  # our state from the checkpoint Lightning loads, until train start

    def on_train_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"SwarmCallback averages one optimizer's parameters; configure_optimizers gave "
                             f"{len(trainer.optimizers)}")
        self.training.begin(trainer.optimizers[0], step=trainer.global_step, state=self._resumed)
        self._resumed = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.training.should_stop():
            trainer.should_stop = True
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            pl_module.log_dict(self.training.figures(), on_step=True, on_epoch=False)
            self.training.publish({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
                                  | {"step": trainer.global_step})

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        ours = self.training.state_dict()
        if ours is not None:
            checkpoint[STATE_KEY] = ours

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._resumed = checkpoint.get(STATE_KEY)

    def on_train_end(self, trainer, pl_module) -> None:
        self.training.end()

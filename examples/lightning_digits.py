"""A PyTorch Lightning module classifying the shipped UCI digits, trained as 3 local peers, and the same
script as one process, for comparison:

    python examples/lightning_digits.py           3 peers and the reference; prints held-out accuracy of each

The peertrain lines are marked `# peertrain`: without them this is an ordinary Lightning script. Against a
daemon you started yourself (`peer start`), `swarm = peertrain.attach()` takes `worker_swarm`'s place.
"""

from __future__ import annotations

import logging
import time

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import local_swarm
import peertrain
import peertrain.integrations.lightning


class Classifier(L.LightningModule):
    def __init__(self, lr: float, steps: int):
        super().__init__()
        self.lr, self.steps = lr, steps
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=self.steps), "interval": "step"}}


def main() -> None:
    p = local_swarm.parser(__doc__, steps=300, batch=16, lr=0.05)
    args = p.parse_args()
    if args.worker is None and not args.reference:
        local_swarm.compare(__file__, args)
        return

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, held_out = local_swarm.digits()
    model = Classifier(args.lr, args.steps)
    batch = args.batch if args.worker is not None else args.batch * args.peers  # the reference: DDP's whole batch
    swarm = local_swarm.worker_swarm(args) if args.worker is not None else None  # peertrain (or peertrain.attach())
    callbacks = []
    if swarm is not None:
        train = peertrain.shard(train, swarm)  # peertrain
        callbacks.append(peertrain.integrations.lightning.SwarmCallback(swarm, peers=args.peers - 1))  # peertrain
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=25)
    local_swarm.start_together(args)
    t0 = time.monotonic()
    trainer.fit(model, DataLoader(train, batch_size=batch, shuffle=True, drop_last=True))
    result = {"accuracy": round(local_swarm.digits_accuracy(model.net, held_out), 3), "steps": trainer.global_step,
              "seconds": round(time.monotonic() - t0, 1)}
    if swarm is not None:
        result["exchanges"] = swarm.exchanges()
        swarm.close()
    local_swarm.write_result(args.out, result, model.parameters())


if __name__ == "__main__":
    main()

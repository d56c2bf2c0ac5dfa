"""A Hugging Face Trainer training a small GPT-2 (built from a config: nothing is downloaded) on the shipped
Shakespeare text, as 3 local peers, and the same script as one process, for comparison:

    python examples/hf_trainer.py                 3 peers and the reference; prints held-out accuracy of each
    python examples/hf_trainer.py --late-peer     the third peer starts late and joins from the others' model

The peertrain lines are marked `# peertrain`: without them this is an ordinary Trainer script. Against a
daemon you started yourself (`peer start`), `swarm = peertrain.attach()` takes `worker_swarm`'s place.
"""

from __future__ import annotations

import time
from importlib import resources

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import local_swarm
import peertrain
import peertrain.integrations.hf


class Windows(Dataset):
    """Non-overlapping windows of `block` bytes: each a training example (the model shifts the labels)."""

    def __init__(self, data: torch.Tensor, block: int):
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> dict:
        x = self.data[i * self.block:(i + 1) * self.block]
        return {"input_ids": x, "labels": x}


def corpus(block: int) -> tuple[Windows, Windows]:
    text = (resources.files("trainers") / "data" / "shakespeare.txt").read_bytes()
    data = torch.tensor(list(text), dtype=torch.long)
    cut = int(0.9 * len(data))
    return Windows(data[:cut], block), Windows(data[cut:], block)


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: Windows, n: int = 256) -> float:
    """Next-byte accuracy, in percent, on the first `n` held-out windows."""
    model.eval()
    x = torch.stack([data[i]["input_ids"] for i in range(min(n, len(data)))])
    logits = model(input_ids=x).logits[:, :-1]
    return 100.0 * (logits.argmax(-1) == x[:, 1:]).float().mean().item()


def main() -> None:
    p = local_swarm.parser(__doc__, steps=400, batch=16, lr=2e-3, batch_help="windows per step of each peer")
    p.add_argument("--block", type=int, default=64, help="bytes per window (default 64)")
    args = p.parse_args()
    if args.worker is None and not args.reference:
        local_swarm.compare(__file__, args)
        return

    torch.set_num_threads(1)
    torch.manual_seed(0)
    train, held_out = corpus(args.block)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.block, n_embd=64, n_layer=2, n_head=4))
    batch = args.batch if args.worker is not None else args.batch * args.peers  # the reference: DDP's whole batch
    swarm = local_swarm.worker_swarm(args) if args.worker is not None else None  # peertrain (or peertrain.attach())
    if swarm is not None:
        train = peertrain.shard(train, swarm)  # peertrain
    training = TrainingArguments(output_dir=f"{args.out}.trainer", max_steps=args.steps, learning_rate=args.lr,
                                 per_device_train_batch_size=batch, lr_scheduler_type="cosine", warmup_steps=20,
                                 logging_steps=50, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                                 dataloader_drop_last=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=train)
    if swarm is not None:
        partners = args.peers - 1 - (args.late_peer and not args.late)  # the early peers do not wait for the late one
        callback = peertrain.integrations.hf.add_swarm(trainer, swarm, peers=partners)  # peertrain
    local_swarm.start_together(args)
    t0 = time.monotonic()
    trainer.train()
    result = {"accuracy": round(accuracy(model, held_out), 3), "steps": trainer.state.global_step,
              "seconds": round(time.monotonic() - t0, 1)}
    if swarm is not None:
        result["exchanges"] = swarm.exchanges()
        result["joined_at_step"] = callback.training.wrapper.joined_at_step
    local_swarm.write_result(args.out, result, model.parameters())
    if swarm is not None:
        local_swarm.stay_for_the_late_peer(args)
        swarm.close()


if __name__ == "__main__":
    main()

"""Your own training loop, averaged with the swarm by peertrain: a digits classifier from a plain TensorDataset.

Three ways to run it (README, "Use it from your own training script"):
  python examples/train_digits.py --home runs/local/node1          attach to a running daemon (`peer start`)
  python examples/train_digits.py --embedded --join HOST:PORT      run a daemon inside this process
  torchrun --nproc-per-node=2 examples/train_digits.py --home H    two ranks on one host, one peer
The peertrain lines are marked `# peertrain`; the rest is an ordinary PyTorch loop.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import local_swarm
import peertrain


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset, device: torch.device) -> float:
    x, y = data.tensors
    return (model(x.to(device)).argmax(1) == y.to(device)).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--home", help="home of the daemon to attach to (default $PEERTRAIN_HOME or ~/.peertrain)")
    p.add_argument("--embedded", action="store_true", help="run a daemon inside this process instead")
    p.add_argument("--config", help="config file of the embedded daemon (e.g. configs/local.toml)")
    p.add_argument("--join", action="append", default=[], help="embedded daemon: bootstrap peer HOST:PORT")
    p.add_argument("--listen", default="127.0.0.1:0", help="embedded daemon: address to accept peers on")
    p.add_argument("--swarm", help="embedded daemon: swarm name")
    p.add_argument("--world", type=int, default=0, help="data shards (default: the peers seen at start)")
    p.add_argument("--mode", default="adpsgd", choices=["adpsgd", "dpsgd", "local"],
                   help="adpsgd/dpsgd: GossipOptimizer; local: LocalStepsOptimizer (local steps, for slow links)")
    p.add_argument("--average-every", type=int, default=1, help="adpsgd/dpsgd: optimizer steps between averaging")
    p.add_argument("--inner-steps", type=int, default=10, help="local: inner steps between outer steps")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--target", type=float, default=0.95, help="stop at this held-out accuracy")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if "RANK" in os.environ:  # started by torchrun: the ranks of this host keep gradients in step
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    distributed = dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)

    if args.embedded:  # peertrain
        swarm = peertrain.start(args.config, home=args.home, listen=args.listen, join=args.join, swarm=args.swarm)
    else:
        swarm = peertrain.attach(args.home, label="examples/train_digits.py")  # peertrain
    train, test = local_swarm.digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.mode == "local":  # peertrain (slow links: an outer step and one exchange every --inner-steps)
        # outer lr 1, no outer momentum: the inner SGD already carries momentum 0.9, and DiLoCo's defaults (for
        # Adam) would scale each round's move by up to 7 (peertrain/outer.py)
        opt = peertrain.LocalStepsOptimizer(inner, swarm, inner_steps=args.inner_steps,
                                            outer_lr=1.0, outer_momentum=0.0)
    else:  # peertrain
        opt = peertrain.GossipOptimizer(inner, swarm, mode=args.mode, average_every=args.average_every)
    swarm.wait_for_peers(max(1, args.world - 1), group="model", timeout=30)  # peertrain: start together
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    loader = DataLoader(peertrain.shard(train, swarm, world=args.world or None), batch_size=32, shuffle=True)  # peertrain

    t0, acc, loss, samples = time.monotonic(), 0.0, torch.tensor(0.0), 0
    for epoch in range(args.epochs):
        for x, y in loader:
            loss = F.cross_entropy(net(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            samples += len(y)
            if opt.local_step == args.max_steps:
                break
        sched.step()
        acc = accuracy(model, test, device)
        elapsed = time.monotonic() - t0
        swarm.publish({"epoch": epoch + 1, "step": opt.local_step, "loss": loss.item(), "accuracy": acc,  # peertrain
                       "samples_per_s": samples / elapsed, "mode": args.mode, "device": str(device)})
        done = torch.tensor([float(acc >= args.target or opt.local_step == args.max_steps)])
        if distributed:  # every rank leaves the loop together (rank 0 decides)
            dist.broadcast(done, 0)
        if done.item() or swarm.should_stop():
            break
    swarm.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict()}, "own_loop.pt")  # peertrain
    if not distributed or dist.get_rank() == 0:
        exchanges = swarm.exchanges()
        print(json.dumps({"peer_id": swarm.peer_id, "accuracy": round(acc, 4), "epochs": epoch + 1,
                          "steps": opt.local_step, "joined_at_step": opt.joined_at_step, "exchanges": exchanges,
                          "seconds": round(time.monotonic() - t0, 2)}), flush=True)
    swarm.close()
    if distributed:  # DDP goes before its process group, then the ranks tear down together: otherwise gloo
        del net  # (torch 2.13) aborts a rank at exit about one run in six ("terminate called without an
        gc.collect()  # active exception")
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

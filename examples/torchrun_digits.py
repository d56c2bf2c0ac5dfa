"""Several ranks, one peer: a torchrun job of 2 gloo ranks per peer (DistributedDataParallel inside the peer,
gossip between peers), on the shipped UCI digits: 3 such peers, and one process with the batch of all 6
ranks, for comparison:

    python examples/torchrun_digits.py            3 peers of 2 ranks each, and the reference

Every rank calls the same peertrain functions; rank 0 alone runs the daemon and gossips, and after each
averaging call broadcasts the parameters to the other ranks (peertrain/distributed.py). On a host whose
daemon you started (`peer start`), each rank calls `peertrain.attach()` and finds it through $PEERTRAIN_HOME.
The peertrain lines are marked `# peertrain`.
"""

from __future__ import annotations

import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

import local_swarm
import peertrain

RANKS = 2  # ranks per peer


def main() -> None:
    p = local_swarm.parser(__doc__, steps=300, batch=8, lr=0.05, batch_help="samples per step of each rank")
    args = p.parse_args()
    if args.worker is None and not args.reference:
        local_swarm.compare(__file__, args, ranks=RANKS)
        return

    torch.set_num_threads(1)
    torch.manual_seed(0)
    distributed = "RANK" in os.environ  # started by torchrun
    if distributed:
        dist.init_process_group("gloo")
    train, held_out = local_swarm.digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    batch = args.batch if args.worker is not None else args.batch * RANKS * args.peers  # the reference: all ranks'
    swarm = local_swarm.worker_swarm(args) if args.worker is not None else None  # peertrain: rank 0 runs the daemon
    if swarm is not None:
        train = peertrain.shard(train, swarm)  # peertrain: this rank's part of this peer's shard
        opt = peertrain.GossipOptimizer(opt, swarm, join=False)  # peertrain
        swarm.wait_for_peers(args.peers - 1, group="model", timeout=120)  # peertrain: start together
        opt.join()  # peertrain
        if not distributed or dist.get_rank() == 0:
            local_swarm.start_together(args)
        if distributed:
            dist.barrier()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loader = DataLoader(train, batch_size=batch, shuffle=True, drop_last=True)
    t0, steps = time.monotonic(), 0
    while steps < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            steps += 1
            if steps == args.steps:
                break
    result = {"steps": steps, "seconds": round(time.monotonic() - t0, 1), "ranks": RANKS if distributed else 1}
    if swarm is not None:
        if not distributed or dist.get_rank() == 0:
            local_swarm.end_together(args)
        if distributed:
            dist.barrier()
        opt.settle()  # peertrain: average on until the peers' models agree
        result["exchanges"] = swarm.exchanges()
    result["accuracy"] = round(local_swarm.digits_accuracy(model, held_out), 3)
    if not distributed or dist.get_rank() == 0:
        local_swarm.write_result(args.out, result, model.parameters())
    if swarm is not None:
        swarm.close()
    if distributed:  # DDP goes before its process group, then the ranks tear down together (see train_digits.py)
        del net
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

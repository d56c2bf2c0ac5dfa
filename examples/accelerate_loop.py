"""Your own loop under Hugging Face Accelerate (mixed precision: bf16 by default, which runs on a CPU too),
with peertrain's GossipOptimizer inside Accelerate's optimizer wrapper, on the shipped UCI digits: 3 local
peers, and the same script as one process, for comparison:

    python examples/accelerate_loop.py                       3 peers and the reference (adpsgd)
    python examples/accelerate_loop.py --mode local          LocalStepsOptimizer instead (for slow links)

The peertrain lines are marked `# peertrain`. Against a daemon you started yourself (`peer start`),
`swarm = peertrain.attach()` takes `worker_swarm`'s place.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader

import local_swarm
import peertrain


def main() -> None:
    p = local_swarm.parser(__doc__, steps=300, batch=16, lr=0.05)
    p.add_argument("--mode", default="adpsgd", choices=["adpsgd", "dpsgd", "local"])
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16", "fp16"])
    args = p.parse_args()
    if args.worker is None and not args.reference:
        local_swarm.compare(__file__, args)
        return

    torch.set_num_threads(1)
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available())
    train, held_out = local_swarm.digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    batch = args.batch if args.worker is not None else args.batch * args.peers  # the reference: DDP's whole batch
    swarm = local_swarm.worker_swarm(args) if args.worker is not None else None  # peertrain (or peertrain.attach())
    if swarm is not None:
        train = peertrain.shard(train, swarm)  # peertrain
        if args.mode == "local":  # peertrain
            opt = peertrain.LocalStepsOptimizer(opt, swarm, inner_steps=10, join=False)
        else:  # peertrain
            opt = peertrain.GossipOptimizer(opt, swarm, mode=args.mode, join=False)
        swarm.wait_for_peers(args.peers - 1, group="model", timeout=120)  # peertrain: start together
        opt.join()  # peertrain: a late joiner starts from its partners' model
        gossip = opt
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loader = DataLoader(train, batch_size=batch, shuffle=True, drop_last=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    local_swarm.start_together(args)
    t0, steps = time.monotonic(), 0
    while steps < args.steps:
        for x, y in loader:
            with accelerator.autocast():
                loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            steps += 1
            if steps == args.steps:
                break
    model = accelerator.unwrap_model(model).float().cpu()
    result = {"accuracy": round(local_swarm.digits_accuracy(model, held_out), 3), "steps": steps,
              "seconds": round(time.monotonic() - t0, 1), "mixed_precision": args.mixed_precision}
    if swarm is not None:
        local_swarm.end_together(args)
        gossip.settle()  # peertrain: average on until the peers' models agree
        result["exchanges"] = swarm.exchanges()
        swarm.close()
    local_swarm.write_result(args.out, result, model.parameters())


if __name__ == "__main__":
    main()

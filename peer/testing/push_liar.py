"""A lying pusher, for tests only: a daemon whose trainer floods its partners with huge sparse updates, or
sends back the honest peers' mean update negated.

The daemon is the stock one and speaks the real protocol; only what its trainer pushes lies. It builds the
model the honest local-steps trainer builds (trainers/gossip_sgd.py: same name, options and seed) and shares
its outer weights as group "model" taking pushes, as `LocalStepsOptimizer(codec="sparse")` does, so it is a
partner of the group like any other. Then, every `interval` seconds until its daemon stops, it pushes an
update `scale` times larger than any honest one (random signs, every value the same magnitude, as the
sparse codec keeps 64 of every 4096), to every partner: the cheapest attack on the sparse outer exchange
(peer/averaging/push_gate.py), which each honest receiver must scale down to a few of its own updates and
rate-limit per sender. With `attack = "negate"` it is subtler: it takes the honest peers' pushes into its own
copy (as every peer does), and every `interval` pushes what they added since its last push, negated and
scaled to twice their mean, inside the norm bound: the update that undoes the swarm's progress, which each
honest receiver must see pointing away from its own and refuse (the angle). What it did is published in
`peer status` (trainer: pushes started).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from peer.averaging.edge_copies import sparse_roundtrip
from peertrain.optimizer import named
from protocol.tensor_encoder import TensorEncoder
from trainers.baseline import seeded_model
from trainers.datasets import load_sized_model
from trainers.options import option, parse_options

NAME = "peer.testing.push_liar"
NEGATE_SCALE = 5 / 4  # the honest pushes' sum from what we took of it (lr 1 / n, n = 5), over the 4 honest ones


@dataclass(frozen=True)
class PushLiarOptions:
    """`[trainer.options]` of this trainer (tests only; not in docs/config.md)."""

    model: str = option("char_transformer", "the honest peers' model")
    model_options: dict = option({}, "its sizes, as the honest peers' model_options")
    seed: int = option(0, "the honest peers' seed")
    attack: str = option("flood", "flood: huge random pushes; negate: the honest peers' mean update negated")
    interval: float = option(0.1, "seconds between pushes: far more often than an honest round")
    magnitude: float = option(100.0, "each pushed value's magnitude: an honest round's are ~0.05")
    threads: int = option(1, "torch threads")


def run(swarm, options: dict) -> dict:
    o = parse_options(PushLiarOptions, options, trainer=NAME)
    torch.set_num_threads(o.threads)
    _, _, model_opts = load_sized_model(o.model, o.model_options)
    model = seeded_model(o.model, o.seed, **model_opts)
    params = named([p for p in model.parameters() if p.is_floating_point()])
    tensors = {k: p.detach().to("cpu", torch.float32, copy=True).contiguous() for k, p in params.items()}
    swarm.share("model", tensors, push_lr=1.0)
    if o.attack not in ("flood", "negate"):
        raise ValueError(f"attack: expected flood or negate, got {o.attack!r}")
    rng = np.random.default_rng(o.seed + 1)
    started = 0
    last = {k: t.numpy().copy() for k, t in tensors.items()}  # negate: our copy at our last push
    while not swarm.should_stop():
        if o.attack == "negate" and started:
            # the honest pushes' sum since our last push, times lr / n (we take them with lr 1, n = all of us)
            added = {k: t.numpy() - last[k] for k, t in tensors.items()}
            last = {k: t.numpy().copy() for k, t in tensors.items()}
            if not any(a.any() for a in added.values()):
                time.sleep(o.interval)
                continue
            values = {k: (-2.0 * a * NEGATE_SCALE).astype(np.float32) for k, a in added.items()}
        else:  # flood; negate's first push, which gives our daemon the yardstick it needs to take pushes
            values = {k: (o.magnitude * rng.choice([-1.0, 1.0], size=t.shape)
                          * rng.uniform(0.5, 1.0, size=t.shape)).astype(np.float32) for k, t in tensors.items()}
        encoded = [TensorEncoder(k, v, codec="sparse").encoded() for k, v in values.items()]
        norm = sum(float(np.dot(q, q)) for q in map(sparse_roundtrip, values.values())) ** 0.5
        if swarm.push_update("model", encoded, norm=norm, round=started) is not None:
            started += 1
        swarm.publish({"trainer": NAME, "state": "attacking", "pushes_started": started})
        time.sleep(o.interval)
    result = {"trainer": NAME, "state": "stopped", "pushes_started": started}
    swarm.publish(result)
    return result

"""How far apart do replicas stay, and what does it cost in loss, when the local-steps outer exchange sends
sparse updates? A measurement in one process, for issue 41's choice of design (docs/design.md, "Sparse updates").

Peers on a ring train a small character transformer on their shards of the shipped corpus (Adam, `--inner`
steps a round), all from one initial model (a joiner downloads before it trains), and after each round
combine by one of:

  * `allreduce`: every peer takes the mean of all (local steps with an exact all-reduce, outer lr 1): the
    uncompressed reference, DiLoCo's;
  * `pairwise`: dense pairwise averaging along a perfect matching of the ring (what the gossip outer exchange
    does in fp32 today, weight 1/2);
  * `edges:G`: per-edge public copies (peer/averaging/edge_copies.py: the real sparse codec, top-k 64 of
    4096 with 2-bit values), consensus step G, on the same matching; an edge's first exchange is dense and
    sets its copies;
  * `everyone`: every peer's round update, sparse with error feedback, applied by all (SparseLoCo's
    all-gather; replicas stay identical; each peer receives N - 1 sparse updates a round); `everyone:K` sends
    K of every 4096 entries instead of the codec's default 64; `everyone:K:B` keeps B of the error feedback
    each round (SparseLoCo's decay; 1 by default); `everyone:K:B:A` steps A times the mean update (SparseLoCo's
    outer learning rate α; 1 by default);

Printed per mode: the validation loss of the peers' mean model and the mean of the peers' own, the spread
(the peers' mean distance from their mean, over its norm) late in the run, and the bytes a peer sends and
receives a round as a multiple of one float32 model. Only the rules and the model are real; no daemons.

    python -m peer.testing.sparse_mixing_sim --rounds 60 --json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from peer.averaging.edge_copies import SPARSE_BLOCK, SPARSE_TOPK, EdgeCopies
from peer.averaging.sparse_updates import UpdateFeedback, outer_step
from protocol.tensor_codec import tensor_nbytes
from trainers.datasets import load_sized_model
from trainers.models import build_model

SIZES = {"d_model": 128, "n_layers": 2, "n_heads": 4, "block": 64}  # 0.4 M parameters: ~100 sparse chunks
BATCH = 16
LR = 3e-3
EVAL_BATCHES = 8


def sparse_share(topk: int = SPARSE_TOPK) -> float:
    """Bytes of a sparse send over float32's, the wire's own body size for one chunk of SPARSE_BLOCK."""
    return tensor_nbytes("float32", [SPARSE_BLOCK], "sparse", SPARSE_BLOCK, topk) / (SPARSE_BLOCK * 4)


class Replica:
    def __init__(self, rank: int, world: int, train, opts: dict, init: torch.Tensor, seed: int):
        self.model = build_model("char_transformer", **opts)
        vector_to_parameters(init.clone(), self.model.parameters())
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.train = train
        self.idx = np.arange(rank, len(train), world)  # its shard
        self.rng = np.random.default_rng(seed * 100 + rank)

    def flat(self) -> np.ndarray:
        return parameters_to_vector(self.model.parameters()).detach().numpy().astype(np.float32)  # a copy

    def load(self, v: np.ndarray) -> None:
        vector_to_parameters(torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)), self.model.parameters())

    def steps(self, n: int) -> None:
        for _ in range(n):
            pick = self.rng.choice(self.idx, BATCH)
            xs, ys = zip(*(self.train[int(i)] for i in pick))
            x, y = torch.stack(xs), torch.stack(ys)
            self.opt.zero_grad()
            logits = self.model(x)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            self.opt.step()


@torch.no_grad()
def val_loss(model, batches) -> float:
    total = 0.0
    for x, y in batches:
        logits = model(x)
        total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    return total / len(batches)


def matching(n: int, rnd: int) -> list[tuple[int, int]]:
    """A perfect matching of the ring's edges, alternating between its two (n even)."""
    off = rnd % 2
    return [((i + off) % n, (i + off + 1) % n) for i in range(0, n, 2)]


def run(mode: str, peers: int, rounds: int, inner: int, seed: int, sizes: dict | None = None) -> dict:
    """One mode's run; `sizes` overrides the model's (SIZES), for a test that needs the arithmetic, not the loss."""
    torch.manual_seed(seed)
    train, test, opts = load_sized_model("char_transformer", dict(sizes or SIZES))
    init = parameters_to_vector(build_model("char_transformer", **opts).parameters()).detach().clone()
    reps = [Replica(r, peers, train, opts, init, seed) for r in range(peers)]
    rng = np.random.default_rng(seed)
    val = [tuple(torch.stack(t) for t in zip(*(test[int(i)] for i in rng.choice(len(test), BATCH))))
           for _ in range(EVAL_BATCHES)]
    edges: dict[tuple[int, int], tuple[EdgeCopies, EdgeCopies]] = {}
    feedback: list[UpdateFeedback] = []  # `everyone`'s accumulators, one per peer
    reference = init.numpy().copy()
    gamma = float(mode.split(":")[1]) if mode.startswith("edges:") else 0.0
    spreads, sent, received = [], 0.0, 0.0
    t0 = time.monotonic()
    for rnd in range(rounds):
        for r in reps:
            r.steps(inner)
        xs = [r.flat() for r in reps]
        if mode == "allreduce":
            mean = np.mean(xs, axis=0)
            xs = [mean.copy() for _ in xs]
            sent += 1.0
            received += 1.0  # a ring all-reduce moves about 2 (n-1)/n of a model each way; counted as one
        elif mode == "pairwise":
            for i, j in matching(peers, rnd):
                mean = (xs[i] + xs[j]) / 2
                xs[i], xs[j] = mean.copy(), mean.copy()
            sent += 1.0
            received += 1.0
        elif mode.startswith("edges:"):
            each = 2 / peers  # a pair's send counted per peer: every peer is in one pair a round
            for i, j in (sorted(pair) for pair in matching(peers, rnd)):
                if (i, j) not in edges:  # a new edge: one dense exchange sets its copies (q8 on the wire)
                    mean = (xs[i] + xs[j]) / 2
                    edges[(i, j)] = (EdgeCopies.start(xs[i], xs[j]), EdgeCopies.start(xs[j], xs[i]))
                    xs[i], xs[j] = mean.copy(), mean.copy()
                    sent += 0.25 * each
                    received += 0.25 * each
                    continue
                ci, cj = edges[(i, j)]  # i's copies and j's of one edge: each the other's mirror
                qi, qj = ci.send(xs[i]), cj.send(xs[j])
                di, dj = ci.commit(qi, qj), cj.commit(qj, qi)
                xs[i] = xs[i] + gamma * di
                xs[j] = xs[j] + gamma * dj
                sent += sparse_share() * each
                received += sparse_share() * each
        elif mode == "everyone" or mode.startswith("everyone:"):
            parts = mode.split(":")
            topk = int(parts[1]) if len(parts) > 1 else SPARSE_TOPK
            decay = float(parts[2]) if len(parts) > 2 else 1.0  # SparseLoCo's error-feedback decay
            outer_lr = float(parts[3]) if len(parts) > 3 else 1.0  # SparseLoCo's α: the step along the mean
            if not feedback:
                feedback = [UpdateFeedback(reference.size, decay=decay, topk=topk) for _ in xs]
            sends = {f"{k:04d}": fb.send(x - reference) for k, (fb, x) in enumerate(zip(feedback, xs))}
            reference = outer_step(reference, sends, outer_lr=outer_lr)
            xs = [reference.copy() for _ in xs]
            sent += sparse_share(topk)  # flooded: each peer's update reaches each other once
            received += (peers - 1) * sparse_share(topk)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        for r, x in zip(reps, xs):
            r.load(x)
        if rnd >= rounds // 2:
            mean = np.mean(xs, axis=0)
            spreads.append(float(np.mean([np.linalg.norm(x - mean) for x in xs]) / np.linalg.norm(mean)))
    mean_model = build_model("char_transformer", **opts)
    vector_to_parameters(torch.from_numpy(np.mean([r.flat() for r in reps], axis=0)), mean_model.parameters())
    return {"mode": mode, "val_loss_mean_model": round(val_loss(mean_model, val), 4),
            "val_loss_peers": round(float(np.mean([val_loss(r.model, val) for r in reps])), 4),
            "spread_late": round(float(np.mean(spreads)), 5) if spreads else None,
            "sent_per_round_models": round(sent / rounds, 4), "received_per_round_models": round(received / rounds, 4),
            "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m peer.testing.sparse_mixing_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="allreduce,pairwise,everyone,edges:0.01,edges:0.05",
                    help="comma-separated: allreduce, pairwise, everyone, everyone:K (K of every 4096 entries "
                         "sent), everyone:K:B (error feedback decayed by B a round), everyone:K:B:A (outer lr A), edges:G (default: %(default)s)")
    ap.add_argument("--peers", type=int, default=4, help="peers on the ring, even (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=60, help="outer rounds (default: %(default)s)")
    ap.add_argument("--inner", type=int, default=10, help="inner Adam steps a round (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object for all modes")
    a = ap.parse_args(argv)
    if a.peers < 2 or a.peers % 2:
        ap.error(f"--peers must be even and at least 2, got {a.peers}")
    torch.set_num_threads(1)
    out = []
    for mode in a.modes.split(","):
        res = run(mode.strip(), a.peers, a.rounds, a.inner, a.seed)
        out.append(res)
        if not a.json:
            print(res, flush=True)
    if a.json:
        print(json.dumps({"peers": a.peers, "rounds": a.rounds, "inner": a.inner, "seed": a.seed,
                          "sparse_share": round(sparse_share(), 5), "runs": out}, indent=1))


if __name__ == "__main__":
    main()

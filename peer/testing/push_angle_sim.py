"""What angles do honest sparse pushes make with each other when peers hold different labels? A measurement in one
process, for the push gate's angle rule (peer/averaging/push_gate.py: `opposed`, `turned_away`).

Peers train a small MLP on the digits (64 -> 256 -> 10: 19,210 parameters, past OPPOSED_MIN_ELEMENTS), each on
its own shard, `--inner` Adam steps a round from the round's shared reference, then send their round's update
with the real codec and error feedback (peer/averaging/sparse_updates.py) and step the reference by the mean, as
`outer_codec = "sparse"` does. Each receiver's cosine of every other peer's decoded push with its own, on its
own support, is what PushGate judges. Shards (`--splits`): `iid` (interleaved), `classes` (peer r holds the
labels c with c mod peers = r), `dir:A` (each label split over the peers by a Dirichlet(A) draw: small A, strong
skew). Also printed: what the swarm's mean push negated (the `negate` liar of peer/testing/push_liar.py) reads
against each honest push. Only the rules and the model are real; no daemons.

    python -m peer.testing.push_angle_sim --splits iid,classes,dir:0.1,dir:1.0 --peers 4 --seeds 2
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from peer.averaging.bounds import OPPOSED_COSINE
from peer.averaging.push_gate import ANGLE_MIN_PUSHES, ANGLE_WINDOW
from peer.averaging.sparse_updates import EF_DECAY, OUTER_LR, UpdateFeedback, outer_step

BATCH = 16
LR = 1e-3
HIDDEN = 256
LABELS = 10


def shards(labels: np.ndarray, split: str, peers: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each peer's sample indices under `split` (module docstring)."""
    if split == "iid":
        return [np.arange(r, len(labels), peers) for r in range(peers)]
    if split == "classes":
        return [np.where(labels % peers == r)[0] for r in range(peers)]
    if split.startswith("dir:"):
        alpha = float(split.split(":", 1)[1])
        parts: list[list[int]] = [[] for _ in range(peers)]
        for c in range(LABELS):
            idx = np.where(labels == c)[0]
            rng.shuffle(idx)
            cuts = (np.cumsum(rng.dirichlet([alpha] * peers)) * len(idx)).astype(int)[:-1]
            for r, part in enumerate(np.split(idx, cuts)):
                parts[r] += part.tolist()
        return [np.array(p, dtype=np.int64) for p in parts]
    raise ValueError(f"unknown split {split!r}: iid, classes or dir:A")


def _windowed_min(series: list[float], n: int) -> float | None:
    """The lowest mean of `n` consecutive values (None: fewer than n)."""
    if len(series) < n:
        return None
    return float(np.min(np.convolve(series, np.ones(n) / n, "valid")))


def run(split: str, *, peers: int, rounds: int, inner: int, seed: int) -> dict:
    from trainers.pipeline.wide import digits

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    train, test = digits()
    x, y = train.tensors
    parts = shards(y.numpy(), split, peers, rng)

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(x.shape[1], HIDDEN), torch.nn.ReLU(),
                                   torch.nn.Linear(HIDDEN, LABELS))

    reference = parameters_to_vector(mlp().parameters()).detach().numpy().copy()
    models = [mlp() for _ in range(peers)]
    optimizers = [torch.optim.Adam(m.parameters(), lr=LR) for m in models]
    feedback = [UpdateFeedback(reference.size, decay=EF_DECAY) for _ in range(peers)]
    pairs: dict[tuple[int, int], list[float]] = {}  # (receiver, sender) -> cosines, round by round
    negated: list[float] = []
    for _ in range(rounds):
        sends = []
        for r, (model, opt) in enumerate(zip(models, optimizers)):
            vector_to_parameters(torch.from_numpy(reference.copy()), model.parameters())
            for _ in range(inner):
                pick = rng.choice(parts[r], BATCH)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[pick]), y[pick]).backward()
                opt.step()
            sends.append(feedback[r].send(parameters_to_vector(model.parameters()).detach().numpy() - reference))
        norms = [float(np.linalg.norm(q)) for q in sends]
        for i in range(peers):
            for j in range(peers):
                if i != j and norms[i] > 0 and norms[j] > 0:
                    pairs.setdefault((i, j), []).append(float(sends[j] @ sends[i]) / (norms[i] * norms[j]))
        liar = -np.mean(sends, axis=0)
        negated += [float(liar @ q) / (float(np.linalg.norm(liar)) * n) for q, n in zip(sends, norms) if n > 0]
        reference = outer_step(reference, {f"{k:04d}": q for k, q in enumerate(sends)}, outer_lr=OUTER_LR)
    vector_to_parameters(torch.from_numpy(reference.copy()), models[0].parameters())
    xt, yt = test.tensors
    with torch.no_grad():
        accuracy = float((models[0](xt).argmax(1) == yt).float().mean())
    cosines = np.array([c for series in pairs.values() for c in series])
    runs = [max((len(s) for s in "".join("x" if c < -OPPOSED_COSINE else " " for c in series).split()), default=0)
            for series in pairs.values()]
    means = {n: [m for s in pairs.values() if (m := _windowed_min(s, n)) is not None]
             for n in (ANGLE_MIN_PUSHES, ANGLE_WINDOW)}
    return {"split": split, "peers": peers, "seed": seed, "parameters": int(reference.size),
            "cosine_min": round(float(cosines.min()), 3), "cosine_median": round(float(np.median(cosines)), 3),
            "opposed": f"{int((cosines < -OPPOSED_COSINE).sum())} of {cosines.size}",
            "opposed_most_by_one_sender": max(int((np.array(s) < -OPPOSED_COSINE).sum()) for s in pairs.values()),
            "opposed_longest_run": max(runs),
            **{f"mean_of_{n}_min": round(min(means[n]), 3) if means[n] else None
               for n in (ANGLE_MIN_PUSHES, ANGLE_WINDOW)},
            "negated_mean_cosine_median": round(float(np.median(negated)), 3),
            "negated_mean_cosine_max": round(float(np.max(negated)), 3), "accuracy": round(accuracy, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m peer.testing.push_angle_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--splits", default="iid,classes,dir:0.1,dir:1.0", help="comma-separated (default: %(default)s)")
    ap.add_argument("--peers", type=int, default=4, help="(default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=40, help="outer rounds (default: %(default)s)")
    ap.add_argument("--inner", type=int, default=20, help="inner Adam steps a round (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per split (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.peers < 2 or args.rounds < 1 or args.inner < 1 or args.seeds < 1:
        ap.error("--peers must be at least 2, and --rounds, --inner and --seeds at least 1")
    for split in args.splits.split(","):
        for seed in range(args.seeds):
            print(json.dumps(run(split, peers=args.peers, rounds=args.rounds, inner=args.inner, seed=seed)), flush=True)


if __name__ == "__main__":
    main()

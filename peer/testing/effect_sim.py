"""Would evidence by effect (issue 40, item 2) tell liars from honest partners? A measurement in one process.

Honest digits-CNN replicas train AD-PSGD on their shards (SGD, lr 0.05, momentum 0.9, batch 32: the byzantine
tests' recipe) on a ring with chords (degree 4) and average pairwise by the real rules (`Radii`: the clip
radius, the judge and the share bound; `bounds.clip_scale`; pairwise weight 1/3); liars answer with what
the attack library crafts (peer/testing/byzantine_craft.py) from the honest models they last saw, and start
one exchange per round as an honest peer does (dissensus: always with its victim). At every exchange the
honest side scores what it received on a probe of its own shard held out of its training: the loss of
their values minus the loss of ours (the "effect"). Printed, per run: the honest peers' test accuracy, and
the effect's quantiles for exchanges with honest partners and with liars, early and late in the run, so a
rule can be chosen from figures. No daemons: only the rules and the model are real.

    python -m peer.testing.effect_sim --attack dissensus --liars 1 --rounds 300
"""

from __future__ import annotations

import argparse
import json
import math
import random

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from peer.averaging.bans import BanList
from peer.averaging.bounds import clip_scale, opposed
from peer.averaging.radius import Radii
from peer.testing import byzantine_craft as craft
from trainers.baseline import seeded_model
from trainers.datasets import load_sized_model

WEIGHT = 1 / 3  # the pairwise rule's weight (peer/averaging/weights.py)
PROBE = 64  # samples of each honest peer's shard held out of its training, to score what it receives
LEARN_EVERY = 10  # rounds between a liar's looks at its honest neighbours' models (2 s at the tests' pace)
QUANTILES = (0.5, 0.9, 0.99)


class Peer:
    def __init__(self, rank: int, x: torch.Tensor, y: torch.Tensor, seed: int):
        self.model = seeded_model("digits_cnn", seed)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.probe = (x[:PROBE], y[:PROBE])
        self.x, self.y = x[PROBE:], y[PROBE:]
        self.rng = torch.Generator().manual_seed(1000 + rank)

    def flat(self) -> torch.Tensor:
        return parameters_to_vector(self.model.parameters()).detach().clone()

    def load(self, v: torch.Tensor) -> None:
        vector_to_parameters(v, self.model.parameters())

    def step(self) -> None:
        idx = torch.randint(len(self.x), (32,), generator=self.rng)
        self.opt.zero_grad()
        torch.nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx]).backward()
        self.opt.step()

    @torch.no_grad()
    def probe_loss(self, v: torch.Tensor) -> float:
        keep = self.flat()
        self.load(v)
        loss = float(torch.nn.functional.cross_entropy(self.model(self.probe[0]), self.probe[1]))
        self.load(keep)
        return loss


def run(attack: str, liars: int, honest: int, rounds: int, seed: int) -> dict:
    torch.manual_seed(seed)
    random.seed(seed)
    train, test, _ = load_sized_model("digits_cnn", {})
    n = honest + liars
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    shards = order.chunk(honest)
    peers = [Peer(i, train.x[s], train.y[s], seed) for i, s in enumerate(shards)]
    initial = parameters_to_vector(seeded_model("digits_cnn", seed).parameters()).detach()
    lying = set(range(honest, n))  # the last ids; the ring puts them side by side, as colluders would sit
    nbrs = {i: sorted({(i + k) % n for k in (-2, -1, 1, 2)} - {i}) for i in range(n)}
    radii = {i: Radii(max_ratio=8.0, byzantine_share=0.25) for i in range(honest)}
    bans = {i: BanList() for i in range(honest)}
    seen: dict[int, dict[str, list[torch.Tensor]]] = {l: {} for l in lying}
    victim = {l: next(j for j in nbrs[l] if j not in lying) for l in lying}
    effects: dict[str, list[tuple[int, float]]] = {"honest": [], "liar": []}
    t = 0.0
    struck = {"honest": 0, "liar": 0}

    def values(j: int) -> torch.Tensor:
        if j not in lying:
            return peers[j].flat()
        if not seen[j]:  # before its first look: the seeded initial model, as the real liar holds
            return initial.clone()
        crafted = craft.craft(attack, seen[j], epsilon={"dissensus": 1.5, "drift": 6.0}.get(attack, 0.1),
                              victim=str(victim[j]), seed=40)
        return torch.cat([c.reshape(-1) for c in crafted])

    def exchange(i: int, j: int, rnd: int) -> None:
        """Honest `i` with partner `j` (honest or lying), by the real rules, i's effect recorded."""
        nonlocal t
        t += 0.01
        if bans[i].banned(str(j), t) or radii[i].shares.over("g", str(j), t):
            return
        if j not in lying and (bans[j].banned(str(i), t) or radii[j].shares.over("g", str(i), t)):
            return
        a, b = peers[i].flat(), values(j)
        effects["liar" if j in lying else "honest"].append((rnd, peers[i].probe_loss(b) - peers[i].probe_loss(a)))
        ra = radii[i].radius("g", str(j), float(a.norm()), t)
        rb = radii[j].radius("g", str(i), float(b.norm()), t) if j not in lying else None
        d2, dot = float(((b - a) ** 2).sum()), float(a @ b)
        s = clip_scale(d2, ra.announced, rb.announced if rb else math.inf, dot=dot, elements=a.numel())
        peers[i].load(a + WEIGHT * s * (b - a))
        if j not in lying:
            peers[j].load(b + WEIGHT * s * (a - b))
        for me, other, r in ((i, j, ra), (j, i, rb)):
            if me in lying or r is None:
                continue
            why = radii[me].judge("g", str(other), distance=math.sqrt(d2), radius=r, moved=WEIGHT * s, now=t,
                                  opposed=opposed(d2, dot, a.numel()))
            if why:
                struck["liar" if other in lying else "honest"] += 1
                bans[me].strike(str(other), why, t)

    shapes = [p.shape for p in peers[0].model.parameters()]

    def as_model(v: torch.Tensor) -> list[torch.Tensor]:
        out, k = [], 0
        for shp in shapes:
            m = math.prod(shp)
            out.append(v[k:k + m].reshape(shp))
            k += m
        return out

    for rnd in range(rounds):
        if rnd % LEARN_EVERY == 0:
            for l in lying:
                seen[l] = {str(j): as_model(peers[j].flat()) for j in nbrs[l] if j not in lying}
        for i in random.sample(range(honest), honest):
            peers[i].step()
            exchange(i, random.choice(nbrs[i]), rnd)
        for l in lying:  # a liar's own exchange of the round: with its victim (dissensus) or any honest neighbour
            target = victim[l] if attack == "dissensus" else random.choice([j for j in nbrs[l] if j not in lying])
            exchange(target, l, rnd)
    with torch.no_grad():
        acc = [float((p.model(test.x).argmax(1) == test.y).float().mean()) for p in peers]

    def quantiles(xs: list[float]) -> dict:
        if not xs:
            return {}
        s = sorted(xs)
        return {f"q{int(q * 100)}": round(s[min(len(s) - 1, int(q * len(s)))], 4) for q in QUANTILES} | {"n": len(s)}

    third = rounds // 3
    return {"attack": attack, "liars": liars, "honest": honest, "rounds": rounds, "seed": seed,
            "accuracy_worst": round(min(acc), 4), "accuracy_mean": round(sum(acc) / len(acc), 4),
            "struck": struck,
            "effect": {kind: {"early": quantiles([e for r, e in xs if r < third]),
                              "late": quantiles([e for r, e in xs if r >= third])}
                       for kind, xs in effects.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peer.testing.effect_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--attack", default="dissensus", choices=[a for a in craft.ATTACKS])
    p.add_argument("--liars", type=int, default=1)
    p.add_argument("--honest", type=int, default=6)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(run(a.attack, a.liars, a.honest, a.rounds, a.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

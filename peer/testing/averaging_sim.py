"""A simulated averaging swarm that runs the real clip rule (peer/averaging/radius.py, bounds.py) in numpy:
the robust-averaging tests' swarm and `peer bench sybil`'s radius ratchet. No daemons, no sockets: peers are
rows of an array, a step is a noisy gradient step and one pairwise exchange, as AD-PSGD makes them."""

from __future__ import annotations

import math

import numpy as np

from peer.averaging.bans import BanList
from peer.averaging.bounds import clip_scale, opposed
from peer.averaging.radius import Radii, Radius

RATCHET_EXCESS = 3.9  # radii the colluders answer from: under STRIKE_EXCESS (4), so no exchange is struck
RATCHET_STEPS = 4000  # exchanges after the warm-up: the ratchet reached the ceiling within a few hundred
PULL = 0.01  # what each peer's step pulls its model back to the loss's minimum (the bare swarm has no loss)


class Swarm:
    """n peers on a ring with chords (degree 4), AD-PSGD: a random peer takes a noisy step with its own data's
    bias, then averages with a random neighbour by the real rule (pairwise weight 1/3). `lie(i, x_i)` gives
    the values a lying peer answers peer i with."""

    def __init__(self, n: int = 8, dim: int = 256, *, seed: int = 0, heterogeneity: float = 3.0,
                 noise: float = 0.01, lie=None, liars: frozenset = frozenset()):
        self.rng = np.random.default_rng(seed)
        self.noise = noise  # a step's size: with these defaults the peers disagree by ~1/5 of the model's norm
        self.n = n
        self.x = np.tile(self.rng.standard_normal(dim), (n, 1))  # a trained model, shared start
        self.bias = self.rng.standard_normal((n, dim)) * heterogeneity
        self.nbrs = {i: sorted({(i + k) % n for k in (-2, -1, 1, 2)} - {i}) for i in range(n)}
        self.radii = [Radii(max_ratio=8.0, byzantine_share=0.25) for _ in range(n)]
        self.bans = [BanList() for _ in range(n)]
        self.struck: dict[tuple[int, int], int] = {}  # (judge, peer) -> strikes
        self.judged: list[tuple[int, int, bool]] = []  # (judge, peer, struck) of every exchange
        self.clipped = self.exchanges = 0
        self.lie, self.liars = lie, liars
        self.t = 0.0

    def step(self) -> tuple[int, int, float]:
        self.t += 0.05
        i = int(self.rng.integers(self.n))
        if i not in self.liars:
            self.x[i] += self.noise * (self.rng.standard_normal(self.x.shape[1]) + self.bias[i])
        j = int(self.rng.choice(self.nbrs[i]))
        if self.bans[i].banned(str(j), self.t) or self.bans[j].banned(str(i), self.t):
            return i, j, 1.0
        if self.radii[i].shares.over("g", str(j), self.t) or self.radii[j].shares.over("g", str(i), self.t):
            return i, j, 1.0  # moved us past its share lately: refused as busy, as the engine does (shares.py)
        return i, j, self.exchange(i, j)

    def values(self, i: int, partner: int) -> np.ndarray:
        return self.lie(self.x[partner]) if i in self.liars else self.x[i]

    def radius(self, me: int, other: int) -> Radius:
        """The radius `me` announces to `other`, by the real rule."""
        return self.radii[me].radius("g", str(other), float(np.linalg.norm(self.x[me])), self.t)

    def exchange(self, i: int, j: int) -> float:
        a, b = self.values(i, j).copy(), self.values(j, i).copy()  # copies: an honest peer's values are its row
        ra, rb = self.radius(i, j), self.radius(j, i)
        d = float(np.linalg.norm(b - a))
        pointing_away = opposed(d * d, float(a @ b), a.shape[0])
        s = clip_scale(d * d, ra.announced, rb.announced, dot=float(a @ b), elements=a.shape[0])
        w = 1 / 3
        self.x[i] += w * s * (b - a)
        self.x[j] += w * s * (a - b)
        self.exchanges += 1
        self.clipped += s < 1.0
        for me, other, r in ((i, j, ra), (j, i, rb)):
            if me in self.liars:
                continue
            reason = self.radii[me].judge("g", str(other), distance=d, radius=r, moved=w * s, now=self.t,
                                          opposed=pointing_away)
            self.judged.append((me, other, bool(reason)))
            if reason:
                self.struck[(me, other)] = self.struck.get((me, other), 0) + 1
                self.bans[me].strike(str(other), reason, self.t)
        return s


def ratchet_run(colluders: bool, seed: int) -> tuple[float, float, dict]:
    """The largest radius honest peers announce to honest partners, and to peers 0 and 1, over 4000 steps of a
    swarm whose peers' steps also pull their models back to a minimum (what training does: the bare simulation
    has no loss), with peers 0 and 1 colluding or honest. Colluding, each answers its partner with the
    partner's own model moved 3.9 of the partner's radii along one fixed direction: never struck (within
    STRIKE_EXCESS radii), and its distance became a reference for every other partner of that peer."""
    sw = Swarm(seed=seed, noise=0.001)
    minimum = sw.x[0].copy()
    liars = {0, 1}
    step = sw.step

    def pulled_step():
        got = step()
        for k in range(sw.n):
            if k not in sw.liars:
                sw.x[k] -= PULL * (sw.x[k] - minimum) / sw.n
        return got
    sw.step = pulled_step
    for _ in range(500):
        sw.step()
    u = sw.rng.standard_normal(sw.x.shape[1])
    u /= np.linalg.norm(u)
    if colluders:
        def lie(i: int, partner: int) -> np.ndarray:
            r = sw.radius(partner, i).announced
            return sw.x[partner] + RATCHET_EXCESS * (r if math.isfinite(r) else 0.0) * u
        sw.values = lambda i, partner: lie(i, partner) if i in sw.liars else sw.x[i]
        sw.liars = frozenset(liars)
    honest = to_liars = 0.0
    for k in range(RATCHET_STEPS):
        sw.step()
        if k % 20:
            continue
        for v in set(range(sw.n)) - liars:
            for p in sw.nbrs[v]:
                r = sw.radius(v, p).announced
                if p in liars:
                    to_liars = max(to_liars, r)
                else:
                    honest = max(honest, r)
    return honest, to_liars, sw.struck

"""What a Byzantine peer sends: the models of the attack library, crafted from the honest models it has seen.

Pure functions over models, a model being a list of tensors in its group's order (the order the group's
specs travel in). The attacker (peer/testing/byzantine_trainer.py) learns honest models through the real protocol and
writes one of these into the tensors its daemon averages with; tests check them here, without processes.

The attacks, in model space (decentralized gossip averages models, not gradients), with μ and σ the
coordinate-wise mean and standard deviation of the honest models the attacker has seen:

- sign flip: −μ (bit flipping, as He, Karimireddy and Jaggi 2022, "Byzantine-robust decentralized learning
  via self-centered clipping", run it on models);
- scaled: c·μ, c = −4 by default (a sign flip made large);
- ALIE, "a little is enough" (Baruch, Baruch and Goldberg 2019): μ − z·σ, every coordinate within z standard
  deviations of the honest mean, so a check of each value against the mean and spread of the others lets it
  through for any threshold above z; z from their rule for n peers of which f lie (`baruch_z`), or configured;
- IPM, inner product manipulation (Xie, Koyejo and Gupta 2020): −ε·μ. Its gradient form sends −ε times the
  honest mean gradient; the decentralized adaptation of He et al. (2022) sends −ε times the mean of the
  victim's and its honest neighbours' models, and so does this one with the honest models it has seen.
  ε = 0.1 pulls a partner towards 0 (a shrunk model, hard to tell from a lagging one); ε = 10 is far;
- dissensus (He et al. 2022): x_v − ε·(m_v − x_v) for a victim v with model x_v whose honest neighbours'
  mean is m_v: it undoes the victim's pull towards its neighbours and pushes it away by ε times as much,
  so the victim drifts from the swarm while every value sent stays near it. The paper weighs m_v by the
  victim's mixing weights; here m_v is the mean of the honest models the attacker has seen other than the
  victim's (it cannot see the victim's other neighbours), and the push is ε times the gap, as specified.
- drift (issue 40's colluders): μ + ε·d·u, with d the largest distance between two honest models seen and u
  one fixed unit direction that every colluder draws from the same seed. A partner's radius is twice its
  other partners' largest distance, so at ε = 6 this sits about 3 radii out: under the 4 past which a run is
  judged, never struck, clipped to the radius each time, and never pointing away (u is nearly orthogonal to
  the model). Every push goes the same way, and each colluder's distance widens the radius a partner grants
  the other (the ratchet, peer/averaging/radius.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import torch

Model = list[torch.Tensor]

ATTACKS = ("sign_flip", "scaled", "alie", "ipm", "dissensus", "drift")


def mean(models: Sequence[Model]) -> Model:
    """The coordinate-wise mean of one or more models, in float32."""
    if not models:
        raise ValueError("no model to take the mean of")
    return [torch.stack([m[i].float() for m in models]).mean(dim=0) for i in range(len(models[0]))]


def std(models: Sequence[Model]) -> Model:
    """The coordinate-wise sample standard deviation (zeros for a single model: no spread seen yet)."""
    if not models:
        raise ValueError("no model to take the spread of")
    if len(models) == 1:
        return [torch.zeros_like(t, dtype=torch.float32) for t in models[0]]
    return [torch.stack([m[i].float() for m in models]).std(dim=0) for i in range(len(models[0]))]


def sign_flip(mu: Model) -> Model:
    return [-t for t in mu]


def scaled(mu: Model, factor: float) -> Model:
    return [factor * t for t in mu]


def alie(mu: Model, sigma: Model, z: float) -> Model:
    return [m - z * s for m, s in zip(mu, sigma)]


def ipm(mu: Model, epsilon: float) -> Model:
    return [-epsilon * t for t in mu]


def dissensus(victim: Model, neighbours_mean: Model, epsilon: float) -> Model:
    return [v - epsilon * (m - v) for v, m in zip(victim, neighbours_mean)]


def direction(like: Model, seed: int) -> Model:
    """A unit vector in model space (a model shaped as `like`), the same for every colluder with `seed`."""
    g = torch.Generator().manual_seed(seed)
    u = [torch.randn(t.shape, generator=g, dtype=torch.float32) for t in like]
    norm = math.sqrt(sum(float((t * t).sum()) for t in u)) or 1.0
    return [t / norm for t in u]


def widest(models: Sequence[Model]) -> float:
    """The largest distance between two of the models (0 for fewer than two)."""
    flat = [torch.cat([t.float().reshape(-1) for t in m]) for m in models]
    return max((float(torch.dist(a, b)) for i, a in enumerate(flat) for b in flat[i + 1:]), default=0.0)


def drift(mu: Model, reach: float, u: Model) -> Model:
    return [m + reach * d for m, d in zip(mu, u)]


def baruch_z(n: int, f: int) -> float:
    """ALIE's z_max (Baruch et al. 2019): with s = floor(n/2 + 1) − f honest peers needed beside the f liars for a
    majority, the largest z such that s honest values lie farther from the mean than μ − zσ does, Φ⁻¹((n − s)/n)
    for normally spread values; 0 where that is below 0 (few peers: the liars would need to sit at the mean)."""
    if n < 2 or not 0 <= f < n:
        raise ValueError(f"baruch_z: expected n >= 2 peers and 0 <= f < n liars, got n={n}, f={f}")
    s = math.floor(n / 2 + 1) - f
    p = (n - s) / n
    if p <= 0.5:
        return 0.0
    return NormalDist().inv_cdf(min(p, 1.0 - 1e-9))


def craft(attack: str, honest: dict[str, Model], *, scale: float = -4.0, epsilon: float = 0.1, z: float = 1.0,
          victim: str | None = None, seed: int = 0) -> Model:
    """The model `attack` sends, from the honest models seen (peer → model). Dissensus needs `victim` among
    them; with no other honest model than the victim's its push is 0 (it sends the victim's own model).
    Drift's direction comes from `seed` (the same for every colluder); with one honest model seen it has no
    spread to scale by and sends the mean."""
    if not honest:
        raise ValueError("no honest model seen yet")
    models = list(honest.values())
    if attack == "sign_flip":
        return sign_flip(mean(models))
    if attack == "scaled":
        return scaled(mean(models), scale)
    if attack == "alie":
        return alie(mean(models), std(models), z)
    if attack == "ipm":
        return ipm(mean(models), epsilon)
    if attack == "dissensus":
        if victim not in honest:
            raise ValueError(f"dissensus: the victim {victim!r} is not among the models seen")
        others = [m for p, m in honest.items() if p != victim]
        x_v = [t.float() for t in honest[victim]]
        return dissensus(x_v, mean(others), epsilon) if others else x_v
    if attack == "drift":
        mu = mean(models)
        return drift(mu, epsilon * widest(models), direction(mu, seed))
    raise ValueError(f"unknown attack {attack!r} (choose from {', '.join(ATTACKS)})")

"""A lying peer, for tests and `peer bench byzantine` only: a daemon whose trainer sends crafted models.

The daemon is the stock one and speaks the real protocol; only what its trainer puts in the shared tensors
lies. It lives with the test support, not in trainers/: no installed trainer holds an attack. It builds the same model as the honest trainer (trainers/gossip_sgd.py: same name, options and seed)
and shares it as group "model" (and "model.outer", as the local-steps wrapper does), so its exchanges carry
the names, dtypes and shapes honest peers expect. Then, until its daemon stops:

- every `learn_every` seconds it downloads its neighbours' current models (the download peers serve to a
  joiner: only neighbours get it). A download is refused past a bound against our own values, so it first
  puts back the honest mean it learnt last (the seeded initial model at first), as an honest peer would hold;
- it crafts the attack's model from the honest ones (peer/testing/byzantine_craft.py) and writes it into the
  shared tensors under the group's lock, so exchanges its neighbours start with it are served from it too;
- it starts an exchange with a neighbour (a random one; the victim, for dissensus) as often as an honest peer
  does: once per `steps_per_exchange` honest steps at the pace the steps it learns advance (or every
  `interval` seconds), from when the honest peers train (or at once, `eager`: a flood while they still wait
  for one another and have no honest distance to judge by); it rewrites the crafted model before each, since
  every exchange also moves our own tensors.

A sleeper (`sleep_exchanges` > 0) holds the honest mean instead for that many exchanges (ours and those served),
then attacks. The label-flip attacker needs no code here: it is the honest gossip trainer on `flipped_digits`.
Allies (`allies`: the other liars' peer IDs, which a colluding attacker knows) are neither learnt from nor
exchanged with. What it does is published in `peer status` (trainer: attack, phase, exchanges, refusals).
The attacker's own daemon should not judge honest partners (peer/testing/byzantine.py starts it so).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

import torch

from peertrain.optimizer import named
from protocol.refusal import Code
from peer.testing import byzantine_craft as craft
from trainers.baseline import seeded_model
from trainers.datasets import ArrayDataset, load_digits, load_sized_model
from trainers.models import count_parameters
from trainers.options import option, parse_options

NAME = "peer.testing.byzantine_trainer"  # its `[trainer] name`: the module the daemon hosts
ATTACKS = (*craft.ATTACKS, "none")  # none: honest-looking all along (holds the honest mean): the harness's control
MODES = ("adpsgd", "local")  # the honest trainer's modes whose groups we mirror (dpsgd shares what adpsgd does)
DEFAULT_EPSILON = {"ipm": 0.1, "dissensus": 1.5, "drift": 6.0}  # the issue's: IPM's small case, dissensus as He et al.
#   2022 run it; drift about 3 radii out (byzantine_craft.py)
DRIFT_SEED = 40  # drift's direction: the same for every colluder (they read the same code)
FIRST_INTERVAL_S = 0.1  # between exchanges until two downloads tell the honest pace (eager), or between looks
PACE_BOUNDS_S = (0.01, 5.0)  # the honest pace as an interval, kept within these (a stalled swarm: 5 s)
RETRY_BANNED_S = 10.0  # a neighbour that refused us as banned is offered again after this (its ban may have lapsed)
PUBLISH_EVERY_S = 1.0  # status lines, as often as an honest trainer's
MAX_ALLIES = 64  # far above any bench's liars; bounds what the option may make us hold


@dataclass(frozen=True)
class ByzantineOptions:
    """`[trainer.options]` of this trainer (test and benchmark only; not in docs/config.md)."""

    attack: str = option("sign_flip", "sign_flip | scaled | alie | ipm | dissensus | drift | none "
                                      "(peer/testing/byzantine_craft.py)")
    scale: float = option(-4.0, "scaled: the factor on the honest mean (-4: the issue's)")
    epsilon: float = option(0.0, "ipm: the factor of -ε·mean; dissensus: the push; drift: how far out, in the honest "
                                 "models' widest distance (0: 0.1 for ipm, 1.5 for dissensus, 6 for drift)")
    z: float = option(-1.0, "alie: standard deviations below the mean (-1: Baruch et al.'s z_max for `world` peers "
                            "of which `byzantine` lie)")
    byzantine: int = option(1, "alie's rule: how many of the `world` peers lie")
    sleep_exchanges: int = option(0, "exchanges (ours and served) to hold the honest mean before attacking: a sleeper")
    learn_every: float = option(2.0, "seconds between downloads of the neighbours' models")
    interval: float = option(0.0, "seconds between the exchanges we start (0: one per `steps_per_exchange` honest "
                                   "steps, at the pace the steps we learn advance)")
    steps_per_exchange: int = option(1, "honest steps between an honest peer's exchanges: its average_every, or its "
                                        "inner_steps in mode local")
    eager: bool = option(False, "exchange before the honest peers step (default: from their first steps on, as an "
                                "honest peer starts averaging)")
    allies: list = option([], "the other liars' peer IDs: never learnt from nor averaged with")
    # the honest trainer's, so the shared groups match theirs (trainers/gossip_sgd.py)
    model: str = option("digits_cnn", "the honest peers' built-in model")
    model_options: dict = option({}, "its size, as the honest peers' model_options")
    mode: str = option("adpsgd", "the honest peers' mode: adpsgd or dpsgd (group model) | local (model, model.outer)")
    seed: int = option(0, "the honest peers' seed: the same initial model, our first honest-looking values")
    world: int = option(0, "peers in all, for alie's rule (0: the peers seen at start, and us)")
    min_peers: int = option(1, "peers sharing the model to wait for before the first exchange")
    join_wait: float = option(60.0, "most seconds to wait for them")
    threads: int = option(1, "torch threads")


def check(o: ByzantineOptions) -> None:
    """Every option in range, or a ValueError naming the key."""
    def bad(key: str, want: str, got) -> ValueError:
        return ValueError(f"[trainer.options] {key}: expected {want}, got {got!r}")
    if o.attack not in ATTACKS:
        raise bad("attack", f"one of {', '.join(ATTACKS)}", o.attack)
    if o.mode not in (*MODES, "dpsgd"):
        raise bad("mode", "adpsgd, dpsgd or local", o.mode)
    for key, lo, hi in (("scale", -1e6, 1e6), ("epsilon", 0.0, 1e6), ("learn_every", 0.1, 3600.0),
                        ("interval", 0.0, 60.0), ("join_wait", 0.0, 3600.0)):
        v = getattr(o, key)
        if not (math.isfinite(v) and lo <= v <= hi):
            raise bad(key, f"a finite number in [{lo:g}, {hi:g}]", v)
    if not (math.isfinite(o.z) and (o.z == -1.0 or 0.0 <= o.z <= 100.0)):
        raise bad("z", "-1 (Baruch's rule) or a number in [0, 100]", o.z)
    for key, lo in (("byzantine", 0), ("sleep_exchanges", 0), ("world", 0), ("min_peers", 0), ("threads", 1),
                    ("steps_per_exchange", 1)):
        if getattr(o, key) < lo:
            raise bad(key, f"an integer >= {lo}", getattr(o, key))
    if len(o.allies) > MAX_ALLIES or not all(isinstance(a, str) and 0 < len(a) <= 128 for a in o.allies):
        raise bad("allies", f"at most {MAX_ALLIES} peer IDs", o.allies)


def flipped_digits():
    """The label-flip attacker's data (gossip_sgd `dataset_factory`): digits whose training labels are 9 - y;
    the held-out set keeps the true labels, so its accuracy shows what it learns."""
    train, test = load_digits(as_images=True)
    return ArrayDataset(train.x, 9 - train.y), test


class Liar:
    """The attacker's state between exchanges: the honest models it learnt, what it sends, its counts."""

    def __init__(self, swarm, o: ByzantineOptions, group, model_names: list[str], initial: list[torch.Tensor]):
        self.swarm, self.o, self.group, self.names = swarm, o, group, model_names
        self.honest: dict[str, list[torch.Tensor]] = {}  # peer -> its model at our last download
        self.honest_mean = [t.clone() for t in initial]  # what an honest peer would hold, as far as we know
        self.step = 0  # the largest honest step seen: told to peers as ours
        self.pace: list[tuple[float, int]] = []  # (when, largest honest step) at our first and latest download
        self.refused_at: dict[str, float] = {}  # peer -> when it last refused us as banned
        self.victim: str | None = None
        self.counts = {"exchanges": 0, "failed": 0, "refused_banned": 0, "learned": 0, "learn_failed": 0}
        self.refused: dict[str, int] = {}  # refusals other than bans, by code (busy: the partner was exchanging)
        self.epsilon = o.epsilon or DEFAULT_EPSILON.get(o.attack, 0.0)
        self.z = o.z

    # -- learning ------------------------------------------------------------------------------------
    def partners(self) -> list[str]:
        allies = set(self.o.allies)
        return [p for p in self.swarm.neighbours() if p not in allies]

    def learn(self) -> None:
        """Download every honest neighbour's model, holding honest-looking values meanwhile."""
        self.write(self.honest_mean)
        seen: dict[str, list[torch.Tensor]] = {}
        for p in self.partners():
            got = self.swarm.fetch_params("model", p)
            if got is None:
                self.counts["learn_failed"] += 1
                continue
            values, step = got
            seen[p] = [torch.as_tensor(v).float().clone() for v in values]
            self.step = max(self.step, int(step))
            self.counts["learned"] += 1
        if seen:
            self.honest = seen
            self.honest_mean = craft.mean(list(seen.values()))
            self.pace = [*self.pace[:1], (time.monotonic(), self.step)]

    def training(self) -> bool:
        """Whether the honest peers have begun to step (their step has grown between our downloads)."""
        return len(self.pace) == 2 and self.pace[1][1] > self.pace[0][1]

    def interval(self) -> float:
        """Seconds until our next exchange: `interval`, else `steps_per_exchange` honest steps at their pace."""
        if self.o.interval:
            return self.o.interval
        if not self.training():
            return FIRST_INTERVAL_S
        (t0, s0), (t1, s1) = self.pace
        lo, hi = PACE_BOUNDS_S
        return min(hi, max(lo, self.o.steps_per_exchange * (t1 - t0) / (s1 - s0)))

    # -- what we send --------------------------------------------------------------------------------
    def sleeping(self) -> bool:
        if not self.o.sleep_exchanges:
            return False
        c = self.swarm.exchanges()
        return c.get("initiated", 0) + c.get("served", 0) < self.o.sleep_exchanges

    def crafted(self, attacking: bool) -> list[torch.Tensor]:
        if not attacking or self.o.attack == "none" or not self.honest:
            return self.honest_mean
        if self.o.attack == "dissensus" and self.victim not in self.honest:  # no victim picked yet: nothing to push
            return self.honest_mean
        return craft.craft(self.o.attack, self.honest, scale=self.o.scale, epsilon=self.epsilon, z=self.z,
                           victim=self.victim, seed=DRIFT_SEED)

    def write(self, values: list[torch.Tensor]) -> None:
        with self.group.lock, torch.no_grad():
            for name, v in zip(self.names, values):
                self.group.tensors[name].copy_(v)
            self.group.step = self.step

    # -- exchanging ----------------------------------------------------------------------------------
    def pick(self) -> str | None:
        """Our next partner: the victim (dissensus), else a random neighbour that has not lately refused us."""
        now = time.monotonic()
        open_ = [p for p in self.partners() if now - self.refused_at.get(p, -math.inf) >= RETRY_BANNED_S]
        if self.o.attack == "dissensus":
            if self.victim not in open_ or self.victim not in self.honest:
                self.victim = next((p for p in sorted(open_) if p in self.honest), None)
            return self.victim
        return random.choice(open_) if open_ else None

    def exchange(self, peer: str) -> None:
        r = self.swarm.average_with("model", peer)
        if r.ok:
            self.counts["exchanges"] += 1
        elif r.code is Code.BANNED:
            self.counts["refused_banned"] += 1
            self.refused_at[peer] = time.monotonic()
        elif r.code is not None:
            self.refused[str(r.code)] = self.refused.get(str(r.code), 0) + 1
        else:
            self.counts["failed"] += 1

    def report(self, phase: str) -> dict:
        return {"attack": self.o.attack, "phase": phase, **self.counts, "refused": dict(self.refused),
                "victim": self.victim,
                "learned_from": len(self.honest), "honest_step": self.step,
                "banned_by": sorted(p for p, t in self.refused_at.items() if time.monotonic() - t < RETRY_BANNED_S)}


def run(swarm, options: dict) -> dict:
    o = parse_options(ByzantineOptions, options, trainer=NAME)
    check(o)
    torch.set_num_threads(o.threads)
    _, _, model_opts = load_sized_model(o.model, o.model_options)
    model = seeded_model(o.model, o.seed, **model_opts)
    params = named([p for p in model.parameters() if p.is_floating_point()])
    tensors = {k: p.detach().to("cpu", torch.float32, copy=True).contiguous() for k, p in params.items()}
    initial = [t.clone() for t in tensors.values()]
    group = swarm.share("model", tensors)
    if o.mode == "local":  # the outer momentum the local-steps wrapper serves to joiners: zeros, as a fresh one's
        swarm.share("model.outer", {k: torch.zeros_like(t) for k, t in tensors.items()}, averaged=False)
    have = swarm.wait_for_peers(o.min_peers, group="model", timeout=o.join_wait)
    world = o.world or (len(swarm.peers()) + 1)
    liar = Liar(swarm, o, group, list(tensors), initial)
    if o.attack == "alie" and o.z == -1.0:
        liar.z = craft.baruch_z(max(2, world), min(o.byzantine, world - 1))
    swarm.publish({"trainer": NAME, "state": "attacking", "parameters": count_parameters(model),
                   "phase": "sleeping" if o.sleep_exchanges else "attacking",
                   "peers_at_start": have, "world": world, "z": liar.z if o.attack == "alie" else None,
                   "epsilon": liar.epsilon or None, "options": asdict(o)})
    next_learn = next_publish = 0.0
    while not swarm.should_stop():
        now = time.monotonic()
        if now >= next_learn:
            liar.learn()
            next_learn = now + o.learn_every
        attacking = not liar.sleeping()
        peer = liar.pick() if o.eager or liar.training() else None
        liar.write(liar.crafted(attacking))
        if peer is not None:
            liar.exchange(peer)
        if now >= next_publish:
            swarm.publish(liar.report("attacking" if attacking else "sleeping"))
            next_publish = now + PUBLISH_EVERY_S
        time.sleep(liar.interval() if peer is not None else max(liar.interval(), FIRST_INTERVAL_S))
    result = liar.report("stopped")
    swarm.publish(result)
    return result

"""Honest training swarms with lying peers in them (issue 29): the one way tests and `peer bench byzantine`
start them and read what the defence did.

An honest peer is a daemon hosting trainers.gossip_sgd; a liar is a stock daemon whose trainer lies
(peer.testing.byzantine_trainer, or for label flipping the honest trainer on flipped labels): both are named in
the config only, as the daemon names every trainer. `ATTACKS` lists the attacks with the options that make
them; `run_swarm` starts `honest` + `liars` daemons, watches every honest daemon's bans while the honest
trainers run (`BanWatch`) and returns per-peer figures: accuracy, steps, bans and false positives.

Every home and identity is made before any daemon starts, so each liar knows its allies' peer IDs (a
colluding attacker would) and the watch knows who is who. A liar's own daemon never judges its partners
(the bench-only switch of the defence, `NO_DEFENCE_ENV`, and the widest max_update_ratio), as a real
attacker would run its daemon: that is its choice, and it only keeps it from refusing honest peers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from peer.home import Home
from peer.testing.daemon import DaemonProcess
from peer.testing.swarm import LocalSwarm, rank_env, swarm_config
from protocol import identity as ident

from peer.averaging.radius import NO_DEFENCE_ENV  # the defence's bench-only switch

HONEST_TRAINER = "trainers.gossip_sgd"
LIAR_TRAINER = "peer.testing.byzantine_trainer"
FLIPPED_DATA = "peer.testing.byzantine_trainer:flipped_digits"
LIAR_MAX_UPDATE_RATIO = 1e6  # the config's ceiling: the liar's daemon never clips, so never strikes an honest peer
SLEEP_EXCHANGES = 30  # the sleeper's honest exchanges (ours and served) before it attacks: many of its partners' first
LOCAL_INNER_STEPS = 50  # gossip_sgd's default inner_steps (a round's steps in mode local)
POLL_S = 0.5  # how often the watch reads every honest daemon's status (a ban shows within this)
NO_TRAINER_S = 60.0  # an honest trainer that has not started within this after its daemon is up has failed


@dataclass(frozen=True)
class Attack:
    """One attack of the library: what a liar runs, and what the defence owes against it."""

    name: str
    doc: str
    detectable: bool  # the defence must ban it within a bounded number of exchanges (else: bound its effect)
    options: dict  # the byzantine trainer's options; for `honest_trainer`, gossip_sgd's on top of the honest ones
    honest_trainer: bool = False  # label flip: the honest trainer, on flipped labels
    digits_only: bool = False  # needs the digits data set (label flip)


ATTACKS = {a.name: a for a in (
    Attack("sign_flip", "sends -μ, the honest mean flipped", True, {"attack": "sign_flip"}),
    Attack("scaled", "sends -4μ", True, {"attack": "scaled", "scale": -4.0}),
    Attack("alie", "sends μ - zσ, z = 1: within one standard deviation of the honest values in every coordinate",
           False, {"attack": "alie", "z": 1.0}),
    Attack("ipm_0.1", "sends -0.1μ (inner product manipulation, ε = 0.1)", False, {"attack": "ipm", "epsilon": 0.1}),
    Attack("ipm_10", "sends -10μ (inner product manipulation, ε = 10)", True, {"attack": "ipm", "epsilon": 10.0}),
    Attack("dissensus", "sends x_v - 1.5 (m_v - x_v) to a victim v, m_v its honest neighbours' mean", False,
           {"attack": "dissensus", "epsilon": 1.5}),
    Attack("drift", "sends μ + 6·d·u, d the honest models' widest distance, u one direction every colluder "
           "shares: about 3 radii out, never struck; colluders widen each other's radius", False,
           {"attack": "drift", "epsilon": 6.0}),
    Attack("label_flip", "trains honestly on labels 9 - y", False, {"dataset_factory": FLIPPED_DATA,
                                                                     "target_accuracy": 0.0},
           honest_trainer=True, digits_only=True),
    Attack("sleeper", f"holds the honest mean for {SLEEP_EXCHANGES} exchanges, then sends -μ", True,
           {"attack": "sign_flip", "sleep_exchanges": SLEEP_EXCHANGES}),
)}


@dataclass(frozen=True)
class SwarmPlan:
    """One swarm: `honest` peers training `honest_options` (gossip_sgd), `liars` running `attack`."""

    honest: int
    liars: int
    attack: str | None  # a key of ATTACKS; None: no liar (liars must be 0)
    topology: dict
    honest_options: dict  # gossip_sgd's: model, mode, steps, target, eval cadence...
    gossip: dict = field(default_factory=dict)
    membership: dict = field(default_factory=dict)
    defence: bool = True  # False: every honest daemon runs with the defence switched off (NO_DEFENCE_ENV)
    liar_options: dict = field(default_factory=dict)  # the byzantine trainer's, on top of the attack's (interval...)

    def __post_init__(self) -> None:
        if self.honest < 2 or self.liars < 0:
            raise ValueError(f"a swarm needs >= 2 honest peers and >= 0 liars, got {self.honest} and {self.liars}")
        if (self.attack is None) != (self.liars == 0):
            raise ValueError("liars need an attack, and an attack needs liars")
        if self.attack is not None and self.attack not in ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}; known: {', '.join(ATTACKS)}")


def make_identity(home: Path) -> str:
    """Create `home` and its identity key now (the daemon uses it when it starts); the peer ID."""
    key = Home(home).ensure().load_or_create_identity()
    return ident.peer_id_from_public_bytes(ident.public_key_bytes(key))


@dataclass
class Roster:
    """Who is who in a started swarm."""

    honest: list[DaemonProcess]
    liars: list[DaemonProcess]
    honest_ids: list[str]
    liar_ids: list[str]


def start_swarm(swarm: LocalSwarm, plan: SwarmPlan, name: str) -> Roster:
    """Start the plan's daemons in `swarm` (swarm name `name`): honest ones first, each told its shard of
    `plan.honest`; liars get shards too (the label flipper trains on one), numbered after them mod honest."""
    n = plan.honest + plan.liars
    honest_ids = [make_identity(swarm.root / f"h{i}") for i in range(plan.honest)]
    liar_ids = [make_identity(swarm.root / f"x{i}") for i in range(plan.liars)]
    honest_opts = {"world": plan.honest, "min_peers": n - 1, "target_accuracy": 0.0, "checkpoint_every": 0,
                   "threads": 1, "join_wait": 60.0, **plan.honest_options}
    common = {"swarm": name, "topology": plan.topology, "membership": plan.membership}
    off = {} if plan.defence else {NO_DEFENCE_ENV: "1"}
    honest = [swarm.start(f"h{i}", config=swarm_config(**common, gossip=plan.gossip, trainer=HONEST_TRAINER,
                                                      options=honest_opts),
                          env={**rank_env(i, plan.honest), "OMP_NUM_THREADS": "1", **off})
              for i in range(plan.honest)]
    liars = []
    if plan.liars:
        attack = ATTACKS[plan.attack]  # type: ignore[index]
        liar_gossip = {**plan.gossip, "max_update_ratio": LIAR_MAX_UPDATE_RATIO}
        for i in range(plan.liars):
            allies = [x for x in liar_ids if x != liar_ids[i]]
            if attack.honest_trainer:
                trainer, options = HONEST_TRAINER, {**honest_opts, **attack.options}
            else:
                trainer = LIAR_TRAINER
                options = {"model": honest_opts.get("model", "digits_cnn"), "seed": honest_opts.get("seed", 0),
                           "mode": "local" if honest_opts.get("mode") == "local" else "adpsgd",
                           **({"model_options": honest_opts["model_options"]} if "model_options" in honest_opts
                              else {}),
                           "world": n, "byzantine": plan.liars, "allies": allies, "join_wait": 60.0,
                           # as often as an honest peer exchanges: every average_every steps, or once a round
                           "steps_per_exchange": (honest_opts.get("inner_steps", LOCAL_INNER_STEPS)
                                                  if honest_opts.get("mode") == "local"
                                                  else honest_opts.get("average_every", 1)),
                           **attack.options, **plan.liar_options}
            cfg = swarm_config(**common, gossip=liar_gossip, trainer=trainer, options=options)
            liars.append(swarm.start(f"x{i}", config=cfg, env={**rank_env(i % plan.honest, plan.honest),
                                                                "OMP_NUM_THREADS": "1", NO_DEFENCE_ENV: "1"}))
    return Roster(honest, liars, honest_ids, liar_ids)


def trainer_of(st: dict | None) -> dict:
    return (st or {}).get("trainer") or {}


def _exchanges_with(st: dict, peer: str) -> int:
    return int((((st.get("gossip") or {}).get("by_peer") or {}).get(peer) or {}).get("exchanges", 0))


class BanWatch:
    """What the honest daemons did about the liars, from their statuses polled as training runs: when each
    first banned each liar and after how many exchanges with it (for a sleeper: from when it woke), and every
    ban of an honest peer by an honest peer (a false positive)."""

    def __init__(self, roster: Roster):
        self.roster = roster
        self.t0 = time.monotonic()
        self.bans: dict[tuple[int, str], dict] = {}  # (honest index, liar id) -> {after_s, exchanges, reason}
        self.false_positives: dict[tuple[int, str], str] = {}  # (honest index, honest id) -> reason
        self.exchanges: dict[tuple[int, str], int] = {}  # (honest index, liar id) -> completed exchanges, latest
        self.woke: dict[tuple[int, str], int] = {}  # (honest index, liar id) -> exchanges when the liar woke
        self.woke_at: dict[str, float] = {}  # liar id -> seconds into the run it began to attack
        self.radius_max = {"to_honest": 0.0, "to_liars": 0.0}  # the largest radius honest peers announced (status)

    def poll(self) -> list[dict | None]:
        """Read every honest and liar status once; the honest ones'."""
        honest = [d.try_status() for d in self.roster.honest]
        liars = [d.try_status() for d in self.roster.liars]
        now = time.monotonic() - self.t0
        for lid, st in zip(self.roster.liar_ids, liars):
            if lid not in self.woke_at and trainer_of(st).get("phase") == "attacking":
                self.woke_at[lid] = now
                for i, hs in enumerate(honest):
                    if hs is not None:
                        self.woke[(i, lid)] = _exchanges_with(hs, lid)
        liar_ids = set(self.roster.liar_ids)
        for i, st in enumerate(honest):
            if st is None:
                continue
            for p, e in (((st.get("gossip") or {}).get("by_peer")) or {}).items():
                r = (e or {}).get("radius")
                if isinstance(r, (int, float)) and math.isfinite(r):
                    side = "to_liars" if p in liar_ids else "to_honest"
                    self.radius_max[side] = max(self.radius_max[side], float(r))
            bans = {b["peer"]: b.get("reason", "") for b in (st.get("gossip") or {}).get("bans") or []}
            for lid in self.roster.liar_ids:
                self.exchanges[(i, lid)] = _exchanges_with(st, lid)
                if lid in bans and (i, lid) not in self.bans:
                    self.bans[(i, lid)] = {"after_s": round(now, 1), "exchanges": self.exchanges[(i, lid)],
                                           "reason": bans[lid][:200]}
            for j, hid in enumerate(self.roster.honest_ids):
                if j != i and hid in bans:
                    self.false_positives.setdefault((i, hid), bans[hid][:200])
        return honest

    def summary(self) -> dict:
        """Per liar: which honest peers exchanged with it, which banned it, after how many exchanges."""
        liars = {}
        for lid in self.roster.liar_ids:
            partners = [i for i in range(len(self.roster.honest)) if self.exchanges.get((i, lid), 0) > 0]
            banned = {i: b for (i, x), b in self.bans.items() if x == lid}
            until = [b["exchanges"] - self.woke.get((i, lid), 0) for i, b in banned.items()]
            # the most exchanges an honest peer had with it while it attacked, and did not ban it
            unbanned = [self.exchanges.get((i, lid), 0) - self.woke.get((i, lid), 0) for i in partners
                        if i not in banned and lid in self.woke_at]
            liars[lid[:8]] = {
                "honest_partners": len(partners), "banned_by": len(banned),
                "exchanges_until_ban_max": max(until) if until else None,
                "exchanges_until_ban_mean": round(sum(until) / len(until), 1) if until else None,
                "seconds_until_first_ban": min((b["after_s"] for b in banned.values()), default=None),
                "woke_after_s": round(self.woke_at[lid], 1) if lid in self.woke_at else None,
                "exchanges_with_honest": sum(self.exchanges.get((i, lid), 0) for i in range(len(self.roster.honest))),
                "exchanges_unbanned_max": max(unbanned, default=0),
                "ban_reason": next((b["reason"] for b in banned.values()), None),
            }
        return {"liars": liars, "radius_max": {k: round(v, 4) for k, v in self.radius_max.items()},
                "honest_banned": len(self.false_positives),
                "false_positives": [{"by": i, "banned": hid[:8], "reason": r}
                                    for (i, hid), r in sorted(self.false_positives.items())]}


def run_swarm(plan: SwarmPlan, root: Path, name: str, *, timeout: float) -> dict:
    """Start the plan's swarm under `root`, wait (at most `timeout` s) until every honest trainer is done or
    has failed, watching bans all along; what each honest peer reached, and the watch's summary. Raises
    TimeoutError (the swarm prints its daemons' log tails as it stops) if they do not finish in time."""
    with LocalSwarm(root) as swarm:
        roster = start_swarm(swarm, plan, name)
        watch = BanWatch(roster)
        deadline = time.monotonic() + timeout
        honest: list[dict | None] = []
        while True:
            for d in roster.honest:
                d.check_alive()
            honest = watch.poll()
            states = [str(trainer_of(st).get("state", "")) for st in honest]
            if all(s == "done" or s.startswith("failed") for s in states):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"honest trainers not done after {timeout:.0f} s: {states}")
            time.sleep(POLL_S)
        wall = time.monotonic() - watch.t0
        liars = [trainer_of(d.try_status()) for d in roster.liars]
        failed = [str(l.get("state")) for l in liars if str(l.get("state", "")).startswith("failed")]
        if failed:  # its daemon would serve a frozen model on: a different attack from the one measured
            raise RuntimeError(f"a liar's trainer failed, so {plan.attack} was not what ran: {failed}")
    peers = []
    for st in honest:
        t, g = trainer_of(st), (st or {}).get("gossip") or {}
        by_peer = g.get("by_peer") or {}
        peers.append({"state": t.get("state"), "accuracy": t.get("accuracy"), "test_loss": t.get("test_loss"),
                      "step": t.get("step"), "reached_target": t.get("reached_target"), "exchanges": g.get("exchanges"),
                      # what this peer's averaging says of each liar it met (counts; distance, radius, clip rate)
                      "liars_seen": {lid[:8]: by_peer[lid] for lid in roster.liar_ids if lid in by_peer}})
    defence = {((st or {}).get("gossip") or {}).get("defence") for st in honest} - {None}
    return {"peers": peers, "watch": watch.summary(), "wall_s": round(wall, 1),
            "defence": defence.pop() if len(defence) == 1 else None,  # what the honest daemons report running
            "liars": [{k: l.get(k) for k in ("attack", "phase", "exchanges", "refused_banned", "refused",
                                              "failed", "learned", "learn_failed", "victim", "z", "epsilon")}
                      for l in liars]}

"""Gossip for an optimizer a framework owns: what the Hugging Face and Lightning adapters share.

The framework built the optimizer and calls its `step`; we wrap the innermost torch optimizer (the one whose
`step` really runs) in GossipOptimizer or LocalStepsOptimizer and let the wrapper follow its steps through
torch's step hooks. So mixed precision (a skipped step runs no hook), gradient accumulation, clipping and LR
schedulers stay the framework's, and each framework adapter only maps its events onto `begin`, `figures`,
`state_dict` and `end`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from peertrain.optimizer import SETTLE_ROUNDS
from peertrain.swarm import Swarm

MODES = ("adpsgd", "dpsgd", "local")  # GossipOptimizer's two modes, and LocalStepsOptimizer (slow links)
PEER_WAIT_S = 120.0  # how long `begin` waits for `peers` partners: several daemons starting on one machine
STATE_KEY = "peertrain"  # the name our state takes in a framework's checkpoint


@dataclass(frozen=True)
class SwarmOptions:
    """How a framework's training joins the swarm (the adapters take these as keyword arguments).

    mode: "adpsgd" (a pairwise exchange in the background after each step), "dpsgd" (average with every
      neighbour after each step) or "local" (`inner_steps` local steps, then an outer step, gossiped).
    average_every: adpsgd/dpsgd, optimizer steps between averaging.
    inner_steps: local, optimizer steps per outer step.
    peers: wait for this many partners to share the model before the first step (0: start at once).
    settle_rounds: averaging rounds with every neighbour at the end, so the peers' models agree.
    group: the name the model's parameters are shared under (peers training one model use the same one).
    """

    mode: str = "adpsgd"
    average_every: int = 1
    inner_steps: int = 50
    peers: int = 0
    settle_rounds: int = SETTLE_ROUNDS
    group: str = "model"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        for name, low in (("average_every", 1), ("inner_steps", 1), ("peers", 0), ("settle_rounds", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        if not isinstance(self.group, str) or not self.group:
            raise ValueError(f"group: expected a non-empty name, got {self.group!r}")


def innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose `step` really runs, under the frameworks' wrappers (Accelerate's
    AcceleratedOptimizer and Lightning's LightningOptimizer hold it as `optimizer` / `_optimizer`), or a
    GossipOptimizer / LocalStepsOptimizer the user passed in already."""
    from peertrain.optimizer import WrappingOptimizer

    seen = 0
    while not isinstance(optimizer, WrappingOptimizer) and seen < 8:
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer, seen = inner, seen + 1
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch optimizer (or a framework's wrapper of one), got {type(optimizer).__name__}")
    return optimizer


class FollowedTraining:
    """One training run's place in the swarm: made by an adapter, begun when the framework has its optimizer."""

    def __init__(self, swarm: Swarm, options: SwarmOptions):
        self.swarm, self.options = swarm, options
        self.wrapper: Any = None  # GossipOptimizer or LocalStepsOptimizer, once begun
        self.ours = False  # did we wrap (and so follow) the optimizer, or did the user pass a wrapper in?

    def begin(self, optimizer: Any, *, step: int = 0, state: dict | None = None) -> None:
        """Share the optimizer's parameters, wait for `peers` partners, then resume `state` (ours, from a
        checkpoint) or join late: a partner ahead of `step` gives us its parameters. Begun again (the framework
        trains again after `end`), it follows the same optimizer again; another optimizer is refused."""
        from peertrain.optimizer import GossipOptimizer, WrappingOptimizer
        from peertrain.outer import LocalStepsOptimizer

        inner, o = innermost(optimizer), self.options
        if self.wrapper is not None:  # begun before: a framework training again (a second `trainer.train()`)
            if inner is not self.wrapper and inner is not self.wrapper.optimizer:
                raise RuntimeError("this training began with another optimizer, whose parameters the swarm shares: "
                                   "a new optimizer needs a new adapter (and the group unshared, or another group)")
            if self.ours:
                self.wrapper.follow()  # again, after `end` stopped it: else it would train alone without a word
            return
        if isinstance(inner, WrappingOptimizer):  # the user's own GossipOptimizer: it steps itself
            self.wrapper = inner
        elif o.mode == "local":
            self.wrapper = LocalStepsOptimizer(inner, self.swarm, inner_steps=o.inner_steps, group=o.group, join=False)
            self.ours = True
        else:
            self.wrapper = GossipOptimizer(inner, self.swarm, mode=o.mode, average_every=o.average_every,
                                           group=o.group, join=False)
            self.ours = True
        if self.ours:
            self.wrapper.follow()
        if o.peers:
            self.swarm.wait_for_peers(o.peers, group=self.wrapper.group_name, timeout=PEER_WAIT_S)
        if state is not None:
            self.wrapper.load_state_dict(state)
        elif step:
            self.wrapper.local_step = self.wrapper.shared.step = step
        self.wrapper.join(min_step=max(step, self.wrapper.local_step) + 1)

    def figures(self) -> dict[str, float]:
        """The swarm's figures for the framework's loggers, under "swarm/"."""
        counts = self.swarm.exchanges()
        out = {"swarm/peers": float(len(self.swarm.peers())),
               "swarm/exchanges": float(counts.get("initiated", 0) + counts.get("served", 0)),
               "swarm/exchanges_failed": float(counts.get("failed", 0))}
        if self.wrapper is not None and self.wrapper.joined_at_step is not None:
            out["swarm/joined_at_step"] = float(self.wrapper.joined_at_step)
        return out

    def publish(self, metrics: dict[str, Any]) -> None:
        """The framework's logged figures (finite numbers only), for `peer status` and the dashboard."""
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if clean:
            self.swarm.publish(clean)

    def should_stop(self) -> bool:
        return self.swarm.should_stop()

    def state_dict(self) -> dict | None:
        return None if self.wrapper is None else self.wrapper.state_dict()

    def end(self) -> None:
        """Settle (WrappingOptimizer.settle: the peers leave with models that agree), then stop following."""
        if self.wrapper is None:
            return
        self.wrapper.settle(self.options.settle_rounds)
        if self.ours:
            self.wrapper.unfollow()

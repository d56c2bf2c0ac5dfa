"""GossipOptimizer: gossip averaging around any torch optimizer, so a user's own loop changes by two lines.

    swarm = peertrain.attach()                                         # or peertrain.start(...)
    opt = peertrain.GossipOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), swarm)

Each `step()` runs the inner optimizer under the group's lock (the daemon updates the same memory in place
between steps), then every `average_every` steps averages the parameters with neighbours:
  * adpsgd — starts one pairwise exchange with a random neighbour in the background and returns at once
    (AD-PSGD: no rounds, a slow neighbour delays only itself);
  * dpsgd — averages with every neighbour before returning (D-PSGD; a neighbour past the exchange deadline
    is skipped, never waited for).
Optimizer state (momentum, Adam moments) stays local, as in both papers; `state_dict()` holds the inner
optimizer's state and our step count, so checkpoints resume. It subclasses torch.optim.Optimizer and shares
the inner optimizer's `param_groups` and `state`, so LR schedulers, `torch.amp.GradScaler` (`scaler.step(opt)`;
a step it skips is not counted) and gradient clipping work on it as on the inner one.
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from contextlib import ExitStack, nullcontext
from typing import Any, ContextManager

import torch

from peertrain.swarm import Swarm

MODES = ("adpsgd", "dpsgd")
SETTLE_ROUNDS = 3  # `settle`: at least this many averaging rounds with every neighbour when training ends,
SETTLED = 1e-4  # and more until one round moves our tensors by less than this, relative to their norm: a
#                partner still training keeps moving them, and once all are done the spread shrinks geometrically
#                (a round's move is about the mixing weight times our distance to the partners),
SETTLE_TRIES = 1200  # but no more tries than this (rounds, and waits of SETTLE_RETRY_S): about a minute at the
#                      most on loopback, and a partner that trains on for longer is not waited for. A count, not
#                      a clock, so that the ranks of a torchrun job (whose rounds are collectives) stop together.
SETTLE_RETRY_S = 0.05  # a round in which no exchange ran (ours still in flight) is tried again after this


def named(params: list) -> dict:
    """Parameters named by position: peers build the same model and optimizer, so position i is the same
    tensor everywhere (each exchange checks names, dtypes and shapes before it moves a byte)."""
    return {f"p{i}": p for i, p in enumerate(params)}


def _on_stack(frame: Any, top: Any) -> bool:
    """Is `frame` one of the frames below `top` (the call running now)?"""
    while top is not None:
        if top is frame:
            return True
        top = top.f_back
    return False


class WrappingOptimizer(torch.optim.Optimizer):
    """What GossipOptimizer and LocalStepsOptimizer share: torch.optim.Optimizer's attributes taken from the
    inner optimizer (not copied: a scheduler that changes our param_groups' lr changes the inner one's), and
    one step: the inner step under `_step_lock()`, then `_after_step()` (the subclass's counting and gossip).

    A framework that owns the optimizer (a Hugging Face Trainer, Lightning) steps the inner one itself;
    `follow()` runs the same step around it, from the inner optimizer's step hooks (peertrain/integrations)."""

    _following: tuple | None = None  # the hook handles, once follow() ran
    swarm: Swarm  # set by each subclass: where it averages, under which group, which shared tensors
    group_name: str
    shared: Any

    def _wrap(self, optimizer: torch.optim.Optimizer) -> list:
        """Adopt `optimizer`; its distinct floating-point parameters, in order."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(self).__name__} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.defaults, self.param_groups, self.state = optimizer.defaults, optimizer.param_groups, optimizer.state
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())
        params, seen = [], set()
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in seen and p.is_floating_point():
                    seen.add(id(p))
                    params.append(p)
        if not params:
            raise ValueError("the optimizer has no floating-point parameters to average")
        return params

    def _step_lock(self) -> ContextManager[Any]:
        """Held around the inner step: the tensors the daemon updates in place must not change under it."""
        return nullcontext()

    def _after_step(self) -> None:
        raise NotImplementedError

    def step(self, closure=None):
        if self._following is not None:
            raise RuntimeError(f"this {type(self).__name__} follows its inner optimizer's steps (follow()): "
                               "step the inner optimizer, as the framework does")
        with self._step_lock():
            loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self._after_step()
        return loss

    def follow(self) -> "WrappingOptimizer":
        """Run our step around every step of the inner optimizer, whoever calls it: the lock from its pre-hook
        to its post-hook, then `_after_step`. A step a GradScaler skips runs no hook and is not counted.
        Returns self.

        The hooks may nest: torch hooks every optimizer class's `step`, so one whose `step` calls its base
        class's (`super().step()`, once that class was built too) runs them twice per step; only the
        outermost pair takes the lock (it is not reentrant) and counts the step. A step that raised ran no
        post-hook: the next step's pre-hook finds the frame that took the lock gone from the stack, releases
        the lock and starts afresh (the raised step is not counted), so a framework that catches an error and
        goes on (an OOM retry) neither deadlocks nor stops gossiping."""
        if self._following is None:
            held, depth = ExitStack(), [0]
            owner: list[Any] = [None]  # the frame of the step call that took the lock

            def before(optimizer, args, kwargs) -> None:
                caller = sys._getframe(1)  # torch's step wrapper, running this call
                if depth[0] and not _on_stack(owner[0], caller):  # the step that took the lock raised
                    held.close()
                    depth[0] = 0
                depth[0] += 1
                if depth[0] == 1:
                    owner[0] = caller
                    held.enter_context(self._step_lock())

            def after(optimizer, args, kwargs) -> None:
                depth[0] -= 1
                if depth[0] == 0:
                    owner[0] = None
                    held.close()
                    self._after_step()

            self._following = (self.optimizer.register_step_pre_hook(before),
                               self.optimizer.register_step_post_hook(after))
        return self

    def unfollow(self) -> None:
        """Remove the hooks `follow()` put on the inner optimizer (training ended; the optimizer lives on)."""
        for handle in self._following or ():
            handle.remove()
        self._following = None

    def settle(self, rounds: int = SETTLE_ROUNDS, *, tries: int = SETTLE_TRIES) -> int:
        """Training is over: average with every neighbour at least `rounds` times, and on while partners still
        train (a round moves us by more than SETTLED), within `tries`, so that peers ending at about the same
        time leave with models that agree. The rounds run."""
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ValueError(f"rounds: expected an integer >= 0, got {rounds!r}")
        self._before_settling()
        done = 0
        for _ in range(tries):
            if done >= rounds:
                break
            moved = self._settle_round()
            if moved is None:  # no exchange ran: our own background round still runs, or the partners left
                if not self.swarm.neighbours():
                    break
                time.sleep(SETTLE_RETRY_S)
                continue
            done += 1
            if done == rounds and moved > SETTLED:
                rounds += 1  # a partner still moves us: another round
        self._after_settling()
        return done

    def _settle_round(self) -> float | None:
        """One averaging round with every neighbour: how far it moved the shared tensors, relative to their
        norm, or None if no exchange of it ran."""
        tensors = list(self.shared.tensors.values())
        with torch.no_grad():
            before = [t.detach().to("cpu", torch.float64, copy=True) for t in tensors]
            if not any(r.ok for r in self.swarm.average(self.group_name, mode="all")):
                return None
            moved = sum(float((t.detach().to("cpu", torch.float64) - b).pow(2).sum()) for t, b in zip(tensors, before))
            norm = sum(float(b.pow(2).sum()) for b in before)
        return (moved / max(norm, 1e-30)) ** 0.5

    def _before_settling(self) -> None:
        pass

    def _after_settling(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError(f"{type(self).__name__} shares its parameters when it is made: add parameter groups "
                           "to the inner optimizer before wrapping it")


class GossipOptimizer(WrappingOptimizer):
    """Wraps `optimizer`; averages its parameters through `swarm` (attached, embedded, hosted, or a torchrun
    job's ranks as one peer: peertrain/distributed.py)."""

    def __init__(self, optimizer: torch.optim.Optimizer, swarm: Swarm, *, mode: str = "adpsgd",
                 average_every: int = 1, group: str = "model", join: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if isinstance(average_every, bool) or not isinstance(average_every, int) or average_every < 1:
            raise ValueError(f"average_every: expected an integer >= 1 (steps between averaging), got {average_every!r}")
        params = self._wrap(optimizer)
        self.swarm, self.mode, self.average_every, self.group_name = swarm, mode, average_every, group
        self.shared = swarm.share(group, named(params))
        self.local_step = 0
        self.averaged = 0  # averaging rounds started (adpsgd) or completed (dpsgd)
        self.joined_at_step: int | None = None
        if join:
            self.join()

    def join(self, *, min_step: int = 1) -> int | None:
        """Start from the swarm's current parameters if a partner has trained to `min_step` or past (a peer
        joining late; one resuming passes its own step + 1); the step it was at, or None (no such partner).
        `join=True` does this when the wrapper is made; a trainer that first waits for its peers passes
        join=False and calls this after."""
        self.joined_at_step = self.swarm.download(self.group_name, min_step=min_step)
        if self.joined_at_step is not None:
            self.local_step = self.shared.step = self.joined_at_step  # what peers are told of our progress
        return self.joined_at_step

    def _step_lock(self) -> ContextManager[Any]:
        return self.shared.lock  # the daemon's in-place updates take it too

    def _after_step(self) -> None:
        """Count the step; average every `average_every` steps."""
        self.local_step += 1
        self.shared.step = self.local_step
        if self.local_step % self.average_every == 0:
            self.average()

    def average(self) -> None:
        """Average now (also called by `step`): adpsgd starts a round in the background, dpsgd waits for one."""
        if self.mode == "adpsgd":
            if self.swarm.average_in_background(self.group_name, mode="one"):
                self.averaged += 1
        else:
            self.swarm.average(self.group_name, mode="all")
            self.averaged += 1

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "gossip": {"step": self.local_step, "mode": self.mode,
                                                                      "average_every": self.average_every}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Ours (from `state_dict`), or a plain state dict of the inner optimizer."""
        if set(state_dict) == {"optimizer", "gossip"}:
            self.optimizer.load_state_dict(state_dict["optimizer"])
            step = state_dict["gossip"].get("step", 0)
            if isinstance(step, int) and step >= 0:
                self.local_step = self.shared.step = step
        else:
            self.optimizer.load_state_dict(state_dict)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    def __repr__(self) -> str:
        return f"GossipOptimizer({self.optimizer!r}, mode={self.mode!r}, average_every={self.average_every})"


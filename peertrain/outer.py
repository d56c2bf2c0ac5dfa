"""LocalStepsOptimizer: many local steps, then an outer step, gossiped, for peers on slow links.

DiLoCo's recipe (inner steps with any optimizer, then an outer Nesterov step on the pseudo-gradient) without
its all-reduce: no global round, no barrier, a peer that leaves mid-round is only skipped.

    opt = peertrain.LocalStepsOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), swarm, inner_steps=100)

Every `inner_steps` steps, each peer:
  1. forms its pseudo-gradient: where the round began minus where the inner steps took the model;
  2. takes a local outer step on its outer ("slow") weights with it: SGD with Nesterov momentum;
  3. averages the outer weights, not the pseudo-gradients, pairwise with a neighbour. Why: without an
     all-reduce nothing else pulls the replicas together; averaging only pseudo-gradients would let each
     peer's weights drift by what its mixes left out. When the weights agree, averaging them after each
     peer's step equals DiLoCo's step on the averaged pseudo-gradient (the outer momentum is linear in it);
  4. starts the next round from its outer weights.
The exchange runs in the background while the next round's inner steps run (`background=True`): it lands in
the outer weights, so the model sees it one round later (a staleness of one round; Streaming DiLoCo overlaps
the same way). `codec` ("float16", "q8") compresses what is exchanged; with `error_feedback` what a send
rounded off is carried into the next one (peer/averaging/shared.py: the swarm's sum is kept exactly and the
rounding telescopes instead of adding up). The outer weights and momentum live on the CPU in float32 (a GPU
model's memory holds only its inner copy); a joining peer downloads both from a partner.

`codec="sparse"` (hosted trainers: `HostedSwarm.push_update`) replaces step 3 with SparseLoCo's exchange, every
update to everyone: the round's update (where the inner steps took the model less where the round began) goes
through error feedback decayed by `decay` (the accumulator takes the momentum's place, and its memory), what
the wire's sparse codec keeps of it (64 of every 4096 values) is pushed to every partner, and every peer,
this one included, adds outer_lr / n of each push to its outer weights (peer/averaging/pushes.py; n: the
partners and us). Every `resync_every` rounds the outer weights are also averaged pairwise in q8, which brings
back together replicas that a lost push left apart. A round's model starts from the outer weights plus its own
share of its last update, dense, which the outer weights take a round later, sparse: the partners' updates
are a round late, ours is not.

The defaults (outer_lr 0.7, momentum 0.9) are DiLoCo's, for an Adam inner optimizer. They scale a round's move
by up to 0.7 / (1 - 0.9) = 7; over an inner SGD with momentum already at its largest stable rate that diverges
(the digits CNN fell to 10%): there, pass outer_lr=1.0, outer_momentum=0.0 (plain averaging of the rounds).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

from peer.averaging.sparse_updates import EF_DECAY, OUTER_LR, encode_with_feedback, nonzero_entries
from peertrain.optimizer import WrappingOptimizer, named
from peertrain.swarm import AVERAGE_MODES, Swarm

MODES = AVERAGE_MODES  # how each round averages the outer weights: the Swarm's own modes
MOMENTUM_BOUND = 10.0  # a joiner's downloaded momentum may be at most this times the weights' norm: at momentum
#                        0.9 it sums ~1/(1-0.9) = 10 rounds of pseudo-gradients, each far below the weights' norm
DENSE_OUTER_LR = 0.7  # DiLoCo's, for an Adam inner optimizer (the sparse exchange's is sparse_updates.OUTER_LR)
RESYNC_EVERY = 25  # sparse: rounds between dense (q8) averagings of the outer weights; the q8 sends then cost
#                    1/100 of float32's a round, as much again as the pushes at four peers
RESYNC_CODEC = "q8"
SPARSE = "sparse"


class LocalStepsOptimizer(WrappingOptimizer):
    """Wraps `optimizer` (the inner one); every `inner_steps` of its steps, an outer step and gossip."""

    def __init__(self, optimizer: torch.optim.Optimizer, swarm: Swarm, *, inner_steps: int = 50,
                 outer_lr: float | None = None, outer_momentum: float = 0.9, nesterov: bool = True,
                 codec: str | None = None, error_feedback: bool = True, background: bool = True, mode: str = "one",
                 group: str = "model", join: bool = True, decay: float = EF_DECAY, resync_every: int = RESYNC_EVERY):
        if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
            raise ValueError(f"inner_steps: expected an integer >= 1, got {inner_steps!r}")
        self.sparse = codec == SPARSE
        if outer_lr is None:
            outer_lr = OUTER_LR if self.sparse else DENSE_OUTER_LR
        if self.sparse:
            if not callable(getattr(swarm, "push_update", None)):
                raise ValueError("codec 'sparse' pushes each round's update to every partner, which a job hosted by "
                                 "the daemon can do (`peer start` with a trainer); this handle cannot: use q8")
            if not (isinstance(decay, (int, float)) and 0 < decay <= 1):
                raise ValueError(f"decay: expected a number in (0, 1], got {decay!r}")
            if isinstance(resync_every, bool) or not isinstance(resync_every, int) or resync_every < 0:
                raise ValueError(f"resync_every: expected an integer >= 0 (0: never), got {resync_every!r}")
        if not (isinstance(outer_lr, (int, float)) and 0 < outer_lr <= 10):
            raise ValueError(f"outer_lr: expected a number in (0, 10], got {outer_lr!r}")
        if not (isinstance(outer_momentum, (int, float)) and 0 <= outer_momentum < 1):
            raise ValueError(f"outer_momentum: expected a number in [0, 1), got {outer_momentum!r}")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        params = self._wrap(optimizer)
        self.swarm = swarm
        self.inner_steps, self.outer_lr, self.outer_momentum = inner_steps, float(outer_lr), float(outer_momentum)
        self.nesterov, self.background, self.mode, self.group_name = nesterov, background, mode, group
        self.decay, self.resync_every = float(decay), resync_every
        self.params = named(params)
        self.slow = {k: p.detach().to("cpu", torch.float32, copy=True).contiguous() for k, p in self.params.items()}
        # the outer momentum; with codec "sparse" the error feedback, which plays its part (SparseLoCo)
        self.momentum = {k: torch.zeros_like(t) for k, t in self.slow.items()}
        if self.sparse:
            self.shared = swarm.share(group, self.slow, codec=RESYNC_CODEC,  # type: ignore[call-arg]
                                      error_feedback=True, push_lr=self.outer_lr)
        else:
            self.shared = swarm.share(group, self.slow, codec=codec, error_feedback=error_feedback)
        self.outer_state = swarm.share(f"{group}.outer", self.momentum, averaged=False)  # for joiners only
        self.start = {k: t.clone() for k, t in self.slow.items()}  # the outer weights this round began from
        self.local_step = 0  # inner steps in all
        self.round_began = 0  # the inner step this round began at: a round is `inner_steps` long from there, so a
        #                       joiner that took a partner's step mid-round still trains a whole first round
        self.rounds = 0  # outer steps taken
        self.skipped = 0  # rounds whose exchange could not start (the previous one still ran)
        self.pushed = 0  # sparse: rounds whose update went to the partners
        self._own_share: float | None = None  # sparse: outer_lr / n of our last push (None: no round ended yet)
        self._sender: threading.Thread | None = None  # sparse: the worker sending the last round's update
        self._sender_error: BaseException | None = None
        self._carried = False  # sparse: a round ended while the last was still being sent, so it was kept
        self.joined_at_step: int | None = None
        if join:
            self.join()

    # -- joining --------------------------------------------------------------------------------------
    def join(self, *, min_step: int = 1) -> int | None:
        """Start from a partner's outer weights and momentum if one has trained to `min_step` or past (one
        resuming passes its own step + 1): its step, or None."""
        step = self.swarm.download(self.group_name, min_step=min_step)
        if step is not None and not self.sparse:  # (a partner's error feedback is its own to send, not ours)
            self.swarm.download(f"{self.group_name}.outer", min_step=0)  # momentum: best effort
            self._check_momentum()
        if step is not None:
            self.local_step = self.shared.step = step
            self.restart_round()
        self.joined_at_step = step
        return step

    @torch.no_grad()
    def _check_momentum(self) -> None:
        """A downloaded momentum sums pseudo-gradients, each a round's change of the weights: one larger than
        MOMENTUM_BOUND times the weights' norm is not a momentum but a push, and is dropped (we start at 0)."""
        with self.shared.lock, self.outer_state.lock:
            m = sum(float(t.double().pow(2).sum()) for t in self.momentum.values()) ** 0.5
            w = sum(float(t.double().pow(2).sum()) for t in self.slow.values()) ** 0.5
            if not m <= MOMENTUM_BOUND * w:  # (NaN included)
                for t in self.momentum.values():
                    t.zero_()

    # -- the optimizer --------------------------------------------------------------------------------
    def _after_step(self) -> None:
        """Count the inner step; every `inner_steps`, the outer step (the inner step needs no lock: the
        daemon updates only the outer weights)."""
        self.local_step += 1
        self.shared.step = self.local_step
        if self.local_step - self.round_began >= self.inner_steps:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """The round's end (also called by `step`): pseudo-gradient, outer step, gossip, next round."""
        if self.sparse:
            self._sparse_outer_step()
            return
        mu, lr = self.outer_momentum, self.outer_lr
        with self.shared.lock, self.outer_state.lock:
            for k, p in self.params.items():
                delta = self.start[k] - p.detach().to("cpu", torch.float32)  # the pseudo-gradient
                m = self.momentum[k]
                m.mul_(mu).add_(delta)
                self.slow[k].sub_(delta.add_(m, alpha=mu) if self.nesterov else m, alpha=lr)
        self.rounds += 1
        if self.background:
            if not self.swarm.average_in_background(self.group_name, mode=self.mode):
                self.skipped += 1
        else:
            self.swarm.average(self.group_name, mode=self.mode)
        self.restart_round()

    def _sparse_outer_step(self) -> None:
        """SparseLoCo's round end, overlapped: the round's update is handed to a worker thread, which puts it
        through the error feedback, has the daemon push it to every partner, and adds outer_lr / n of it to
        the outer weights as every partner does (the module docstring). The next round starts at once, from
        the outer weights as they are (our update lands in them a round later, as the partners' do) plus our
        own share of this round's update, dense (outer_lr / n of it, as it will be added once sent): so our
        own work is not a round late, only the partners' is (before our first push, with n counted from our
        neighbours rather than waiting for the daemon's). A round
        that ends while the last one's update is still being sent takes no outer step: it keeps training from
        where it is, and the next round's update holds both. A dense q8 averaging every
        `resync_every` rounds."""
        self._raise_from_sender()
        if self._sender is not None and self._sender.is_alive():
            self.skipped += 1
            self._carried = True  # the model holds a round not yet sent
            self.round_began = self.local_step  # (the next end: a round from now, as for any round)
            return
        self._carried = False
        with torch.no_grad(), self.shared.lock:
            updates = {k: p.detach().to("cpu", torch.float32, copy=True).sub_(self.start[k])
                       for k, p in self.params.items()}
        self.rounds += 1
        self._sender = threading.Thread(target=self._send_round, args=(updates, self.rounds),
                                        name="peertrain-sparse-round", daemon=True)
        if self.background:  # the next round's start is taken before the worker can add to the outer weights
            if self._own_share is None:  # before our first push, n from our neighbours (then the daemon's)
                self._own_share = self.outer_lr / (len(self.swarm.neighbours()) + 1)
            self.restart_round(ahead=updates)
            self._sender.start()
        else:
            self._sender.start()
            self.wait_for_round()
            self.restart_round()
        if self.resync_every and self.rounds % self.resync_every == 0:
            self.swarm.average_in_background(self.group_name, mode=self.mode)

    @torch.no_grad()
    def _send_round(self, updates: dict[str, torch.Tensor], round: int) -> None:
        """The worker's part of a sparse round (see `_sparse_outer_step`). A push not started gives its send
        back to the feedback: nothing is lost. An error is raised in the trainer's thread at its next round."""
        try:
            sends = []
            with self.outer_state.lock:  # the feedback is this thread's while it encodes
                for k, u in updates.items():
                    q, encoded = encode_with_feedback(self.momentum[k].numpy().reshape(-1), u.numpy(),
                                                      decay=self.decay, name=k, shape=tuple(u.shape))
                    sends.append((k, q, encoded))
            norm = sum(float(np.dot(q, q)) for _, q, _ in sends) ** 0.5
            push = self.swarm.push_update  # type: ignore[attr-defined]
            support = [nonzero_entries(q) for _, q, _ in sends]
            n = push(self.group_name, [e for _, _, e in sends], norm=norm, round=round,  # (checked at construction)
                     support=support)
            with self.shared.lock, self.outer_state.lock:
                for k, q, _ in sends:
                    if n is None:
                        self.momentum[k].view(-1).add_(torch.from_numpy(q))  # not sent: still owed
                    else:
                        self.slow[k].view(-1).add_(torch.from_numpy(q), alpha=self.outer_lr / n)
            if n is None:
                self.skipped += 1
            else:
                self.pushed += 1
                self._own_share = self.outer_lr / n
        except BaseException as exc:  # the trainer's thread raises it (a daemon thread's would vanish)
            self._sender_error = exc

    def wait_for_round(self) -> None:
        """Wait until the last sparse round's update is sent and applied (settling, a synchronous round)."""
        if self._sender is not None:
            self._sender.join()
        self._raise_from_sender()

    def _raise_from_sender(self) -> None:
        error, self._sender_error = self._sender_error, None
        if error is not None:
            raise RuntimeError(f"the last sparse round failed: {type(error).__name__}: {error}") from error

    def _before_settling(self) -> None:
        self.wait_for_round()
        if self.local_step != self.round_began or self._carried:
            self.outer_step()  # close the round we are in (sparse: also one whose update could not go yet)
            self.wait_for_round()

    def _after_settling(self) -> None:
        self.restart_round()  # the model leaves with the settled outer weights

    def restart_round(self, ahead: dict[str, torch.Tensor] | None = None) -> None:
        """The next round starts from the outer weights as they are now (an exchange may land in them any time
        after: taken under the lock, so `start` and the model hold the same cut), plus our own share of
        `ahead`, the update the sparse round has just handed its worker (see `_sparse_outer_step`)."""
        self.round_began = self.local_step
        with torch.no_grad(), self.shared.lock:
            for k, p in self.params.items():
                self.start[k].copy_(self.slow[k])
                if ahead is not None:
                    assert self._own_share is not None
                    self.start[k].add_(ahead[k], alpha=self._own_share)
                p.copy_(self.start[k].to(p.device, p.dtype))

    def state_dict(self, *, copy: bool = True) -> dict:
        """The inner optimizer's state, the outer weights, momentum and round start, and the counts. With
        `copy=False` the outer tensors are the live ones, for a caller that holds `locked()` until it has
        written them out: a checkpoint streamed to disk then costs no memory, where the three copies were
        1.3 GB more at the end of a 100 M-parameter run (docs/benchmarks.md, 2026-11-29)."""
        take = (lambda t: t.clone()) if copy else (lambda t: t)
        with self.shared.lock if copy else nullcontext():
            outer = {part: {k: take(t) for k, t in getattr(self, part).items()}
                     for part in ("slow", "momentum", "start")}
        return {"optimizer": self.optimizer.state_dict(), "outer": outer,
                "local_steps": {"step": self.local_step, "rounds": self.rounds, "inner_steps": self.inner_steps}}

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the outer weights and momentum still (the daemon applies exchanges to them under these locks;
        one that finds them held owes its update until the next snapshot, peer/averaging/shared.py)."""
        with self.shared.lock, self.outer_state.lock:
            yield

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Ours (from `state_dict`), or a plain state dict of the inner optimizer."""
        if set(state_dict) != {"optimizer", "outer", "local_steps"}:
            self.optimizer.load_state_dict(state_dict)
            return
        outer = state_dict["outer"]
        for part in ("slow", "momentum", "start"):
            if set(outer[part]) != set(self.slow) or any(outer[part][k].shape != self.slow[k].shape for k in self.slow):
                raise ValueError(f"this state's outer {part} tensors do not match the model's parameters")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with self.shared.lock, self.outer_state.lock:
            for k in self.slow:
                self.slow[k].copy_(outer["slow"][k])
                self.momentum[k].copy_(outer["momentum"][k])
                self.start[k].copy_(outer["start"][k])
        counts = state_dict["local_steps"]
        self.local_step = self.shared.step = int(counts.get("step", 0))
        self.round_began = self.local_step - self.local_step % self.inner_steps  # (its `start` is that round's)
        self.rounds = int(counts.get("rounds", 0))
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    def __repr__(self) -> str:
        return (f"LocalStepsOptimizer({self.optimizer!r}, inner_steps={self.inner_steps}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum}, nesterov={self.nesterov})")

"""A stage handler that lies in its answers: the benchmark's and tests' attacker for verified stage calls
(peer/pipeline/verify.py). Benchmark and tests only: a peer of trainers.swarm_pipeline serves its stage through
it when its options name it as their `stage_wrapper` (`options(spec)` gives them); the trainer holds no attack.

It computes every call honestly (so its own stage learns, averages and keeps gradients as an honest peer's),
then sends something else back:
  * "scale:F": every output tensor times F (activations, and the gradients of a backward or loss call);
  * "noise:S": every output plus Gaussian noise of S times the output's RMS;
  * "flip": the gradient of a backward or loss call negated (forwards stay honest);
  * "stale": the outputs of the weights it had when it started lying, frozen, while its stage trains on;
  * "blame": computes nothing and refuses every call as the asker's fault (the server answers BAD_INPUT), a lie
    any honest peer of the stage contradicts by serving the call (peer/pipeline/driver.py strikes it then).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from trainers.pipeline.blocks import seeded

MODES = ("scale", "noise", "flip", "stale", "blame")
WRAPPER = "peer.testing.lying_stage:liar"  # the swarm_pipeline `stage_wrapper` that serves a stage through `Lying`


def parse(spec: str) -> tuple[str, float]:
    """"scale:1.05" -> ("scale", 1.05); "flip" -> ("flip", 0.0). ValueError naming what is wrong."""
    mode, _, arg = spec.partition(":")
    if mode not in MODES:
        raise ValueError(f"liar: expected one of {', '.join(MODES)} (scale:F, noise:S), got {spec!r}")
    if mode in ("scale", "noise"):
        try:
            value = float(arg)
        except ValueError:
            raise ValueError(f"liar: {mode} takes a number ({mode}:F), got {spec!r}") from None
        if not (value == value and abs(value) < 1e6) or (mode == "noise" and value <= 0):
            raise ValueError(f"liar: {mode}'s number must be finite{' and above 0' if mode == 'noise' else ''}, "
                             f"got {arg!r}")
        return mode, value
    if arg:
        raise ValueError(f"liar: {mode} takes no argument, got {spec!r}")
    return mode, 0.0


def liar(spec: str) -> Callable[[Any, Any, int], Lying]:
    """trainers.swarm_pipeline's `stage_wrapper` (stage_wrapper_options = {"spec": ...}): a stage served through
    `Lying`. The spec is checked here, so a bad one fails the trainer's option check, before any work."""
    parse(spec)
    return lambda handler, worker, seed: Lying(handler, spec, worker, seed=seed)


def options(spec: str) -> dict:
    """The swarm_pipeline options that make a peer's stage server lie as `spec` says."""
    return {"stage_wrapper": WRAPPER, "stage_wrapper_options": {"spec": spec}}


class Lying:
    """Wraps a stage handler (the `worker`, or one wrapping it); lies as `spec` says (see the module doc)."""

    def __init__(self, handler, spec: str, worker, seed: int = 0):
        self.handler, self.worker = handler, worker
        self.mode, self.value = parse(spec)
        self._gen = torch.Generator().manual_seed(seed)
        self._frozen = None
        if self.mode == "stale":
            with worker.lock:
                self._frozen = copy.deepcopy(worker.module).requires_grad_(False)

    def kinds(self) -> tuple[str, ...]:
        return self.handler.kinds()

    def input_specs(self, kind: str, batch: int) -> list[tuple[str, str, list[int]]]:
        return self.handler.input_specs(kind, batch)

    def compute(self, kind: str, tensors: list[Any], seed: int):
        if self.mode == "blame":  # the server answers a ValueError as BAD_INPUT, blaming the driver
            raise ValueError("your inputs are not what this stage takes (a lie: any honest peer serves them)")
        loss, outputs, held = self.handler.compute(kind, tensors, seed)
        if self.mode == "stale":
            outputs = self._stale(kind, tensors, seed, outputs)
        elif self.mode == "scale":
            outputs = [t * self.value if t.is_floating_point() else t for t in outputs]
        elif self.mode == "noise":
            outputs = [t + torch.randn(t.shape, generator=self._gen, dtype=t.dtype) * t.pow(2).mean().sqrt()
                       * self.value if t.is_floating_point() else t for t in outputs]
        elif self.mode == "flip" and kind in ("backward", "loss"):
            outputs = [-t if t.is_floating_point() else t for t in outputs]
        return loss, outputs, held

    def _stale(self, kind: str, tensors: list[Any], seed: int, honest: list[Any]) -> list[Any]:
        """What the frozen weights answer (outputs on the CPU, as the worker's)."""
        w, frozen = self.worker, self._frozen
        if kind == "evaluate" or not honest:
            return honest
        xs = [t.to(w.device) for t in tensors]
        with w.lock, seeded(seed, w.device):
            if kind == "forward":
                with torch.no_grad():
                    return [frozen(xs[0]).cpu()]
            inp = xs[0].detach().requires_grad_(True)
            with torch.enable_grad():
                out = frozen(inp)
                target, grad_out = (w.loss_fn(out, xs[1]) * inp.shape[0], None) if kind == "loss" else (out, xs[1])
                (grad,) = torch.autograd.grad(target, [inp], grad_outputs=grad_out)
            return [grad.cpu()]

    def samples_per_s(self) -> float:
        return self.handler.samples_per_s()

    @property
    def steps(self) -> int:
        return self.handler.steps

    def write_state(self, write):
        return self.handler.write_state(write)

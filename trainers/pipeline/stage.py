"""One pipeline stage: a contiguous run of blocks that serves forward/backward/loss requests.

Stateless between a microbatch's forward and its backward (SWARM): the backward request carries
the stage's inputs again with the output gradient, and the forward is recomputed under the same
seed so dropout masks match. A server can therefore drop, reorder or restart requests without
holding activations for drivers that may never come back.

Gradients accumulate as the gradient of the *summed* loss ("loss" backpropagates mean * batch,
"backward" passes on what the next stage returned), and a step divides by the samples accumulated,
so a step uses the gradient of the mean loss over exactly those samples: the same as one
single-process batch of them.

A request's parameter gradient counts in the stage only once the driver acknowledged the request's microbatch
(peer/pipeline/kept.py): a reply lost and the request re-sent elsewhere, or a microbatch failed at an earlier
stage, leaves nothing here. Until the gradient holds a step's worth of samples, a call's gradient is added to it
when computed, provisionally, and the stage does not step while any provisional gradient is in it: so a
dropped one (`release`) is taken out exactly, by the same computation with the opposite sign, and a step uses
only acknowledged samples. Such a call keeps only its inputs (activations' worth), not a copy of the
parameters' gradient: the stage holds what a plain torch loop holds. Past a step's worth, until the step, a
call's gradient waits apart: as a copy while the memory room holds copies (`max_held`), else deferred to its
ack (`HeldGradient`). One provisional gradient that holds a due step back too long is taken out and deferred.
"""

from __future__ import annotations

import copy
import functools
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from protocol.tensor_codec import DTYPES
from trainers.pipeline import shapes, state_tensors, staging
from trainers.pipeline.blocks import LossFn, PipelineModel, seeded
from trainers.pipeline.shapes import Boundary

# Weight of the newest measurement in the throughput EWMA: remembers ~10 requests, enough to
# smooth scheduling jitter while still following a change of load within seconds.
EWMA_ALPHA = 0.2
# A backward request recomputes the forward (1x) and backpropagates (~2x a forward); used to
# estimate one from the other before both have been measured.
BACKWARD_OVER_FORWARD = 3.0
# The throughput EWMA's key for adding an acknowledged gradient (and the optimizer step it triggers), per sample.
ACCUMULATE = "accumulate"
# Largest seed torch.manual_seed accepts, so a bad seed from a peer is a ValueError, not a RuntimeError.
MAX_SEED = 2**64 - 1

SETTLE_FACTOR = 4.0
"""A provisional gradient that has held a due step back this many times the stage's typical wait for an ack
(`_settle_s`) is taken out and deferred: a driver slow to ack (or never acking) delays our steps that long, no
longer."""
SETTLE_FIRST_S = 10.0
"""The typical wait for an ack before one was measured: a microbatch's backward through a few loaded stages."""
SETTLE_MIN_S = 0.5  # below this, scheduling jitter alone would defer calls whose acks are on their way

FIRST_KINDS = ("forward", "backward")
LAST_KINDS = ("loss", "evaluate")


PROVISIONAL, COPY, DEFERRED, SETTLED = "provisional", "copy", "deferred", "settled"


@dataclass(eq=False)
class HeldGradient:
    """One call's parameter gradient, waiting for its driver's ack (peer/pipeline/kept.py): at most once.

    `provisional`: added to the stage's accumulated gradient when computed, under weights that do not change
    until it settles (no step while any is provisional), so `release()` takes it out again exactly: the call
    recomputed under its seed and backpropagated with the opposite sign. It keeps only the call's inputs.
    Once the gradient holds a step's worth of samples, the next calls' gradients wait apart until the step:
    `copy`, a copy of the parameters' gradient kept until the ack (while the memory room holds them), else
    `deferred`, only the inputs kept and the gradient computed on the ack, against the weights of then
    (docs/design.md, "Swarm pipeline": what at-most-once keeps)."""

    worker: "StageWorker"
    samples: int
    generation: int  # the worker's state generation it was computed against
    nbytes: int  # what it keeps: the call's inputs
    replay: tuple[str, list[Tensor], int]  # (kind, the call's inputs, seed)
    state: str = PROVISIONAL
    grads: list[Tensor | None] | None = None  # `copy`: per parameter of the worker, in its order
    born: float = 0.0  # time.monotonic() when computed: a provisional one that holds a step back too long is deferred

    @property
    def deferred(self) -> bool:
        return self.state == DEFERRED

    def accumulate(self) -> bool:
        """Acknowledged: count it in the stage (adding it now if deferred), and step if the stage's share is
        reached; False if it settled already or the stage's state was replaced since it was computed."""
        return self.worker.accumulate(self)

    def release(self) -> None:
        """Dropped (never acknowledged, its microbatch failed, a check's call): leave no trace in the stage."""
        self.worker.release(self)


def _dtype_name(dtype: torch.dtype, where: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"{where}: dtype {name} cannot travel between peers; use one of {', '.join(DTYPES)}")
    return name


def _spec(b: Boundary, name: str, batch: int) -> tuple[str, str, list[int]]:
    return name, _dtype_name(b.dtype, name), [batch, *b.shape]


class StageWorker:
    """Blocks [lo, hi) of `model` as pipeline stage `stage` of `stages`.

    The worker builds its blocks itself (`PipelineModel.build`, one at a time, on `device`), and only
    those: the rest of the model is never materialised here. On the `meta` device it holds no storage
    (shapes and state specs only: the stage this peer backs up, see seat.py). `lock` is held around every compute and optimizer step;
    the daemon takes it to average `params()` in place. `accumulated_grads`, `state_dict`,
    `load_state_dict`, `export_state` and `import_state` take it themselves (it is not reentrant:
    do not call them while holding it).
    """

    def __init__(
        self, model: PipelineModel, bounds: tuple[int, int], *, stage: int, stages: int,
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        max_batch: int, sample_x: Tensor, sample_y: Tensor, grad_clip: float = 0.0,
        device: torch.device | None = None,
    ) -> None:
        n = len(model)
        lo, hi = bounds
        where = f"StageWorker(stage {stage} of {stages}, blocks [{lo}, {hi}))"
        if stages < 1 or not 0 <= stage < stages:
            raise ValueError(f"{where}: need 0 <= stage < stages")
        if not 0 <= lo < hi <= n:
            raise ValueError(f"{where}: bounds must satisfy 0 <= lo < hi <= {n} blocks")
        if (stage == 0) != (lo == 0):
            raise ValueError(f"{where}: the first stage, and only it, starts at block 0")
        if (stage == stages - 1) != (hi == n):
            raise ValueError(f"{where}: the last stage, and only it, ends at block {n}")
        if max_batch < 1:
            raise ValueError(f"{where}: max_batch must be >= 1, got {max_batch}")
        if not (math.isfinite(grad_clip) and grad_clip >= 0):
            raise ValueError(f"{where}: grad_clip must be finite and >= 0, got {grad_clip}")
        self.stage, self.stages, self.lo, self.hi = stage, stages, lo, hi
        self.first, self.last = stage == 0, stage == stages - 1
        self.max_batch = max_batch
        self.grad_clip = grad_clip
        self.loss_fn: LossFn = model.loss_fn
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._in, self._out, self._y = self._record_shapes(model, sample_x, sample_y, where)
        if self.device.type == "meta":
            self.module = nn.Sequential(*(model.on_meta(i) for i in range(lo, hi)))
        else:
            self.module = nn.Sequential(*(model.build(i, self.device) for i in range(lo, hi)))
        self.module.train()
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self._optimizer = optimizer(self._params)
        self.lock = threading.Lock()
        self._accumulate = max_batch
        # Always keep a call's inputs and compute its parameter gradient when it is acknowledged (tests); by
        # default a call's gradient is added at once, provisionally (HeldGradient), and deferred only while a
        # due step waits for the provisional ones to settle.
        self.defer_gradients = False
        self._provisional: dict[HeldGradient, None] = {}  # added to p.grad, not yet acknowledged or dropped
        self._provisional_samples = 0
        # Gradient copies this stage may keep at once (None: no bound): past it, calls that cannot go into p.grad
        # are deferred. The seat sets it from the memory room left beside the stage's plan.
        self.max_held: int | None = None
        self._copies = 0  # `copy` gradients kept now
        self._settle_s: float | None = None  # EWMA of the wait from a call to its ack (SETTLE_FACTOR)
        self._pending = 0  # samples whose gradients are accumulated since the last step
        self._generation = 0  # bumped when the state is replaced: gradients held from before are dropped
        self.steps = 0
        self.samples = 0
        self._sec_per_sample: dict[str, float] = {}

    # --- shapes ----------------------------------------------------------------------------------

    def _record_shapes(self, model: PipelineModel, x: Tensor, y: Tensor, where: str) -> tuple[Boundary, Boundary, Boundary]:
        """This stage's input, output and target shapes, traced without building the model (shapes.py)."""
        try:
            traced = shapes.trace(model, x, y)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        ins, outs = traced.boundary[self.lo], traced.boundary[self.hi]
        for name, s in (("input", ins), ("output", outs), ("targets", traced.targets)):
            _dtype_name(s.dtype, f"{where} {name}")
        return ins, outs, traced.targets

    def kinds(self) -> tuple[str, ...]:
        """Request kinds served here: the last stage computes the loss, the others forward/backward."""
        return LAST_KINDS if self.last else FIRST_KINDS

    def input_specs(self, kind: str, batch: int) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, shape) of each input tensor of a `kind` request for `batch` samples."""
        if kind not in self.kinds():
            raise ValueError(f"stage {self.stage}: kind {kind!r} is not served here; it serves {', '.join(self.kinds())}")
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"stage {self.stage} {kind}: batch must be in [1, {self.max_batch}], got {batch}")
        inp = _spec(self._in, "x" if self.first else "h", batch)
        if kind == "forward":
            return [inp]
        if kind == "backward":
            return [inp, _spec(self._out, "grad_out", batch)]
        return [inp, _spec(self._y, "y", batch)]

    # --- compute ---------------------------------------------------------------------------------

    def _validate(self, kind: str, tensors: list[Tensor], seed: int) -> int:
        """The batch size of a well-formed request; ValueError naming what is wrong otherwise."""
        if kind not in self.kinds():
            raise ValueError(f"stage {self.stage}: kind {kind!r} is not served here; it serves {', '.join(self.kinds())}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ValueError(f"stage {self.stage} {kind}: seed must be an int in [0, 2**64), got {seed!r}")
        if not isinstance(tensors, (list, tuple)) or not tensors:
            raise ValueError(f"stage {self.stage} {kind}: expected a list of tensors, got {type(tensors).__name__}")
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise ValueError(f"stage {self.stage} {kind}: input {i} is a {type(t).__name__}, not a tensor")
        if tensors[0].dim() < 1:
            raise ValueError(f"stage {self.stage} {kind}: input 0 has no batch dimension")
        specs = self.input_specs(kind, tensors[0].shape[0])
        if len(tensors) != len(specs):
            raise ValueError(f"stage {self.stage} {kind}: expected {len(specs)} tensors "
                             f"({', '.join(s[0] for s in specs)}), got {len(tensors)}")
        for i, (t, (name, dtype, shape)) in enumerate(zip(tensors, specs)):
            got = str(t.dtype).removeprefix("torch.")
            if got != dtype:
                raise ValueError(f"stage {self.stage} {kind}: input {i} ({name}) has dtype {got}, expected {dtype}")
            if list(t.shape) != shape:
                raise ValueError(f"stage {self.stage} {kind}: input {i} ({name}) has shape {list(t.shape)}, expected {shape}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"stage {self.stage} {kind}: input {i} ({name}) contains NaN or Inf")
        return specs[0][2][0]

    def compute(self, kind: str, tensors: list[Tensor], seed: int) -> tuple[float | None, list[Tensor], HeldGradient | None]:
        """Serve one request: (mean loss or None, output tensors on the CPU, ready for the wire, and for
        "backward" and "loss" the parameter gradient, held until its `accumulate()`; None otherwise).

        forward: [in] -> [out]. backward: [in, grad_out] -> [grad_in] ([] on the first stage).
        loss: [in, y] -> (loss, [grad_in]) ([] with one stage). evaluate: [in, y] -> (loss, []),
        eval mode, no gradients. A bad request raises ValueError and changes no state; no request changes
        the stage's state (weights, accumulated gradient, counters) until its gradient is accumulated.
        """
        batch = self._validate(kind, tensors, seed)
        xs = staging.to_device(tensors, self.device)
        held = None
        with self.lock:
            start = time.perf_counter()
            if kind == "forward":
                with torch.no_grad(), seeded(seed, self.device):
                    loss, outs = None, [self.module(xs[0])]
            elif kind == "evaluate":
                loss, outs = self._evaluate(xs, seed), []
            else:
                loss, outs, held = self._train(kind, xs, seed, batch)
            result = staging.to_wire(outs, self.device)  # also waits for the device: the time below is the compute's
            if kind != "evaluate":
                self._observe(kind, batch, time.perf_counter() - start)
        return loss, result, held

    def _evaluate(self, xs: list[Tensor], seed: int) -> float:
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad(), seeded(seed, self.device):
                return float(self.loss_fn(self.module(xs[0]), xs[1]))
        finally:
            self.module.train(was_training)

    def _train(self, kind: str, xs: list[Tensor], seed: int,
               batch: int) -> tuple[float | None, list[Tensor], HeldGradient]:
        """Recompute the forward under `seed`, backpropagate: the input's gradient for the reply, and the
        parameters' (if all is finite) added to `.grad` provisionally while it holds less than a step's worth,
        else kept apart as a copy while the room holds one, else deferred: computed when the call is acknowledged
        (always, with `defer_gradients`). The module docstring says why."""
        self._defer_the_late()
        if self.defer_gradients:
            state = DEFERRED
        elif self._pending + self._provisional_samples < self._accumulate:
            state = PROVISIONAL  # the gradient holds less than a step's worth: this one goes in
        elif self.max_held is None or self._copies < self.max_held:
            state = COPY
        else:
            state = DEFERRED
        loss, grad_in, grads = self._backprop(kind, xs, seed, batch, sign=1.0, params=state != DEFERRED,
                                              apart=state == COPY)
        kept = [t.detach() for t in xs] if state != COPY else []
        held = HeldGradient(self, batch, self._generation, sum(t.numel() * t.element_size() for t in kept),
                            replay=(kind, kept, seed), state=state, grads=grads, born=time.monotonic())
        if state == PROVISIONAL:
            self._provisional[held] = None
            self._provisional_samples += batch
        elif state == COPY:
            held.nbytes = sum(g.numel() * g.element_size() for g in grads or [] if g is not None)
            self._copies += 1
        return loss, ([] if self.first else [grad_in]), held

    def _backprop(self, kind: str, xs: list[Tensor], seed: int, batch: int, *, sign: float, params: bool,
                  apart: bool = False, undo: bool = False) -> tuple[float | None, Tensor | None, list | None]:
        """The call's forward under `seed` and its backward: (the mean loss for "loss", the input's gradient unless
        first, the parameters' gradient if `apart`). With `params`, `sign` times the parameters' gradient is added
        into their `.grad` in place (one parameter at a time, as torch's own backward does: no second gradient of
        the stage), or with `apart` returned as fresh tensors instead. ValueError, leaving `.grad` as it was, if the
        loss or a gradient is not finite. `undo`: taking a gradient out again (the same computation, `sign`
        negated): its non-finite parts are left out as they were."""
        inp = xs[0] if self.first else xs[0].detach().requires_grad_(True)
        into = params and not apart
        wrt = (self._params if params else []) + ([] if self.first else [inp])
        bad: list[bool] = []

        def finite_only(g: Tensor) -> Tensor:  # a non-finite gradient never reaches p.grad
            if not bool(torch.isfinite(g).all()):
                bad.append(True)
                return torch.zeros_like(g)
            return g
        hooks = [p.register_hook(finite_only) for p in self._params] if into else []
        loss: float | None = None
        grads: list | None = None
        grad_in: Tensor | None = None
        try:
            with seeded(seed, self.device), torch.enable_grad():
                out = self.module(inp)
                if kind == "loss":
                    mean = self.loss_fn(out, xs[1])
                    loss = float(mean.detach())
                    if not math.isfinite(loss):
                        raise ValueError(f"stage {self.stage} loss: the loss is {loss}")
                    target, grad_out = mean * (batch * sign), None  # the SUM over the microbatch (module doc)
                else:
                    target, grad_out = out, (xs[1] if sign == 1.0 else xs[1] * sign)
                if apart:
                    got = list(torch.autograd.grad(target, wrt, grad_outputs=grad_out, allow_unused=True))
                    grads, grad_in = got[:len(self._params)], (None if self.first else got[-1])
                    bad = [True] if any(g is not None and not bool(torch.isfinite(g).all()) for g in grads) else []
                elif wrt:
                    torch.autograd.backward(target, grad_tensors=grad_out, inputs=wrt)
                    grad_in = None if self.first else inp.grad
        finally:
            for h in hooks:
                h.remove()
        if undo:
            return loss, grad_in, None
        if bad or (grad_in is not None and not bool(torch.isfinite(grad_in).all())):
            if into:  # what did enter goes out again: same weights, same seed, the same gradient
                self._backprop(kind, xs, seed, batch, sign=-sign, params=True, undo=True)
            raise ValueError(f"stage {self.stage} {kind}: the gradients are not finite (inputs too large?)")
        if grad_in is None and not self.first:
            grad_in = torch.zeros_like(inp)
        return loss, grad_in, grads

    def _step_due(self) -> bool:
        return self._pending >= self._accumulate

    def _defer_the_late(self) -> None:
        """While a step is due: provisional gradients older than SETTLE_FACTOR x the typical wait for an ack are
        taken out and deferred (their ack, if it comes, adds them then), so no driver holds our steps back for
        longer; then step if nothing provisional is left. Under `lock`."""
        if not (self._step_due() and self._provisional):
            return
        typical = self._settle_s if self._settle_s is not None else SETTLE_FIRST_S
        too_old = time.monotonic() - max(SETTLE_MIN_S, SETTLE_FACTOR * typical)
        for held in [h for h in self._provisional if h.born < too_old]:
            self._take_out(held)
            held.state = DEFERRED
        self._maybe_step()

    def _take_out(self, held: HeldGradient) -> None:
        kind, xs, seed = held.replay
        self._settle_provisional(held)
        self._backprop(kind, xs, seed, held.samples, sign=-1.0, params=True, undo=True)

    def _settle_provisional(self, held: HeldGradient) -> None:
        if held in self._provisional:
            del self._provisional[held]
            self._provisional_samples -= held.samples

    def _maybe_step(self) -> None:
        """Step once this stage's share of samples entered and no provisional gradient is in p.grad."""
        if self._step_due() and not self._provisional:
            self._step()

    def accumulate(self, held: HeldGradient) -> bool:
        """`held` acknowledged: count its samples (a deferred one is computed and added now), and step once this
        stage's share of samples has entered (`accumulate_samples`) and nothing provisional is in the gradient.
        False, changing nothing, if `held` settled already, is another worker's, or was computed before the
        state was replaced (`load_state_dict`, `import_state`)."""
        with self.lock:
            if held.worker is not self or held.generation != self._generation or held.state == SETTLED:
                return False
            start = time.perf_counter()
            if held.state == DEFERRED:
                kind, xs, seed = held.replay
                try:
                    self._backprop(kind, xs, seed, held.samples, sign=1.0, params=True)
                except ValueError:  # not finite under the weights of now: it counts nowhere
                    self._settle(held)
                    return False
            elif held.state == COPY:
                self._add(held.grads or [])
            else:
                self._settle_provisional(held)
            # the typical wait for an ack, from every ack (a copy's too: were provisional ones never acknowledged,
            # the wait would stay unmeasured and SETTLE_FIRST_S would hold steps back for its four times)
            wait = time.monotonic() - held.born
            self._settle_s = wait if self._settle_s is None else self._settle_s + EWMA_ALPHA * (wait - self._settle_s)
            self._settle(held)  # at most once; what it kept is freed
            self.samples += held.samples
            self._pending += held.samples
            self._defer_the_late()
            self._maybe_step()
            # Adding and stepping are the stage's work too, done on the ack rather than in the call: they count
            # in its measured speed (what routing, placement and rebalancing read), as when the call did them.
            self._observe(ACCUMULATE, held.samples, time.perf_counter() - start)
            return True

    def release(self, held: HeldGradient) -> None:
        """`held` dropped: a provisional gradient is taken out of p.grad (exactly: no step came since it went
        in), a copy or a deferred one just forgotten; then a step that waited for it may come."""
        with self.lock:
            if held.state == SETTLED:
                return
            if held.worker is self and held.generation == self._generation and held.state == PROVISIONAL:
                self._take_out(held)
            self._settle(held)
            self._maybe_step()

    def _settle(self, held: HeldGradient) -> None:
        """`held` counts no more here (taken or dropped): what it kept is freed."""
        if held.state == COPY and held.worker is self and held.generation == self._generation:
            self._copies -= 1
        held.state, held.grads, held.replay = SETTLED, None, (held.replay[0], [], held.replay[2])

    def _add(self, grads: list[Tensor | None]) -> None:
        """Add a copy's gradient to p.grad, each tensor freed as it is added (no second gradient held after)."""
        for i, (p, g) in enumerate(zip(self._params, grads)):
            if g is not None:
                if p.grad is None:  # adopted, not copied, unless autograd handed out a view (expanded)
                    p.grad = g if g.is_contiguous() else g.clone()
                else:
                    p.grad.add_(g)
                grads[i] = g = None

    def _step(self) -> None:
        """Average the accumulated gradients over their samples, clip (this stage's norm), step."""
        for p in self._params:
            if p.grad is not None:
                p.grad.div_(self._pending)
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self._params, self.grad_clip)
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._pending = 0
        self.steps += 1

    # --- accumulation and throughput -------------------------------------------------------------

    @property
    def accumulate_samples(self) -> int:
        """Step once gradients of this many samples have accumulated (default max_batch)."""
        return self._accumulate

    @accumulate_samples.setter
    def accumulate_samples(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"stage {self.stage}: accumulate_samples must be an int >= 1, got {n!r}")
        self._accumulate = n

    @property
    def pending_samples(self) -> int:
        """Samples whose gradients entered toward the next step (a move drops them: counted there)."""
        return self._pending

    def accumulated_grads(self) -> dict[str, Tensor]:
        """Name -> the gradient the next step would use (accumulated / samples, before clipping); copies. Provisional
        gradients (not yet acknowledged) are in it too."""
        with self.lock:
            out = {}
            for name, p in self._named_params():
                if p.grad is None or not self._pending:
                    out[name] = torch.zeros_like(p.data)
                else:
                    out[name] = p.grad.detach() / self._pending
            return out

    def _observe(self, kind: str, batch: int, seconds: float) -> None:
        per = seconds / batch
        old = self._sec_per_sample.get(kind)
        self._sec_per_sample[kind] = per if old is None else old + EWMA_ALPHA * (per - old)

    def samples_per_s(self) -> float:
        """Training samples per second this stage sustains (its forward + backward, or its loss); 0.0 unmeasured."""
        s = self._sec_per_sample
        if self.last:
            t = s.get("loss")
            t = t + s.get(ACCUMULATE, 0.0) if t is not None else None
        else:
            f, b = s.get("forward"), s.get("backward")
            if f is None and b is None:
                t = None
            else:
                f = f if f is not None else b / BACKWARD_OVER_FORWARD  # type: ignore[operator]
                b = b if b is not None else f * BACKWARD_OVER_FORWARD
                t = f + b + s.get(ACCUMULATE, 0.0)
        return 1.0 / t if t else 0.0

    # --- parameters and checkpoints --------------------------------------------------------------

    def _global(self, name: str) -> str:
        """Module-relative "0.attn.qkv.weight" -> model-wide "3.attn.qkv.weight" (same as sequential())."""
        idx, _, rest = name.partition(".")
        return f"{int(idx) + self.lo}.{rest}"

    def _local(self, name: str) -> str:
        idx, _, rest = name.partition(".")
        return f"{int(idx) - self.lo}.{rest}"

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        return [(self._global(n), p) for n, p in self.module.named_parameters()]

    def params(self) -> dict[str, Tensor]:
        """Model-wide parameter name -> p.data, the live tensors that gossip averages in place under `lock`."""
        return {name: p.data for name, p in self._named_params()}

    def state_dict(self) -> dict[str, Any]:
        """A snapshot (copies) of weights, optimizer state and counters; pending gradients are not saved."""
        with self.lock:
            return {
                "module": {self._global(k): v.detach().clone() for k, v in self.module.state_dict().items()},
                "optimizer": copy.deepcopy(self._optimizer.state_dict()),
                "steps": self.steps,
                "samples": self.samples,
            }

    def checkpoint(self, write: Callable[[dict[str, Any]], Any]) -> None:
        """`write` a `state_dict()` plus the gradient accumulated toward the next step ("grad_sums", summed over
        "pending_samples" samples), holding `lock` meanwhile: the tensors are the live ones, not copies, so a
        stage that fills its memory budget can still be checkpointed (nothing computes until it is written)."""
        with self.lock:
            whole = not self._provisional  # p.grad holds unacknowledged gradients too: then it is not saved
            write({"module": {self._global(k): v.detach() for k, v in self.module.state_dict().items()},
                   "optimizer": self._optimizer.state_dict(), "steps": self.steps, "samples": self.samples,
                   "grad_sums": {name: p.grad.detach() for name, p in self._named_params()
                                 if p.grad is not None and self._pending and whole},
                   "pending_samples": self._pending if whole else 0})

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a `state_dict()` of the same stage; drops gradients accumulated against the old weights."""
        if not isinstance(d, dict) or not {"module", "optimizer", "steps"} <= d.keys():
            raise ValueError(f"stage {self.stage}: a stage state dict needs 'module', 'optimizer' and 'steps'")
        mine = {self._global(k): v for k, v in self.module.state_dict().items()}
        theirs = d["module"]
        if mine.keys() != theirs.keys():
            raise ValueError(f"stage {self.stage}: state dict does not match blocks [{self.lo}, {self.hi}): "
                             f"missing {sorted(mine.keys() - theirs.keys())[:5]}, "
                             f"unexpected {sorted(theirs.keys() - mine.keys())[:5]}")
        for k, v in mine.items():  # checked up front: torch would load the fitting tensors before failing
            t = theirs[k]
            if not isinstance(t, Tensor) or t.shape != v.shape:
                got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"stage {self.stage}: state dict entry {k} is {got}, expected {list(v.shape)}")
        with self.lock:
            try:
                self.module.load_state_dict({self._local(k): v for k, v in d["module"].items()})
                self._optimizer.load_state_dict(d["optimizer"])
            except (RuntimeError, KeyError) as e:
                raise ValueError(f"stage {self.stage}: cannot load state dict: {e}") from e
            self._optimizer.zero_grad(set_to_none=True)
            self._pending = 0
            self._provisional.clear()  # they were in the gradient just dropped: nothing to take out
            self._provisional_samples = self._copies = 0
            self._generation += 1
            self.steps = int(d["steps"])
            self.samples = int(d.get("samples", self.samples))

    # --- live state transfer (names: see trainers/pipeline/state_tensors.py) -----------------------

    @functools.cached_property
    def _layout(self) -> state_tensors.StateLayout:
        """Fixed once built: loads copy into the same tensors, and gossip averages them in place."""
        names = {id(p): n for n, p in self._named_params()}
        params = {names[id(p)]: (i, p) for i, p in enumerate(state_tensors.optimizer_params(self._optimizer))
                  if id(p) in names}
        module = {self._global(k): (state_tensors.dtype_name(v), list(v.shape))
                  for k, v in self.module.state_dict().items()}
        return state_tensors.StateLayout(module, params, state_tensors.probe_keys(self._optimizer))

    def export_state(self) -> tuple[list[tuple[str, Tensor]], int, int]:
        """(named tensors, steps, samples): copies (detached, contiguous, on CPU) taken under `lock`, of
        every module state_dict entry ("m/<global key>", state_dict order) and every per-parameter
        optimizer state value ("o/<global param name>/<state key>", the optimizer's parameter order).
        Pending gradients do not travel. ValueError if the optimizer keeps a state no tensor can carry."""
        got: list[tuple[list[tuple[str, Tensor]], int, int]] = []
        self.write_state(lambda tensors, steps, samples: got.append(
            ([(n, state_tensors.cpu_copy(t)) for n, t in tensors], steps, samples)))  # copied under the lock
        return got[0]

    def write_state(self, write: Callable[[list[tuple[str, Tensor]], int, int], None]) -> None:
        """`write(named tensors, steps, samples)` under `lock`, with the tensors themselves (detached, where
        they live): what `export_state` copies, handed to a writer that puts it on disk tensor by tensor, so a
        state sent to a peer or kept on disk costs no second copy in memory. `write` must not keep them."""
        named = [(name, p) for name, (_, p) in self._layout.params.items()]
        with self.lock:
            module = [(self._global(k), v) for k, v in self.module.state_dict().items()]
            write(state_tensors.flatten(module, named, self._optimizer.state), self.steps, self.samples)

    def check_state_specs(self, specs: list[tuple[str, str, list[int]]]) -> str | None:
        """None if `specs` [(name, dtype, shape)] is a state this stage can load; else a reason naming
        the first offending entry (<= 300 chars). Pure; allocates nothing proportional to the specs
        beyond a set of names. Call it before allocating the tensors of a state from a peer."""
        return state_tensors.check_specs(self._layout, specs)

    def import_state(self, tensors: list[tuple[str, Tensor]], steps: int, samples: int) -> None:
        """Load an `export_state()` of the same blocks: module entries, optimizer state, counters; drops
        the gradients accumulated so far (as load_state_dict does). The optimizer may keep the given
        tensors as its state (no copy): pass tensors nothing else uses. Takes `lock`. ValueError with a
        reason if anything does not fit, checked before anything changes."""
        where = f"stage {self.stage}: cannot import state"
        for what, n in (("steps", steps), ("samples", samples)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{where}: {what} must be an int >= 0, got {n!r}")
        if not isinstance(tensors, (list, tuple)) or not all(
                isinstance(e, tuple) and len(e) == 2 and isinstance(e[1], Tensor) for e in tensors):
            raise ValueError(f"{where}: expected a list of (name, tensor) pairs")
        why = self.check_state_specs([(n, state_tensors.dtype_name(t), list(t.shape)) for n, t in tensors])
        if why is not None:
            raise ValueError(f"{where}: {why}")
        module, state = state_tensors.split(self._layout, list(tensors))
        with self.lock:
            old = self._optimizer.state_dict()
            try:  # the receiver's param_groups: hyperparameters are its own
                self._optimizer.load_state_dict({**old, "state": state})
            except Exception as e:  # an optimizer that could not be probed refused the state
                self._optimizer.load_state_dict(old)
                raise ValueError(f"{where}: the optimizer refused its state: {e}") from e
            self.module.load_state_dict({self._local(k): v for k, v in module.items()})
            self._optimizer.zero_grad(set_to_none=True)
            self._pending = 0
            self._provisional.clear()  # they were in the gradient just dropped: nothing to take out
            self._provisional_samples = self._copies = 0
            self._generation += 1
            self.steps, self.samples = steps, samples

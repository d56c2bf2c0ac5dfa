"""One pipeline stage: a contiguous run of blocks that serves forward/backward/loss requests.

Stateless between a microbatch's forward and its backward (SWARM): the backward request carries
the stage's inputs again with the output gradient, and the forward is recomputed under the same
seed so dropout masks match. A server can therefore drop, reorder or restart requests without
holding activations for drivers that may never come back.

Gradients accumulate as the gradient of the *summed* loss ("loss" backpropagates mean * batch,
"backward" passes on what the next stage returned), and a step divides by the samples accumulated,
so a step uses the gradient of the mean loss over exactly those samples: the same as one
single-process batch of them.

A request's parameter gradient does not enter the accumulated gradient when it is computed: `compute`
returns it as a `HeldGradient`, and it enters when its `accumulate()` is called, which the daemon does
once the driver acknowledged the request's microbatch (peer/pipeline/kept.py): a reply lost and the
request re-sent elsewhere, or a microbatch failed at an earlier stage, leaves nothing here. `samples`
and the step count follow what entered. Nothing more is copied than before: autograd returns fresh
tensors, kept as they are until they are added.
"""

from __future__ import annotations

import copy
import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from protocol.tensor_codec import DTYPES
from trainers.pipeline import shapes, stage_state, staging
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

FIRST_KINDS = ("forward", "backward")
LAST_KINDS = ("loss", "evaluate")


@dataclass(eq=False)
class HeldGradient:
    """One request's parameter gradient, kept out of the stage until `accumulate()` (at most once)."""

    worker: "StageWorker"
    grads: list[Tensor | None]  # per parameter of the worker, in its order
    samples: int
    generation: int  # the worker's state generation it was computed against
    nbytes: int
    replay: tuple[str, list[Tensor], int] | None = None  # deferred: (kind, the call's inputs, seed) instead of grads

    @property
    def deferred(self) -> bool:
        return self.replay is not None

    def accumulate(self) -> bool:
        """Add it to the stage's accumulated gradient (and step if the stage's share is reached); False if it was
        added already or the stage's state was replaced since it was computed (then it is dropped)."""
        return self.worker.accumulate(self)


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
        # Keep a call's inputs, not its parameter gradient, until it is acknowledged, and compute the gradient
        # then: activations' worth of memory per held call instead of parameters' worth, for a forward and a
        # backward more per microbatch (counted in the stage's measured speed). Always (tests), or past max_held.
        self.defer_gradients = False
        # The gradients this stage may hold at once (None: no bound): past it, calls are deferred as above. The
        # seat sets it from the memory budget; held gradients are tracked weakly, so one the kept book drops
        # (never acknowledged) stops counting once it is collected.
        self.max_held: int | None = None
        self._outstanding: weakref.WeakSet[HeldGradient] = weakref.WeakSet()
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
        """Recompute the forward under `seed`, backpropagate; the parameter gradient held, if all is finite.
        With `defer_gradients`, only the input's gradient is computed now and the call's inputs are held instead:
        the parameter gradient is computed when it is acknowledged (`accumulate`)."""
        inp = xs[0] if self.first else xs[0].detach().requires_grad_(True)
        defer = self.defer_gradients or (self.max_held is not None and len(self._outstanding) >= self.max_held)
        params = [] if defer else self._params
        wrt = params + ([] if self.first else [inp])
        loss: float | None = None
        with seeded(seed, self.device), torch.enable_grad():
            out = self.module(inp)
            if kind == "loss":
                mean = self.loss_fn(out, xs[1])
                loss = float(mean.detach())
                if not math.isfinite(loss):
                    raise ValueError(f"stage {self.stage} loss: the loss is {loss}")
                target, grad_out = mean * batch, None  # the SUM over the microbatch, see the module doc
            else:
                target, grad_out = out, xs[1]
            grads = list(torch.autograd.grad(target, wrt, grad_outputs=grad_out, allow_unused=True)) if wrt else []
        present = [g for g in grads if g is not None]
        if present and not bool(torch.stack([g.isfinite().all() for g in present]).all()):
            raise ValueError(f"stage {self.stage} {kind}: the gradients are not finite (inputs too large?)")
        if defer:
            kept = [t.detach() for t in xs]
            held = HeldGradient(self, [], batch, self._generation, sum(t.numel() * t.element_size() for t in kept),
                                replay=(kind, kept, seed))
        else:
            own = grads[:len(self._params)]
            held = HeldGradient(self, own, batch, self._generation,
                                sum(g.numel() * g.element_size() for g in own if g is not None))
            self._outstanding.add(held)  # until it is added, or dropped by the kept book (then collected)
        if self.first:
            return loss, [], held
        grad_in = grads[-1]
        return loss, [grad_in if grad_in is not None else torch.zeros_like(inp)], held

    def accumulate(self, held: HeldGradient) -> bool:
        """Add a gradient `compute` held to the accumulated gradient, and step once this stage's share of
        samples has entered (`accumulate_samples`). False, changing nothing, if `held` entered already, is
        another worker's, or was computed before the state was replaced (`load_state_dict`, `import_state`)."""
        with self.lock:
            if held.worker is not self or held.generation != self._generation or not (held.grads or held.replay):
                return False
            start = time.perf_counter()
            if held.replay is not None:  # deferred: the parameter gradient of the call, computed now
                (kind, xs, seed), held.replay = held.replay, None  # at most once
                grads = self._param_grads(kind, xs, seed, held.samples)
            else:
                grads, held.grads = held.grads, []  # at most once: the tensors are ours now
                self._outstanding.discard(held)
            for i, (p, g) in enumerate(zip(self._params, grads)):
                if g is not None:
                    if p.grad is None:  # adopted, not copied (a copy is a stage's worth of memory), unless
                        p.grad = g if g.is_contiguous() else g.clone()  # autograd handed out a view (expanded)
                    else:
                        p.grad.add_(g)
                    grads[i] = g = None  # freed as it is added: the step below must not hold a second gradient
            del grads
            self.samples += held.samples
            self._pending += held.samples
            if self._pending >= self._accumulate:
                self._step()
            # Adding and stepping are the stage's work too, done on the ack rather than in the call: they count
            # in its measured speed (what routing, placement and rebalancing read), as when the call did them.
            self._observe(ACCUMULATE, held.samples, time.perf_counter() - start)
            return True

    def _param_grads(self, kind: str, xs: list[Tensor], seed: int, batch: int) -> list[Tensor | None]:
        """A deferred call's parameter gradient: its forward again under its seed, backpropagated into the
        parameters only (against the weights as they are now: a step may have come since the call)."""
        with seeded(seed, self.device), torch.enable_grad():
            out = self.module(xs[0])
            if kind == "loss":
                target, grad_out = self.loss_fn(out, xs[1]) * batch, None
            else:
                target, grad_out = out, xs[1]
            grads = list(torch.autograd.grad(target, self._params, grad_outputs=grad_out, allow_unused=True))
        present = [g for g in grads if g is not None]
        if present and not bool(torch.stack([g.isfinite().all() for g in present]).all()):
            return [None] * len(grads)  # not finite now (the weights moved): this call's gradient is left out
        return grads

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
        """Name -> the gradient the next step would use (accumulated / samples, before clipping); copies."""
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
            write({"module": {self._global(k): v.detach() for k, v in self.module.state_dict().items()},
                   "optimizer": self._optimizer.state_dict(), "steps": self.steps, "samples": self.samples,
                   "grad_sums": {name: p.grad.detach() for name, p in self._named_params()
                                 if p.grad is not None and self._pending},
                   "pending_samples": self._pending})

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
            self._generation += 1
            self.steps = int(d["steps"])
            self.samples = int(d.get("samples", self.samples))

    # --- live state transfer (names: see trainers/pipeline/stage_state.py) -----------------------

    @functools.cached_property
    def _layout(self) -> stage_state.StateLayout:
        """Fixed once built: loads copy into the same tensors, and gossip averages them in place."""
        names = {id(p): n for n, p in self._named_params()}
        params = {names[id(p)]: (i, p) for i, p in enumerate(stage_state.optimizer_params(self._optimizer))
                  if id(p) in names}
        module = {self._global(k): (stage_state.dtype_name(v), list(v.shape))
                  for k, v in self.module.state_dict().items()}
        return stage_state.StateLayout(module, params, stage_state.probe_keys(self._optimizer))

    def export_state(self) -> tuple[list[tuple[str, Tensor]], int, int]:
        """(named tensors, steps, samples): copies (detached, contiguous, on CPU) taken under `lock`, of
        every module state_dict entry ("m/<global key>", state_dict order) and every per-parameter
        optimizer state value ("o/<global param name>/<state key>", the optimizer's parameter order).
        Pending gradients do not travel. ValueError if the optimizer keeps a state no tensor can carry."""
        named = [(name, p) for name, (_, p) in self._layout.params.items()]
        with self.lock:
            module = [(self._global(k), v) for k, v in self.module.state_dict().items()]
            tensors = stage_state.flatten(module, named, self._optimizer.state)
            return tensors, self.steps, self.samples

    def check_state_specs(self, specs: list[tuple[str, str, list[int]]]) -> str | None:
        """None if `specs` [(name, dtype, shape)] is a state this stage can load; else a reason naming
        the first offending entry (<= 300 chars). Pure; allocates nothing proportional to the specs
        beyond a set of names. Call it before allocating the tensors of a state from a peer."""
        return stage_state.check_specs(self._layout, specs)

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
        why = self.check_state_specs([(n, stage_state.dtype_name(t), list(t.shape)) for n, t in tensors])
        if why is not None:
            raise ValueError(f"{where}: {why}")
        module, state = stage_state.split(self._layout, list(tensors))
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
            self._generation += 1
            self.steps, self.samples = steps, samples

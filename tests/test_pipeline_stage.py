"""StageWorker: a 4-stage in-process chain against the single-process model, recompute, validation.

A tiny char transformer (6 blocks: embedding, 4 x Block, head) is cut [0,1) [1,3) [3,5) [5,6).
"""

from __future__ import annotations

import copy
import re
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainers.baseline import make_optimizer, seeded_model
from trainers.pipeline.blocks import PipelineModel, char_transformer_pipeline, from_factory, seeded
from trainers.pipeline import shapes
from trainers.pipeline.stage import COPY, DEFERRED, PROVISIONAL, StageWorker

VOCAB, BLOCK = 20, 16
BOUNDS = [(0, 1), (1, 3), (3, 5), (5, 6)]
LR = 0.1
CPU = torch.device("cpu")


def tiny(dropout: float, seed: int = 0) -> PipelineModel:
    return char_transformer_pipeline(VOCAB, d_model=32, n_layers=4, n_heads=4, block=BLOCK, dropout=dropout, seed=seed)


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, BLOCK), generator=g), torch.randint(0, VOCAB, (n, BLOCK), generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def workers(model: PipelineModel, bounds=BOUNDS, max_batch: int = 4, optimizer=sgd) -> list[StageWorker]:
    sx, sy = data(max_batch, seed=99)
    return [StageWorker(model, b, stage=s, stages=len(bounds), optimizer=optimizer,
                        max_batch=max_batch, sample_x=sx, sample_y=sy) for s, b in enumerate(bounds)]


def run_chain(ws: list[StageWorker], x: torch.Tensor, y: torch.Tensor, seeds: list[int]) -> float:
    """What a driver does: forward stage by stage, loss on the last, backward again; then, the backward
    complete, every stage takes the gradient it held (the daemon does that on the driver's ack)."""
    acts = [x]
    for s in range(len(ws) - 1):
        _, (h,), held = ws[s].compute("forward", [acts[-1]], seeds[s])
        assert held is None
        acts.append(h)
    loss, (g,), held = ws[-1].compute("loss", [acts[-1], y], seeds[-1])
    kept = [held]
    for s in range(len(ws) - 2, -1, -1):
        _, out, held = ws[s].compute("backward", [acts[s], g], seeds[s])
        kept.append(held)
        if s:
            (g,) = out
        else:
            assert out == []
    assert loss is not None
    assert all(h.accumulate() for h in kept)
    return loss


def reference_grads(model: PipelineModel, x: torch.Tensor, y: torch.Tensor,
                    seeds: list[int] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients; with `seeds`, each stage's blocks run under its seed."""
    seq = model.sequential()
    h = x
    for s, (lo, hi) in enumerate(BOUNDS):
        with seeded(seeds[s] if seeds else 0, CPU):
            h = seq[lo:hi](h)
    loss = model.loss_fn(h, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in seq.named_parameters()}


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k] - b[k]).norm()) <= rel * float(b[k].norm()) + 1e-12, k


def all_grads(ws: list[StageWorker]) -> dict[str, torch.Tensor]:
    return {k: v for w in ws for k, v in w.accumulated_grads().items()}


def test_blocks_have_char_transformers_parameters() -> None:
    """The built-in pipeline model is CharTransformer cut into blocks: the same parameter shapes, in order."""
    model = tiny(0.0, seed=3)
    ref = seeded_model("char_transformer", 3, vocab=VOCAB, d_model=32, n_layers=4, n_heads=4, block=BLOCK)
    assert [p.shape for p in model.sequential().parameters()] == [p.shape for p in ref.parameters()]
    names = [n for n, _ in model.sequential().named_parameters()]
    assert len(names) == len(set(names)) and names[0] == "0.tok.weight"


def test_block_built_alone_equals_the_whole_models_block() -> None:
    """Block i materialised alone (a peer serving only its stage) is bit-exact block i of a whole-model build,
    built in any order, for the built-in model, a user's builders and a user's meta-device modules."""
    for model in (tiny(0.1, seed=5), from_factory(f"{__name__}:builder_blocks"), from_factory(f"{__name__}:meta_blocks")):
        whole = copy.deepcopy(model.sequential().state_dict())
        for i in reversed(range(len(model))):
            alone = model.build(i).state_dict()
            assert all(torch.equal(v, whole[f"{i}.{k}"]) for k, v in alone.items()), (model.name, i)
            assert alone.keys() == {k.partition(".")[2] for k in whole if k.startswith(f"{i}.")}
    a, b = tiny(0.0, seed=5).build(2).state_dict(), tiny(0.0, seed=6).build(2).state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the model's seed matters
    first, second = tiny(0.0, seed=5), tiny(0.0, seed=5)
    assert not torch.equal(first.build(1).mlp[0].weight, second.build(2).mlp[0].weight)  # each block its own seed


def test_shapes_are_traced_without_building_blocks() -> None:
    """Boundary shapes and block sizes come from the meta device: no builder runs for real."""
    built: list[int] = []
    model = from_factory(f"{__name__}:builder_blocks")
    real_build = model.build
    model.build = lambda i, device=None: built.append(i) or real_build(i, device)  # type: ignore[method-assign]
    traced = shapes.trace(model, torch.randn(4, 8), torch.randint(0, 3, (4,)))
    assert built == [] and traced.meta_only
    assert [b.shape for b in traced.boundary] == [(8,), (16,), (16,), (3,)]
    assert traced.param_bytes == [(8 * 16 + 16) * 4, 0, (16 * 3 + 3) * 4]


def test_meta_blocks_without_reset_parameters_are_refused() -> None:
    model = from_factory(f"{__name__}:meta_without_reset")
    with pytest.raises(ValueError, match="no reset_parameters"):
        model.build(0)


def test_chain_equals_single_process_without_dropout() -> None:
    ws = workers(tiny(0.0))
    for w in ws:
        w.accumulate_samples = 100  # no step yet: compare what the step would use
    x, y = data(8)
    losses = [run_chain(ws, x[i:i + 4], y[i:i + 4], [11, 12, 13, 14]) for i in (0, 4)]
    ref = tiny(0.0)
    for i, loss in zip((0, 4), losses):
        with torch.no_grad():
            expect = float(ref.loss_fn(ref.sequential()(x[i:i + 4]), y[i:i + 4]))
        assert loss == pytest.approx(expect, rel=1e-6)
    _, grads = reference_grads(ref, x, y)  # one batch of 8: the mean over all samples
    assert_close(all_grads(ws), grads)
    assert [w.samples for w in ws] == [8] * 4 and [w.steps for w in ws] == [0] * 4


def test_step_after_accumulate_samples_uses_the_mean_gradient() -> None:
    ws = workers(tiny(0.0))
    for w in ws:
        w.accumulate_samples = 8
    x, y = data(8)
    ref = tiny(0.0)
    _, grads = reference_grads(ref, x, y)
    before = {k: v.clone() for w in ws for k, v in w.params().items()}
    run_chain(ws, x[:4], y[:4], [1, 2, 3, 4])
    assert [w.steps for w in ws] == [0] * 4
    run_chain(ws, x[4:], y[4:], [5, 6, 7, 8])
    assert [w.steps for w in ws] == [1] * 4 and [w.samples for w in ws] == [8] * 4
    after = {k: v for w in ws for k, v in w.params().items()}
    assert_close(after, {k: before[k] - LR * g for k, g in grads.items()})  # SGD with the mean gradient
    assert all(float(g.abs().max()) == 0 for g in all_grads(ws).values())  # zeroed after the step


def test_chain_with_dropout_matches_per_stage_seeds() -> None:
    seeds = [21, 22, 23, 24]
    ws = workers(tiny(0.1))
    for w in ws:
        w.accumulate_samples = 100
    x, y = data(4)
    loss = run_chain(ws, x, y, seeds)
    ref_loss, grads = reference_grads(tiny(0.1), x, y, seeds)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_close(all_grads(ws), grads)


def test_a_held_gradient_counts_once_and_only_when_acknowledged() -> None:
    """A call's gradient goes into the stage provisionally: one released (a lost reply, a failed microbatch) leaves
    no trace; one accumulated twice counts once; one held across a state load is dropped; the stage steps on the
    samples that were acknowledged, never while a provisional gradient is in it (calls meanwhile defer theirs).
    What is kept is the call's inputs, never a copy of the parameters' gradient."""
    ws = workers(tiny(0.0))
    w, ref = ws[1], workers(tiny(0.0))[1]
    w.accumulate_samples = ref.accumulate_samples = 8
    g = torch.Generator().manual_seed(3)
    h, grad_out, other = (torch.randn(4, BLOCK, 32, generator=g) for _ in range(3))
    _, _, lost = w.compute("backward", [h, other], 1)  # computed, never acknowledged
    _, _, held = w.compute("backward", [h, grad_out], 2)
    assert (w.samples, w.pending_samples, w.steps) == (0, 0, 0)
    assert held.samples == 4 and held.nbytes == 2 * h.numel() * 4 and not held.deferred
    assert held.accumulate() and not held.accumulate()
    lost.release()
    lost.release()  # twice: taken out once
    assert not lost.accumulate()  # released: it never counts
    _, _, r = ref.compute("backward", [h, grad_out], 2)
    assert r.accumulate()
    assert_close(w.accumulated_grads(), ref.accumulated_grads(), rel=1e-6)
    assert (w.samples, w.pending_samples, w.steps) == (4, 4, 0)
    _, _, stale = w.compute("backward", [h, other], 3)
    assert not ws[2].accumulate(stale)  # another worker's
    w.load_state_dict(w.state_dict())
    assert not stale.accumulate() and w.samples == 4  # held before the state was replaced: dropped
    ref.load_state_dict(ref.state_dict())
    _, _, a = w.compute("backward", [h, grad_out], 2)
    _, _, b = w.compute("backward", [h, grad_out], 2)
    _, _, c = w.compute("backward", [h, other], 4)  # p.grad holds a step's worth: this one waits apart, a copy
    assert not a.deferred and c.state == COPY and c.nbytes == sum(p.numel() * 4 for p in w.params().values())
    assert a.accumulate() and w.steps == 0 and b.accumulate() and w.steps == 1  # the step on a and b alone
    c.release()
    for _ in range(2):
        _, _, r = ref.compute("backward", [h, grad_out], 2)
        assert r.accumulate()
    assert ref.steps == 1 and w.pending_samples == 0
    assert_close(w.params(), ref.params(), rel=1e-6)
    w.max_held = 0  # no room for a copy beside the stage: past a step's worth, calls defer to their ack
    held = [w.compute("backward", [h, grad_out], 5)[2] for _ in range(3)]
    assert [x.state for x in held] == [PROVISIONAL, PROVISIONAL, DEFERRED] and held[2].nbytes == held[0].nbytes
    assert all(x.accumulate() for x in held) and w.steps == 2 and w.pending_samples == 4  # added now, stepped on


def test_a_provisional_gradient_that_holds_a_step_back_too_long_is_deferred(monkeypatch) -> None:
    """A driver that never acknowledges delays a due step by SETTLE_FACTOR x the typical wait for an ack, no more:
    its gradient is then taken out and deferred, and the step comes on the acknowledged samples."""
    from trainers.pipeline import stage as stage_mod

    monkeypatch.setattr(stage_mod, "SETTLE_MIN_S", 0.0)
    w, ref = workers(tiny(0.0))[1], workers(tiny(0.0))[1]
    w.accumulate_samples = ref.accumulate_samples = 4
    h, grad_out, other = torch.randn(4, BLOCK, 32), torch.randn(4, BLOCK, 32), torch.randn(4, BLOCK, 32)
    _, _, silent = w.compute("backward", [h, other], 1)
    _, _, acked = w.compute("backward", [h, grad_out], 2)
    w._settle_s = 0.0  # acks come at once here: the silent one is late as soon as the step is due
    assert acked.accumulate() and w.steps == 1 and silent.deferred
    _, _, r = ref.compute("backward", [h, grad_out], 2)
    assert r.accumulate() and ref.steps == 1
    assert_close(w.params(), ref.params(), rel=1e-6)
    assert silent.accumulate() and w.samples == 8 and w.steps == 2  # a late ack still counts it, computed now


def test_a_non_finite_gradient_leaves_the_stage_as_it_was() -> None:
    """A call whose gradient overflows is refused, and the part of it that went into p.grad comes out again: the
    stage then accumulates as one that never saw the call. (Taking a gradient out is exact up to rounding at its
    own magnitude: docs/design.md, "Swarm pipeline": what at-most-once keeps.)"""
    w, ref = workers(tiny(0.0))[1], workers(tiny(0.0))[1]
    w.accumulate_samples = ref.accumulate_samples = 100
    h, grad_out = torch.randn(4, BLOCK, 32), torch.randn(4, BLOCK, 32)
    with pytest.raises(ValueError, match="not finite"):
        w.compute("backward", [h, torch.full_like(grad_out, 3e37)], 3)
    assert all(float(g.abs().max()) == 0 for g in w.accumulated_grads().values()) and w.samples == 0
    for worker in (w, ref):
        _, _, ok = worker.compute("backward", [h, grad_out], 2)
        assert ok.accumulate()
    w.accumulate_samples = ref.accumulate_samples = 4  # read the sums (accumulated_grads divides by the samples)
    assert_close(w.accumulated_grads(), ref.accumulated_grads(), rel=1e-6)


def test_adding_an_acknowledged_gradient_counts_in_the_stage_speed() -> None:
    """The add and the optimizer step happen on the ack, outside the call's timing: they still count in the
    samples/s the stage announces (routing, placement and rebalancing read it), as when the call did them."""
    from trainers.pipeline.stage import ACCUMULATE

    w = workers(tiny(0.0))[1]
    w.accumulate_samples = 4  # every acknowledged microbatch steps
    h, grad_out = torch.randn(4, BLOCK, 32), torch.randn(4, BLOCK, 32)
    w.compute("forward", [h], 1)
    _, _, held = w.compute("backward", [h, grad_out], 1)
    calls_only = w.samples_per_s()
    assert calls_only > 0 and held.accumulate() and w.steps == 1
    assert ACCUMULATE in w._sec_per_sample and 0 < w.samples_per_s() < calls_only


def test_backward_recompute_reproduces_the_forward_bit_exactly() -> None:
    w = workers(tiny(0.1))[1]
    h = torch.randn(4, BLOCK, 32)
    _, (out,), _ = w.compute("forward", [h], 5)
    _, (other,), _ = w.compute("forward", [h], 6)
    assert not torch.equal(out, other)  # dropout is on: the seed matters
    seen: list[torch.Tensor] = []
    handle = w.module.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    try:
        w.compute("backward", [h, torch.randn(4, BLOCK, 32)], 5)
    finally:
        handle.remove()
    assert len(seen) == 1 and torch.equal(seen[0], out)


def test_specs_kinds_and_single_stage() -> None:
    ws = workers(tiny(0.0))
    assert ws[0].kinds() == ("forward", "backward") and ws[3].kinds() == ("loss", "evaluate")
    assert ws[0].input_specs("backward", 3) == [("x", "int64", [3, BLOCK]), ("grad_out", "float32", [3, BLOCK, 32])]
    assert ws[2].input_specs("forward", 1) == [("h", "float32", [1, BLOCK, 32])]
    assert ws[3].input_specs("loss", 4) == [("h", "float32", [4, BLOCK, 32]), ("y", "int64", [4, BLOCK])]
    for bad in ((ws[0], "loss", 1), (ws[3], "forward", 1), (ws[1], "forward", 0), (ws[1], "forward", 5)):
        with pytest.raises(ValueError):
            bad[0].input_specs(bad[1], bad[2])

    (one,) = workers(tiny(0.1), bounds=[(0, 6)])
    x, y = data(4)
    assert one.input_specs("loss", 2)[0] == ("x", "int64", [2, BLOCK])
    loss, out, held = one.compute("loss", [x, y], 0)
    assert out == [] and loss is not None and one.samples == 0 and one.steps == 0  # held, not taken yet
    assert held.accumulate() and one.samples == 4 and one.steps == 1
    assert one.samples_per_s() > 0
    e1, _, none1 = one.compute("evaluate", [x, y], 1)
    e2, _, none2 = one.compute("evaluate", [x, y], 2)
    assert none1 is None and none2 is None
    assert e1 == e2 and one.module.training  # eval mode: no dropout; train mode restored
    assert one.samples == 4


def test_bad_inputs_are_rejected_without_state_change() -> None:
    ws = workers(tiny(0.0))
    for w in ws:
        w.accumulate_samples = 100
    x, y = data(4)
    run_chain(ws, x, y, [1, 2, 3, 4])
    grads = all_grads(ws)
    params = {k: v.clone() for w in ws for k, v in w.params().items()}
    h = torch.randn(4, BLOCK, 32)
    nan = h.clone()
    nan[1, 2, 3] = float("nan")
    bad_ids = x.clone()
    bad_ids[0, 0] = VOCAB
    cases = [
        (ws[1], "backward", [h], 0, "expected 2 tensors"),
        (ws[1], "backward", [h, h[:, :, :16]], 0, r"input 1 \(grad_out\) has shape"),
        (ws[1], "forward", [h.double()], 0, r"input 0 \(h\) has dtype float64"),
        (ws[1], "backward", [h, nan], 0, r"input 1 \(grad_out\) contains NaN"),
        (ws[3], "loss", [nan, y], 0, r"input 0 \(h\) contains NaN"),
        (ws[1], "forward", [torch.randn(5, BLOCK, 32)], 0, r"batch must be in \[1, 4\]"),
        (ws[1], "loss", [h, y], 0, "not served"),
        (ws[1], "forward", [h], -1, "seed"),
        (ws[1], "forward", ["h"], 0, "not a tensor"),
        (ws[0], "backward", [bad_ids, h], 0, "token ids"),
        (ws[3], "loss", [h, torch.full_like(y, VOCAB)], 0, "targets"),
        (ws[1], "backward", [h, torch.full_like(h, 3e38)], 0, "not finite"),
    ]
    for w, kind, tensors, seed, msg in cases:
        with pytest.raises(ValueError, match=msg):
            w.compute(kind, tensors, seed)
    assert_close(all_grads(ws), grads, rel=0.0)
    assert all(torch.equal(v, params[k]) for w in ws for k, v in w.params().items())
    assert [w.samples for w in ws] == [4] * 4 and [w.steps for w in ws] == [0] * 4


def test_worker_arguments() -> None:
    model = tiny(0.0)
    sx, sy = data(2)
    opt = sgd
    for bounds, stage, stages, msg in [((1, 3), 0, 2, "first stage"), ((0, 3), 1, 2, "first stage"),
                                       ((0, 3), 0, 2, None), ((3, 5), 1, 2, "last stage"),
                                       ((3, 9), 1, 2, "bounds"), ((2, 2), 1, 3, "bounds"), ((0, 6), 1, 1, "stage")]:
        if msg is None:
            StageWorker(tiny(0.0), bounds, stage=stage, stages=stages, optimizer=opt, max_batch=2,
                        sample_x=sx, sample_y=sy)
            continue
        with pytest.raises(ValueError, match=msg):
            StageWorker(model, bounds, stage=stage, stages=stages, optimizer=opt, max_batch=2,
                        sample_x=sx, sample_y=sy)
    w = workers(tiny(0.0))[1]
    with pytest.raises(ValueError, match="accumulate_samples"):
        w.accumulate_samples = 0
    assert w.samples_per_s() == 0.0
    # model-wide names: the same as sequential()'s, for blocks 1 and 2 only
    assert list(w.params()) == [n for n, _ in tiny(0.0).sequential().named_parameters() if n.split(".")[0] in "12"]


def test_state_dict_round_trip() -> None:
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731 (has state worth carrying)
    a = workers(tiny(0.0), optimizer=adam)
    for w in a:
        w.accumulate_samples = 4
    x, y = data(4)
    run_chain(a, x, y, [1, 2, 3, 4])
    b = workers(tiny(0.0, seed=5), optimizer=adam)
    b[2].load_state_dict(a[2].state_dict())
    assert b[2].steps == 1 and b[2].samples == 4
    assert all(torch.equal(v, a[2].params()[k]) for k, v in b[2].params().items())
    sa, sb = a[2].state_dict()["optimizer"]["state"], b[2].state_dict()["optimizer"]["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i]["exp_avg"], sb[i]["exp_avg"]) for i in sa)
    with pytest.raises(ValueError, match="does not match"):
        b[1].load_state_dict(a[2].state_dict())
    bad = a[2].state_dict()
    bad["module"]["3.ln1.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="3.ln1.weight is \\[3\\], expected \\[32\\]"):
        b[2].load_state_dict(bad)


# --- live state transfer (export_state / check_state_specs / import_state) ----------------------------


def adam(ps):
    return make_optimizer(ps, "adam", lr=1e-2)


def specs(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int]]]:
    return [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors]


def assert_same_state(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    assert all(x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def train_stage(w: StageWorker, seed: int) -> None:
    """One backward request of max_batch (4) samples on a middle stage: one optimizer step."""
    g = torch.Generator().manual_seed(seed)
    _, _, held = w.compute("backward", [torch.randn(4, BLOCK, 32, generator=g), torch.randn(4, BLOCK, 32, generator=g)],
                           seed)
    assert held.accumulate()


class TaggedAdam(torch.optim.Adam):
    """Adam with a constructor the state probe cannot call: the stage does not know its state keys."""

    def __init__(self, params, tag: str, **kw) -> None:
        super().__init__(params, **kw)


class CountingSGD(torch.optim.SGD):
    """SGD that also keeps Python-number state, as older optimizers kept `step`."""

    def step(self, closure=None):
        for p in (p for g in self.param_groups for p in g["params"] if p.grad is not None):
            self.state[p]["count"] = self.state[p].get("count", 0) + 1
            self.state[p]["frac"] = self.state[p]["count"] / 4
        return super().step(closure)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_state_round_trip_is_exact(name: str) -> None:
    def opt(ps):
        return make_optimizer(ps, name, lr=1e-2, momentum=0.9)
    a, b = workers(tiny(0.1), optimizer=opt), workers(tiny(0.1, seed=5), optimizer=opt)
    x, y = data(12)
    for i in (0, 4):
        run_chain(a, x[i:i + 4], y[i:i + 4], [i + 1, i + 2, i + 3, i + 4])
    for wa, wb in zip(a, b):
        tensors, steps, samples = wa.export_state()
        assert (steps, samples) == (2, 8) and wb.check_state_specs(specs(tensors)) is None
        assert {n.rsplit("/", 1)[1] for n, _ in tensors if n.startswith("o/")} == \
            ({"step", "exp_avg", "exp_avg_sq"} if name == "adam" else {"momentum_buffer"})
        assert all(t.is_contiguous() and t.device == CPU for _, t in tensors)
        wb.import_state(tensors, steps, samples)
        again, steps_b, samples_b = wb.export_state()
        assert_same_state(again, tensors)
        assert (steps_b, samples_b) == (2, 8)
    run_chain(a, x[8:], y[8:], [7, 8, 9, 10])  # the same step on both: equal only if the optimizer state loaded
    run_chain(b, x[8:], y[8:], [7, 8, 9, 10])
    for wa, wb in zip(a, b):
        assert wb.steps == 3 and all(torch.equal(v, wb.params()[k]) for k, v in wa.params().items())


def test_write_state_hands_over_what_export_state_copies_under_the_lock_without_copying_it() -> None:
    """What the daemon writes to a file before sending it (peer/pipeline/state_transfer.py): the same state as
    export_state's, the tensors themselves (no second copy in memory), with the lock held while it writes."""
    w = workers(tiny(0.1), optimizer=adam)[1]
    train_stage(w, 1)
    got = []

    def write(tensors, steps, samples):
        assert w.lock.locked()  # no step lands while the file is written
        got.append((tensors, steps, samples))

    w.write_state(write)
    [(tensors, steps, samples)] = got
    copied, steps_c, samples_c = w.export_state()
    assert_same_state(tensors, copied) and (steps, samples) == (steps_c, samples_c) == (1, 4)
    own = {p.data_ptr() for p in w.params().values()} | {v.data_ptr() for st in w._optimizer.state.values()
                                                        for v in st.values() if torch.is_tensor(v) and v.dim()}
    assert {t.data_ptr() for _, t in tensors if t.dim()} <= own  # the stage's own storage, not copies
    assert not {t.data_ptr() for _, t in copied if t.dim()} & own  # (export_state's are copies)
    assert not w.lock.locked()


def test_fresh_state_has_only_module_entries() -> None:
    a = workers(tiny(0.0), optimizer=adam)[1]
    b = workers(tiny(0.0, seed=5), optimizer=adam)[1]
    train_stage(b, 1)
    b.accumulate_samples = 100
    train_stage(b, 2)  # pending gradients, dropped by the import
    tensors, steps, samples = a.export_state()
    assert (steps, samples) == (0, 0) and tensors and all(n.startswith("m/") for n, _ in tensors)
    assert [n for n, _ in tensors] == [f"m/{k}" for k in b.params()]  # blocks 1-2 have no buffers
    b.import_state(tensors, steps, samples)
    assert_same_state(b.export_state()[0], tensors)  # b's optimizer state is gone too
    assert (b.steps, b.samples) == (0, 0) and all(float(g.abs().max()) == 0 for g in b.accumulated_grads().values())
    b.accumulate_samples = 4
    train_stage(b, 3)
    assert b.steps == 1 and any(n.startswith("o/") for n, _ in b.export_state()[0])


def test_python_number_state_travels_as_num() -> None:
    def opt(ps):
        return CountingSGD(ps, lr=LR, momentum=0.9)
    a, b = workers(tiny(0.0), optimizer=opt)[1], workers(tiny(0.0, seed=5), optimizer=opt)[1]
    for seed in (1, 2, 3):
        train_stage(a, seed)
    tensors, steps, samples = a.export_state()
    nums = {n: t for n, t in tensors if n.endswith(":num")}
    assert nums["o/1.ln1.bias/count:num"].dtype == torch.float64 and float(nums["o/1.ln1.bias/frac:num"]) == 0.75
    b.import_state(tensors, steps, samples)
    state = b._optimizer.state[b._params[1]]
    assert state["count"] == 3 and type(state["count"]) is int and state["frac"] == 0.75
    assert_same_state(b.export_state()[0], tensors)
    train_stage(a, 4)
    train_stage(b, 4)
    assert all(torch.equal(v, b.params()[k]) for k, v in a.params().items())


def test_check_state_specs_rejects_with_a_reason() -> None:
    a = workers(tiny(0.0), optimizer=adam)
    x, y = data(4)
    run_chain(a, x, y, [1, 2, 3, 4])
    w = a[1]
    good = specs(w.export_state()[0])
    assert w.check_state_specs(good) is None
    n_module = sum(n.startswith("m/") for n, _, _ in good)

    def drop(name):
        return [s for s in good if s[0] != name]

    def change(name, dtype=None, shape=None):
        return [(n, dtype or d, shape if shape is not None else sh) if n == name else (n, d, sh) for n, d, sh in good]

    def put(name, spec):
        return [spec if s[0] == name else s for s in good]

    cases = [
        (drop("m/1.ln1.weight"), r"^'m/1.ln1.weight': missing"),
        (change("m/1.ln1.bias", shape=[3]), r"'m/1.ln1.bias': shape \[3\], expected \[32\]"),
        (change("m/1.ln1.bias", dtype="float64"), r"'m/1.ln1.bias': dtype 'float64', expected float32"),
        (good + [("x/1.ln1.bias", "float32", [32])], r"'x/1.ln1.bias': unknown prefix"),
        (good + [("1.ln1.bias", "float32", [32])], r"'1.ln1.bias': unknown prefix"),
        (good + [("o/0.tok.weight/exp_avg", "float32", [VOCAB, 32])], r"'o/0.tok.weight/exp_avg': not a parameter"),
        (good + [("o/1.ln1.bias/exp-avg", "float32", [32])], r"'o/1.ln1.bias/exp-avg': bad state key"),
        (good + [(f"o/1.ln1.bias/{'k' * 33}", "float32", [32])], "bad state key"),
        (change("o/1.ln1.bias/exp_avg", shape=[31]), r"exp_avg': shape \[31\], expected the parameter's \[32\]"),
        (change("o/1.ln1.bias/exp_avg", dtype="int64"), r"exp_avg': dtype 'int64': optimizer state must be a float"),
        (change("o/1.ln1.bias/exp_avg", shape=[]), r"exp_avg': .*keeps 'exp_avg' as a parameter-shaped tensor"),
        (change("o/1.ln1.bias/step", shape=[32]), r"step': .*keeps 'step' 0-d"),
        (good + [("o/1.ln1.bias/momentum_buffer", "float32", [32])], r"momentum_buffer': .*keeps no state"),
        (drop("o/1.ln1.bias/exp_avg_sq"), r"^'o/1.ln1.bias/exp_avg_sq': missing"),
        (good + [("o/1.ln1.bias/step:num", "float64", [])], r"step:num': duplicate state key"),
        (put("o/1.ln1.bias/step", ("o/1.ln1.bias/step:num", "float32", [])), r"step:num': .*0-d float64"),
        (good + [good[5]], rf"entry {len(good)} '{good[5][0]}': duplicate name"),
        (good + [("x", "float32", [])] * (9 * n_module - len(good) + 1), rf"entry {9 * n_module}: more than"),
        (good + [("m/1.ln1.bias", "float32")], r"not a \(name, dtype, shape\) triple"),
        (change("m/1.ln1.bias", shape=[32.0]), "list of ints"),
        (good + [("o/" + "a" * 1000 + "/exp_avg", "float32", [32])], "not a parameter"),
        ("m/1.ln1.bias", "not a list"),
    ]
    for bad, msg in cases:
        why = w.check_state_specs(bad)
        assert why is not None and len(why) <= 300, msg
        assert re.search(msg, why), (msg, why)
    assert w.check_state_specs(put("o/1.ln1.bias/step", ("o/1.ln1.bias/step:num", "float64", []))) is None  # a float step
    assert a[2].check_state_specs(good) is not None  # another stage's state

    # An optimizer the stage cannot probe: the grammar alone applies, at most 8 state keys per parameter.
    u = workers(tiny(0.0), optimizer=lambda ps: TaggedAdam(ps, "t", lr=1e-2))[1]
    base = specs(u.export_state()[0])
    extra = [(f"o/1.ln1.bias/k{i}", "float32", [32]) for i in range(9)]
    assert u.check_state_specs(base + extra[:8]) is None
    assert "'o/1.ln1.bias/k8': more than 8 state keys" in u.check_state_specs(base + extra)


def test_import_state_rejects_without_state_change() -> None:
    a = workers(tiny(0.0), optimizer=adam)[1]
    b = workers(tiny(0.0, seed=5), optimizer=adam)[1]
    train_stage(a, 1)
    train_stage(b, 2)
    before = b.export_state()
    tensors, steps, samples = a.export_state()
    names = [n for n, _ in tensors]
    wrong = list(tensors)
    wrong[names.index("o/2.ln2.bias/exp_avg")] = ("o/2.ln2.bias/exp_avg", torch.zeros(31))  # the last checked
    cases = [
        ((wrong, steps, samples), "'o/2.ln2.bias/exp_avg': shape"),
        ((tensors[1:], steps, samples), "'m/1.ln1.weight': missing"),
        ((tensors + [("o/1.ln1.bias/bogus", torch.zeros(32))], steps, samples), "keeps no state 'bogus'"),
        ((tensors, -1, samples), "steps must be an int >= 0"),
        ((tensors, steps, True), "samples must be an int >= 0"),
        (([(n, t.numpy()) for n, t in tensors], steps, samples), r"\(name, tensor\) pairs"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            b.import_state(*args)
    after = b.export_state()
    assert_same_state(after[0], before[0])
    assert after[1:] == before[1:] == (1, 4)

    # An optimizer the stage could not probe refuses the state it is given: it keeps its own.
    def tagged(ps):
        return TaggedAdam(ps, "t", lr=1e-2)
    u = workers(tiny(0.0), optimizer=tagged)[1]
    train_stage(u, 3)
    mine = u.export_state()
    no_step = [(n, t) for n, t in tensors if not n.endswith("/step")]
    with pytest.raises(ValueError, match="the optimizer refused its state"):
        u.import_state(no_step, steps, samples)
    assert_same_state(u.export_state()[0], mine[0])
    train_stage(u, 4)  # and still steps
    assert u.steps == 2


def test_export_state_while_another_thread_trains() -> None:
    w = workers(tiny(0.0), optimizer=adam)[1]
    stop, errors = threading.Event(), []

    def train() -> None:
        try:
            seed = 0
            while not stop.is_set():
                seed += 1
                train_stage(w, seed)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    t = threading.Thread(target=train)
    t.start()
    try:
        seen, deadline = set(), time.monotonic() + 30
        while len(seen) < 4 and not errors and time.monotonic() < deadline:  # exports of several steps
            tensors, steps, samples = w.export_state()
            assert samples == 4 * steps and any(n.startswith("o/") for n, _ in tensors) == (steps > 0)
            assert w.check_state_specs(specs(tensors)) is None
            seen.add(steps)
    finally:
        stop.set()
        t.join()
    assert not errors and len(seen) == 4


def builder_blocks():
    return [lambda: nn.Linear(8, 16), nn.ReLU, lambda: nn.Linear(16, 3)], F.cross_entropy


def meta_blocks():
    with torch.device("meta"):
        return [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)], F.cross_entropy


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def meta_without_reset():
    with torch.device("meta"):
        return [_Scale()], F.cross_entropy


# --- from_factory ----------------------------------------------------------------------------------


def good_factory():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), F.cross_entropy


def not_a_pair():
    return nn.Linear(4, 2)


def empty_blocks():
    return [], F.cross_entropy


def bad_element():
    return [nn.Linear(4, 2), "relu"], F.cross_entropy


def bad_loss():
    return [nn.Linear(4, 2)], "mse"


def test_from_factory() -> None:
    spec = f"{__name__}:good_factory"
    m1, m2 = from_factory(spec), from_factory(spec)
    assert m1.name == spec and len(m1) == 3 and m1.loss_fn is F.cross_entropy
    assert torch.equal(m1.build(0).weight, m2.build(0).weight)  # every peer builds the same weights
    for fn, msg in [("not_a_pair", "pair"), ("empty_blocks", "no blocks"), ("bad_element", "block 1 is a str"),
                    ("bad_loss", "not callable")]:
        with pytest.raises(ValueError, match=f"{__name__}:{fn}.*{msg}"):
            from_factory(f"{__name__}:{fn}")
    with pytest.raises(ValueError, match="no attribute"):
        from_factory(f"{__name__}:missing")


def test_deferred_gradients_equal_held_ones() -> None:
    """A stage that keeps its calls' inputs and computes the parameter gradient on the ack (memory too short for
    in_flight gradients) accumulates the gradient a held one would have, with dropout, and holds inputs' bytes."""
    x, y = data(4)
    held_ws, deferred_ws = workers(tiny(0.1)), workers(tiny(0.1))
    for w in deferred_ws:
        w.defer_gradients = True
    assert run_chain(held_ws, x, y, [11, 12, 13]) == run_chain(deferred_ws, x, y, [11, 12, 13])
    assert_close(all_grads(deferred_ws), all_grads(held_ws), rel=1e-6)
    _, _, kept = deferred_ws[1].compute("backward", [torch.randn(4, BLOCK, 32), torch.randn(4, BLOCK, 32)], 5)
    assert kept is not None and kept.deferred and kept.nbytes == 2 * 4 * BLOCK * 32 * 4
    assert kept.accumulate() and not kept.accumulate()  # at most once


@pytest.mark.unit
def test_staging_keeps_values_and_order_on_the_cpu_and_on_a_gpu_when_present():
    """What crosses between the wire and a stage's device: the same values, dtypes and shapes, contiguous on
    the way out; on a GPU (proven on the lent one, docs/benchmarks.md) through pinned host memory."""
    from trainers.pipeline import staging

    received = [torch.randn(3, 4), torch.arange(12).reshape(3, 4), torch.randn(4, 3).t()]
    devices = [CPU] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    for device in devices:
        on = staging.to_device(received, device)
        assert [t.device.type for t in on] == [device.type] * 3
        back = staging.to_wire(on, device)
        for got, want in zip(back, received):
            assert got.device.type == "cpu" and got.is_contiguous() and got.dtype == want.dtype
            assert torch.equal(got, want)
            assert staging.is_pinned(got) == (device.type == "cuda")

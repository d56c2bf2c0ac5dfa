"""What one `peer bench train` invocation decides before any run: model, target, the trainer options our
daemons get and the matching all-reduce flags, so that every mode trains the same model the same way."""

from __future__ import annotations

import json
from dataclasses import dataclass

from peer.bench.args import (DIGITS_MODES, LM_BATCH, LM_EVAL_EVERY, LM_EVAL_SAMPLES, LM_MAX_STEPS, LM_MODEL,
                             LM_MODEL_OPTIONS, LM_MODES, LM_REPEATS, LM_TARGET_LOSS, LM_TOPOLOGY)
from peer.testing.process import module_json

RECIPE_TIMEOUT = 120.0  # the baseline imports torch and loads the data set before it answers
# Our local modes: gossip_sgd mode "local" with these outer exchanges (the outer optimizer keeps its defaults)
LOCAL_MODES = {"local": {"outer_codec": "raw"}, "local_q8": {"outer_codec": "q8", "outer_error_feedback": True},
               "local_sparse": {"outer_codec": "sparse"}}


@dataclass
class Plan:
    """Everything one invocation decided, shared by all its runs."""

    model: str
    target: float
    eval_every: int
    epochs: float
    options: dict
    allreduce_args: list[str]
    gossip: dict
    membership: dict
    topology: dict
    metric: str = "accuracy"  # what `target` is a value of: held-out "accuracy" (reach it) or "test_loss" (fall to it)
    max_steps: int = 0  # the step budget (0: `epochs`)
    inner_steps: int = 0  # H of the local modes
    local_eval_every: int = 0  # local modes evaluate at round ends (the outer weights a round produced)
    repeats: int = 1  # runs per mode

    def mode_options(self, mode: str) -> dict:
        """gossip_sgd's options for one of our modes, on top of `options`."""
        if mode not in LOCAL_MODES:
            return {"mode": mode}
        return {"mode": "local", "inner_steps": self.inner_steps, "eval_every": self.local_eval_every,
                **LOCAL_MODES[mode]}


def reaches(metrics: dict, target: float, metric: str = "accuracy") -> bool:
    """Whether one evaluation (a peer's metrics line) reached the target: an accuracy at or above it, a loss at or
    below it; never without a target."""
    value = metrics.get(metric)
    if value is None or not target:
        return False
    return value <= target if metric == "test_loss" else value >= target


def default_modes(model: str) -> str:
    return LM_MODES if model == LM_MODEL else DIGITS_MODES


def recipe(model: str, a) -> dict:
    """The hyperparameters gossip_sgd and the baseline resolve for this model (asked of the baseline: peer/
    does not import trainers)."""
    return module_json("trainers.allreduce_baseline",
                       ["--world", str(a.n), "--model", model, "--print-recipe",
                        *(["--batch-size", str(a.batch_size)] if a.batch_size else [])],
                       timeout=RECIPE_TIMEOUT, what=f"resolving the recipe of {model!r}")


def make_plan(a) -> Plan:
    model = a.model or ("digits_wide_mlp" if a.netns else "digits_mlp")
    lm = model == LM_MODEL
    metric = "test_loss" if lm or a.target_loss is not None else "accuracy"
    if metric == "test_loss" and a.target is not None:
        raise ValueError("--target is a held-out accuracy; this run is timed to a loss (--target-loss)")
    if metric == "test_loss":
        target = a.target_loss if a.target_loss is not None else LM_TARGET_LOSS
    else:
        target = a.target if a.target is not None else 0.95
    eval_every = a.eval_every or (LM_EVAL_EVERY if lm else 5 if model == "digits_wide_mlp" else 20)
    # Without --stop-at-target every peer keeps training until the bench has seen all of them reach the target:
    # a peer that stops at its own target keeps serving exchanges with a frozen model, which drags the others.
    stop_at = target if a.stop_at_target else 0.0
    options = {"model": model, "world": a.n, "target_" + ("loss" if metric == "test_loss" else "accuracy"): stop_at,
               "eval_every": eval_every, "seed": a.seed,
               "threads": 1, "checkpoint_every": 0, "join_wait": 60.0}
    ar = ["--model", model, "--eval-every", str(eval_every), "--seed", str(a.seed), "--threads", "1",
          *(["--target", "0", "--target-loss", str(target)] if metric == "test_loss" else ["--target", str(target)])]
    if lm:  # the same small model, and the same cheaper held-out windows, in every mode
        options.update(model_options=dict(LM_MODEL_OPTIONS), eval_samples=LM_EVAL_SAMPLES)
        ar += ["--model-options", json.dumps(LM_MODEL_OPTIONS), "--eval-samples", str(LM_EVAL_SAMPLES)]
    max_steps = a.max_steps or (LM_MAX_STEPS if lm else 0)
    if max_steps:
        options["max_steps"] = max_steps
        ar += ["--max-steps", str(max_steps)]
    epochs = a.epochs or (0.0 if max_steps else 2 * recipe(model, a)["epochs"])
    if epochs:
        options["epochs"] = epochs
        ar += ["--epochs", str(epochs)]
    batch = a.batch_size or (LM_BATCH if lm else 0)
    if batch:
        options["batch_size"] = batch
        ar += ["--batch-size", str(batch)]
    if a.lr:
        options["lr"] = a.lr
        ar += ["--lr", str(a.lr)]
    # A 9.9 MB exchange (the largest model here) over a throttled link takes model_bits / rate; give it room,
    # and keep heartbeats (queued behind tensor frames on the same session) from declaring the slow peer dead.
    slowest = min(r for r in (a.slow_link, a.link_mbit, float("inf")) if r)
    slow_s = 10e6 * 8 / (slowest * 1e6) if slowest < float("inf") else 0.0
    gossip = {"exchange_timeout": max(10.0, 4 * slow_s), "codec": a.codec}
    membership = {"dead_after": max(4.0, 3 * slow_s)}
    # rewired, as configs/train-digits.toml: min degree 1 and room for one edge above the target
    topology = ({"kind": LM_TOPOLOGY} if lm else
                {"kind": "rewired", "target_degree": a.degree, "min_degree": 1, "max_degree": max(a.degree, 3)})
    return Plan(model, target, eval_every, epochs, options, ar, gossip, membership, topology, metric=metric,
                max_steps=max_steps, inner_steps=a.inner_steps, local_eval_every=a.eval_every or a.inner_steps,
                repeats=a.repeats or (LM_REPEATS if lm else 1))

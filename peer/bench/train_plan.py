"""What one `peer bench train` invocation decides before any run: model, target, the trainer options our
daemons get and the matching all-reduce flags, so that every mode trains the same model the same way."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

RECIPE_TIMEOUT = 120.0  # the baseline imports torch and loads the data set before it answers


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


def recipe(model: str, a) -> dict:
    """The hyperparameters gossip_sgd and the baseline resolve for this model (asked of the baseline: peer/
    does not import trainers)."""
    argv = [sys.executable, "-m", "trainers.allreduce_baseline", "--world", str(a.n), "--model", model,
            "--print-recipe", *(["--batch-size", str(a.batch_size)] if a.batch_size else [])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=RECIPE_TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"cannot resolve the recipe of {model!r}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_plan(a) -> Plan:
    model = a.model or ("digits_wide_mlp" if a.netns else "digits_mlp")
    target = a.target if a.target is not None else 0.95
    eval_every = a.eval_every or (5 if model == "digits_wide_mlp" else 20)
    # Without --stop-at-target every peer keeps training until the bench has seen all of them reach the target:
    # a peer that stops at its own target keeps serving exchanges with a frozen model, which drags the others.
    options = {"model": model, "world": a.n, "target_accuracy": target if a.stop_at_target else 0.0,
               "eval_every": eval_every, "seed": a.seed,
               "threads": 1, "checkpoint_every": 0, "join_wait": 60.0}
    ar = ["--model", model, "--target", str(target), "--eval-every", str(eval_every), "--seed", str(a.seed),
          "--threads", "1"]
    epochs = a.epochs or 2 * recipe(model, a)["epochs"]
    options["epochs"] = epochs
    ar += ["--epochs", str(epochs)]
    if a.batch_size:
        options["batch_size"] = a.batch_size
        ar += ["--batch-size", str(a.batch_size)]
    if a.lr:
        options["lr"] = a.lr
        ar += ["--lr", str(a.lr)]
    # A 9.9 MB exchange over a throttled link takes model_bits / rate; give it room, and keep heartbeats
    # (queued behind tensor frames on the same session) from declaring the slow peer dead.
    slow_s = (10e6 * 8 / (a.slow_link * 1e6)) if a.slow_link else 0.0
    gossip = {"exchange_timeout": max(10.0, 4 * slow_s), "codec": a.codec}
    membership = {"dead_after": max(4.0, 3 * slow_s)}
    # rewired, as configs/train-digits.toml: min degree 1 and room for one edge above the target
    topology = {"kind": "rewired", "target_degree": a.degree, "min_degree": 1, "max_degree": max(a.degree, 3)}
    return Plan(model, target, eval_every, epochs, options, ar, gossip, membership, topology)

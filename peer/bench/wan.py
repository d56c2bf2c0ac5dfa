"""`peer bench wan` (issue 41): training where the links bind.

n peers, one network namespace each, every host's link limited by tbf to a rate chosen so that one float32 outer
exchange of the big model (lm_100m) takes `--ratio` times the compute of one outer round (measured: one process's
steps on this machine, times the peers each core carries). Two parts, each a run per mode through `peer bench
train`'s runners (train_gossip.run_gossip, train_allreduce.run_allreduce), not a mechanism of its own:

- the big model, a few outer rounds with small batches: bytes, wall time and compute utilization per outer step,
  per peer and mode (gloo DDP all-reduce, AD-PSGD, local steps float32, 8-bit and sparse);
- the small model (lm_14m) timed to a held-out loss: loss against tokens per mode, and local steps' time to the
  loss against the all-reduce's.

`loss_gap` compares the sparse run's held-out loss with float32 local steps' at the most tokens both reached, on
the small model (null unless both ran there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from peer.bench.args import LM_TOPOLOGY
from peer.bench.hosts import Net, run_root
from peer.bench.train_allreduce import run_allreduce, summarise_allreduce
from peer.bench.train_gossip import run_gossip, summarise_gossip
from peer.bench.train_plan import Plan
from peer.bench.wan_figures import (SPARSE_MODE, WAN_MODES, choose_link_mbit, exchange_s, loss_vs_tokens, mode_figures,
                                    per_peer_allreduce, per_peer_gossip, wan_figures)
from peer.testing.netns import netns_available, virtual_lan
from peer.testing.process import module_json

TRAINER = "trainers.gossip_sgd"
CALIBRATION_STEPS = 3  # one process's steps of the big model that time a step (the first allocates: a bound above)
CALIBRATION_TIMEOUT = 300.0
NO_EVAL = 10**6  # the big model's runs evaluate once, at their end
BIG_EVAL_SAMPLES = 1  # ... on one held-out window: 64 windows of lm_100m took ~130 s of a 1-thread peer, 10 steps
PRESET_BLOCKS = {"lm_100m": 256, "lm_14m": 128}  # trainers/models.py LM_PRESETS' windows (peer/ imports no trainers)


@dataclass
class RunArgs:
    """What the runners of `peer bench train` read of their invocation."""

    n: int
    timeout: float
    trainer: str = TRAINER


@dataclass
class Part:
    """One model's runs: its options, and how long each mode trains."""

    model: str
    model_options: dict
    batch: int
    inner_steps: int
    gossip_steps: int
    allreduce_steps: int
    eval_every: int
    target: float  # held-out loss (0: none, run the whole budget)
    eval_samples: int

    def block(self) -> int:
        return int(self.model_options.get("block") or PRESET_BLOCKS.get(self.model, 64))


def make_plan(part: Part, a, link_mbit: float, params: int | None) -> Plan:
    """gossip_sgd's options and the all-reduce's flags for one part; the exchange timeout and the liveness
    deadline sized to a float32 copy of the model through the link."""
    options = {"model": part.model, "world": a.n, "target_loss": 0.0, "eval_every": part.eval_every,
               "seed": a.seed, "threads": 1, "checkpoint_every": 0, "checkpoint_at_end": False,
               "join_wait": 120.0,
               "max_steps": part.gossip_steps, "batch_size": part.batch, "eval_samples": part.eval_samples,
               **({"model_options": part.model_options} if part.model_options else {})}
    copy_s = exchange_s(params, link_mbit) if params else 60.0
    gossip = {"exchange_timeout": max(10.0, 4 * copy_s), "codec": "raw"}
    membership = {"dead_after": max(4.0, 3 * copy_s)}
    return Plan(part.model, part.target, part.eval_every, 0.0, options, [], gossip, membership,
                {"kind": LM_TOPOLOGY}, metric="test_loss", max_steps=part.gossip_steps,
                inner_steps=part.inner_steps, local_eval_every=part.inner_steps if part.target else NO_EVAL)


def allreduce_args(part: Part, a, *, steps: int = 0, eval_every: int = 0) -> list[str]:
    """trainers.allreduce_baseline's flags for this part (steps, eval_every: other than the part's)."""
    return ["--model", part.model, "--eval-every", str(eval_every or part.eval_every), "--seed", str(a.seed),
            "--threads", "1", "--target", "0", "--target-loss", str(part.target),
            "--eval-samples", str(part.eval_samples), "--max-steps", str(steps or part.allreduce_steps),
            "--batch-size", str(part.batch),
            *(["--model-options", json.dumps(part.model_options)] if part.model_options else [])]


def calibrate(part: Part, a) -> dict:
    """Seconds of compute per step of one process of the model alone (1 thread, gloo world of 1 on 127.0.0.1),
    and its parameter count."""
    r = module_json("trainers.allreduce_baseline",
                    ["--world", "1", "--spawn", *allreduce_args(part, a, steps=CALIBRATION_STEPS, eval_every=NO_EVAL)],
                    timeout=CALIBRATION_TIMEOUT, what=f"timing a step of {part.model!r}")
    return {"parameters": r["parameters"], "step_s": r["compute_s_per_worker"][0] / max(1, r["steps"])}


def run_mode(mode: str, part: Part, a, net: Net, root: Path, plan: Plan) -> tuple[dict, list[dict]]:
    """One run: its summary (time to the target) and its peers' per-outer-step figures."""
    d = root / mode
    d.mkdir(parents=True)
    ra = RunArgs(a.n, a.timeout)
    try:
        if mode == "allreduce":
            raw = run_allreduce(ra, net, d, args=allreduce_args(part, a))
            summary = summarise_allreduce(raw)
            summary["loss_curve"] = loss_vs_tokens([raw.get("test_loss_curve") or []],
                                                   part.batch * part.block() * a.n)
            return summary, per_peer_allreduce(raw)
        if mode == SPARSE_MODE:  # every update to everyone: each peer pushes to its neighbours, so all of them
            plan = dataclasses.replace(plan, topology={"kind": "full"})
        raw = run_gossip(mode, ra, net, d, plan, options=plan.options, delays={},
                         wait_for_peers=list(range(a.n)), target=part.target)
        summary = summarise_gossip(raw, a.n)
        summary["loss_curve"] = loss_vs_tokens([p.get("test_loss_curve") or [] for p in raw["peers"]],
                                               part.batch * part.block())
        return summary, per_peer_gossip(mode, raw)
    except (RuntimeError, TimeoutError, OSError) as exc:  # one broken run is reported, not allowed to hide others
        return {"error": f"{type(exc).__name__}: {str(exc)[-600:]}"}, []
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)  # the big model's checkpoints: ~2 GB a peer


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in WAN_MODES]
    if bad:
        raise ValueError(f"unknown modes {bad}; choose from {', '.join(WAN_MODES)}")
    return modes


def run(args) -> int:
    a = args
    if a.n < 2:
        raise ValueError("--n must be at least 2")
    if not netns_available():
        raise RuntimeError("peer bench wan needs root and permission to create network namespaces")
    big_modes, small_modes = _modes(a.big_modes), _modes(a.small_modes)
    big = Part(a.big_model, a.big_model_options, a.big_batch, a.big_inner_steps, a.big_rounds * a.big_inner_steps,
               a.big_allreduce_steps, NO_EVAL, 0.0, BIG_EVAL_SAMPLES)
    small = Part(a.small_model, a.small_model_options, a.small_batch, a.small_inner_steps, a.small_steps,
                 a.small_allreduce_steps, a.eval_every, a.target_loss, a.eval_samples)
    t0 = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    cal = calibrate(big, a)
    params = cal["parameters"]
    per_core = max(1.0, a.n / (os.cpu_count() or 1))  # peers one core carries here (1 torch thread each)
    round_s = cal["step_s"] * per_core * big.inner_steps
    link = a.link_mbit or choose_link_mbit(params, round_s, a.ratio)
    planned = round(exchange_s(params, link) / round_s, 2)
    big_fig: dict[str, dict] = {}
    small_sum: dict[str, dict] = {}
    with ExitStack() as stack:
        root = run_root(stack, a.keep, "peertrain-bench-wan-")
        lan = virtual_lan(a.n, prefix="ptw", subnet="10.79.0", rate_mbit={i: link for i in range(a.n)})
        net = Net(lan=stack.enter_context(lan))
        plan = make_plan(big, a, link, params)
        for mode in big_modes:
            summary, peers = run_mode(mode, big, a, net, root / "big", plan)
            big_fig[mode] = {**mode_figures(peers), **({"error": summary["error"]} if "error" in summary else {})}
        plan = make_plan(small, a, link, None)
        for mode in small_modes:
            summary, _ = run_mode(mode, small, a, net, root / "small", plan)
            small_sum[mode] = summary
    curves = {m: s.get("loss_curve") for m, s in small_sum.items()}
    result = {"bench": "wan", "n": a.n,
              **wan_figures(params=params, link_mbit=link, planned_ratio=planned, big=big_fig, small=small_sum,
                            curves=curves, target=small.target if small_modes else None),
              "link_mbit_source": "--link-mbit" if a.link_mbit else f"chosen for --ratio {a.ratio:g}",
              "calibration": {"step_s_one_process": round(cal["step_s"], 3), "peers_per_core": per_core,
                              "round_compute_s_planned": round(round_s, 3)},
              "big": {"model": big.model, "model_options": big.model_options or None, "batch": big.batch,
                      "tokens_per_step": big.batch * big.block(), "inner_steps": big.inner_steps,
                      "rounds": a.big_rounds, "allreduce_steps": big.allreduce_steps, "modes": big_fig},
              "small": {"model": small.model, "model_options": small.model_options or None, "batch": small.batch,
                        "tokens_per_step": small.batch * small.block(), "inner_steps": small.inner_steps,
                        "target_test_loss": small.target,
                        "modes": {m: {k: v for k, v in s.items() if k not in ("trials", "loss_curve")}
                                  for m, s in small_sum.items()}},
              "notes": [
                  "outer step: a step for allreduce and adpsgd (one exchange each), a round of inner_steps steps "
                  "for local modes; figures are medians over peers, per_peer beside",
                  "utilization: compute seconds (forward, backward, the inner optimizer's update) / the trainer's "
                  "wall seconds in its loop less its held-out evaluations (the big model evaluates once, at the "
                  "last step, on one window); peers share this machine's cores, so compute is as slow as the "
                  "sharing makes it, and a peer that starts before the others steps faster until they do",
                  "bytes_per_outer_step: eth0 tx bytes of each peer's namespace from its training start until the "
                  "bench saw all trainers done (an exchange still in flight at the end counts as far as it got) "
                  "over its outer steps; all-reduce: its training loop's",
                  "exchange_to_compute_ratio: a float32 copy of the big model through the link over the local "
                  "run's measured compute per round; _planned: over the calibrated step x peers per core x H",
                  "no latency added: tbf only (this kernel has no netem); at these sizes a copy takes tens of "
                  "seconds, so bandwidth alone binds",
                  "loss_vs_tokens: the small model, [tokens the swarm trained on, mean held-out loss of its peers]",
              ],
              "loadavg_before": load_before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
              "cpus": os.cpu_count(), "bench_wall_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(result) if a.json else json.dumps(result, indent=2))
    errors = [m for m, f in big_fig.items() if "error" in f] + [m for m, s in small_sum.items() if "error" in s]
    if errors:
        print(f"peer bench wan: runs failed: {errors}", file=sys.stderr)
    return 1 if errors else 0

"""`peer bench pipeline --codec raw,float16,q8`: what each wire codec costs in validation loss and saves in bytes.

For each codec (activations and gradients alike) a fresh swarm of 4 daemons, one per stage (rank r serves
stage r; rebalancing off), trains the same model from the same seed on the same data: the first `--drivers`
daemons each drive `--samples` samples, then every driver's `evaluate` gives the validation loss through the
pipeline (the codec applies there too). The model has as many blocks as stages (embedding, STAGES - 2 transformer blocks,
head), so every run has the one possible cut. With one driver and one microbatch in flight (the defaults)
nothing depends on timing: the microbatches reach each stage in one order and every optimizer step sums the
same gradients, so two raw runs give the same loss and a codec's gap to raw is the codec's alone. More
drivers or more in flight make the steps timing-dependent, and the gap then holds run-to-run noise too.

Bytes per microbatch are measured as the plain run measures them: every daemon's encrypted session bytes out
(calls, replies, control) over the microbatches the drivers finished, while they drove.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from peer.bench.cpu_caps import CapSupport, CpuCaps
from peer.bench.hosts import netns_refused, run_root
from peer.bench.pipeline import POLL_S, START_TIMEOUT_S, STAGES, TINY, Model, Poller, daemon_config
from peer.bench.pipeline_figures import CODECS, Poll, bytes_per_microbatch, driver_of, session_bytes_out
from peer.testing.netns import virtual_lan
from peer.testing.swarm import LocalSwarm, rank_env, unique_swarm

# One block per stage, so the cut is the same in every run; no dropout, so a run depends only on its codec.
CODEC_MODEL = replace(Model(), n_layers=STAGES - 2, dropout=0.0)  # the plain run's activations (8 x 64 x 256)
TINY_CODEC = replace(TINY, n_layers=STAGES - 2, dropout=0.0, lr=3e-3)  # --tiny: plumbing checks
EVAL_BATCHES = 16  # validation microbatches (x8 samples): the trainer's default 4 is 32 sequences, too few to compare
RUN_TIMEOUT_S = 900.0  # most seconds one codec's run may drive after start-up (~60 s at the defaults on 2 CPUs)
EVAL_TIMEOUT_S = 120.0  # most seconds a driver's final validation pass may take when asked


@dataclass(frozen=True)
class CodecRun:
    """One codec's figures."""

    codec: str
    val_loss: float | None  # mean over the drivers of their final `evaluate`
    val_loss_by_driver: list[float | None]
    train_loss: float | None  # mean over the drivers of their last 20 microbatches' losses
    bytes_per_microbatch: int | None  # measured: every daemon's session bytes out / microbatches done
    samples_per_s: float | None  # the drivers' own: samples over the seconds from their first microbatch to the last
    done: int
    failed: int
    samples: int
    cuts: list[int] | None
    startup_s: float
    drive_s: float


def codecs_of(text: str) -> list[str]:
    """The codecs `--codec` names, raw first (the reference every gap is measured from: added if not named)."""
    named = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in named if c not in CODECS]
    if bad or not named:
        raise ValueError(f"--codec: expected a comma list of {', '.join(CODECS)}, got {text!r}")
    return ["raw"] + [c for c in dict.fromkeys(named) if c != "raw"]


def recommend(runs: dict[str, dict], tolerance: float) -> str:
    """The codec with the fewest bytes per microbatch whose loss is within `tolerance` (relative) of raw's."""
    ok = [c for c, r in runs.items() if c == "raw" or (r["loss_gap_relative"] is not None
                                                        and r["loss_gap_relative"] <= tolerance)]
    return min(ok, key=lambda c: (runs[c]["bytes_per_microbatch"] or math.inf, c != "raw"))


def trainer_of(st: dict | None) -> dict:
    return (st or {}).get("trainer") or {}


def _failed(p: Poll) -> str | None:
    for i, st in enumerate(p.statuses):
        state = str(trainer_of(st).get("state") or "")
        if state.startswith("failed"):
            return f"daemon {i}'s trainer {state}"
    return None


def wait_polls(poller: Poller, drivers: list[int], done, until: float, what: str) -> Poll:
    """Poll every POLL_S until `done(poll)`; a trainer failing or `until` (bench clock) passing ends the run."""
    while True:
        t = poller.now()
        p = poller.poll()
        if why := _failed(p):
            raise RuntimeError(why)
        if all(p.statuses[i] is not None for i in drivers) and done(p):
            return p
        if poller.now() > until:
            seen = [(driver_of(st).get("done"), trainer_of(st).get("state")) for st in p.statuses]
            raise TimeoutError(f"{what} within {until:.0f}s: (microbatches done, trainer state) by daemon {seen}")
        time.sleep(max(0.0, POLL_S - (poller.now() - t)))


def one_run(a, codec: str, model: Model, root: Path, netns: bool, caps_support: CapSupport | None) -> CodecRun:
    """A fresh swarm trained with `codec` both ways until every driver has driven its samples (its daemons
    capped at --cpus / STAGES each where `caps_support` is given)."""
    drivers = list(range(a.drivers))
    options = {**asdict(model), "stages": STAGES, "samples": a.samples, "in_flight": a.in_flight,
               "forward_codec": codec, "backward_codec": codec, "seed": a.seed, "eval_batches": EVAL_BATCHES,
               "rebalance": False}
    with ExitStack() as stack:
        lan = stack.enter_context(virtual_lan(STAGES, prefix="ptc", subnet="10.77.18")) if netns else None
        caps = stack.enter_context(CpuCaps(STAGES, a.cpus / STAGES, caps_support)) if caps_support else None
        swarm = stack.enter_context(LocalSwarm(root / codec))
        name = unique_swarm("bc")
        t_launch = time.monotonic()
        for i in range(STAGES):
            opts = dict(options, role="auto" if i in drivers else "server")
            d = swarm.start(f"p{i}", config=daemon_config(name, i, lan, opts), host=lan.hosts[i] if lan else None,
                            env={**rank_env(i, STAGES), "OMP_NUM_THREADS": "1"})
            if caps is not None:
                caps.add(i, d.pid)
        poller = Poller(swarm, t_launch)
        stack.callback(poller.close)
        going = wait_polls(poller, drivers, lambda p: all(driver_of(p.statuses[i]).get("done", 0) > 0 for i in drivers),
                      START_TIMEOUT_S, "not every driver finished a microbatch")
        finished = wait_polls(poller, drivers, lambda p: all(trainer_of(p.statuses[i]).get("driving_done") for i in drivers),
                         going.t + RUN_TIMEOUT_S, f"not every driver drove {a.samples} samples")
        # the window: from every driver going to the last poll before a validation microbatch (a driver's pass
        # once it has driven its samples: forward only, so it would lower the bytes per microbatch)
        driving = [p for p in poller.polls if p.t >= going.t and None not in p.statuses
                   and not any(driver_of(p.statuses[i]).get("evaluated", 0) for i in drivers)]
        last = driving[-1] if driving else going
        mb = [sum(driver_of(p.statuses[i]).get("done", 0) for i in drivers) for p in (going, last)]
        by = [sum(session_bytes_out(st) or 0 for st in p.statuses) for p in (going, last)]
        vals = [final_val_loss(swarm.daemons[i]) for i in drivers]
        trs = [trainer_of(finished.statuses[i]) for i in drivers]
        train = [t["loss"] for t in trs if t.get("loss") is not None]
        return CodecRun(
            codec=codec,
            val_loss=sum(vals) / len(vals) if vals and None not in vals else None,
            val_loss_by_driver=vals,
            train_loss=sum(train) / len(train) if train else None,
            bytes_per_microbatch=round((by[1] - by[0]) / (mb[1] - mb[0])) if mb[1] > mb[0] else None,
            samples_per_s=_r(sum(t.get("samples_per_s", 0) for t in trs)),
            done=sum(t.get("microbatches_done", 0) for t in trs),
            failed=sum(t.get("microbatches_failed", 0) for t in trs),
            samples=sum(t.get("samples", 0) for t in trs),
            cuts=(finished.statuses[0].get("pipeline") or {}).get("cuts"),
            startup_s=round(going.t, 1), drive_s=round(finished.t - going.t, 1))


def final_val_loss(daemon) -> float | None:
    got = daemon.command("evaluate", timeout=EVAL_TIMEOUT_S)
    v = got.get("val_loss") if isinstance(got, dict) else None
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def figures(runs: list[CodecRun], tolerance: float) -> dict:
    """Per codec its figures and gaps to raw's; the loss and byte ratios; the recommendation."""
    raw = runs[0]
    out: dict[str, dict] = {}
    for r in runs:
        gap = None if r.val_loss is None or raw.val_loss is None else r.val_loss - raw.val_loss
        out[r.codec] = {**asdict(r), "loss_gap": _sig(gap),
                        "loss_gap_relative": None if gap is None or not raw.val_loss else _sig(gap / raw.val_loss),
                        "bytes_ratio": (_r(r.bytes_per_microbatch / raw.bytes_per_microbatch, 3)
                                        if r.bytes_per_microbatch and raw.bytes_per_microbatch else None)}
        del out[r.codec]["codec"]
    top = {"codecs": out}
    for c in CODECS[1:]:
        top[f"loss_gap_{c}"] = out[c]["loss_gap_relative"] if c in out else None
        top[f"bytes_ratio_{c}"] = out[c]["bytes_ratio"] if c in out else None
    top["tolerance_relative"] = tolerance
    top["recommended"] = recommend(out, tolerance)
    top["same_cut"] = len({tuple(r.cuts or ()) for r in runs}) == 1
    return top


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _sig(x: float | None, digits: int = 3) -> float | None:
    """`x` to `digits` significant digits: a codec's gap may be a millionth of the loss."""
    return None if x is None else float(f"{x:.{digits}g}")


def run(a) -> int:
    try:
        codecs = codecs_of(a.codec)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if a.samples < 1 or not 1 <= a.drivers <= STAGES or a.in_flight < 1 or a.cpus <= 0 or not a.tolerance >= 0:
        print(f"--samples and --in-flight must be at least 1, --drivers in [1, {STAGES}], --cpus positive, "
              "--tolerance at least 0",
              file=sys.stderr)
        return 2
    netns = not a.no_netns
    if netns_refused(netns):
        return 2
    model = TINY_CODEC if a.tiny else CODEC_MODEL
    support = CpuCaps.probe()
    use_caps = support.mechanism is not None and not a.no_caps
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    runs = []
    with ExitStack() as stack:
        root = run_root(stack, a.logs, "peertrain-codecs-")
        for codec in codecs:
            runs.append(one_run(a, codec, model, root, netns, support if use_caps else None))
            print(f"{codec}: val loss {runs[-1].val_loss}, {runs[-1].bytes_per_microbatch} bytes per microbatch",
                  file=sys.stderr)
    act = [model.microbatch, model.block, model.d_model]
    tokens = model.microbatch * model.block * 8  # int64 token ids
    out = {
        **figures(runs, a.tolerance),
        "bytes_per_microbatch_computed": bytes_per_microbatch(act, STAGES, "raw", "raw", tokens, tokens)["via_driver"],
        "config": {"stages": STAGES, "daemons": STAGES, "drivers": a.drivers, "samples_per_driver": a.samples,
                   "in_flight_per_driver": a.in_flight, "seed": a.seed, "eval_batches": EVAL_BATCHES,
                   "netns": netns, "cpu_cap_each": round(a.cpus / STAGES, 3) if use_caps else None,
                   "cpu_cap_note": ("off (--no-caps)" if a.no_caps else support.reason) if use_caps or a.no_caps
                   else f"UNCAPPED: {support.reason}",
                   "model": {"name": "built-in char transformer (Shakespeare)", **asdict(model)}},
        "load_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out) if a.json else json.dumps(out, indent=2))
    ok = all(r.val_loss is not None and r.failed == 0 for r in runs)
    return 0 if ok else 1

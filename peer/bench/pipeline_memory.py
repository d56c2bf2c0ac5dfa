"""`peer bench pipeline --memory`: a stage's peak memory against a plain torch loop over the same blocks.

Two fresh processes run `trainers/pipeline/memory_probe.py` over the same stage (by default blocks [1, 5) of
`trainers.pipeline.wide:issue_stage`: four 4096² residual blocks, 67 M parameters, the stage issue 39 names),
the same optimizer and microbatch: one as a plain torch loop, one as a `StageWorker` served as the daemon serves
it (2 microbatches in flight, their acks after, every 5th call dropped as a driver's check would be), in a room
of just its plan (`memory_vs_torch`) and with room to spare, where it keeps gradient copies rather than recompute
(`memory_vs_torch_spare_room`). Reported: each one's VmHWM, the ratios (whole processes), the plan's estimate and
`estimate_over_measured` (the estimate ÷ the stage's peak above its baseline: at least 1 means the plan does not
under-count). The plain run (`peer bench pipeline`) reports the same figures under `memory`.
"""

from __future__ import annotations

import json
import time

from peer.testing.process import module_json

MODEL = "trainers.pipeline.wide:issue_stage"
DATA = "trainers.pipeline.wide:digits"
LO, HI = 1, 5  # the four 4096² blocks between the input layer and the head
PROBE_TIMEOUT_S = 600.0  # 16 microbatches of a 67 M-parameter stage: ~15 s here; a slow CI machine gets room


def probe(mode: str, optimizer: str, max_held: int = 0) -> dict:
    return module_json("trainers.pipeline.memory_probe",
                       ["--mode", mode, "--model", MODEL, "--data", DATA, "--lo", str(LO), "--hi", str(HI),
                        "--optimizer", optimizer, "--max-held", str(max_held)],
                       timeout=PROBE_TIMEOUT_S, what=f"the memory probe ({mode}, {optimizer})")


def figures(optimizer: str = "adam") -> dict:
    """Both probes, one after the other, and their ratios."""
    torch_run, stage_run, spare = probe("torch", optimizer), probe("stage", optimizer), probe("stage", optimizer, -1)
    return {"memory_vs_torch": round(stage_run["hwm_mib"] / torch_run["hwm_mib"], 3),
            "memory_vs_torch_spare_room": round(spare["hwm_mib"] / torch_run["hwm_mib"], 3),
            "estimate_over_measured": round(stage_run["estimate_mib"] / stage_run["above_baseline_mib"], 3),
            "stage_hwm_mib": stage_run["hwm_mib"], "torch_hwm_mib": torch_run["hwm_mib"],
            "stage_spare_room_hwm_mib": spare["hwm_mib"],
            "stage_above_baseline_mib": stage_run["above_baseline_mib"],
            "torch_above_baseline_mib": torch_run["above_baseline_mib"],
            "estimate_mib": stage_run["estimate_mib"], "params_mib": stage_run["params_mib"],
            "optimizer": optimizer, "model": MODEL, "blocks": [LO, HI]}


def run(args) -> int:
    t0 = time.monotonic()
    out = {"adam": figures("adam"), "sgd": figures("sgd")}
    out["memory_vs_torch"] = max(f["memory_vs_torch"] for f in (out["adam"], out["sgd"]))
    out["goals"] = {"memory_vs_torch_at_most_1.15": out["memory_vs_torch"] <= 1.15,
                    "estimate_not_below_measured": all(out[o]["estimate_over_measured"] >= 1 for o in ("adam", "sgd"))}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0

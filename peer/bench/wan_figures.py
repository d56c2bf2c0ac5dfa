"""The figures of `peer bench wan` (issue 41), computed from runs already read, without processes.

Per mode and per peer: bytes per outer step, wall seconds per outer step, compute utilization (compute seconds ÷
wall seconds) from the big model's short runs, and held-out loss against tokens from the small model's runs. An
"outer step" is what each mode exchanges once per: a step for the all-reduce and AD-PSGD, a round of H inner steps
for local steps. The link rate is chosen so that one float32 exchange of the big model takes `ratio` times the
compute of one outer round, and `h100_mapping` says what that ratio stands for on an H100 behind 100 Mbit/s.
"""

from __future__ import annotations

import statistics
from typing import Any

SPARSE_MODE = "local_sparse"  # issue 41 item 3: top-k, 2-bit values, error feedback; every update to everyone
GOSSIP_MODES = ("adpsgd", "local", "local_q8", SPARSE_MODE)
WAN_MODES = ("allreduce", *GOSSIP_MODES)
FP32_BYTES = 4  # a float32 parameter on the wire (codec raw)
# The H100 the ratio maps to: dense bf16 peak of the SXM part, at a utilization typical of LM training
H100_FLOPS = 989e12
H100_MFU = 0.4
H100_LINK_MBIT = 100.0
FLOPS_PER_PARAM_TOKEN = 6  # forward and backward of a decoder: ~6 FLOPs per parameter per token
# The goals, checked on what was measured (None where the figure needs what is not built)
GOAL_PARAMS = 1e8
GOAL_BYTES_RATIO = 100.0
GOAL_UTILIZATION = 0.9
GOAL_LOSS_GAP = 0.02
GOAL_TIME_TO_TARGET = 0.2


def exchange_s(params: int, mbit: float) -> float:
    """Seconds for one float32 copy of the model through a link of `mbit` Mbit/s."""
    return params * FP32_BYTES * 8 / (mbit * 1e6)


def choose_link_mbit(params: int, round_compute_s: float, ratio: float) -> float:
    """The link rate at which one float32 exchange takes `ratio` times one outer round's compute."""
    if round_compute_s <= 0 or ratio <= 0:
        raise ValueError("round_compute_s and ratio must be positive")
    return round(params * FP32_BYTES * 8 / (ratio * round_compute_s) / 1e6, 1)


def h100_mapping(params: int, ratio: float) -> dict:
    """What the same exchange-to-compute ratio means for one H100 on a 100 Mbit/s link: the seconds and tokens of
    compute per outer round that make a float32 exchange of this model `ratio` times as long."""
    ex = exchange_s(params, H100_LINK_MBIT)
    round_s = ex / ratio if ratio else None
    tokens = round_s * H100_FLOPS * H100_MFU / (FLOPS_PER_PARAM_TOKEN * params) if round_s else None
    return {"link_mbit": H100_LINK_MBIT, "fp32_exchange_s": round(ex, 1),
            "round_compute_s": round(round_s, 2) if round_s else None,
            "tokens_per_round": round(tokens) if tokens else None,
            "assumes": f"{H100_FLOPS / 1e12:g} TFLOP/s bf16 at {H100_MFU:g} MFU, {FLOPS_PER_PARAM_TOKEN} FLOPs per "
                       "parameter per token: an H100 round of fewer tokens is more link-bound than this bench"}


def _med(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return round(x, nd) if x is not None else None


def per_peer_gossip(mode: str, raw: dict) -> list[dict]:
    """A gossip run (train_gossip.run_gossip's dict) per peer: outer steps are rounds (local modes) or steps
    (AD-PSGD), timed to the trainer's last in-loop line (its final checkpoint is no step), less its held-out
    evaluations (the run's last step evaluates; no outer step waits for it on a real deployment's schedule)."""
    tx = raw.get("netdev_tx_bytes_training") or [None] * len(raw["peers"])
    out: list[dict[str, Any]] = []
    for p, sent in zip(raw["peers"], tx):
        if not p.get("started"):
            out.append({"outer_steps": None})
            continue
        outer = p.get("rounds") if mode != "adpsgd" else p.get("loop_step")
        wall, compute = p.get("loop_elapsed_s"), p.get("compute_s")
        wall = wall - (p.get("eval_s") or 0.0) if wall is not None else None
        out.append({
            "steps": p.get("loop_step"), "outer_steps": outer, "rounds_skipped": p.get("rounds_skipped"),
            "wall_s": _r(wall), "compute_s": compute, "bytes_sent": sent,
            "bytes_per_outer_step": round(sent / outer) if sent is not None and outer else None,
            "wall_per_outer_step": _r(wall / outer) if wall and outer else None,
            "compute_per_outer_step": _r(compute / outer) if compute is not None and outer else None,
            "utilization": _r(compute / wall) if compute is not None and wall else None,
        })
    return out


def per_peer_allreduce(raw: dict) -> list[dict]:
    """The all-reduce job's ranks (trainers.allreduce_baseline's JSON): every step is an outer step; wall seconds
    are less the evaluations (rank 0 evaluates, the others wait for its verdict)."""
    steps = raw.get("steps") or 0
    evals = raw.get("eval_s_per_worker") or [0.0] * len(raw.get("elapsed_s_per_worker") or [])
    walls = [w - e for w, e in zip(raw.get("elapsed_s_per_worker") or [], evals)]  # less rank 0's evaluations
    computes = raw.get("compute_s_per_worker") or []
    sent = raw.get("bytes_sent_per_worker_each") or [None] * len(walls)
    return [{"steps": steps, "outer_steps": steps, "wall_s": _r(w), "compute_s": c, "bytes_sent": b,
             "bytes_per_outer_step": round(b / steps) if b is not None and steps else None,
             "wall_per_outer_step": _r(w / steps) if steps else None,
             "compute_per_outer_step": _r(c / steps) if steps else None,
             "utilization": _r(c / w) if w else None}
            for w, c, b in zip(walls, computes, sent)]


def mode_figures(peers: list[dict]) -> dict:
    """A mode's figures: the median over its peers (each peer's own list beside)."""
    return {"bytes_per_outer_step": _med([p.get("bytes_per_outer_step") for p in peers]),
            "wall_per_outer_step": _r(_med([p.get("wall_per_outer_step") for p in peers])),
            "compute_per_outer_step": _r(_med([p.get("compute_per_outer_step") for p in peers])),
            "utilization": _r(_med([p.get("utilization") for p in peers])),
            "per_peer": peers}


def loss_vs_tokens(curves: list[list[list[float]]], tokens_per_step: int) -> list[list[float]]:
    """[[tokens, held-out loss], ...]: the peers' mean loss at each step all of them evaluated at, against the
    tokens the whole swarm had trained on by then (each peer's steps x tokens per step x peers)."""
    if not curves:
        return []
    by_step = [dict((int(s), loss) for s, loss in c) for c in curves]
    common = sorted(set.intersection(*(set(d) for d in by_step)))
    n = len(curves)
    return [[s * tokens_per_step * n, round(statistics.mean(d[s] for d in by_step), 4)] for s in common]


def _ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x and y else None


def loss_gap(curve: list | None, reference: list | None) -> float | None:
    """`curve`'s held-out loss ÷ `reference`'s at the most tokens both reached (loss_vs_tokens points), minus 1."""
    if not curve or not reference:
        return None
    ours, theirs = dict((t, v) for t, v in curve), dict((t, v) for t, v in reference)
    common = sorted(set(ours) & set(theirs))
    return round(ours[common[-1]] / theirs[common[-1]] - 1.0, 4) if common else None


def wan_figures(*, params: int | None, link_mbit: float, planned_ratio: float, big: dict[str, dict],
                small: dict[str, dict], curves: dict[str, list | None], target: float | None) -> dict:
    """The top-level keys of `peer bench wan`: `big` holds each mode's mode_figures from the big model, `small`
    each mode's time-to-target summary from the small model, `curves` each mode's loss_vs_tokens."""
    local = big.get("local") or {}
    round_compute = local.get("compute_per_outer_step")
    ratio = _r(exchange_s(params, link_mbit) / round_compute, 2) if params and round_compute else None
    modes: dict[str, Any] = {}
    for m in WAN_MODES:
        f = big.get(m) or {}
        modes[m] = {"bytes_per_outer_step": f.get("bytes_per_outer_step"),
                    "wall_per_outer_step": f.get("wall_per_outer_step"), "utilization": f.get("utilization"),
                    "loss_vs_tokens": curves.get(m) or None}
    q8 = _ratio(local.get("bytes_per_outer_step"), (big.get("local_q8") or {}).get("bytes_per_outer_step"))
    sparse_bytes = (big.get(SPARSE_MODE) or {}).get("bytes_per_outer_step")
    sparse = _ratio(local.get("bytes_per_outer_step"), sparse_bytes)
    gap = loss_gap(curves.get(SPARSE_MODE), curves.get("local"))
    sparse_util = modes[SPARSE_MODE]["utilization"]
    t_local = (small.get("local") or {}).get("seconds_to_target")
    t_ar = (small.get("allreduce") or {}).get("seconds_to_target")
    out: dict[str, Any] = {
        "params": params, "link_mbit": link_mbit,
        "exchange_to_compute_ratio": ratio, "exchange_to_compute_ratio_planned": planned_ratio,
        "h100": h100_mapping(params, ratio or planned_ratio) if params else None,
        "modes": modes,
        "bytes_ratio_vs_fp32": {"local_q8": q8, SPARSE_MODE: sparse},
        # the same against one float32 copy of the model a round, which float32 local steps would send if the
        # link let every round's exchange through (here it skips most: its bytes per round are the link's)
        "bytes_ratio_vs_fp32_copy": {SPARSE_MODE: _ratio(params * FP32_BYTES if params else None, sparse_bytes)},
        "utilization": {m: (modes[m] or {}).get("utilization") for m in WAN_MODES},
        "loss_gap": gap,
        "time_to_target_vs_allreduce": _ratio(t_local, t_ar),
        "time_to_target_vs_allreduce_sparse": _ratio((small.get(SPARSE_MODE) or {}).get("seconds_to_target"), t_ar),
        "target_test_loss": target,
    }
    out["goals"] = [
        {"goal": "params >= 1e8", "value": params, "met": params >= GOAL_PARAMS if params else None},
        {"goal": "bytes_ratio_vs_fp32 >= 100 (sparse)", "value": sparse,
         "met": sparse >= GOAL_BYTES_RATIO if sparse is not None else None},
        {"goal": "utilization >= 0.9 with sparse and overlap", "value": sparse_util,
         "met": sparse_util >= GOAL_UTILIZATION if sparse_util is not None else None},
        {"goal": "loss_gap <= 0.02 (sparse vs local fp32, small model)", "value": gap,
         "met": gap <= GOAL_LOSS_GAP if gap is not None else None},
    ]
    for key, says in (("time_to_target_vs_allreduce", ""), ("time_to_target_vs_allreduce_sparse", ", sparse")):
        out["goals"].append({"goal": f"{key} <= 0.2 (small model{says})", "value": out[key],
                             "met": out[key] <= GOAL_TIME_TO_TARGET if out[key] is not None else None})
    return out

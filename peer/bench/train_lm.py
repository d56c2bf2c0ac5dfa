"""The figures of `peer bench train --model char_transformer` (issue 20): local steps against an exchange every step.

Time to a held-out loss for `local` (H local steps, then a DiLoCo outer step; outer weights gossiped pairwise),
AD-PSGD and the gloo all-reduce, usually with every host's link limited (`--link-mbit`); and the bytes the local
mode sends to the same loss with 8-bit outer exchanges and error feedback (`local_q8`) against float32 (`local`).
`profile` says where each mode's time goes: seconds per step against the all-reduce's link time per step.
"""

from __future__ import annotations

import statistics

# The goals of issue 20 (reported with whether they were met; at 20 Mbit/s per host, 4 hosts)
GOAL_LOCAL_TO_ALLREDUCE = 0.2  # local's time to the loss <= 0.2x all-reduce's
GOAL_LOCAL_TO_ADPSGD = 0.5  # ... and <= 0.5x AD-PSGD's
GOAL_BYTES_Q8 = 0.3  # 8-bit outer exchanges send <= 0.3x the bytes of float32 ones to the same loss


def _ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 3) if x and y else None


def lm_figures(modes: dict, plan, a) -> dict:
    """The ratios, goals, profile and notes of one invocation (modes: summarised runs by mode)."""
    def get(mode: str, key: str):
        return (modes.get(mode) or {}).get(key)

    def sent(run: dict) -> float | None:  # in the training window where measured (namespaces), else all of it
        return run.get("bytes_sent_training_per_peer") or run.get("bytes_sent_per_peer")

    def reached_bytes(mode: str) -> float | None:  # bytes to the loss: only a run that reached it
        return sent(modes[mode]) if get(mode, "reached_target") else None

    batch = plan.options.get("batch_size")
    out: dict = {
        "ratio_local_to_allreduce": _ratio(get("local", "seconds_to_target"), get("allreduce", "seconds_to_target")),
        "ratio_local_to_adpsgd": _ratio(get("local", "seconds_to_target"), get("adpsgd", "seconds_to_target")),
        "bytes_ratio_q8_to_float32": _ratio(reached_bytes("local_q8"), reached_bytes("local")),
        "bytes_per_peer_to_target": {m: reached_bytes(m) for m in modes},
        "bytes_ratio_q8_to_float32_after_joins": (
            _ratio(get("local_q8", "bytes_sent_after_joins_per_peer"), get("local", "bytes_sent_after_joins_per_peer"))
            if reached_bytes("local_q8") and reached_bytes("local") else None),
        "local": {"inner_steps": plan.inner_steps, "eval_every": plan.local_eval_every,
                  "outer": "Nesterov SGD, lr 0.7, momentum 0.9 (gossip_sgd's defaults, DiLoCo's); outer weights "
                           "averaged pairwise with a random neighbour in the background"},
    }

    def per_exchange(mode: str) -> float | None:  # bytes per exchange a peer took part in (median over runs)
        runs = get(mode, "trials") or ([modes[mode]] if mode in modes else [])
        each = [r["bytes_sent_after_joins_per_peer"] / (sum(r["exchanges_per_peer"]) / len(r["exchanges_per_peer"]))
                for r in runs if r.get("bytes_sent_after_joins_per_peer") and all(r.get("exchanges_per_peer") or [0])]
        return statistics.median(each) if each and len(each) == len(runs) else None

    out["bytes_per_exchange_q8_to_float32"] = _ratio(per_exchange("local_q8"), per_exchange("local"))

    def per_trial(num: str, den: str, value) -> list | None:  # with --repeats: each interleaved pair's ratio
        pairs = zip(get(num, "trials") or [], get(den, "trials") or [])
        ratios = [_ratio(value(x), value(y)) if x.get("reached_target") and y.get("reached_target") else None
                  for x, y in pairs]
        return ratios or None

    if plan.repeats > 1:
        seconds = lambda r: r.get("seconds_to_target")  # noqa: E731
        out["trials_ratio_local_to_allreduce"] = per_trial("local", "allreduce", seconds)
        out["trials_ratio_local_to_adpsgd"] = per_trial("local", "adpsgd", seconds)
        out["trials_bytes_ratio_q8_to_float32"] = per_trial("local_q8", "local", sent)
    goals = [("local time-to-loss <= 0.2x all-reduce's", out["ratio_local_to_allreduce"], GOAL_LOCAL_TO_ALLREDUCE),
             ("local time-to-loss <= 0.5x AD-PSGD's", out["ratio_local_to_adpsgd"], GOAL_LOCAL_TO_ADPSGD),
             ("8-bit outer exchanges: bytes per peer to the loss <= 0.3x float32's", out["bytes_ratio_q8_to_float32"],
              GOAL_BYTES_Q8)]
    out["goals"] = [{"goal": g, "value": v, "met": (v <= limit) if v is not None else None} for g, v, limit in goals]
    profile = {}
    for mode in modes:
        sps = get(mode, "samples_per_s_per_peer")
        profile[f"{mode}_s_per_step"] = round(batch / sps, 4) if sps and batch else None
    grad = get("allreduce", "bytes_sent_estimate_ring")
    steps = get("allreduce", "steps_to_target")
    rate = a.link_mbit or None
    if grad and steps and rate:
        # the ring all-reduce's bytes per step through a link of `rate`: the time no computing can hide
        profile["allreduce_link_s_per_step"] = round(grad / steps * 8 / (rate * 1e6), 4)
    out["profile"] = profile
    out["notes"] = [
        f"target: held-out loss (cross-entropy per character) <= {plan.target} on the first "
        f"{plan.options.get('eval_samples')} held-out windows, for every peer's own model (all-reduce: rank 0's)",
        f"local modes evaluate every {plan.local_eval_every} steps (at round ends: the outer weights), the others "
        f"every {plan.eval_every}",
        "bytes_per_peer_to_target and bytes ratios: eth0 tx bytes of each peer's namespace in its training window, "
        "from its training start (seen within 0.25 s) until the bench saw every peer reach the loss (heartbeats "
        "and records included; all-reduce: its training loop); bytes_sent_per_peer of our modes also counts "
        "discovery, from daemon start; _after_joins: from when every peer trained, so without the float32 state "
        "(model and outer momentum, ~0.9 MB) a peer that started late downloaded from one already training; "
        "bytes_per_exchange_: those bytes over the exchanges a peer took part in (a faster exchange is skipped "
        "less, so 8-bit peers exchange more often to the same loss)",
        "no latency is added to the links: tbf only (this kernel has no netem qdisc)",
        f"ratios are of the medians of {plan.repeats} interleaved runs per mode; trials_*: each run's own",
        "profile: seconds per step = batch / samples per second, each mode's own average over its run (evaluation "
        "included); allreduce_link_s_per_step: the ring all-reduce's bytes per step over the link's rate",
    ]
    return out

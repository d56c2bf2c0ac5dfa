"""The figures of `peer bench pipeline --uneven/--churn`: pure functions of measured speeds and polled statuses.

Speeds. A peer's speed factor is v_p = (its measured samples/s on its stage) x (that stage's planned seconds per
microbatch, as a share of the whole model's): how much of the model it gets through per second. On stage s it
would then run v_p / planned[s] samples/s, and an assignment of peers to stages runs as fast as its slowest
stage: min over s of the sum of its peers' rates (`predicted`). `best_assignment` tries every assignment with
no empty stage (4^6 = 4096 for 6 peers and 4 stages) and keeps the fastest.

Counting across restarts. A restarted daemon's driver counts from 0 again, and a dead one answers nothing, so
throughput over a churn phase is read from `cumulative`: per daemon, its counter plus what its earlier
incarnations (told apart by the status's pid) had counted when last seen; a daemon that does not answer
counts what it had.
"""

from __future__ import annotations

import itertools
import statistics

from peer.bench.pipeline_figures import Poll, driver_of

RECOVERED = 0.9  # an event is recovered from when windowed throughput is back to 90% of the level before it


# ---- speeds and assignments ---------------------------------------------------------------------------------
def shares(plan_ms: list[float]) -> list[float]:
    """Planned seconds per stage as shares of the whole (only ratios of stage costs matter)."""
    tot = sum(plan_ms)
    if tot <= 0 or any(x <= 0 for x in plan_ms):
        raise ValueError(f"planned stage times must be positive, got {plan_ms}")
    return [x / tot for x in plan_ms]


def speed_factors(samples_per_s: list[float], stage_of: list[int], plan: list[float]) -> list[float]:
    """v_p = samples/s of peer p on its stage x that stage's planned share of the model."""
    return [r * plan[s] for r, s in zip(samples_per_s, stage_of)]


def stage_rates(assignment: tuple[int, ...] | list[int], speeds: list[float], plan: list[float]) -> list[float]:
    """Predicted samples/s of each stage: the sum of its peers' v_p / planned[s]."""
    out = [0.0] * len(plan)
    for p, s in enumerate(assignment):
        out[s] += speeds[p] / plan[s]
    return out


def predicted(assignment: tuple[int, ...] | list[int], speeds: list[float], plan: list[float]) -> float:
    """Predicted samples/s of the pipeline: its slowest stage (0 if a stage has no peer)."""
    return min(stage_rates(assignment, speeds, plan))


def moved(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """How many peers serve another stage in `b` than in `a`."""
    return sum(x != y for x, y in zip(a, b))


def best_assignment(speeds: list[float], plan: list[float],
                    start: tuple[int, ...] | list[int] | None = None) -> tuple[tuple[int, ...], float]:
    """(the fastest assignment of the peers to the stages with every stage served, its predicted samples/s), by
    brute force. Ties (within 1e-9) go to the fewest peers moved from `start`, then to the first in order."""
    stages, n = len(plan), len(speeds)
    if n < stages:
        raise ValueError(f"{n} peers cannot serve {stages} stages")
    best: tuple[int, ...] | None = None
    best_key: tuple[float, int] | None = None
    for a in itertools.product(range(stages), repeat=n):
        if len(set(a)) < stages:
            continue
        thr = predicted(a, speeds, plan)
        key = (thr, -(moved(start, a) if start is not None else 0))
        if best_key is None or key[0] > best_key[0] + 1e-9 or (abs(key[0] - best_key[0]) <= 1e-9 and key[1] > best_key[1]):
            best, best_key = a, key
    assert best is not None and best_key is not None
    return best, best_key[0]


def round_robin(n: int, stages: int) -> tuple[int, ...]:
    """Peer i on stage i mod stages: the layout a static config written without speeds in mind gives."""
    return tuple(i % stages for i in range(n))


def cpu_caps_from_shares(weights: list[float], total: float) -> list[float]:
    """Per-daemon CPUs: `weights` scaled so they add up to `total`."""
    tot = sum(weights)
    if tot <= 0 or any(w <= 0 for w in weights):
        raise ValueError(f"CPU shares must be positive, got {weights}")
    return [round(total * w / tot, 4) for w in weights]


def fraction(x: float | None, best: float | None) -> float | None:
    return round(x / best, 3) if x is not None and best else None


# ---- counting across restarts --------------------------------------------------------------------------------
def cumulative(polls: list[Poll], key: str = "samples") -> list[tuple[float, float]]:
    """[(t, the drivers' `key` summed over every daemon and every incarnation of it)] per poll (module doc)."""
    state: list[dict] = []
    out = []
    for p in polls:
        while len(state) < len(p.statuses):
            state.append({"pid": None, "last": 0, "offset": 0})
        for i, st in enumerate(p.statuses):
            v = driver_of(st).get(key)
            if v is None:
                continue
            s = state[i]
            pid = st.get("pid")
            if s["pid"] is not None and pid != s["pid"]:
                s["offset"] += s["last"]
                s["last"] = 0
            s["pid"], s["last"] = pid, v
        out.append((p.t, sum(s["offset"] + s["last"] for s in state)))
    return out


def series_rate(series: list[tuple[float, float]], t0: float, t1: float) -> float | None:
    """Per second between the first point at or after t0 and the last at or before t1 (None: fewer than two)."""
    inside = [(t, v) for t, v in series if t0 - 1e-9 <= t <= t1 + 1e-9]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (ta, a), (tb, b) = inside[0], inside[-1]
    return (b - a) / (tb - ta)


def windowed(series: list[tuple[float, float]], t0: float, t1: float, window: float) -> list[list[float]]:
    """Throughput over consecutive `window`s from t0 to t1: [[window start - t0, samples/s], ...]."""
    out, t = [], t0
    while t + window <= t1 + 1e-9:
        r = series_rate(series, t, t + window)
        if r is not None:
            out.append([round(t - t0, 1), round(r, 2)])
        t += window
    return out


def recovery(series: list[tuple[float, float]], t_event: float, reference: float | None, window: float,
             t_end: float) -> tuple[float | None, list[list[float]]]:
    """(seconds from the event until the throughput over a `window` starting at a poll is back to
    RECOVERED x `reference`, None if not before `t_end`; the trace [[seconds after the event, samples/s]])."""
    trace, found = [], None
    for t, _ in series:
        if t < t_event - 1e-9 or t + window > t_end + 1e-9:
            continue
        r = series_rate(series, t, t + window)
        if r is None:
            continue
        trace.append([round(t - t_event, 2), round(r, 2)])
        if found is None and reference and r >= RECOVERED * reference:
            found = round(t - t_event, 2)
    return found, trace


# ---- stages and moves ----------------------------------------------------------------------------------------
def my_stage(st: dict | None) -> int | None:
    return ((st or {}).get("pipeline") or {}).get("my_stage")


def stage_changes(polls: list[Poll], t0: float = 0.0) -> list[dict]:
    """Every change of a daemon's stage seen between polls: {"at_s" (after t0), "daemon", "from", "to"}
    ("from" None: it came back after a restart)."""
    last: dict[int, int | None] = {}
    out = []
    for p in polls:
        for i, st in enumerate(p.statuses):
            s = my_stage(st)
            if s is None:
                continue  # dead, restarting or not serving yet: it keeps what it last served
            if i in last and last[i] != s:
                out.append({"at_s": round(p.t - t0, 1), "daemon": i, "from": last[i], "to": s})
            last[i] = s
    return out


def reported_moves(statuses: list[dict | None], t0_unix: float | None = None) -> list[dict]:
    """The rebalancer's own account, `pipeline.moves` of every daemon (absent before it exists): a list of
    {"daemon", "at", "from", "to", "reason", "took_s"}, "at_s" added when `t0_unix` says where the run began."""
    out = []
    for i, st in enumerate(statuses):
        for m in ((st or {}).get("pipeline") or {}).get("moves") or []:
            row = {"daemon": i, **m}
            if t0_unix is not None and isinstance(m.get("at"), (int, float)):
                row["at_s"] = round(m["at"] - t0_unix, 1)
            out.append(row)
    return sorted(out, key=lambda m: (m.get("at") or 0, m["daemon"]))


def own_samples_per_s(polls: list[Poll], daemon: int, t0: float, t1: float) -> float | None:
    """Mean over [t0, t1] of the samples/s daemon `daemon` announces for itself (its `me` entry in its own
    stage map), counting only polls where it is measured."""
    seen = []
    for p in polls:
        if not t0 <= p.t <= t1:
            continue
        smap = ((p.statuses[daemon] or {}).get("pipeline") or {}).get("stage_map") or []
        seen += [q["samples_per_s"] for s in smap for q in s["peers"] if q.get("me") and q["samples_per_s"] > 0]
    return statistics.mean(seen) if seen else None

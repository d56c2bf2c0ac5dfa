"""The figures of `peer bench pipeline`, computed from polled statuses: no daemons here, so each is testable.

A `Poll` is one round of `peer status --json` of every daemon, taken at one moment (bench clock). From a
series of them: throughput (samples the drivers finished per second), the slowest-stage bound (per stage the
sum of its servers' announced, measured samples/s; the least of the stages), the recovery after a kill, and
the bytes a microbatch puts on the wire per codec (from the activation's shape: exact, as the codec sizes it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from protocol.tensor_codec import codec_params, tensor_nbytes

RECOVERED = 0.9  # "back within 10%": the windowed throughput reaches 90% of the reference
CODECS = ("raw", "float16", "q8")


@dataclass(frozen=True)
class Poll:
    t: float  # seconds on the bench's clock
    statuses: list[dict | None]  # by daemon index; None: did not answer (or dead)


def driver_of(st: dict | None) -> dict:
    return ((st or {}).get("pipeline") or {}).get("driver") or {}


def total(poll: Poll, daemons: list[int], key: str = "samples") -> int | None:
    """Sum of `key` of the drivers of `daemons` in one poll; None if one of them did not answer."""
    vals = [driver_of(poll.statuses[i]).get(key) for i in daemons]
    return None if any(v is None for v in vals) else sum(vals)


def rate(polls: list[Poll], daemons: list[int], t0: float, t1: float) -> float | None:
    """Samples/s the drivers of `daemons` finished between the first poll at or after t0 and the last at or
    before t1 (both with every one of them answering); None if fewer than two such polls."""
    inside = [(p.t, v) for p in polls if t0 - 1e-9 <= p.t <= t1 + 1e-9 and (v := total(p, daemons)) is not None]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (ta, a), (tb, b) = inside[0], inside[-1]
    return (b - a) / (tb - ta)


def stage_capacities(st: dict | None, stages: int) -> list[float] | None:
    """Per stage, the sum of its live peers' announced samples/s, as one daemon's stage map has it (None if
    it has no stage map yet or a stage has no measured peer)."""
    smap = ((st or {}).get("pipeline") or {}).get("stage_map")
    if not smap or len(smap) != stages:
        return None
    caps = [sum(p["samples_per_s"] for p in s["peers"]) for s in sorted(smap, key=lambda s: s["stage"])]
    return caps if all(c > 0 for c in caps) else None


def capacities_over(polls: list[Poll], viewer: int, stages: int, t0: float, t1: float) -> list[float] | None:
    """Mean per-stage capacity over the polls in [t0, t1], as daemon `viewer` saw the stage map."""
    seen = [c for p in polls if t0 <= p.t <= t1 and (c := stage_capacities(p.statuses[viewer], stages))]
    if not seen:
        return None
    return [statistics.mean(c[s] for c in seen) for s in range(stages)]


def recovery(polls: list[Poll], daemons: list[int], t_kill: float, reference: float,
             window: float) -> tuple[float | None, list[list[float]]]:
    """(seconds from the kill until the throughput of `daemons` over a `window` starting there is back to
    RECOVERED x `reference`, None if never; the trace [[seconds after the kill, windowed samples/s], ...]).
    A window starts at each poll after the kill that leaves a whole window before the last poll."""
    end = max(p.t for p in polls)
    trace, found = [], None
    for p in polls:
        if p.t < t_kill or p.t + window > end + 1e-9:
            continue
        r = rate(polls, daemons, p.t, p.t + window)
        if r is None:
            continue
        trace.append([round(p.t - t_kill, 2), round(r, 2)])
        if found is None and r >= RECOVERED * reference:
            found = p.t - t_kill
    return found, trace


def bytes_per_microbatch(act_shape: list[int], stages: int, forward_codec: str, backward_codec: str,
                         x_bytes: int, y_bytes: int) -> dict:
    """Bytes per microbatch for the activation `act_shape` (float32, the shape at every cut of the built-in
    transformer), per codec used both ways:

    - `per_cut`: the activation forward plus its gradient back, once each: what crosses a cut between two
      stages that talk directly (PipeDream, GPipe).
    - `via_driver`: everything one driver sends and receives for one training microbatch, the SWARM path
      (every call goes through the driver, and a backward call carries the stage's inputs again): per inner
      cut the activation 3x (stage reply, next call, next stage's backward call) and its gradient 2x; the
      last cut's activation 2x (the loss call does forward and backward at once); plus the token ids (twice:
      stage 0's forward and backward) and targets. Calls a driver makes to its own stage skip the wire.
    - `this_run`: `via_driver` for the codecs the run used (activations `forward_codec`, gradients
      `backward_codec`).
    """
    def nb(codec: str) -> int:
        return tensor_nbytes("float32", act_shape, codec, *codec_params(codec))

    cuts = stages - 1
    act_crossings = 3 * (cuts - 1) + 2
    grad_crossings = 2 * cuts
    tokens = 2 * x_bytes + y_bytes

    def via(fc: str, bc: str) -> int:
        return act_crossings * nb(fc) + grad_crossings * nb(bc) + tokens

    return {
        "activation_shape": list(act_shape), "dtype": "float32", "cuts": cuts,
        "per_cut": {c: 2 * nb(c) for c in CODECS},
        "via_driver": {c: via(c, c) for c in CODECS},
        "this_run": {"forward_codec": forward_codec, "backward_codec": backward_codec,
                     "via_driver": via(forward_codec, backward_codec)},
    }


def busy_shares(polls: list[Poll], daemons: list[int], t0: float, t1: float) -> list[dict | None]:
    """Per daemon, its stage and the share of [t0, t1] its server spent computing calls (its `compute_s`, waits for
    the compute thread included, the adding of acknowledged gradients not): near 1 for a stage that is the
    bottleneck and kept busy; less means calls did not reach it fast enough (None: not seen in two polls)."""
    out: list[dict | None] = []
    for i in daemons:
        seen = [(p.t, sv["compute_s"], pl.get("my_stage")) for p in polls if t0 - 1e-9 <= p.t <= t1 + 1e-9
                and (pl := ((p.statuses[i] or {}).get("pipeline") or {})) and (sv := pl.get("server"))
                and sv.get("compute_s") is not None]
        if len(seen) < 2 or seen[-1][0] <= seen[0][0]:
            out.append(None)
            continue
        (ta, ca, _), (tb, cb, stage) = seen[0], seen[-1]
        out.append({"stage": stage, "busy": round((cb - ca) / (tb - ta), 3)})
    return out


def session_bytes_out(st: dict | None) -> int | None:
    """Encrypted session bytes this daemon has sent to all peers (pipeline calls, averaging, control)."""
    if not st:
        return None
    return sum(p.get("bytes_out", 0) for p in st.get("peers", []))


def median_deadline(statuses: list[dict | None]) -> float | None:
    """The median, over drivers, of each driver's median recent stage-call deadline (seconds)."""
    ds = [d for st in statuses if (d := driver_of(st).get("deadline_s")) is not None]
    return round(statistics.median(ds), 3) if ds else None

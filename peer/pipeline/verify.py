"""Verified stage calls: a driver re-executes a random share of its calls at another peer of the stage and
compares the answers (docs/design.md, "Verified stage calls").

Peers of a stage never hold the same weights (each steps on its own share, then averages with one partner),
so an honest second answer differs from an honest first one, by about what a step or two moves it. Two answers
are compared by two statistics, their relative error and the log of their norms' ratio (`Distance`), and agree
when each is within its tolerance for that stage and kind of call: `max(floor, MIN_x, K_x x honest_x)`, at most
`GROSS_x`, where `floor` is what the dtype, the devices and the wire codec let two exact computations differ by,
and `honest_x` the median of the smallest distance of this driver's recent triples of answers at that stage
(`Calibration`: with one liar among three, at most the honest pair's, so no lie raises it).

Who answers a check: ourselves where we serve the stage, else a peer of the stage drawn at random (not the
balancer's choice, which favours new and fast peers), and every call carries a fresh wire id (driver.py), so
nothing but its inputs tells a check from a first call. Where our own answer is one of the two, it is the
reference: the other answer, if it is grossly off ours (over GROSS_x), is the outlier, however many others
would agree with it. Otherwise a mismatch asks a third peer: the one answer that disagrees with the two others,
which agree with each other, is the outlier, and a microbatch one of whose calls it answered is run again
without it. (A majority of three is what two colluders who answer alike win at a stage we do not serve: it
names the honest third; docs/design.md, "Verified stage calls", says what that costs and what bounds it.) A peer that just
stepped is sometimes that outlier once; a liar is it every time its lie shows: a peer is struck only when it
was the outlier in ODD_TO_STRIKE of its HISTORY latest verdicts on one kind of call (a liar may lie in one
kind only: its honest answers in another would dilute the lies), and three strikes within ten minutes ban it
(`peer/averaging/bans.py`'s `BanList`: 60 s, doubling each time). With two peers only, a mismatch names nobody
unless the driver is one of them (it trusts its own compute, and then only a gross mismatch counts: there is
no third opinion to calibrate with). While a stage's kind is uncalibrated (fewer than MIN_SAMPLES triples),
every check asks three peers where the stage has them and only a gross lie stands out; the triples are judged
again against the tolerance they make once they make one, so a liar counts from its first checks. After that
REFRESH of the agreeing checks ask a third peer too, so the calibration follows the training.

What a check may cost is bounded: a call is checked with probability `[pipeline] verify_fraction`, one check
per driver at a time, one call more (two while calibrating, on a mismatch or a refresh). A check's calls are
ordinary calls (same kind, inputs and seed: a server cannot tell them from the first), and the gradients they
keep are dropped at once (`StageAck(accumulate=False)`): a check never adds to any stage.

Pure rules (distances, tolerances, verdicts, strikes) and the check's sequence; the driver makes the calls.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import trio

from peer.averaging.bans import BanList

log = logging.getLogger("peertrain.pipeline")

FLOOR_BY_DTYPE = {"float64": 1e-3, "float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
"""Relative error two exact computations of one call may differ by, by the outputs' dtype. A driver does not
know where a peer computes, so each is the cross-device one: a stage in float32 on an H200 differs from the CPU
by 2e-7 with torch's defaults, 2.4e-4 with TF32 matrix products allowed (docs/benchmarks.md), so 1e-3 leaves a
margin; half precision rounds to 2^-11 (float16) or 2^-8 (bfloat16) per element, and accumulates. Dropout's
masks differ between a CPU and a GPU (7.5% at p = 0.1): no floor covers that (docs/design.md says what to do)."""
FLOOR_UNKNOWN_DTYPE = 1e-2  # a dtype not listed (an integer output is never compared): half precision's
FLOOR_BY_CODEC = {"raw": 0.0, "float16": 2e-3, "q8": 3e-2}
"""What the wire codec adds, each answer having its own rounding: float16 ≤ 2^-11 per element, so ≤ 1e-3 for
the difference of two; q8 a block's max/254 per element, ~1% relative each for normal-looking values."""

# Two statistics compare two answers: their relative error (what noise, a sign flip or stale weights move) and
# the log of their norms' ratio (what a scale moves: log 1.05 = 0.049 where honest peers differ by ~0.003).
# Each has its tolerance: max(floor, MIN_x, K_x x honest_x), at most GROSS_x, and GROSS_x while uncalibrated.
# The figures are the swarm tests' (docs/benchmarks.md, 'Verified pipeline stages'): honest relative errors of
# 1-6% (median) with tails to 18%, log norm ratios of 0.001-0.01 with tails to 0.05 in a peer that just stepped.
MIN_REL = 0.01  # below it no pair disagrees: two peers that just averaged agree far closer than one step later
K_REL = 4.0  # times the honest median: the honest tails reach 3-4x it, but only in one call at a time (below)
GROSS_REL = 0.5  # no honest pair of one stage differs by half its output; a sign flip is 2, noise of its size 1
MIN_NORM = 0.025  # honest peers' norms differ by 0.3% (median), 5% at most, in a peer that just stepped
K_NORM = 8.0  # the norm ratio's honest tails are longer than the relative error's (a step moves norms little)
GROSS_NORM = 0.2  # a norm 22% off: no honest peer's (a 1.5x scale is 0.41)
WINDOW = 16  # triples' smallest distances kept per stage and kind: the newest, so it follows the training
MIN_SAMPLES = 3  # triples measured before the window's median is trusted
REFRESH = 0.25
"""Of the checks whose two answers agree, this share asks a third peer anyway, so the window keeps following
the honest distance when it shrinks (mismatches refresh it when it grows): a quarter more calls per check."""
HISTORY = 6  # the latest verdicts on each peer that a strike weighs
ODD_TO_STRIKE = 3
"""A peer is struck when it is the outlier and was in at least this many of its HISTORY latest verdicts: an
honest peer that just stepped is sometimes the odd one once (3% of the honest triples in the tests), a liar is
every time its lie shows; three strikes ban it (BanList), so a liar is banned after five outlier verdicts."""
MAX_TRACKED = 1024  # peers whose verdicts one driver keeps; the ones unseen longest are forgotten first
MAX_RERUNS = 2  # a microbatch re-run this many times for outliers, and answered by one again, fails
MAX_CHECKS_IN_FLIGHT = 1  # checks one driver runs at once: verification never costs more than one call's worth
RECENT = 20  # outlier verdicts shown in status, with their distances
KINDS_WITH_OUTPUTS = ("forward", "loss", "evaluate", "backward")


@dataclass(frozen=True)
class Answer:
    """One peer's reply to a call: what a check compares (the tensors are the driver's, on the CPU)."""

    peer: str
    loss: float | None
    outputs: list[Any]
    kept: int = 0  # the id its server keeps the call's gradient under (0: none)
    compute_s: float = 0.0


@dataclass(frozen=True)
class Distance:
    rel: float  # the relative error: L2 distance over the larger norm (the loss's too, the larger of both)
    norm: float  # |log(norm a / norm b)|: the outputs' norms (a loss alone: its value)

    def within(self, tol: "Distance") -> bool:
        return self.rel <= tol.rel and self.norm <= tol.norm


FAR = Distance(math.inf, math.inf)
GROSS = Distance(GROSS_REL, GROSS_NORM)  # what no honest pair differs by, while a stage's kind is uncalibrated
OWN_GROSS_NORM = 0.35  # a pair with our own answer, judged without a third: a norm 42% off. Two honest servers of
#                        one stage reached 0.22-0.31 in the verify swarm test (2026-11-29, late in a loaded run:
#                        each driver that served the stage struck the other), so GROSS_NORM framed them there;
#                        a 1.5x scale (0.41) still stands out, and a third peer judges what this lets through
OWN_GROSS = Distance(GROSS_REL, OWN_GROSS_NORM)


def distance(a: Answer, b: Answer) -> Distance:
    """How far two answers to one call are (all outputs as one vector, in float64); FAR when their shapes differ
    or one is zero and the other not."""
    import torch

    rel = norm = 0.0
    if a.outputs or b.outputs:
        if len(a.outputs) != len(b.outputs):
            return FAR
        diff = norm_a = norm_b = 0.0
        for x, y in zip(a.outputs, b.outputs):
            if tuple(x.shape) != tuple(y.shape):
                return FAR
            x64, y64 = x.detach().to(torch.float64), y.detach().to(torch.float64)
            diff += float((x64 - y64).pow(2).sum())
            norm_a += float(x64.pow(2).sum())
            norm_b += float(y64.pow(2).sum())
        rel = _relative(math.sqrt(diff), math.sqrt(max(norm_a, norm_b)))
        norm = _log_ratio(math.sqrt(norm_a), math.sqrt(norm_b))
    if a.loss is not None or b.loss is not None:
        if a.loss is None or b.loss is None:
            return FAR
        rel = max(rel, _relative(abs(a.loss - b.loss), max(abs(a.loss), abs(b.loss))))
        if not (a.outputs or b.outputs):
            norm = _log_ratio(abs(a.loss), abs(b.loss))
    return Distance(rel, norm)


def _relative(diff: float, scale: float) -> float:
    if not (math.isfinite(diff) and math.isfinite(scale)):
        return math.inf
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def _log_ratio(x: float, y: float) -> float:
    if not (math.isfinite(x) and math.isfinite(y)):
        return math.inf
    if x == 0.0 or y == 0.0:
        return 0.0 if x == y else math.inf
    return abs(math.log(x / y))


def floor(dtypes: list[str], codec: str) -> float:
    """The tolerances' floor for answers with outputs of `dtypes` (a loss alone: float32) sent with `codec`."""
    by_dtype = max((FLOOR_BY_DTYPE.get(d, FLOOR_UNKNOWN_DTYPE) for d in dtypes), default=FLOOR_BY_DTYPE["float32"])
    return max(by_dtype, FLOOR_BY_CODEC.get(codec, FLOOR_BY_CODEC["q8"]) if dtypes else 0.0)


class Calibration:
    """One stage's (and kind's) honest disagreement, as this driver measured it: the smallest distance of each
    triple of answers it compared (each statistic's own), the newest WINDOW of them. Only triples count: with
    at most one liar among three answers the smallest distance is at most the honest pair's, so no lie raises
    the window, while a pair's distance may be a liar's (one lying just under the tolerance would ratchet it)."""

    def __init__(self) -> None:
        self.rel: deque[float] = deque(maxlen=WINDOW)
        self.norm: deque[float] = deque(maxlen=WINDOW)

    @property
    def calibrated(self) -> bool:
        return len(self.rel) >= MIN_SAMPLES

    def honest(self) -> Distance | None:
        return Distance(median(self.rel), median(self.norm)) if self.calibrated else None

    def tolerance(self, floor_: float) -> Distance:
        honest = self.honest()
        if honest is None:
            return Distance(max(floor_, GROSS_REL), max(floor_, GROSS_NORM))
        return Distance(max(floor_, MIN_REL, min(GROSS_REL, K_REL * honest.rel)),
                        max(floor_, MIN_NORM, min(GROSS_NORM, K_NORM * honest.norm)))

    def record(self, triple: list[Distance]) -> None:
        rel, norm = min(d.rel for d in triple), min(d.norm for d in triple)
        if math.isfinite(rel) and math.isfinite(norm):
            self.rel.append(rel)
            self.norm.append(norm)


def verdict(distances: dict[tuple[str, str], Distance], tolerance: Distance) -> tuple[str | None, bool]:
    """Three answers' pairwise distances -> (the outlier, or None; whether every pair agrees). The outlier is
    the one peer that disagrees with both others while they agree with each other; otherwise nobody."""
    peers = sorted({p for pair in distances for p in pair})
    agree = {pair: d.within(tolerance) for pair, d in distances.items()}
    if all(agree.values()):
        return None, True
    for odd in peers:
        others = [p for p in peers if p != odd]
        if agree.get(_pair(*others)) and not any(ok for pair, ok in agree.items() if odd in pair):
            return odd, False
    return None, False


def _pair(p: str, q: str) -> tuple[str, str]:
    return (p, q) if p <= q else (q, p)


@dataclass
class VerifyStats:
    checks: int = 0  # checks that got a second answer
    agreed: int = 0
    mismatches: int = 0  # checks whose first two answers disagreed
    unresolved: int = 0  # checks whose answers disagreed with no outlier among them (two peers only, no odd one)
    compared: Counter = field(default_factory=Counter)  # peer -> verdicts its answer was in
    outliers: Counter = field(default_factory=Counter)  # peer -> verdicts naming it the outlier
    strikes: Counter = field(default_factory=Counter)  # peer -> strikes it earned (persistently the outlier)
    bans: int = 0  # outliers banned (their strikes reached the ban list's bound)
    banned: Counter = field(default_factory=Counter)  # peer -> times this driver banned it (a ban expires)
    no_peer: int = 0  # calls drawn for a check whose stage had no second usable peer
    failed: int = 0  # checks whose second call failed (no verdict)
    reruns: int = 0  # microbatches re-run because an outlier had served one of their calls
    dropped: int = 0  # gradients the checks' calls kept, dropped at once
    check_compute_s: float = 0.0  # the checks' calls' compute seconds (their servers' own figures)
    call_compute_s: float = 0.0  # the first calls' compute seconds: the work the checks are measured against
    first_ban_at: int | None = None  # microbatches this driver had done when it first banned an outlier
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # recent outlier verdicts


Ask = Callable[[set[str]], Awaitable[Answer | None]]
"""Ask one more peer of the stage (not one of the given ones) for the same call: its answer, or None."""
Drop = Callable[[list[Answer]], Awaitable[None]]
"""Tell the servers of these answers to drop the gradients they keep for them."""


class Verifier:
    """One driver's checks: which calls to check, the calibrations, the verdicts and the strikes."""

    def __init__(self, fraction: float, me: str, bans: BanList, rng: random.Random | None = None):
        self.fraction, self.me, self.bans = fraction, me, bans
        self.rng = rng or random.Random()
        self.stats = VerifyStats()
        self.calibration: dict[tuple[int, str], Calibration] = {}
        # (peer, kind of call) -> its latest verdicts there: outlier? Per kind, since a liar may lie in one kind
        # only (a flipped input gradient, honest forwards), and its honest answers would dilute the others
        self.history: OrderedDict[tuple[str, str], deque[bool]] = OrderedDict()
        # (stage, kind) -> the triples it is being calibrated on, judged once it is (at most MIN_SAMPLES each)
        self.waiting: dict[tuple[int, str], list[tuple[list[str], dict[tuple[str, str], Distance]]]] = {}
        self.in_flight = 0

    def wants(self, stage: int, kind: str) -> bool:
        """Whether to check this completed call: drawn with probability `fraction`, while no other check runs,
        for a call whose reply carries something to compare (the first stage's backward returns nothing)."""
        if kind not in KINDS_WITH_OUTPUTS or (kind == "backward" and stage == 0):
            return False
        if self.in_flight >= MAX_CHECKS_IN_FLIGHT or self.fraction <= 0:
            return False
        return self.rng.random() < self.fraction

    def banned(self, peer_id: str, now: float) -> bool:
        return self.bans.banned(peer_id, now) is not None

    def _calibration(self, stage: int, kind: str) -> Calibration:
        return self.calibration.setdefault((stage, kind), Calibration())

    async def check(self, first: Answer, stage: int, kind: str, floor_: float, ask: Ask, drop: Drop,
                    done_microbatches: int = 0) -> str | None:
        """Check `first` against another peer's answer (and a third on a mismatch); the outlier, or None. Holds
        one of MAX_CHECKS_IN_FLIGHT until it ends (the caller counted it in `in_flight` when it drew it)."""
        extra: list[Answer] = []
        try:
            return await self._check(first, stage, kind, floor_, ask, extra, done_microbatches)
        finally:
            self.in_flight -= 1
            kept = [a for a in extra if a.kept]
            if kept:
                self.stats.dropped += len(kept)
                with trio.CancelScope(shield=True):  # bounded by the ack's own timeout
                    await drop(kept)

    async def _check(self, first: Answer, stage: int, kind: str, floor_: float, ask: Ask, extra: list[Answer],
                     done_microbatches: int) -> str | None:
        second = await ask({first.peer})
        if second is None:
            self.stats.failed += 1
            return None
        extra.append(second)
        self.stats.checks += 1
        self.stats.check_compute_s += second.compute_s
        cal = self._calibration(stage, kind)
        tol = cal.tolerance(floor_)
        d12 = distance(first, second)
        if self.me in (first.peer, second.peer) and not d12.within(OWN_GROSS):
            # our own compute answered (we serve the stage: the driver asks us first): it is the reference, and
            # an answer grossly off it the outlier, whoever else would agree with it (two colluders answer alike).
            # Grossly: an honest pair's own distance reached 3.9x the calibrated tolerance in the swarm tests
            # (the tolerance is calibrated on triples' closest pairs), so a pair judged by it struck honest peers
            self.stats.mismatches += 1
            other = second.peer if first.peer == self.me else first.peer
            return self._found(other, [first.peer, second.peer], stage, kind,
                               {_pair(first.peer, second.peer): d12}, OWN_GROSS, done_microbatches)
        refresh = not cal.calibrated or self.rng.random() < REFRESH
        if d12.within(tol) and not refresh:
            self.stats.agreed += 1
            self._heard([first.peer, second.peer], kind, None)
            return None
        if not d12.within(tol):
            self.stats.mismatches += 1
        third = await ask({first.peer, second.peer})
        if third is None:
            if d12.within(tol):
                self.stats.agreed += 1
                self._heard([first.peer, second.peer], kind, None)
                return None
            # two answers disagree and no third peer exists: nobody is the outlier (a pair with our own answer
            # was judged above, against OWN_GROSS, before any third was asked)
            return self._found(None, [first.peer, second.peer], stage, kind,
                               {_pair(first.peer, second.peer): d12}, tol, done_microbatches)
        extra.append(third)
        self.stats.check_compute_s += third.compute_s
        distances = {_pair(first.peer, second.peer): d12, _pair(first.peer, third.peer): distance(first, third),
                     _pair(second.peer, third.peer): distance(second, third)}
        log.debug("stage %d %s: a triple's distances (relative, log norm): %s", stage, kind,
                  {f"{p[:8]}-{q[:8]}": (round(d.rel, 4), round(d.norm, 4)) for (p, q), d in distances.items()})
        peers = [first.peer, second.peer, third.peer]
        calibrating = not cal.calibrated
        cal.record(list(distances.values()))
        odd, all_agree = verdict(distances, tol)
        if calibrating and odd is None:  # judged again once the calibration they make exists (`_judge_waiting`)
            self.waiting.setdefault((stage, kind), []).append((peers, distances))
            return self._judge_waiting(stage, kind, floor_, done_microbatches) if cal.calibrated else None
        return self._judge(odd, all_agree, peers, stage, kind, distances, tol, done_microbatches)

    def _judge(self, odd: str | None, all_agree: bool, peers: list[str], stage: int, kind: str,
               distances: dict[tuple[str, str], Distance], tol: Distance, done_microbatches: int) -> str | None:
        if all_agree:
            self.stats.agreed += 1
            self._heard(peers, kind, None)
            return None
        return self._found(odd, peers, stage, kind, distances, tol, done_microbatches)

    def _judge_waiting(self, stage: int, kind: str, floor_: float, done_microbatches: int) -> str | None:
        """The triples a stage's kind was calibrated on, judged against the tolerance they gave (only a gross lie
        stood out before): a liar there counts from its first checks. The outlier of the last, whose microbatch
        may still run again, or None."""
        tol = self._calibration(stage, kind).tolerance(floor_)
        odd = None
        for peers, distances in self.waiting.pop((stage, kind), []):
            odd = self._judge(*verdict(distances, tol), peers, stage, kind, distances, tol, done_microbatches)
        return odd

    def _heard(self, peers: list[str], kind: str, odd: str | None) -> None:
        """Note a verdict on each of `peers` for a call of `kind` (which of them, if any, was the outlier)."""
        for p in peers:
            self.stats.compared[p] += 1
            h = self.history.pop((p, kind), None) or deque(maxlen=HISTORY)
            h.append(p == odd)
            self.history[(p, kind)] = h
        while len(self.history) > MAX_TRACKED:
            self.history.popitem(last=False)

    def _found(self, odd: str | None, peers: list[str], stage: int, kind: str,
               distances: dict[tuple[str, str], Distance], tol: Distance, done_microbatches: int) -> str | None:
        if odd == self.me:  # we are the odd one: we never strike ourselves (nor trust the two others more)
            odd = None
        self._heard(peers, kind, odd)
        seen = {f"{p[:8]}-{q[:8]}": [_round(d.rel), _round(d.norm)] for (p, q), d in distances.items()}
        if odd is None:
            self.stats.unresolved += 1
            log.info("stage %d %s: answers disagree beyond %s (%s); no outlier among them", stage, kind,
                     _show(tol), seen)
            return None
        self.stats.outliers[odd] += 1
        odd_share = sum(self.history[(odd, kind)])
        struck = odd_share >= ODD_TO_STRIKE
        self.stats.recent.append({"stage": stage, "kind": kind, "tolerance": [_round(tol.rel), _round(tol.norm)],
                                  "distances": seen, "outlier": odd, "struck": struck})
        if not struck:
            log.info("stage %d %s: %s is the outlier (%s, tolerance %s), %d of its last %d verdicts", stage, kind,
                     odd[:8], seen, _show(tol), odd_share, len(self.history[(odd, kind)]))
            return odd
        self.stats.strikes[odd] += 1
        reason = (f"its stage {stage} {kind} answers were the outlier among three peers' in {odd_share} of its "
                  f"last {len(self.history[(odd, kind)])} checks of that kind")
        if self.bans.strike(odd, reason, trio.current_time()):
            self.stats.bans += 1
            self.stats.banned[odd] += 1
            if self.stats.first_ban_at is None:
                self.stats.first_ban_at = done_microbatches
            log.warning("banned %s from our pipeline calls: %s", odd[:8], self.bans.banned(odd, trio.current_time()))
        else:
            log.warning("stage %d %s: %s is the outlier again (%s, tolerance %s): struck", stage, kind, odd[:8],
                        seen, _show(tol))
        return odd

    def status(self) -> dict:
        s = self.stats
        return {"fraction": self.fraction, "checks": s.checks, "agreed": s.agreed, "mismatches": s.mismatches,
                "unresolved": s.unresolved, "compared": dict(s.compared), "outliers": dict(s.outliers),
                "strikes": dict(s.strikes), "bans": s.bans, "banned": dict(s.banned),
                "no_peer": s.no_peer, "failed": s.failed, "reruns": s.reruns, "dropped": s.dropped,
                "check_compute_s": round(s.check_compute_s, 4), "call_compute_s": round(s.call_compute_s, 4),
                "overhead": round(s.check_compute_s / s.call_compute_s, 4) if s.call_compute_s else None,
                "first_ban_at": s.first_ban_at,
                "calibration": {f"{st}/{kind}": {"triples": len(c.rel), "honest": _pair_of(c.honest()),
                                                 "tolerance": _pair_of(c.tolerance(0.0))}
                                for (st, kind), c in sorted(self.calibration.items())},
                "recent": list(s.recent)}


def _round(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(f"{x:.3g}")


def _pair_of(d: Distance | None) -> list | None:
    return None if d is None else [_round(d.rel), _round(d.norm)]


def _show(d: Distance) -> str:
    return f"{d.rel:.3g} relative, {d.norm:.3g} log norm"

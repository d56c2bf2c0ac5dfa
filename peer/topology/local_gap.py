"""The spectral gap without the graph: each peer runs a few rounds of a random-vector power iteration
with its neighbours and reads the contraction rate off its own values.

Every peer i holds k random numbers x_i and, once per round, sends them (and its degree) to its gossip
neighbours; then x_i <- x_i + sum_j w_ij (x_j - x_i) with the Metropolis-Hastings weights
w_ij = 1 / (1 + max(d_i, d_j)): one step of x <- W x on the whole swarm, each peer doing its row. The
increment d(t) = x(t+1) - x(t) = (W - I) W^t x(0) has no component on the all-ones vector, so it shrinks
like SLEM(W)^t, the second-largest eigenvalue modulus, without anyone knowing the swarm's mean. A peer
fits the slope of log |d_i(t)| over the second half of the rounds (the first half lets the fast modes
die out); 1 - exp(slope) is its estimate of the gap, which the last round averages with its
neighbours'. (A peer's own reading is within about +-15% of the swarm's: p10-p90 of the ratio
0.87-1.15 in `peer bench scale --peers 10000`.)

What a finite number of rounds reads is not quite the gap: on a random regular graph the spectrum is
dense up to its edge, so after 60 rounds the slope still carries modes a little below SLEM and reads
about 15% above the true gap (0.125 against 0.107 at degree 4, 10^4 peers). The yardstick therefore goes
through the same estimator: `reference_gap(d, rounds)` is what the estimator reads, in expectation, on
a random d-regular graph, computed from the Kesten-McKay law (the spectral measure of a large random
regular graph seen from one node). On a random 4-regular graph of 10^4 peers (true gap 0.1071) the
median peer read 0.1247 against a reference of 0.1236 (60 rounds) and 0.1161 against 0.1152 (120
rounds), so the ratio estimate / reference (median 1.009 and 1.007) is a nearly unbiased local reading
of "gap against a random regular graph of the same degree", the number the rewiring rule
(peer/topology/local_rewire.py) keeps up.

Sans-I/O: the driver (the daemon, or the simulator in peer/bench/scale_sim.py) starts an epoch,
sends `message()` to each neighbour every round, hands what arrives to `receive`, and calls `advance`
with the current neighbours at the round's end. A neighbour whose value did not arrive in time is
left out of that round, by both ends if both missed: an estimate, not an invariant. Epochs are numbered
(the daemon: wall-clock time // epoch_interval), and values of another epoch or round are ignored.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from protocol.schema.views import MAX_GAP_ROUNDS, MAX_GAP_VECTORS, MIN_GAP_SLOPE, GapRound

_TINY = 1e-300  # log of an increment that is exactly zero (a peer whose neighbours all agree with it)


@dataclass(frozen=True, kw_only=True)
class GapConfig:
    vectors: int = 2
    """Random vectors iterated at once: their increments are summed, so one unlucky start (a peer where the
    slow eigenvector is near zero) weighs less. Two halved the spread of peers' readings against one."""
    rounds: int = 60
    """Rounds per epoch. The reading approaches the gap as rounds grow (see the module docstring); 60 keeps
    an epoch to a minute at one round a second while the spread between peers' readings is about +-10%."""
    round_interval: float = 1.0
    """Seconds per round: a round message must reach every neighbour within it (a few RTTs)."""
    epoch_interval: float = 600.0
    """Seconds between epochs: the gap changes only as edges are rewired, and an epoch costs a peer
    rounds x degree small messages (~0.3 kbit/s averaged over this interval at degree 4)."""
    max_neighbours: int = 64
    """Round values held from distinct senders per round (the driver passes only neighbours' values)."""

    def __post_init__(self) -> None:
        if not 1 <= self.vectors <= MAX_GAP_VECTORS:
            raise ValueError(f"vectors must be in 1..{MAX_GAP_VECTORS}, got {self.vectors}")
        if not 8 <= self.rounds <= MAX_GAP_ROUNDS:
            raise ValueError(f"rounds must be in 8..{MAX_GAP_ROUNDS}, got {self.rounds}")
        if not (self.round_interval > 0 and self.epoch_interval >= self.rounds * self.round_interval):
            raise ValueError("need round_interval > 0 and epoch_interval >= rounds x round_interval, got "
                             f"{self.round_interval}, {self.epoch_interval}")
        if self.max_neighbours < 1:
            raise ValueError(f"max_neighbours must be >= 1, got {self.max_neighbours}")

    @property
    def fit_from(self) -> int:
        """First round of the fitted window: the second half."""
        return self.rounds // 2


@dataclass(frozen=True, slots=True)
class GapReading:
    """An epoch's result at one peer: the estimated gap, what the estimator reads on a random regular graph
    of the neighbourhood's mean degree, and their ratio (the number rewiring keeps up)."""

    epoch: int
    gap: float
    reference: float
    degree: float

    @property
    def ratio(self) -> float:
        return self.gap / self.reference if self.reference > 0 else 0.0


def check_round(msg: GapRound, cfg: GapConfig) -> None:
    """Raise ValueError unless a peer's round message fits our config (the session is then closed): its
    schema bounded every field (protocol/schema/views.py); this is what only our estimator knows."""
    if msg.round >= cfg.rounds:
        raise ValueError(f"gap round {msg.round} out of range (an epoch has {cfg.rounds})")
    if len(msg.values) != cfg.vectors:
        raise ValueError(f"gap round needs {cfg.vectors} finite values, got {len(msg.values)}")


@lru_cache(maxsize=256)  # pure: a few degrees per run
def reference_gap(degree: float, rounds: int) -> float:
    """What `GapEstimator` reads, in expectation, on a large random regular graph of this degree.

    The spectral measure of a random d-regular graph at a node tends to the Kesten-McKay law, with density
    d sqrt(4(d-1) - x^2) / (2 pi (d^2 - x^2)) on |x| <= 2 sqrt(d-1) for the adjacency; MH weights on a
    regular graph make W = (A + I) / (d + 1). The expected squared increment at round t is then the
    integral of (mu - 1)^2 mu^(2t), mu = (x + 1) / (d + 1), and the estimator's slope is fitted to its
    log over the same window. A non-integer degree (an irregular neighbourhood's mean) interpolates.
    """
    d = max(float(degree), 2.0)
    r = 2.0 * math.sqrt(d - 1.0)
    x = np.linspace(-r, r, 4001)[1:-1]
    density = d * np.sqrt(4.0 * (d - 1.0) - x * x) / (2.0 * math.pi * (d * d - x * x))
    mu = (x + 1.0) / (d + 1.0)
    lo = rounds // 2
    ts = np.arange(lo, rounds)
    with np.errstate(divide="ignore"):  # mu = 0 at x = -1: log 0 = -inf, a zero term
        base = np.log((mu - 1.0) ** 2 * density)
        log_mu = np.log(np.abs(mu))
    logs = []
    for t in ts:  # in log space: mu^(2t) underflows for long epochs
        terms = base + 2 * int(t) * log_mu
        top = float(np.max(terms))
        logs.append(0.5 * (top + math.log(float(np.trapezoid(np.exp(terms - top), x)))))
    slope = float(np.polyfit(ts, logs, 1)[0])
    return 1.0 - math.exp(slope)


class GapEstimator:
    """One peer's side of the decentralised power iteration (see the module docstring)."""

    __slots__ = ("cfg", "_rng", "epoch", "round", "_x", "_got", "_fit", "_slope", "_nbr_slopes", "_nbr_degrees",
                 "reading")

    def __init__(self, cfg: GapConfig, rng: random.Random):
        self.cfg = cfg
        self._rng = rng
        self.epoch = -1
        self.round = cfg.rounds  # not in an epoch
        self._x: list[float] = []
        self._got: dict[str, GapRound] = {}  # this round's values, by sender
        self._fit = [0.0] * 5  # n, sum t, sum t^2, sum y, sum t y over the fitted window
        self._slope: float | None = None
        self._nbr_slopes: list[float] = []
        self._nbr_degrees: list[int] = []
        self.reading: GapReading | None = None  # the last finished epoch's

    @property
    def running(self) -> bool:
        return self.round < self.cfg.rounds

    def begin(self, epoch: int) -> None:
        """Start epoch `epoch`: fresh random values (Gaussian, so no increment is exactly zero)."""
        self.epoch = epoch
        self.round = 0
        self._x = [self._rng.gauss(0.0, 1.0) for _ in range(self.cfg.vectors)]
        self._got.clear()
        self._fit = [0.0] * 5
        self._slope = None

    def message(self, degree: int) -> GapRound | None:
        """This round's message to every neighbour (None: not in an epoch)."""
        if not self.running:
            return None
        return GapRound(self.epoch, self.round, degree, tuple(self._x), self._slope)

    def receive(self, sender: str, msg: GapRound) -> None:
        """A neighbour's round message: kept if it is this epoch's current round (and room is left)."""
        if (self.running and msg.epoch == self.epoch and msg.round == self.round
                and (sender in self._got or len(self._got) < self.cfg.max_neighbours)):
            self._got[sender] = msg

    def advance(self, neighbours) -> None:
        """End the round: mix with the neighbours (in `neighbours`) whose values came, record the increment."""
        if not self.running:
            return
        got = [m for p, m in self._got.items() if p in neighbours]
        d_i = len(neighbours)
        delta = [0.0] * len(self._x)
        for m in got:
            w = 1.0 / (1.0 + max(d_i, m.degree, 1))
            for k, v in enumerate(m.values):
                delta[k] += w * (v - self._x[k])
        self._x = [x + dx for x, dx in zip(self._x, delta)]
        t = self.round
        if t >= self.cfg.fit_from:
            y = 0.5 * math.log(max(sum(dx * dx for dx in delta), _TINY))
            f = self._fit
            f[0] += 1
            f[1] += t
            f[2] += t * t
            f[3] += y
            f[4] += t * y
            if f[0] >= 3:
                den = f[0] * f[2] - f[1] * f[1]
                self._slope = min(max((f[0] * f[4] - f[1] * f[3]) / den, MIN_GAP_SLOPE), 0.0) if den > 0 else None
        self.round += 1
        if not self.running:
            self._nbr_slopes = [m.slope for m in got if m.slope is not None]
            self._nbr_degrees = [m.degree for m in got]
            self._finish(d_i)
        self._got.clear()

    def _finish(self, degree: int) -> None:
        if self._slope is None:
            self.reading = None
            return
        slopes = [self._slope, *self._nbr_slopes]
        slope = sum(slopes) / len(slopes)
        mean_degree = (degree + sum(self._nbr_degrees)) / (1 + len(self._nbr_degrees))
        self.reading = GapReading(self.epoch, 1.0 - math.exp(slope), reference_gap(round(mean_degree * 4) / 4,
                                                                                   self.cfg.rounds), mean_degree)

    def state_for_size(self) -> list:
        """What this estimator holds, for counting its bytes (values, fit sums, a round's messages)."""
        return [self.epoch, self.round, self._x, self._fit, self._slope, list(self._got.values()),
                self._nbr_slopes, self._nbr_degrees,
                None if self.reading is None else [self.reading.epoch, self.reading.gap, self.reading.reference]]

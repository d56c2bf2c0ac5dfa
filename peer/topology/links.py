"""Per-peer link measurements: RTT and throughput from real transfers and light probes.

Throughput is averaged in log space (a geometric EWMA) and its spread is tracked too. On a busy host
one probe of the same idle loopback link can take 3000x longer than the next (8 daemons sharing two
cores: the answer waits for the other daemon's event loop). Such noise is multiplicative: an
arithmetic mean of bandwidth follows every fast outlier, and a planner that compares bare means swaps
equal links on noise and erodes the graph's spectral gap. `log_se` says how far the mean can be
trusted, so the planner can ask for a speed-up beyond the noise (see `peer.topology.rewire`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peer.topology.graph import LinkEstimate

ALPHA = 0.3  # weight of a new sample
PRIOR_LOG_SD = 1.0
"""Spread assumed for log(bandwidth) before samples show their own: one probe is trusted to within a
factor e. Consistent samples shrink it (a tbf-shaped link: to ~0.1); noisy ones grow it."""
_N_EFF = (2 - ALPHA) / ALPHA  # samples an EWMA's mean is worth once it has forgotten its start


@dataclass
class LinkStats:
    bandwidth_bps: float | None = None  # planned on: probes, the same small transfer to every peer
    rtt_s: float | None = None
    transfer_bps: float | None = None  # seen in averaging exchanges (load and concurrency mixed in)
    samples: int = 0
    updated: float = 0.0  # trio clock of the last sample
    probed: float = -1e9  # trio clock of the last probe
    log_var: float = PRIOR_LOG_SD ** 2  # EWMA variance of log(probe bandwidth)

    def add_rtt(self, rtt: float, now: float) -> None:
        self.rtt_s = rtt if self.rtt_s is None else (1 - ALPHA) * self.rtt_s + ALPHA * rtt
        self.updated = now

    def _bps(self, nbytes: int, seconds: float) -> float | None:
        if nbytes < 16 * 1024 or seconds <= 0:
            return None  # too small to say anything about throughput
        t = seconds - (self.rtt_s or 0.0)
        return nbytes * 8 / max(t, seconds * 0.1)

    def add_probe(self, nbytes: int, seconds: float, now: float) -> None:
        """A probe of `nbytes` took `seconds` (including one RTT, which we subtract when known)."""
        bps = self._bps(nbytes, seconds)
        if bps is None:
            return
        x = math.log(bps)
        if self.bandwidth_bps is None:
            mean = x
        else:
            r = x - math.log(self.bandwidth_bps)
            mean = math.log(self.bandwidth_bps) + ALPHA * r
            self.log_var = (1 - ALPHA) * (self.log_var + ALPHA * r * r)  # exponentially weighted variance
        self.bandwidth_bps = math.exp(mean)
        self.samples += 1
        self.updated = now

    @property
    def log_se(self) -> float:
        """Standard error of log(bandwidth_bps): the spread over the samples the mean is worth."""
        return math.sqrt(self.log_var / min(max(self.samples, 1), _N_EFF))

    def add_transfer(self, nbytes: int, seconds: float, now: float) -> None:
        """An averaging exchange: kept apart, since its time includes the endpoints' other exchanges."""
        bps = self._bps(nbytes, seconds)
        if bps is None:
            return
        self.transfer_bps = bps if self.transfer_bps is None else (1 - ALPHA) * self.transfer_bps + ALPHA * bps

    def estimate(self) -> LinkEstimate:
        return LinkEstimate(bandwidth_bps=self.bandwidth_bps, rtt_s=self.rtt_s,
                            log_se=self.log_se if self.bandwidth_bps is not None else 0.0)

"""Per-peer link measurements: RTT and throughput as EWMAs of real transfers and light probes."""

from __future__ import annotations

from dataclasses import dataclass

from peer.topology.graph import LinkEstimate

ALPHA = 0.3  # weight of a new sample


@dataclass
class LinkStats:
    bandwidth_bps: float | None = None
    rtt_s: float | None = None
    samples: int = 0
    updated: float = 0.0  # trio clock of the last sample
    probed: float = -1e9  # trio clock of the last probe

    def add_rtt(self, rtt: float, now: float) -> None:
        self.rtt_s = rtt if self.rtt_s is None else (1 - ALPHA) * self.rtt_s + ALPHA * rtt
        self.updated = now

    def add_transfer(self, nbytes: int, seconds: float, now: float) -> None:
        """A transfer of `nbytes` took `seconds` (including one RTT, which we subtract when known)."""
        if nbytes < 16 * 1024 or seconds <= 0:
            return  # too small to say anything about throughput
        t = seconds - (self.rtt_s or 0.0)
        t = max(t, seconds * 0.1)
        bps = nbytes * 8 / t
        self.bandwidth_bps = bps if self.bandwidth_bps is None else (1 - ALPHA) * self.bandwidth_bps + ALPHA * bps
        self.samples += 1
        self.updated = now

    def estimate(self) -> LinkEstimate:
        return LinkEstimate(bandwidth_bps=self.bandwidth_bps, rtt_s=self.rtt_s)

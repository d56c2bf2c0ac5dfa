"""Per-peer link measurements: RTT and throughput as EWMAs of real transfers and light probes."""

from __future__ import annotations

from dataclasses import dataclass

from peer.topology.graph import LinkEstimate

ALPHA = 0.3  # weight of a new sample


@dataclass
class LinkStats:
    bandwidth_bps: float | None = None  # planned on: probes, the same small transfer to every peer
    rtt_s: float | None = None
    transfer_bps: float | None = None  # seen in averaging exchanges (load and concurrency mixed in)
    samples: int = 0
    updated: float = 0.0  # trio clock of the last sample
    probed: float = -1e9  # trio clock of the last probe

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
        self.bandwidth_bps = bps if self.bandwidth_bps is None else (1 - ALPHA) * self.bandwidth_bps + ALPHA * bps
        self.samples += 1
        self.updated = now

    def add_transfer(self, nbytes: int, seconds: float, now: float) -> None:
        """An averaging exchange: kept apart, since its time includes the endpoints' other exchanges."""
        bps = self._bps(nbytes, seconds)
        if bps is None:
            return
        self.transfer_bps = bps if self.transfer_bps is None else (1 - ALPHA) * self.transfer_bps + ALPHA * bps

    def estimate(self) -> LinkEstimate:
        return LinkEstimate(bandwidth_bps=self.bandwidth_bps, rtt_s=self.rtt_s)

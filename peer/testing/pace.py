"""How much slower this machine runs than the one the suite's bounds were sized on.

A test's wait is bounded by what it checks ("the swarm trains to 95%"), but the number of seconds that takes
depends on the machine: a bound sized on one VM fails on a VM half as fast, or under a cgroup CPU cap, and a
suite that passes only on a fast machine is a flaky suite. So every bound a test sets in seconds goes through
`scaled`, which multiplies it by the slowdown measured once per test session: a fixed CPU workload, timed
against `REFERENCE_S` (its time on the 2-core VM the bounds were sized on, quiet). The factor never shrinks a
bound (a fast machine keeps the sized bound) and is capped, so a machine that is hopeless fails in bounded time.

tests/conftest.py measures it in the controlling pytest process and puts it in the environment
(`SLOWDOWN_ENV`), so pytest-xdist's workers and the daemons the tests start read the same figure; a user can
also set it by hand (`PEERTRAIN_TEST_SLOWDOWN=3 ./dev test`).
"""

from __future__ import annotations

import hashlib
import math
import os
import time

SLOWDOWN_ENV = "PEERTRAIN_TEST_SLOWDOWN"
REFERENCE_S = 0.16  # `workload()` on the 2-core development VM, quiet (best of 12: 0.153 s on 2026-11-28)
MAX_SLOWDOWN = 6.0  # past 6x the sized bounds, a run would take over an hour: fail in bounded time instead
WORKLOAD_ROUNDS = 3  # the minimum of 3 runs: one run can lose its core to a neighbour for a moment


def workload() -> float:
    """Seconds one fixed piece of CPU work takes: interpreted Python (dicts, bytes, hashing), as a daemon's
    control path is, and numpy arithmetic, as its averaging is. About 0.16 s: longer than a 100 ms CFS period,
    so a cgroup CPU cap slows it as it slows the tests."""
    import numpy as np

    start = time.perf_counter()
    table: dict[int, bytes] = {}
    digest = b""
    for i in range(200_000):
        table[i % 4096] = digest = hashlib.blake2b(digest + i.to_bytes(4, "little"), digest_size=16).digest()
    a = np.arange(1 << 16, dtype=np.float32)
    for _ in range(500):
        a = np.sqrt(a * a + 1.0) - 0.5
    return time.perf_counter() - start


def measure() -> float:
    """This machine's slowdown against the reference, now: ≥ 1, ≤ MAX_SLOWDOWN."""
    best = min(workload() for _ in range(WORKLOAD_ROUNDS))
    return min(MAX_SLOWDOWN, max(1.0, best / REFERENCE_S))


def slowdown() -> float:
    """The session's slowdown (from `SLOWDOWN_ENV`; 1.0 when unset or not a finite number ≥ 1)."""
    try:
        value = float(os.environ.get(SLOWDOWN_ENV, "1"))
    except ValueError:
        return 1.0
    return min(MAX_SLOWDOWN, value) if math.isfinite(value) and value >= 1.0 else 1.0


def scaled(seconds: float) -> float:
    """`seconds`, a bound sized on the reference machine, for this one."""
    return seconds * slowdown()

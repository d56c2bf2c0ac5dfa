"""`peer bench discovery`: seconds until N fresh local daemons are all connected, and idle memory.

Each trial starts N real daemons (`peer local`'s config: mDNS bound to 127.0.0.1) with new homes,
polls their control sockets until every daemon reports N-1 connected peers, then reads each daemon's
resident memory from /proc. The figure reported is the median of the trials.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from peer.cli.local import DEFAULT_CONFIG
from peer.testing.process import ProcessExited, proc_status_mb
from peer.testing.swarm import LocalSwarm

POLL_S = 0.05  # the clock's resolution: a twentieth of a second on a figure of a few seconds
IDLE_AFTER_S = 2.0  # what "idle" means here: memory is read this long after the last one connected


def _trial(n: int, config: Path, timeout: float) -> tuple[float | None, list[float]]:
    with tempfile.TemporaryDirectory(prefix="peertrain-bench-") as tmp, LocalSwarm(Path(tmp)) as swarm:
        t0 = time.monotonic()
        swarm.start_nodes(n, config)
        try:
            swarm.wait(lambda sts: all(s and s["connected"] == n - 1 for s in sts), timeout=timeout,
                       what=f"{n} daemons to connect", interval=POLL_S)
            elapsed = time.monotonic() - t0
        except (TimeoutError, ProcessExited) as exc:
            print(f"peer bench discovery: {exc}", file=sys.stderr)
            elapsed = None
        time.sleep(IDLE_AFTER_S)
        rss = [mb if (mb := proc_status_mb(d.pid, "VmRSS")) is not None else float("nan")
               for d in swarm.daemons if d.running]
    return elapsed, rss


def run(args) -> int:
    config = Path(args.config) if args.config else DEFAULT_CONFIG
    times, rss_all = [], []
    for _ in range(args.trials):
        elapsed, rss = _trial(args.n, config, args.timeout)
        times.append(elapsed)
        rss_all.extend(rss)
    ok = [t for t in times if t is not None]
    result = {
        "n": args.n, "trials": args.trials,
        "seconds_until_all_connected": round(statistics.median(ok), 3) if len(ok) == len(times) else None,
        "trial_seconds": [round(t, 3) if t is not None else None for t in times],
        "rss_mb_per_idle_daemon": round(statistics.mean(rss_all), 1) if rss_all else None,
        "rss_mb_max": round(max(rss_all), 1) if rss_all else None,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0 if len(ok) == len(times) else 1

"""`peer bench discovery`: seconds until N fresh local daemons are all connected, and idle memory.

Each trial starts N real daemons (`peer local` machinery, mDNS bound to 127.0.0.1) with new homes,
polls their control sockets until every daemon reports N-1 connected peers, then reads each daemon's
resident memory from /proc. The figure reported is the median of the trials.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--n", type=int, default=8, help="daemons per trial (default 8)")
    p.add_argument("--trials", type=int, default=3, help="trials; the median is reported (default 3)")
    p.add_argument("--timeout", type=float, default=60.0, help="give up on a trial after this many seconds")
    p.add_argument("--config", default=None, help="config for the daemons (default configs/local.toml)")
    p.add_argument("--json", action="store_true", help="print only the JSON object")


def _trial(n: int, config: Path, timeout: float) -> tuple[float | None, list[float]]:
    from peer.bench.harness import proc_status_mb
    from peer.cli.local import collect, start_daemons, stop_daemons

    with tempfile.TemporaryDirectory(prefix="peertrain-bench-") as tmp:
        root = Path(tmp)
        t0 = time.monotonic()
        procs = start_daemons(n, root, config, to_files=True)
        try:
            elapsed = None
            while time.monotonic() - t0 < timeout:
                rows = collect(root)
                if len(rows) == n and all(r["status"] and r["status"]["connected"] == n - 1 for r in rows):
                    elapsed = time.monotonic() - t0
                    break
                time.sleep(0.05)
            time.sleep(2.0)  # let them settle into idle before reading memory
            rss = [mb if (mb := proc_status_mb(p.pid, "VmRSS")) is not None else float("nan")
                   for p in procs if p.poll() is None]
        finally:
            stop_daemons(procs)
    return elapsed, rss


def run(args) -> int:
    from peer.cli.local import DEFAULT_CONFIG

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

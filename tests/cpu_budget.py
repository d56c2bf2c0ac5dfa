"""The suite's CPU by test: what each test and the processes it started (its daemons, a bench) spent.

The parallel tier runs three workers on two cores, so a test's wall time there says more about its neighbours
than about itself (the language-model bench smoke: 19 s alone, 112 s in a CI run). CPU seconds do not move with
the load, and they are what the tier's time is made of: its wall time is about their sum over the cores.

On when `PEERTRAIN_TEST_CPU` names a folder: each process writes `cpu-<worker>.jsonl` there, a line per test
({"test", "self_s", "children_s", "wall_s"}; children are counted once they are reaped, which the fixtures do at
teardown), and `python -m tests.cpu_budget FOLDER` prints the largest. `./dev test` turns it on.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

CPU_ENV = "PEERTRAIN_TEST_CPU"
TOP = 20  # tests printed: the few that hold most of the budget, where sizing down pays


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    folder = os.environ.get(CPU_ENV)
    if not folder:
        yield
        return
    s0, c0, t0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    yield
    line = {"test": item.nodeid, "self_s": round(_cpu(resource.RUSAGE_SELF) - s0, 2),
            "children_s": round(_cpu(resource.RUSAGE_CHILDREN) - c0, 2), "wall_s": round(time.monotonic() - t0, 2)}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(folder) / f"cpu-{worker}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def summary(folder: Path, top: int = TOP) -> str:
    rows = [json.loads(line) for p in sorted(folder.glob("cpu-*.jsonl")) for line in p.read_text().splitlines() if line]
    if not rows:
        return f"no CPU figures in {folder}"
    for r in rows:
        r["cpu_s"] = r["self_s"] + r["children_s"]
    rows.sort(key=lambda r: r["cpu_s"], reverse=True)
    total = sum(r["cpu_s"] for r in rows)
    out = [f"CPU of {len(rows)} tests: {total:.0f} s in all; the {min(top, len(rows))} largest "
           f"({sum(r['cpu_s'] for r in rows[:top]) / total:.0%} of it):"]
    out += [f"{r['cpu_s']:8.1f} s cpu {r['wall_s']:8.1f} s wall  {r['test']}" for r in rows[:top]]
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))

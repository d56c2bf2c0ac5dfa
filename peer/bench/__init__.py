"""`peer bench ...`: benchmarks that print one JSON object. Speed lives here, never in tests."""

from __future__ import annotations

import importlib
import importlib.util

# name -> module; each module has add_arguments(parser) and run(args) -> int
BENCHES = {
    "transport": "peer.bench.transport",
    "discovery": "peer.bench.discovery",
    "average": "peer.bench.average",
    "gossip": "peer.bench.gossip",
    "train": "peer.bench.train",
}

DOCS = {
    "transport": "encrypted vs plain TCP vs in-memory AEAD throughput between two processes",
    "discovery": "time until N local daemons are all connected, and idle daemon memory",
    "average": "one pairwise average of a big tensor through the real engine (and gloo all_reduce)",
    "gossip": "time to consensus per topology (rewired, ring, exponential, random_regular)",
    "train": "AD-PSGD vs D-PSGD vs gloo all-reduce data parallel: time to target accuracy",
}


def register_all(sub) -> None:
    for name, module in BENCHES.items():
        if importlib.util.find_spec(module) is None:
            continue  # a benchmark still being written
        def run(args, _module=module):
            return importlib.import_module(_module).run(args)

        def add(p, _module=module):
            importlib.import_module(_module).add_arguments(p)

        doc = DOCS.get(name, "")
        p = sub.add_parser(name, help=doc, description=doc)
        add(p)
        p.set_defaults(bench_run=run)


def parse_size(text: str) -> int:
    """'64MiB', '1GiB', '512KiB', '1000000' -> bytes."""
    t = text.strip()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9, "b": 1}
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.lower().endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)

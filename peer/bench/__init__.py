"""`peer bench ...`: benchmarks that print one JSON object. Speed lives here, never in tests.

The parser comes from `peer.bench.args` alone; a bench's own module is imported only when it runs.
"""

from __future__ import annotations

import importlib
from functools import partial

from peer.bench.args import BENCHES


def _run(module: str, args) -> int:
    return importlib.import_module(module).run(args)


def register_all(sub) -> None:
    """Add one subcommand per bench to `sub` (argparse subparsers); `args.bench_run(args)` runs it."""
    for name, bench in BENCHES.items():
        p = sub.add_parser(name, help=bench.doc, description=bench.doc)
        bench.build(p)
        p.set_defaults(bench_run=partial(_run, bench.module))

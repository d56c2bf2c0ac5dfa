"""`peer bench pipeline`: which run the flags ask for.

The plain run (pipeline.py: throughput against the slowest stage, kill -9 recovery) or, with `--uneven` or
`--churn`, the rebalancing run (pipeline_uneven.py), which builds on the plain run's setup. Choosing here
keeps the two from importing each other.
"""

from __future__ import annotations

import argparse

from peer.bench import pipeline, pipeline_uneven


def run(args: argparse.Namespace) -> int:
    if args.uneven or args.churn:
        return pipeline_uneven.run(args)
    return pipeline.run(args)

"""`peer bench pipeline`: which run the flags ask for.

The plain run (pipeline.py: throughput against the slowest stage, kill -9 recovery); with `--uneven` or
`--churn`, the rebalancing run (pipeline_uneven.py), which builds on the plain run's setup; with `--codec`,
the codec comparison (pipeline_codecs.py: validation loss and bytes per codec), which reuses it too. Choosing
here keeps them from importing each other.
"""

from __future__ import annotations

import argparse

from peer.bench import pipeline, pipeline_codecs, pipeline_uneven

IN_FLIGHT = 2  # the plain and rebalancing runs' default (see --in-flight)
IN_FLIGHT_CODECS = 1  # the codec comparison's: one microbatch at a time per driver keeps its run deterministic


def run(args: argparse.Namespace) -> int:
    if args.in_flight is None:
        args.in_flight = IN_FLIGHT_CODECS if args.codec else IN_FLIGHT
    if args.codec:
        return pipeline_codecs.run(args)
    if args.uneven or args.churn:
        return pipeline_uneven.run(args)
    return pipeline.run(args)

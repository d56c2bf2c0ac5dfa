"""`peer bench pipeline`: which run the flags ask for.

The plain run (pipeline.py: throughput against the slowest stage, kill -9 recovery); with `--uneven` or
`--churn`, the rebalancing run (pipeline_uneven.py), which builds on the plain run's setup; with `--big`, a model
bigger than any one daemon across memory-capped daemons (pipeline_big.py); with `--memory`, a stage's peak memory
against a plain torch loop's (pipeline_memory.py, no daemons); with `--codec`,
the codec comparison (pipeline_codecs.py: validation loss and bytes per codec), which reuses it too; with `--liar`,
a lying stage server against the drivers' checks (pipeline_liar.py). Choosing
here keeps them from importing each other.
"""

from __future__ import annotations

import argparse

from peer.bench import pipeline, pipeline_big, pipeline_codecs, pipeline_liar, pipeline_memory, pipeline_uneven

IN_FLIGHT = 2  # the plain and rebalancing runs' default (see --in-flight)
IN_FLIGHT_CODECS = 1  # the codec comparison's: one microbatch at a time per driver keeps its run deterministic;
#                       --big's too: 6 drivers keep 6 stages busy, and a stage's queue stays within its deadlines
SAMPLES_CODECS = 1600  # per driver: 200 microbatches of 8, 50 steps of 32; the loss still falls, so a bad codec shows
SAMPLES_BIG = 96  # per driver: 12 microbatches of a 397 M-parameter model; 6 drivers, ~3 minutes on 2 CPUs
SAMPLES_LIAR = 1600  # per driver: 200 microbatches, ~20 stage-1 checks each at the default fraction: room to ban


def run(args: argparse.Namespace) -> int:
    if args.in_flight is None:
        args.in_flight = IN_FLIGHT_CODECS if args.codec or args.big or args.liar else IN_FLIGHT
    if args.samples is None:
        args.samples = SAMPLES_BIG if args.big else SAMPLES_LIAR if args.liar else SAMPLES_CODECS
    if args.memory:
        return pipeline_memory.run(args)
    if args.liar:
        return pipeline_liar.run(args)
    if args.big:
        return pipeline_big.run(args)
    if args.codec:
        return pipeline_codecs.run(args)
    if args.uneven or args.churn:
        return pipeline_uneven.run(args)
    return pipeline.run(args)

"""The single-process reference of a `trainers.swarm_pipeline` run, as a command (benches run it as a process):

  python -m trainers.pipeline.reference_run --options '{...}' --samples N

The same options a pipeline run takes (`[trainer.options]`: model, data, batch_size, microbatch, lr, optimizer,
seed, eval_batches), trained in one process for N samples (trainers/pipeline/reference.py) and scored the same
way as the pipeline's `evaluate` (the test set's first `eval_batches` microbatches, in order). Prints one JSON
line: val_loss, train_loss, samples, steps, seconds. `peer bench pipeline` divides its pipeline's validation
loss by this one's at equal samples (`loss_vs_reference`).
"""

from __future__ import annotations

import argparse
import json

import torch

from trainers.options import parse_options
from trainers.pipeline.reference import train_reference
from trainers.swarm_pipeline import SwarmPipelineOptions, data_and_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainers.pipeline.reference_run", description=__doc__.split("\n")[0])
    ap.add_argument("--options", required=True, help="the pipeline run's [trainer.options], as JSON")
    ap.add_argument("--samples", type=int, required=True, help="samples to train on (the pipeline's, all drivers')")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    a = ap.parse_args(argv)
    if a.samples < 1:
        ap.error("--samples must be at least 1")
    o = parse_options(SwarmPipelineOptions, json.loads(a.options), trainer="trainers.swarm_pipeline")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    data, model = data_and_model(o)
    if data.test is None:
        ap.error("the run's data has no test set: nothing to compare")
    got = train_reference(model, data.train, data.test, batch_size=o.batch_size, microbatch=o.microbatch, lr=o.lr,
                          samples=a.samples, seed=o.seed, optimizer=o.optimizer, eval_batches=o.eval_batches)
    print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in got.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A pipeline run's validation loss against one process trained on as many samples: `loss_vs_reference`.

The reference is `trainers/pipeline/reference_run.py`, run as a process with the run's own trainer options (the
same model, data, batch, learning rate, optimizer and seed) for the samples the run's drivers completed; both are
scored on the test set's first `eval_batches` microbatches in order. A ratio above 1 is what the pipeline lost to
asynchrony (stale gradients, steps of other sizes), kills and re-sends included.
"""

from __future__ import annotations

import json

from peer.testing.process import module_json

REFERENCE_TIMEOUT_S = 900.0  # a few thousand samples of the bench's model on this machine's CPUs: ~1-3 minutes


def loss_vs_reference(val_loss: float | None, options: dict, samples: int) -> dict:
    """{"loss_vs_reference", "val_loss", "reference_val_loss", "reference_samples"}; None figures when the run
    has no validation loss or no sample."""
    if val_loss is None or samples < 1:
        return {"loss_vs_reference": None, "val_loss": val_loss, "reference_val_loss": None,
                "reference_samples": samples}
    ref = module_json("trainers.pipeline.reference_run", ["--options", json.dumps(options), "--samples", str(samples)],
                      timeout=REFERENCE_TIMEOUT_S, what="the single-process reference")
    return {"loss_vs_reference": round(val_loss / ref["val_loss"], 4), "val_loss": round(val_loss, 4),
            "reference_val_loss": ref["val_loss"], "reference_samples": ref["samples"]}

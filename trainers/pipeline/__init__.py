"""Model side of SWARM-style pipeline parallelism (issue 16).

A model is a list of blocks cut into contiguous stages (`partition`); each stage is served by a
`stage.StageWorker` that is stateless between a microbatch's forward and its backward (the backward
request carries the inputs again and the forward is recomputed under the same seed). `reference`
trains the same blocks in one process, the yardstick a pipeline run is compared against.
"""

"""The swarm pipeline, daemon side: serving one stage of a model cut into stages, and driving microbatches
through whichever peers of each stage are alive and fast (SWARM parallelism).

    directory.py   who serves which stage, from the signed records the topology floods
    balancer.py    which peer of a stage gets the next call (earliest expected finish), and who is avoided
    server.py      serving calls for our stage: checks, bounded queue, compute in a worker thread
    driver.py      moving one microbatch forward and back, with deadlines, retries and its accounting
    service.py     the daemon service that owns them, and the stage map `peer status` shows

The model itself (blocks, the cut, the stage's compute and optimizer) belongs to the trainer
(trainers/pipeline/); `peer/` only moves tensors and never imports it.
"""

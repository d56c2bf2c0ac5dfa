"""A test trainer (`[trainer] name = "tests.pipeline_faults"`): trainers.swarm_pipeline with one fault injected
into its driver, once, for tests/test_pipeline_once_swarm.py. Daemon subprocesses import this module (tests
pass the repository root on PYTHONPATH).

Options: swarm_pipeline's, plus `fault`, `fault_stage` and `fault_kind`, naming the first call of that kind
to that stage the fault hits:
  * "lose_reply": the call is made (the server computes, keeps the gradient and replies), then the session
    to that server is cut and the driver treats the call as failed: it re-sends it to another peer of the stage;
  * "fail": the call is not made; the stage "refuses" it as bad input, which fails the microbatch at once.
"""

from __future__ import annotations

from peer.pipeline.driver import _CallFailed
from protocol.refusal import Code, Refusal, Refused
from trainers import swarm_pipeline

FAULTS = ("lose_reply", "fail")


def run(swarm, options: dict) -> dict:
    options = dict(options)
    fault = options.pop("fault")
    target = (int(options.pop("fault_stage")), str(options.pop("fault_kind")))
    if fault not in FAULTS:
        raise ValueError(f"[trainer.options] fault: one of {', '.join(FAULTS)}, not {fault!r}")
    return swarm_pipeline.run(FaultySwarm(swarm, fault, target), options)


class FaultySwarm:
    """The Swarm handle, whose drivers meet the fault once."""

    def __init__(self, swarm, fault: str, target: tuple[int, str]):
        self._swarm, self._fault, self._target = swarm, fault, target
        self._fired = False

    def __getattr__(self, name):
        return getattr(self._swarm, name)

    def open_driver(self, key, **kw):
        handle = self._swarm.open_driver(key, **kw)
        driver = handle.driver
        real = driver._call_once

        async def call_once(pid, peer, mb, stage, kind, tensors):
            if self._fired or (stage, kind) != self._target:
                return await real(pid, peer, mb, stage, kind, tensors)
            if self._fault == "fail":
                self._fired = True
                raise Refused(Refusal(Code.BAD_INPUT, f"test: microbatch {mb.id} fails at stage {stage} {kind}"))
            # computed, kept and answered there; a refusal (a server still joining its stage) raises here, and the
            # fault waits for a call that is computed
            await real(pid, peer, mb, stage, kind, tensors)
            self._fired = True
            session = driver.service.session_of(pid)
            if session is not None:
                await session.aclose("test: the session cut between the compute and its reply")
            self._swarm.log("test: lost the reply of microbatch %d's stage %d %s from %s", mb.id, stage, kind, pid[:8])
            raise _CallFailed("test: the reply was lost after the server's compute")

        driver._call_once = call_once
        return handle

"""Reading a daemon's `peer status --json` in the pipeline tests: its trainer figures, pipeline section, driver."""

from __future__ import annotations


def trainer(st: dict | None) -> dict:
    return (st or {}).get("trainer", {})


def pipe(st: dict | None) -> dict:
    return (st or {}).get("pipeline", {})


def driver(st: dict | None) -> dict:
    return pipe(st).get("driver", {})


def no_one_struck(st: dict | None) -> bool:
    """The daemon's drivers banned nobody and struck nobody for lying in a stage's answers (verified stage calls:
    every peer of these tests is honest)."""
    return not pipe(st).get("bans") and not (driver(st).get("verify") or {}).get("strikes")


def samples_done(sts: list[dict | None]) -> int:
    """Samples the daemons' drivers have driven so far: the progress a wait on drivers finishing bounds its
    stall by (peer/testing/process.py `wait_for`'s `progress`)."""
    return sum(int(trainer(s).get("samples") or 0) for s in sts)

"""Reading a daemon's `peer status --json` in the pipeline tests: its trainer figures, pipeline section, driver."""

from __future__ import annotations


def trainer(st: dict | None) -> dict:
    return (st or {}).get("trainer", {})


def pipe(st: dict | None) -> dict:
    return (st or {}).get("pipeline", {})


def driver(st: dict | None) -> dict:
    return pipe(st).get("driver", {})

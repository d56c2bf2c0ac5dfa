"""Logging that a person can follow (text) or a machine can parse (one JSON object per line)."""

from __future__ import annotations

import json
import logging
import sys
import time


class _JsonFormatter(logging.Formatter):
    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer = peer

    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "peer": self.peer, "msg": record.getMessage()}
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj)


class _TextFormatter(logging.Formatter):
    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer = peer

    def format(self, record: logging.LogRecord) -> str:
        t = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        name = record.name.removeprefix("peertrain.")
        line = f"{t} {record.levelname:<7} {self.peer} {name:<10} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(*, fmt: str = "text", level: str = "info", peer: str = "-", stream=None) -> None:
    """Configure the root `peertrain` logger for this process (the daemon calls it once at start)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter(peer) if fmt == "json" else _TextFormatter(peer))
    root = logging.getLogger("peertrain")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class Throttle:
    """One log line per kind every `seconds`, for events a stranger can cause thousands of times a second
    (a connection flood): the line says how many like it were held back since the last one, so the log
    keeps the facts without the flood writing it full. Kinds are fixed strings the caller chooses (never
    an address), so the dict stays as small as the code that uses it."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds, self._clock = seconds, clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, kind: str) -> int | None:
        """None: hold this one back; else log it, and say `n` more were held back since the last."""
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.seconds:
            self._held[kind] = self._held.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._held.pop(kind, 0)

    @staticmethod
    def more(n: int) -> str:
        """What to append to a line `allow` let through."""
        return f" (and {n} more like it since)" if n else ""

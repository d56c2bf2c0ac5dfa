"""One real daemon, `python -m peer start`, as a child process: the only place in the repository that
spawns it. Tests, benchmarks and `peer local` all start daemons through `DaemonProcess`.

Its output goes to the home's log file (`Home.log_file`); status and commands go through the control
socket, a Unix socket in the home directory, which also works for a daemon inside a network namespace.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from peer.control import ControlError, call
from peer.home import Home
from peer.testing.pace import scaled
from peer.testing.process import ManagedProcess, wait_for

T = TypeVar("T")

STATUS_TIMEOUT = 5.0  # a daemon on a loaded 2-core machine answers within a few hundred ms
READY_TIMEOUT = 30.0  # start-up imports torch and measures the ciphers: seconds on a slow machine


def daemon_argv(home: Path, config: Path | None = None, args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The command line of `peer start` for this home."""
    argv = [sys.executable, "-m", "peer", "start", "--home", str(home)]
    if config is not None:
        argv += ["--config", str(config)]
    return argv + list(args)


def read_metrics(home: Path) -> list[dict]:
    """Every JSON line a trainer published into the home's metrics file (empty if none yet). A last line
    without its newline is still being appended (benches read while the trainer writes): it is left out."""
    try:
        text = Home(Path(home)).metrics_file.read_text()
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


@dataclass
class DaemonProcess(ManagedProcess):
    """`peer start --home HOME [--config CONFIG] [ARGS]` as a child process we own."""

    home: Path = field(default=Path("."))
    config: Path | None = None

    @classmethod
    def create(cls, name: str, home: Path, *, config: Path | None = None, args: list[str] | tuple[str, ...] = (),
               env: dict[str, str] | None = None, host: Any = None,
               echo: Callable[[str], None] | None = None, log_path: Path | None = None) -> "DaemonProcess":
        """A daemon for `home`, not started yet; its output goes to the home's log file unless `log_path`
        says otherwise (a second daemon tried on a home that has one running)."""
        home = Path(home)
        home.mkdir(mode=0o700, parents=True, exist_ok=True)  # a daemon refuses a home others can write
        return cls(name=name, argv=daemon_argv(home, config, args), log_path=log_path or Home(home).log_file,
                   env=dict(env or {}), host=host, echo=echo, home=home, config=config)

    # ---- the control socket --------------------------------------------------------------------------
    def command(self, cmd: str, args: dict | None = None, *, timeout: float = 30.0) -> Any:
        return call(self.home, cmd, args, timeout=scaled(timeout))  # sized on the reference machine (pace.py)

    def status(self, *, timeout: float = STATUS_TIMEOUT) -> dict:
        """`peer status --json` of this daemon; raises ControlError when it does not answer."""
        return call(self.home, "status", timeout=scaled(timeout))

    def try_status(self, *, timeout: float = STATUS_TIMEOUT) -> dict | None:
        """Its status, or None if it does not answer right now (starting, stopping, busy)."""
        try:
            return self.status(timeout=timeout)
        except (ControlError, OSError):
            return None

    def wait_until(self, predicate: Callable[[dict], T], *, timeout: float, what: str,
                   interval: float = 0.1, progress: Callable[[dict], Any] | None = None) -> T:
        """Poll the status until `predicate(status)` is truthy; fails at once, with the log, if the daemon exits.
        With `progress` (a reading of the status: samples driven), `timeout` bounds the time without progress
        (`wait_for`)."""
        last: list[dict | None] = [None]

        def check() -> T:
            self.check_alive()
            last[0] = self.status()
            return predicate(last[0])
        return wait_for(check, timeout=timeout, what=f"{self.name}: {what}", interval=interval,
                        progress=None if progress is None else lambda: progress(last[0]) if last[0] else None)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> dict:
        """Wait until it answers on its control socket; its first status."""
        return self.wait_until(lambda st: st, timeout=timeout, what="to answer on its control socket")

    @property
    def peer_id(self) -> str:
        return self.status()["peer_id"]

    def connected_ids(self) -> set[str]:
        return {p["peer_id"] for p in self.status()["peers"] if p["state"] == "connected"}

    def metrics(self) -> list[dict]:
        return read_metrics(self.home)

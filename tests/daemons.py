"""Real daemons as subprocesses for tests: temp homes, unique swarm names, bounded waits, logs on failure.

Every daemon is `python -m peer start` on 127.0.0.1 with mDNS bound to loopback (or off). Each test
uses its own swarm name, so tests running at the same time on one host never see each other's peers.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from peer.control import ControlError, call

REPO = Path(__file__).resolve().parent.parent
_counter = itertools.count()


def unique_swarm(prefix: str = "t") -> str:
    return f"{prefix}{os.getpid()}x{next(_counter)}x{int(time.time() * 1000) % 100000}"


def wait_for(predicate, *, timeout: float, what: str, interval: float = 0.1, on_fail=None):
    """Poll `predicate` until it returns a truthy value; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (ControlError, OSError, KeyError) as exc:
            last_exc = exc
        time.sleep(interval)
    if on_fail:
        on_fail()
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def write_config(path: Path, *, swarm: str, mdns: bool = True, extra: str = "") -> Path:
    path.write_text(f"""
[daemon]
swarm = "{swarm}"
listen = "127.0.0.1:0"
log_level = "debug"

[discovery]
mdns = {"true" if mdns else "false"}
interfaces = ["127.0.0.1"]

[membership]
heartbeat_interval = 0.3
dead_after = 2.0
reconnect_min = 0.2
reconnect_max = 2.0
pex_interval = 0.5
max_connections_per_ip = 64
{extra}
""")
    return path


@dataclass
class DaemonProc:
    name: str
    home: Path
    argv: list[str]
    proc: subprocess.Popen | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.home.parent / f"{self.name}.log"

    env: dict = field(default_factory=dict)

    def start(self) -> "DaemonProc":
        self.home.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env), start_new_session=True)
        log.close()
        return self

    def status(self) -> dict:
        return call(self.home, "status", timeout=3)

    def wait_ready(self, timeout: float = 20.0) -> dict:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text()}")
            return self.status()
        return wait_for(ready, timeout=timeout, what=f"{self.name} to answer on its control socket")

    @property
    def peer_id(self) -> str:
        return self.status()["peer_id"]

    def connected_ids(self) -> set[str]:
        return {p["peer_id"] for p in self.status()["peers"] if p["state"] == "connected"}

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"{self.name} did not exit within {timeout}s of SIGTERM:\n{self.log_text()}")

    def log_text(self, tail: int = 80) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-tail:])


class Cluster:
    """Owns the daemons of one test; `close()` stops them all and prints their logs if the test failed."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.daemons: list[DaemonProc] = []

    def daemon(self, name: str, *args: str, config: Path | None = None, home: Path | None = None,
               env: dict | None = None) -> DaemonProc:
        home = home or self.tmp / name
        argv = [sys.executable, "-m", "peer", "start", "--home", str(home)]
        if config is not None:
            argv += ["--config", str(config)]
        d = DaemonProc(name=name, home=home, argv=argv + list(args), env=dict(env or {}))
        self.daemons.append(d)
        return d.start()

    def dump_logs(self) -> None:
        for d in self.daemons:
            print(f"\n===== log of {d.name} ({d.home}) =====\n{d.log_text()}", file=sys.stderr)

    def close(self) -> None:
        for d in self.daemons:
            if d.proc and d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in self.daemons:
            if d.proc:
                try:
                    d.proc.wait(15)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait(5)


def config_file(path: Path, **kw) -> Path:
    """Write a validated config (see peer.bench.harness.make_config) as TOML and return its path."""
    from peer.bench.harness import make_config
    from peer.config import to_toml

    path.write_text(to_toml(make_config(**kw)))
    return path


def rank_env(rank: int, world: int) -> dict:
    return {"PEERTRAIN_RANK": str(rank), "PEERTRAIN_WORLD": str(world)}

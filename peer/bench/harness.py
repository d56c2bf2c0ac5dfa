"""Running a swarm of real daemons for benchmarks: on 127.0.0.1, or one per network namespace.

Configs are built from the typed `Config` (so a benchmark cannot write a key the daemon would reject)
and written as TOML into each node's home. Status comes through the control sockets, which are Unix
sockets on the shared filesystem and so work across network namespaces too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from peer.config import Config, to_toml
from peer.control import ControlError, call


def make_config(*, swarm: str, listen: str = "127.0.0.1:0", mdns: bool = True, interfaces: list[str] | None = None,
                join: list[str] | None = None, topology: dict | None = None, gossip: dict | None = None,
                trainer: str = "", options: dict | None = None, membership: dict | None = None,
                log_level: str = "info") -> Config:
    """A validated daemon config for benchmarks and tests (fast heartbeats, generous connection limits)."""
    return Config().replace(
        daemon={"swarm": swarm, "listen": listen, "join": list(join or []), "log_level": log_level},
        discovery={"mdns": mdns, "interfaces": list(interfaces if interfaces is not None else ["127.0.0.1"])},
        membership={"heartbeat_interval": 0.5, "dead_after": 4.0, "reconnect_min": 0.2, "reconnect_max": 3.0,
                    "pex_interval": 1.0, "max_connections_per_ip": 64, **(membership or {})},
        topology=dict(topology or {}),
        gossip=dict(gossip or {}),
        trainer={"name": trainer, "options": dict(options or {})},
    )


@dataclass
class Node:
    name: str
    home: Path
    proc: subprocess.Popen
    log_path: Path
    host: Any = None  # peer.testing.netns.Host when running inside a namespace

    def status(self, timeout: float = 5.0) -> dict | None:
        try:
            return call(self.home, "status", timeout=timeout)
        except (ControlError, OSError):
            return None

    def command(self, cmd: str, args: dict | None = None, timeout: float = 30.0) -> Any:
        return call(self.home, cmd, args, timeout=timeout)

    def rss_mb(self) -> float:
        mb = proc_status_mb(self.proc.pid, "VmRSS")
        return mb if mb is not None else float("nan")


@dataclass
class Swarm:
    """N daemons; use as a context manager so they are always stopped (SIGTERM, then SIGKILL)."""

    root: Path
    nodes: list[Node] = field(default_factory=list)

    def start(self, name: str, config: Config, *, host: Any = None, env: dict | None = None,
              extra_args: list[str] | None = None) -> Node:
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        cfg_path = home / "bench.toml"
        cfg_path.write_text(to_toml(config))
        log_path = self.root / f"{name}.log"
        argv = [sys.executable, "-m", "peer", "start", "--home", str(home), "--config", str(cfg_path), *(extra_args or [])]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        with open(log_path, "ab") as log:
            if host is not None:
                proc = host.popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env)
            else:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        node = Node(name, home, proc, log_path, host)
        self.nodes.append(node)
        return node

    def statuses(self) -> list[dict | None]:
        return [n.status() for n in self.nodes]

    def wait(self, predicate: Callable[[list[dict | None]], bool], *, timeout: float, what: str,
             interval: float = 0.1) -> float:
        """Poll all statuses until `predicate` holds; returns seconds waited. Raises TimeoutError."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            for n in self.nodes:
                if n.proc.poll() is not None:
                    raise RuntimeError(f"{n.name} exited with {n.proc.returncode}; log:\n{tail(n.log_path)}")
            if predicate(self.statuses()):
                return time.monotonic() - t0
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")

    def wait_connected(self, timeout: float = 60.0) -> float:
        n = len(self.nodes)
        return self.wait(lambda sts: all(s and s["connected"] >= n - 1 for s in sts), timeout=timeout,
                         what=f"{n} daemons to connect")

    def stop(self, timeout: float = 20.0) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for n in self.nodes:
            try:
                n.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait()

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def proc_status_mb(pid: int, field: str) -> float | None:
    """A memory figure of a process from /proc/PID/status, in MB: VmRSS (resident now), VmHWM (peak)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def temp_root(prefix: str = "peertrain-bench-") -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=prefix)


def unique_swarm(prefix: str) -> str:
    return f"{prefix}{os.getpid()}x{int(time.time() * 1000) % 1000000}"
